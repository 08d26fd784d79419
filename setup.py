"""The one part of the build pyproject.toml cannot declare: the package list.

The Hydra config files live in the repository's top-level `configs/` (as in every Hydra project), and the
wheel ships them inside the package as `hybrid/configs`, so an installed hybrid finds them from any folder.
pyproject.toml maps the package `hybrid.configs` to that folder (`package-dir`) and names its files
(`package-data`); `packages.find` only finds folders by their own path, so the list is written here:
hybrid's packages plus `hybrid.configs`. An editable install reads `configs/` from the checkout instead
(`hybrid.config.config_dir`).
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["hybrid", "hybrid.*"]), "hybrid.configs"])

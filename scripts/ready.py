"""Is this Python set up for the README's commands? `scripts/setup.sh --if-needed` (what `make run` and
`make test` call first) runs the full set-up only when it is not, so a second call costs a fraction of a second.

Ready means: hybrid is installed editable from this checkout (what `make setup` does), installed after the
last change to pyproject.toml or setup.py (a new dependency, extra or console script is then in its
metadata), and every distribution it requires, with the `test` extra, is installed. Standard library only:
it runs before anything is installed. Exit status 0 when ready; else 1 and the reason on stdout.
"""

from __future__ import annotations

import json
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
BUILD_INPUTS = ("pyproject.toml", "setup.py")  # a change to either can change what an install holds
EXTRAS = ("test",)  # the extras `make setup` installs


def editable_from_here(dist: metadata.Distribution) -> bool:
    """Whether pip installed `dist` editable from this checkout (PEP 610's direct_url.json)."""
    url = json.loads(dist.read_text("direct_url.json") or "{}")
    return bool(url.get("dir_info", {}).get("editable")) and url.get("url") == ROOT.as_uri()


def installed_at(dist: metadata.Distribution) -> float:
    """When `dist` was installed: its METADATA file's modification time (0 when it cannot be found)."""
    meta = next((f for f in dist.files or [] if f.name == "METADATA"), None)
    path = Path(str(meta.locate())) if meta is not None else None
    return path.stat().st_mtime if path is not None and path.is_file() else 0.0


def required(dist: metadata.Distribution) -> list[str]:
    """The names of the distributions `dist` requires: the unconditional ones and those of EXTRAS."""
    names = []
    for req in dist.requires or []:
        name, _, marker = req.partition(";")
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", marker)
        if not marker.strip() or (extra and extra.group(1) in EXTRAS):
            names.append(re.split(r"[\s<>=!~\[(]", name.strip(), maxsplit=1)[0])
    return names


def missing(names: list[str]) -> list[str]:
    """The names among `names` that no installed distribution has."""
    absent = []
    for name in names:
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            absent.append(name)
    return absent


def installed_hybrid() -> Optional[metadata.Distribution]:
    """hybrid's installed distribution, not the build's `hybrid.egg-info` in the checkout (found first when
    the checkout is on sys.path)."""
    found = (d for d in metadata.distributions(name="hybrid") if Path(str(d.locate_file(""))).resolve() != ROOT)
    return next(found, None)


def problem() -> Optional[str]:
    """Why this Python is not ready, or None when it is."""
    dist = installed_hybrid()
    if dist is None:
        return "hybrid is not installed"
    if not editable_from_here(dist):
        return f"hybrid is not installed editable from {ROOT}"
    changed = [n for n in BUILD_INPUTS if (ROOT / n).is_file() and (ROOT / n).stat().st_mtime > installed_at(dist)]
    if changed:
        return f"{', '.join(changed)} changed since hybrid was installed"
    absent = missing(required(dist))
    return f"not installed: {', '.join(absent)}" if absent else None


def main() -> int:
    reason = problem()
    if reason:
        print(reason)
    return 1 if reason else 0


if __name__ == "__main__":
    sys.exit(main())

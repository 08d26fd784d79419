"""A regular (not editable) install works from any folder: the wheel carries the configs (the top-level
`configs/`, byte for byte, as `hybrid/configs/`) and the console scripts, and `python -m hybrid.train` (two
training steps) / `hybrid-train` (its --help listing the installed configs' options, bash completion) run from
a folder outside the repository. Each of those is a fresh process (seconds of imports): one per behaviour.

The wheel is built from a copy of the package (`pip wheel --no-deps --no-build-isolation --no-index`,
nothing downloaded) and installed with `--no-deps` into a throwaway venv made with
`--system-site-packages`, so torch and the other dependencies come from this environment. That
environment may hold an editable install of another checkout; the venv's own site-packages comes
first on `sys.path` (and an editable finder only runs after the path finders), which the test asserts
through `hybrid.__file__`, with `PYTHONPATH` unset and the user site off.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model=gpt-tiny", "model.n_layers=2", "model.hidden=64", "data.seq_len=64", "train.global_batch_size=4",
        "train.micro_batch_size=4", "train.eval_batches=1", "train.steps=2", "logging.wandb.mode=disabled",
        "logging.progress=false"]


def sh(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of this checkout (its build/ and *.egg-info stay out of the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for folder in ("hybrid", "configs"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip"]
    built = sh([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", tmp / "wheels", src], tmp)
    assert built.returncode == 0, built.stderr[-3000:]
    return next((tmp / "wheels").glob("hybrid-*.whl"))


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding the wheel (and, through system site-packages, torch)."""
    tmp = tmp_path_factory.mktemp("install")
    made = sh([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", tmp / "venv"], tmp)
    assert made.returncode == 0, made.stderr[-3000:]
    python = tmp / "venv" / "bin" / "python"
    installed = sh([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel], tmp)
    assert installed.returncode == 0, installed.stderr[-3000:]
    return tmp / "venv"


@pytest.fixture
def env(venv: Path, e2e_cache: str) -> dict[str, str]:
    """This environment without the checkout on the path: the venv's bin first, no PYTHONPATH, no user site;
    the session's data cache (the default corpus the other end-to-end modules use)."""
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return {**base, "PATH": f"{venv / 'bin'}{os.pathsep}{base.get('PATH', '')}", "PYTHONNOUSERSITE": "1",
            "OMP_NUM_THREADS": "1", "HYBRID_CACHE": e2e_cache, "WANDB_MODE": "disabled"}


def test_the_venv_imports_its_own_installed_copy(venv: Path, env: dict[str, str], tmp_path: Path) -> None:
    r = sh([venv / "bin" / "python", "-c", "import hybrid.config as c; print(c.__file__); print(c.CONFIG_DIR)"],
           tmp_path, env)
    assert r.returncode == 0, r.stderr
    module, configs = r.stdout.split()
    assert Path(module).is_relative_to(venv) and Path(configs).is_relative_to(venv), r.stdout
    assert (Path(configs) / "config.yaml").is_file() and (Path(configs) / "model" / "gpt-tiny.yaml").is_file()


def test_the_wheel_ships_the_top_level_configs_byte_for_byte(wheel: Path) -> None:
    """Every file of configs/ is in the wheel at hybrid/configs/ with the same bytes, and nothing else is."""
    with zipfile.ZipFile(wheel) as z:
        shipped = {name.removeprefix("hybrid/configs/"): z.read(name) for name in z.namelist()
                   if name.startswith("hybrid/configs/")}
    files = {p.relative_to(ROOT / "configs").as_posix(): p.read_bytes()
             for p in (ROOT / "configs").rglob("*") if p.is_file()}
    assert "model/gpt-tiny.yaml" in files and sorted(shipped) == sorted(files)
    assert [name for name in files if shipped[name] != files[name]] == []


def test_help_from_outside_the_repository(venv: Path, env: dict[str, str], tmp_path: Path) -> None:
    """The console script (`python -m hybrid.train` from outside runs below: the same `main`)."""
    r = sh([venv / "bin" / "hybrid-train", "--help"], tmp_path, env)
    assert r.returncode == 0 and "Traceback" not in r.stdout + r.stderr, r.stderr[-3000:]
    groups = dict(line.split(": ", 1) for line in r.stdout.splitlines() if ": " in line)
    assert "gpt-tiny" in groups.get("model", ""), r.stdout  # the group options, read from the installed configs


def test_shell_completion_installs(venv: Path, env: dict[str, str], tmp_path: Path) -> None:
    r = sh([venv / "bin" / "hybrid-train", "--shell-completion", "install=bash"], tmp_path, env)
    assert r.returncode == 0 and "hydra_bash_completion" in r.stdout, r.stderr[-3000:]
    line = {**env, "COMP_LINE": "hybrid-train model=gpt-t"}  # what bash hands the completion script
    query = sh([venv / "bin" / "hybrid-train", "-sc", "query=bash"], tmp_path, line)
    assert query.returncode == 0 and query.stdout.split() == ["model=gpt-tiny"], query.stdout + query.stderr


def test_two_steps_from_outside_the_repository(venv: Path, env: dict[str, str], tmp_path: Path) -> None:
    r = sh([venv / "bin" / "python", "-m", "hybrid.train", *TINY, f"logging.dir={tmp_path / 'run'}"], tmp_path, env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == [1, 2]

"""A regular (not editable) install works from any folder: the wheel carries the configs (the top-level
`configs/`, byte for byte, as `hybrid/configs/`) and the console scripts, and `python -m hybrid.train` (two
training steps) / `hybrid-train` (its --help listing the installed configs' options, bash completion) run from
a folder outside the repository.

The wheel is built from a copy of the package (`pip wheel --no-deps --no-build-isolation --no-index`,
nothing downloaded) and installed with `--no-deps` into a throwaway venv made with
`--system-site-packages`, so torch and the other dependencies come from this environment. That
environment may hold an editable install of another checkout; the venv's own site-packages comes
first on `sys.path` (and an editable finder only runs after the path finders), which the test asserts
through `hybrid.__file__`, with `PYTHONPATH` unset and the user site off.

One fresh venv interpreter (`python -c`, working in a folder outside the repository: the first entry of its
`sys.path`, as under `python -m`) serves every behaviour: it reports where it imported hybrid from, then
runs each command line as a forked child (hybrid.testing.cli_runs, as installed in the venv: a real process
with its own folder, argv, environment and exit status, without seconds of imports each): the installed
`hybrid-train` script file itself (run as `__main__`, the way its `#!` line's venv Python runs it) for
--help and the completion, and the `hybrid.train` module run as `__main__` (what `python -m` does) for the
two steps.
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
    reach_this_venv(tmp / "venv")
    python = tmp / "venv" / "bin" / "python"
    installed = sh([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel], tmp)
    assert installed.returncode == 0, installed.stderr[-3000:]
    return tmp / "venv"


def reach_this_venv(venv: Path) -> None:
    """Where this interpreter is itself a venv (a `make setup PYTHON=.venv/bin/python`), `--system-site-packages`
    reaches the base interpreter's packages, not this venv's (torch): a .pth file adds them after the new venv's
    own. Plain paths: the .pth files inside them (an editable install's finder) are not run."""
    if sys.prefix == sys.base_prefix:
        return
    import site

    (site_dir,) = (venv / "lib").glob("python3*/site-packages")
    (site_dir / "outer-venv.pth").write_text("".join(f"{d}\n" for d in site.getsitepackages()))


DRIVER = """
import json, runpy, sys
from pathlib import Path
import hybrid, hybrid.config, hybrid.train
from hybrid.testing.cli_runs import run_forked

script, folder, jobs = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])

def console():  # the installed script file, as its interpreter runs it
    runpy.run_path(str(script), run_name="__main__")

def module():  # `python -m hybrid.train`: the module run afresh as __main__
    sys.modules.pop("hybrid.train", None)
    runpy.run_module("hybrid.train", run_name="__main__", alter_sys=True)

report = {"paths": [hybrid.__file__, hybrid.config.__file__, str(hybrid.config.CONFIG_DIR), hybrid.train.__file__],
          "sys_path0": sys.path[0]}
for name, (how, argv, env) in jobs.items():
    (folder / name).mkdir()
    r = run_forked(console if how == "script" else module, argv, folder / name, env, timeout_s=300,
                   prog=str(script) if how == "script" else "-m")
    report[name] = [r.code, r.stdout, r.stderr]
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def runs(venv: Path, e2e_cache: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One fresh venv interpreter outside the repository, without the checkout on the path (the venv's bin
    first, no PYTHONPATH, no user site, the session's data cache: the default corpus the other end-to-end
    modules use): where it imported hybrid from (`paths`) and each command line's [status, stdout, stderr],
    run as its forked child in a folder of its own (`folder / name`)."""
    folder = tmp_path_factory.mktemp("outside")
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env = {**base, "PATH": f"{venv / 'bin'}{os.pathsep}{base.get('PATH', '')}", "PYTHONNOUSERSITE": "1",
           "OMP_NUM_THREADS": "1", "HYBRID_CACHE": e2e_cache, "WANDB_MODE": "disabled"}
    jobs = {"help": ("script", ["--help"], {}),
            "install": ("script", ["--shell-completion", "install=bash"], {}),
            "query": ("script", ["-sc", "query=bash"], {"COMP_LINE": "hybrid-train model=gpt-t"}),  # what bash hands it
            "steps": ("module", [*TINY, f"logging.dir={folder / 'steps' / 'run'}"], {})}
    r = sh([venv / "bin" / "python", "-c", DRIVER, venv / "bin" / "hybrid-train", folder, json.dumps(jobs)], folder,
           env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return {**json.loads(r.stdout.splitlines()[-1]), "folder": folder}


def test_the_venv_imports_its_own_installed_copy(venv: Path, runs: dict) -> None:
    package, module, configs, train = (Path(p) for p in runs["paths"])
    assert all(p.is_relative_to(venv) for p in (package, module, configs, train)), runs["paths"]
    assert (configs / "config.yaml").is_file() and (configs / "model" / "gpt-tiny.yaml").is_file()
    assert runs["sys_path0"] == ""  # `-c`: the working folder (outside the repository) first, as under `-m`
    # the console script runs under the venv's interpreter (the one that ran it below)
    assert (venv / "bin" / "hybrid-train").read_text().startswith(f"#!{venv / 'bin' / 'python'}\n")


def test_the_wheel_ships_the_top_level_configs_byte_for_byte(wheel: Path) -> None:
    """Every file of configs/ is in the wheel at hybrid/configs/ with the same bytes, and nothing else is."""
    with zipfile.ZipFile(wheel) as z:
        shipped = {name.removeprefix("hybrid/configs/"): z.read(name) for name in z.namelist()
                   if name.startswith("hybrid/configs/")}
    files = {p.relative_to(ROOT / "configs").as_posix(): p.read_bytes()
             for p in (ROOT / "configs").rglob("*") if p.is_file()}
    assert "model/gpt-tiny.yaml" in files and sorted(shipped) == sorted(files)
    assert [name for name in files if shipped[name] != files[name]] == []


def test_help_from_outside_the_repository(runs: dict) -> None:
    """The console script (`python -m hybrid.train` from outside runs below: the same `main`)."""
    code, out, err = runs["help"]
    assert code == 0 and "Traceback" not in out + err, err[-3000:]
    groups = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    assert "gpt-tiny" in groups.get("model", ""), out  # the group options, read from the installed configs


def test_shell_completion_installs(runs: dict) -> None:
    code, out, err = runs["install"]
    assert code == 0 and "hydra_bash_completion" in out, err[-3000:]
    code, out, err = runs["query"]
    assert code == 0 and out.split() == ["model=gpt-tiny"], out + err


def test_two_steps_from_outside_the_repository(runs: dict) -> None:
    code, _, err = runs["steps"]
    assert code == 0 and "Traceback" not in err, err[-3000:]
    rows = [json.loads(line) for line in (runs["folder"] / "steps" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == [2]  # logging.log_every=10 by default: the last step

"""Does hybrid run with the lowest versions its pyproject.toml declares (the dependency floors)?

    python -m hybrid.bench.dep_floors [--pins transformers==4.46 datasets==4.3 ...] [--venv DIR]

Run by hand, not by the test suite (pip downloads, minutes of work). Steps:

1. install: a venv with `--system-site-packages` (this interpreter's torch is used, never downloaded: a
   constraint file pins torch to the installed build) into which pip installs the pins in one resolve:
   by default `name==X` for every `name>=X` of pyproject's `dependencies` (torch excepted), the lowest
   release of each floor, plus what pip must change for them (older fsspec, huggingface_hub, ...) --
   what a user gets from `pip install hybrid` with every floor. Cached under `--venv` (default
   `$HYBRID_CACHE/venvs/floors-<hash of the pins>`, else `~/.cache/hybrid/venvs/...`), reused while its
   stamp (pins, interpreter, torch) matches.
2. train: `python -m hybrid.train model=gpt-tiny train.steps=2 ...` with the venv's python, cwd a temp
   folder, PYTHONPATH this checkout, HYBRID_CACHE a fresh temp folder (the data build runs on the
   floors' datasets and tokenizers), wandb offline, a checkpoint at step 2.
3. export: `python -m hybrid.tools.export` of that checkpoint (transformers' own load of it included).
4. pytest: `tests/unit/test_config.py tests/unit/test_data_sources.py` from the checkout's root.

One table row per step (PASS/FAIL and the first error line), then the versions pip installed. Exit
status 0 when every step passes, 1 when one fails (a failed install skips the rest), 2 for a bad command line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import torch

from hybrid.bench.common import table, verdict
from hybrid.bench.export_compat import InstallError, _run, _venv_env, make_venv

MODULE = "hybrid.bench.dep_floors"
ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"
SKIP = ("torch",)  # cannot be downloaded here: the venv uses the installed build
COMPANIONS = ("torch", "pyarrow", "fsspec", "huggingface-hub", "pandas")  # shown with the pins: what pip resolved
INSTALL_TIMEOUT_S = 900
STEP_TIMEOUT_S = 900
RUN = "floors"


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _dependencies(pyproject: Path) -> list[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib.loads(pyproject.read_text())["project"]["dependencies"]


def floor_pins(pyproject: Path = PYPROJECT) -> list[str]:
    """`name==X` for every `name>=X` in pyproject's dependencies (SKIP excepted): `==4.46` is 4.46.0,
    the lowest release the floor admits."""
    pins = []
    for dep in _dependencies(pyproject):
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)\s*", dep.split(";")[0])
        if m is None:
            raise ValueError(f"{pyproject}: cannot read a floor from {dep!r} (expected name>=X)")
        if _canon(m.group(1)) not in SKIP:
            pins.append(f"{m.group(1)}=={m.group(2)}")
    return pins


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    p.add_argument("--pins", nargs="+", default=None, help="requirements to install (default: name==X for "
                   "every name>=X of pyproject.toml's dependencies, torch excepted)")
    p.add_argument("--venv", default=None, help="the venv folder (default: $HYBRID_CACHE/venvs/floors-<hash>)")
    args = p.parse_args(argv)
    args.pins = args.pins or floor_pins()
    if any(_canon(re.split(r"[=<>!~ \[]", pin)[0]) in SKIP for pin in args.pins):
        p.error(f"{', '.join(SKIP)} cannot be pinned: the venv uses the installed build")
    return args


def _stamp(pins: Sequence[str]) -> str:
    return json.dumps({"pins": sorted(pins), "python": sys.executable, "torch": torch.__version__})


def venv_dir(pins: Sequence[str], override: Optional[str]) -> Path:
    if override is not None:
        return Path(override)
    root = Path(os.environ.get("HYBRID_CACHE") or Path.home() / ".cache" / "hybrid").expanduser()
    return root / "venvs" / f"floors-{hashlib.sha256(_stamp(pins).encode()).hexdigest()[:10]}"


def _first_error(text: str) -> str:
    """The first line that names an error (pip's ERROR:, a traceback's last line), else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    hits = [ln for ln in lines if re.match(r"(ERROR\b|E\s|hybrid: error|\w+(\.\w+)*(Error|Exception):)", ln)]
    return ((hits or lines[-1:]) or ["no output"])[0][:240]


def _create_venv(path: Path, pins: Sequence[str]) -> None:
    """`export_compat.make_venv`, then one `pip install` of all the pins with torch constrained to the
    installed build."""
    python = make_venv(path)
    r = _run([python, "-m", "pip", "install", "--disable-pip-version-check", "-c", path / "constraints.txt",
              *pins], INSTALL_TIMEOUT_S, _venv_env())
    if r.returncode != 0:
        lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith(("ERROR", "    ", "The conflict"))]
        raise InstallError(" ".join(" ".join(lines).split())[:600] or _first_error(r.stderr))


def ensure_venv(path: Path, pins: Sequence[str]) -> Path:
    """The python of a venv with `pins` at `path`: reused when its stamp matches, else (re)built under a lock."""
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        stamp = path / ".hybrid-venv.json"
        if not (stamp.is_file() and stamp.read_text() == _stamp(pins) and (path / "bin" / "python").exists()):
            _create_venv(path, pins)
            stamp.write_text(_stamp(pins))
    return path / "bin" / "python"


def installed(python: Path, pins: Sequence[str]) -> list[str]:
    """`pip freeze` lines of the pinned packages and COMPANIONS, as the venv's python sees them."""
    r = _run([python, "-m", "pip", "freeze", "--disable-pip-version-check"], 120, _venv_env())
    want = {_canon(re.split(r"[=<>!~ \[]", p)[0]) for p in pins} | set(COMPANIONS)
    return [ln for ln in r.stdout.splitlines() if _canon(re.split(r"[=@ ]", ln)[0]) in want]


def steps(python: Path, tmp: Path) -> list[tuple[str, list[str], Path]]:
    """(name, command, cwd) of the three smoke steps, all under the venv's python."""
    train = [python, "-m", "hybrid.train", "model=gpt-tiny", "train.steps=2", "data.max_chars=200000",
             "data.vocab_size=512", "logging.wandb.mode=offline", "checkpoint.every=2", f"run_name={RUN}",
             f"logging.dir={tmp / 'run'}", f"checkpoint.dir={tmp / 'ck'}"]
    export = [python, "-m", "hybrid.tools.export", f"checkpoint={tmp / 'ck' / RUN}", f"out={tmp / 'exp'}"]
    pytest = [python, "-m", "pytest", "-q", "-x", "tests/unit/test_config.py", "tests/unit/test_data_sources.py",
              "-p", "no:cacheprovider"]
    return [("train", train, tmp / "cwd"), ("export", export, tmp / "cwd"), ("pytest", pytest, ROOT)]


def run_step(cmd: Sequence[object], cwd: Path, env: dict[str, str]) -> tuple[bool, str, float]:
    """Whether `cmd` exited 0, its first error line (or its last output line) and its seconds."""
    t0 = time.perf_counter()
    try:
        r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                           timeout=STEP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {STEP_TIMEOUT_S} s", time.perf_counter() - t0
    out = r.stdout + "\n" + r.stderr
    last = [ln.strip() for ln in (r.stdout.splitlines() or r.stderr.splitlines()) if ln.strip()][-1:] or [""]
    detail = _first_error(out) if r.returncode else last[0][:240]
    return r.returncode == 0, detail, time.perf_counter() - t0


def smoke(python: Path) -> list[list[object]]:
    """The rows of the three steps; a step after a failed one still runs (each says what it can)."""
    rows: list[list[object]] = []
    with tempfile.TemporaryDirectory(prefix="hybrid-dep-floors-") as tmp:
        work = Path(tmp)
        (work / "cwd").mkdir()
        env = _venv_env() | {"PYTHONPATH": str(ROOT), "HYBRID_CACHE": str(work / "cache"),
                             "WANDB_DIR": str(work / "wandb"), "WANDB_SILENT": "true",
                             "WANDB_ERROR_REPORTING": "false"}
        for name, cmd, cwd in steps(python, work):
            ok, detail, seconds = run_step(cmd, cwd, env)
            rows.append([name, f"{seconds:.0f}", verdict(ok), detail.replace("|", "/")])
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    print(f"# {MODULE} — python {sys.version.split()[0]}, torch {torch.__version__} (installed build)\n"
          f"# command: python -m {MODULE} --pins {' '.join(args.pins)}"
          + (f" --venv {args.venv}" if args.venv else ""), flush=True)
    path = venv_dir(args.pins, args.venv)
    t_install = time.perf_counter()
    try:
        python = ensure_venv(path, args.pins)
    except (InstallError, subprocess.SubprocessError, OSError) as e:
        rows = [["install", f"{time.perf_counter() - t_install:.0f}", verdict(False), str(e).replace("|", "/")]]
        rows += [[name, "-", "-", "skipped"] for name in ("train", "export", "pytest")]
        print("\n".join(table(["step", "s", "result", "first error line / last output line"], rows)), flush=True)
        return 1
    rows = [["install", f"{time.perf_counter() - t_install:.0f}", verdict(True), str(path)]] + smoke(python)
    print("\n".join(table(["step", "s", "result", "first error line / last output line"], rows)))
    print("# installed (pip freeze, pinned packages and " + ", ".join(COMPANIONS) + "):\n"
          + "\n".join(f"#   {ln}" for ln in installed(python, args.pins)) + f"\n# {time.perf_counter() - t0:.0f} s",
          flush=True)
    return 0 if all(r[2] == verdict(True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

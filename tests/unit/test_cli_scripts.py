"""The shell around the command line: scripts/setup.sh's version check, `make run` and launch/local.sh's
choice of launcher.

- `version_ge` (scripts/versions.sh, sourced by setup.sh) against `packaging.version.Version`'s order.
- setup.sh keeps an installed torch at or above pyproject's floor (it only installs hybrid) and installs
  torch below it; hybrid's editable link alone (no dependencies, no build isolation: seconds) when the linked
  metadata finds everything it requires, the full install otherwise; run with a wrapper Python that imports a
  stand-in `torch` of a chosen version and records the pip commands instead of running them.
- scripts/ready.py (what `setup.sh --if-needed`, run first by `make run` and `make test`, asks) against a
  stand-in hybrid distribution: ready only when installed editable from this checkout, after the last change
  to pyproject.toml, with every required distribution (the test extra's included) present; `--if-needed`
  then installs nothing, else the full set-up.
- `make -n run PYTHON=…` passes that Python on; launch/local.sh launches with `$PYTHON -m
  torch.distributed.run` when PYTHON is given or no torchrun is on PATH (checked with stand-in
  launchers that print their command line, and once for real: one rank running a probe module).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PAIRS = [("2.13.0", "2.5"), ("2.4.1", "2.5"), ("2.5", "2.5.0"), ("2.5.0", "2.5"), ("2.10.0", "2.9.1"),
         ("2.9.1", "2.10.0"), ("1.26.4", "1.26"), ("3", "10"), ("0.4.1", "0.4"), ("0.4", "0.4.1"), ("5.23.0", "4.46")]


def bash(script: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, cwd=cwd, env=env)


@pytest.mark.parametrize("a,b", PAIRS)
def test_version_ge_orders_versions_like_packaging(a: str, b: str) -> None:
    r = bash(f"set -euo pipefail; source scripts/versions.sh; version_ge {a} {b} && echo ge || echo lt")
    assert r.stdout.strip() == ("ge" if Version(a) >= Version(b) else "lt"), r.stderr


def test_version_ge_ignores_local_tags() -> None:
    r = bash("source scripts/versions.sh; version_ge 2.13.0+cpu 2.5 && version_ge 2.5.0+cu121 2.5 && "
             "! version_ge 2.4.1+cu118 2.5 && echo ok")
    assert r.stdout.strip() == "ok", r.stderr


def fake_python(tmp: Path, torch_version: str) -> tuple[Path, Path]:
    """A Python wrapper whose `torch` is a stand-in of `torch_version` and whose `-m pip` only records."""
    (tmp / "fake" / "torch").mkdir(parents=True)
    (tmp / "fake" / "torch" / "__init__.py").write_text(
        f"__version__ = {torch_version!r}\nclass cuda:\n    is_available = staticmethod(lambda: False)\n")
    log = tmp / "pip.log"
    wrapper = tmp / "python"
    wrapper.write_text(f'#!/usr/bin/env bash\nif [[ "$1 $2" == "-m pip" ]]; then echo "${{*:3}}" >> {log}; exit 0; fi\n'
                       f'PYTHONPATH={tmp / "fake"}:{ROOT} exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, log


LINK = "install -q -e . --no-deps --no-build-isolation"  # the editable link alone: seconds


@pytest.mark.parametrize("torch_version,installs_torch", [("2.13.0+cpu", False), ("2.5.0", False),
                                                          ("2.4.1+cu121", True)])
@pytest.mark.parametrize("requires,full", [((), False), (("no-such-dist-xyz>=1",), True)])
def test_setup_keeps_a_torch_at_or_above_the_floor(torch_version: str, installs_torch: bool,
                                                   requires: tuple[str, ...], full: bool, tmp_path: Path) -> None:
    """torch kept at or above the floor; then the editable link alone, or the full install when the linked
    metadata still finds a requirement missing."""
    python, log = fake_python(tmp_path, torch_version)
    fake_hybrid(tmp_path / "fake", ROOT.as_uri(), requires)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHON": str(python)})
    assert r.returncode == 0, r.stderr
    pip = log.read_text().splitlines()
    assert pip[-2:] == [LINK, "install -e .[test]"] if full else pip[-1] == LINK, pip
    assert any(line.startswith("install torch==") for line in pip) == installs_torch, pip
    assert ("already installed" in r.stdout) != installs_torch, r.stdout


def fake_hybrid(site: Path, url: str, requires: tuple[str, ...] = ('pytest>=8; extra == "test"',),
                age_s: float = 0.0) -> Path:
    """A stand-in installed hybrid in `site`: its dist-info with direct_url.json (editable from `url`),
    Requires-Dist lines and a METADATA file written `age_s` seconds before pyproject.toml was last changed
    (0: now)."""
    info = site / "hybrid-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hybrid\nVersion: 0.1.0\n"
                                   + "".join(f"Requires-Dist: {r}\n" for r in requires))
    (info / "direct_url.json").write_text(json.dumps({"dir_info": {"editable": True}, "url": url}))
    (info / "RECORD").write_text("hybrid-0.1.0.dist-info/METADATA,,\n")
    if age_s:
        when = (ROOT / "pyproject.toml").stat().st_mtime - age_s
        os.utime(info / "METADATA", (when, when))
    return site


@pytest.mark.parametrize("url,requires,age_s,reason", [
    (ROOT.as_uri(), ('pytest>=8; extra == "test"', 'no-such-dist-xyz; extra == "plot"'), 0.0, ""),
    ("file:///elsewhere", (), 0.0, f"hybrid is not installed editable from {ROOT}"),
    (ROOT.as_uri(), (), 86400.0, "pyproject.toml"),
    (ROOT.as_uri(), ("no-such-dist-xyz>=1", 'pytest>=8; extra == "test"'), 0.0, "not installed: no-such-dist-xyz"),
])
def test_ready_checks_the_install(url: str, requires: tuple[str, ...], age_s: float, reason: str,
                                  tmp_path: Path) -> None:
    site = fake_hybrid(tmp_path / "site", url, requires, age_s)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "ready.py")], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHONPATH": str(site)})
    assert r.returncode == (1 if reason else 0) and reason in r.stdout and bool(r.stdout) == bool(reason), r


@pytest.mark.parametrize("url,installs", [(ROOT.as_uri(), False), ("file:///elsewhere", True)])
def test_setup_if_needed_installs_only_when_something_is_missing(url: str, installs: bool, tmp_path: Path) -> None:
    python, log = fake_python(tmp_path, "2.13.0+cpu")
    fake_hybrid(tmp_path / "fake", url)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--if-needed"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHON": str(python)})
    assert r.returncode == 0, r.stderr
    assert (log.read_text().splitlines()[-1:] if log.exists() else []) == (["install -e .[test]"] if installs else [])
    assert ("setup: hybrid is not installed editable from" in r.stdout) == installs, r.stdout


def test_make_run_passes_python_on() -> None:
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    r = subprocess.run(["make", "-n", "run", "PYTHON=/x/python"], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert r.returncode == 0 and 'PYTHON="/x/python" bash launch/local.sh 2' in r.stdout, r.stdout + r.stderr
    assert 'PYTHON="/x/python" bash scripts/setup.sh --if-needed' in r.stdout  # the set-up first, where needed


def stand_ins(tmp: Path, names: tuple[str, ...]) -> Path:
    """A bin folder of launchers that print their own name and arguments."""
    folder = tmp / "bin"
    folder.mkdir()
    for name in names:
        (folder / name).write_text(f'#!/bin/sh\necho {name} "$@"\n')
        (folder / name).chmod(0o755)
    return folder


@pytest.mark.parametrize("on_path,extra,launcher", [
    (("torchrun", "python3"), {}, ["torchrun"]),
    (("python3",), {}, ["python3", "-m", "torch.distributed.run"]),
    (("torchrun", "mypython"), {"PYTHON": "mypython"}, ["mypython", "-m", "torch.distributed.run"]),
    (("torchrun", "mypython"), {"PYTHON": "mypython", "TORCHRUN": "torchrun --foo"}, ["torchrun", "--foo"]),
])
def test_local_sh_picks_the_launcher(on_path: tuple[str, ...], extra: dict[str, str], launcher: list[str],
                                     tmp_path: Path) -> None:
    env = {"PATH": f"{stand_ins(tmp_path, on_path)}:/usr/bin:/bin", **extra}
    r = subprocess.run(["bash", str(ROOT / "launch" / "local.sh"), "2", "model=gpt-tiny"], capture_output=True,
                       text=True, timeout=30, env=env)
    assert r.returncode == 0, r.stderr
    argv = r.stdout.split()
    assert argv[:len(launcher)] == launcher and argv[len(launcher)] == "--standalone", argv
    assert argv[-3:] == ["hybrid.train", "checkpoint.resume=auto", "model=gpt-tiny"], argv


def test_local_sh_runs_without_torchrun_on_path(tmp_path: Path) -> None:
    """One real rank through `$PYTHON -m torch.distributed.run`, with no torchrun anywhere on PATH."""
    (tmp_path / "probe.py").write_text("import sys\nprint('probe ran with', sys.argv[1:])\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "HYBRID_MODULE": "probe", "PYTHONPATH": str(tmp_path),
           "MAX_RESTARTS": "0", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(["bash", str(ROOT / "launch" / "local.sh"), "1", "x=1"], capture_output=True, text=True,
                       timeout=120, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "probe ran with ['checkpoint.resume=auto', 'x=1']" in r.stdout

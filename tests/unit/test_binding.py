"""launch/binding.sh: when the launch scripts bind each rank to its GPU's NUMA node (torchrun --numa-binding), with
stub `numactl` and launchers on PATH; and the `binding:` line the trainer prints under its rank map."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from hybrid.record.comm_env import binding_line, spans

ROOT = Path(__file__).resolve().parents[2]
HELP = {"new": "echo '  --numa-binding {node,socket,exclusive,core-complex}'", "old": "echo '  --standalone'"}


def choose(tmp: Path, gpus: str, numactl: bool, launcher: str = "new", mode: str | None = None
           ) -> subprocess.CompletedProcess:
    """`numa_binding x GPUS <stub torchrun>` in bash; prints BINDING_ARGS and HYBRID_BINDING on stdout."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "torchrun").write_text(f"#!/bin/bash\n{HELP[launcher]}\n")
    (bin_dir / "torchrun").chmod(0o755)
    if numactl:
        (bin_dir / "numactl").write_text("#!/bin/bash\n")
        (bin_dir / "numactl").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    env.pop("NUMA_BINDING", None)
    if mode is not None:
        env["NUMA_BINDING"] = mode
    script = (f'source {ROOT}/launch/binding.sh; numa_binding x "{gpus}" torchrun; '
              'echo "args=${BINDING_ARGS[*]-}"; echo "line=$HYBRID_BINDING"')
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=30)


@pytest.mark.parametrize("gpus, numactl, launcher, mode, args, says", [
    ("8", True, "new", None, "--numa-binding=node", "node (torchrun --numa-binding=node"),
    ("8", True, "new", "socket", "--numa-binding=socket", "socket (torchrun --numa-binding=socket"),
    ("8", True, "new", "none", "", "none (NUMA_BINDING=none)"),
    ("0", True, "new", None, "", "none (no GPU on this host"),
    ("gpu:h100(x)", True, "new", None, "", "none (no GPU on this host"),  # a count in another form
    ("8", False, "new", None, "", "none (numactl is not installed"),
    ("8", True, "old", None, "", "none (this torchrun has no --numa-binding")])
def test_binding_only_where_it_can_work(tmp_path: Path, gpus: str, numactl: bool, launcher: str,
                                        mode: str | None, args: str, says: str) -> None:
    r = choose(tmp_path, gpus, numactl, launcher, mode)
    assert r.returncode == 0, r.stderr
    assert f"args={args}\n" in r.stdout and f"line={says}" in r.stdout
    quiet = gpus != "8" and mode is None  # a host without GPUs, nothing chosen by hand: no line
    assert r.stderr == "" if quiet else r.stderr.startswith(f"x: binding: {says}")


def test_an_unknown_mode_is_one_line_and_exit_2(tmp_path: Path) -> None:
    r = choose(tmp_path, "8", True, mode="numa")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "x: error: NUMA_BINDING must be node, socket, exclusive, core-complex or none, got 'numa'"]


def test_the_binding_line_under_the_rank_map(monkeypatch: pytest.MonkeyPatch) -> None:
    assert spans([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and spans([]) == ""
    with monkeypatch.context() as m:
        m.setattr(os, "sched_getaffinity", lambda pid: set())
        assert "rank 0 may run on CPUs ? (0 of " in binding_line({})
    line = binding_line({"HYBRID_BINDING": "node (torchrun --numa-binding=node: …)"})
    assert line.startswith("binding: node (torchrun --numa-binding=node: …); rank 0 may run on CPUs ")
    assert binding_line({}).startswith("binding: not set (the launch scripts in launch/ choose one)")

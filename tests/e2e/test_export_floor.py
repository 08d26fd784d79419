"""An exported folder on the oldest transformers hybrid declares (pyproject's floor), end to end.

`python -m hybrid.bench.export_compat --transformers <floor>` as a child forked from this process
(hybrid.testing.cli_runs.run_forked: its `main`, without a fresh interpreter's imports): a venv with the
floor's transformers (and the tokenizers/huggingface_hub pip resolves for it, installed without .pyc
files; torch from this interpreter, never downloaded), cached where the benchmark caches it by default,
$HYBRID_CACHE/venvs/transformers-<floor> (else ~/.cache/hybrid/venvs/...: a run without HYBRID_CACHE
reuses it, as the benchmark run by hand does, while its stamp matches); tiny GPT and Llama checkpoints
exported in fp32 and bf16 with the installed transformers; AutoTokenizer, AutoModelForCausalLM and
pipeline("text-generation") on each folder under both versions; the floor's logits against the installed
version's (see the benchmark's docstring for the checks). Skipped only when the benchmark fails without a
venv and pip then cannot reach the package index.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.bench import export_compat
from hybrid.testing.cli_runs import run_forked

ROOT = Path(__file__).resolve().parents[2]
FLOOR = export_compat.FLOOR


def test_the_benchmark_tests_pyprojects_floor() -> None:
    declared = re.search(r'"transformers>=([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert declared is not None and (FLOOR + ".").startswith(declared.group(1) + "."), (declared, FLOOR)


def _index_reachable(tmp_path: Path) -> tuple[bool, str]:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"transformers=={FLOOR}", "-d",
           str(tmp_path / "probe")]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return False, "pip download timed out"
    return r.returncode == 0, (r.stderr.strip().splitlines() or [""])[-1]


def bench() -> None:
    """The benchmark's command line: `main`'s status as the exit status."""
    sys.exit(export_compat.main(sys.argv[1:]))


@pytest.mark.slow
def test_export_loads_on_the_floor_transformers(tmp_path: Path) -> None:
    venv = export_compat.venv_dir(FLOOR, None)  # the benchmark's own cache: $HYBRID_CACHE, else ~/.cache/hybrid
    # pip installs the floor without byte-compiling every module of transformers (about 10 CPU-s of a cold
    # venv; the loader compiles what it imports, once): PIP_NO_COMPILE=0 is pip's `--no-compile` (the variable
    # sets the option's `compile` destination to the value given)
    env = {"OMP_NUM_THREADS": "1", "PIP_NO_COMPILE": "0"}
    r = run_forked(bench, ["--transformers", FLOOR, "--venv", str(venv)], ROOT, env, timeout_s=600,
                   prog=export_compat.MODULE)
    if r.code != 0 and not export_compat.venv_ready(venv, FLOOR):  # asked only on failure (a slow probe)
        reachable, why = _index_reachable(tmp_path)
        if not reachable:
            pytest.skip(f"pip cannot reach the package index ({why})")
    assert r.code == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and "PASS" in line]
    assert len(rows) == 2 and "(current)" in rows[0], r.stdout
    assert re.match(rf"^\|\s+{re.escape(FLOOR)} \|.*\| 4/4 .*\| PreTrainedTokenizerFast .*\| PASS\s+\|$", rows[1]), rows
    assert export_compat.venv_ready(venv, FLOOR)  # cached for the next run

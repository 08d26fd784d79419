"""An exported folder on the oldest transformers hybrid declares (pyproject's floor), end to end.

`python -m hybrid.bench.export_compat --transformers <floor>` in a subprocess: a venv with the
floor's transformers (and the tokenizers/huggingface_hub pip resolves for it; torch from this
interpreter, never downloaded), cached under $HYBRID_CACHE/venvs/transformers-<floor>; tiny GPT and
Llama checkpoints exported in fp32 and bf16 with the installed transformers; AutoTokenizer,
AutoModelForCausalLM and pipeline("text-generation") on each folder under both versions; the floor's
logits against the installed version's (see the benchmark's docstring for the checks). Skipped only
when the benchmark fails without a venv and pip then cannot reach the package index.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.bench import export_compat

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


@pytest.mark.slow
def test_export_loads_on_the_floor_transformers(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    cache = os.environ.get("HYBRID_CACHE") or str(tmp_path_factory.mktemp("cache"))
    venv = Path(cache) / "venvs" / f"transformers-{FLOOR}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRID_CACHE": cache, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "hybrid.bench.export_compat", "--transformers", FLOOR, "--venv",
                        str(venv)], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    if r.returncode != 0 and not export_compat.venv_ready(venv, FLOOR):  # asked only on failure (a slow probe)
        reachable, why = _index_reachable(tmp_path)
        if not reachable:
            pytest.skip(f"pip cannot reach the package index ({why})")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and "PASS" in line]
    assert len(rows) == 2 and "(current)" in rows[0], r.stdout
    assert re.match(rf"^\|\s+{re.escape(FLOOR)} \|.*\| 4/4 .*\| PreTrainedTokenizerFast .*\| PASS\s+\|$", rows[1]), rows
    assert export_compat.venv_ready(venv, FLOOR)  # cached for the next run

"""CPU seconds per test, children included: what each test costs the suite, whatever else the machine runs.

Wall durations (`--durations`) swell with load; CPU time does not, much. As a pytest plugin it appends one JSON
line per test (its id, CPU of this process and of the children it reaped — forked ranks, torchrun and its
workers — and wall) to `$CPU_PER_TEST_OUT.<xdist worker>.jsonl`; run as a script it sums them per file:

    CPU_PER_TEST_OUT=/tmp/cpu PYTHONPATH=scripts python -m pytest -p cpu_per_test -n 2 --dist loadfile tests
    python scripts/cpu_per_test.py /tmp/cpu [--tests 20]

A module-scoped fixture's launch counts in the first test that asks for it; the per-file sums are the figure to
compare.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import resource
import time
from collections.abc import Iterator
from typing import Any

import pytest


def _cpu() -> float:
    """CPU seconds of this process and of every child it has waited for."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    cpu, wall = _cpu(), time.monotonic()
    yield
    row = {"id": item.nodeid, "cpu": _cpu() - cpu, "wall": time.monotonic() - wall}
    out = f"{os.environ.get('CPU_PER_TEST_OUT', 'cpu_per_test')}.{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl"
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description="sum the plugin's rows per test file, most CPU first")
    p.add_argument("prefix", help="the CPU_PER_TEST_OUT the suite ran with")
    p.add_argument("--tests", type=int, default=0, help="also list the N costliest tests")
    args = p.parse_args()
    rows = [json.loads(line) for f in glob.glob(f"{args.prefix}.*.jsonl") for line in open(f)]
    cpu, wall = collections.Counter(), collections.Counter()
    for r in rows:
        cpu[r["id"].split("::")[0]] += r["cpu"]
        wall[r["id"].split("::")[0]] += r["wall"]
    print(f"{len(rows)} tests, {sum(cpu.values()):.0f} CPU s, {sum(wall.values()):.0f} wall s (summed over workers)")
    for name, seconds in cpu.most_common():
        print(f"{seconds:8.1f} CPU s {wall[name]:8.1f} wall s  {name}")
    for r in sorted(rows, key=lambda r: -r["cpu"])[: args.tests]:
        print(f"{r['cpu']:8.1f} CPU s  {r['id']}")


if __name__ == "__main__":
    main()

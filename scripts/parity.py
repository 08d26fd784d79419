"""Same numbers before and after a refactor: train the same runs from two trees and compare metrics.jsonl.

    python scripts/parity.py BEFORE_TREE AFTER_TREE [--out DIR] [--only NAME ...]

Each run is launched from each tree's own folder (`PYTHONPATH` = that tree), one tree after the other, into
DIR/<tree>/<run>; then every record of the two metrics.jsonl files is compared field by field, the timing
fields aside (`timed`: wall-clock and throughput figures that differ between any two runs). The last run
resumes the BEFORE tree's step-3 checkpoint of `dp4-powersgd` with the AFTER tree and compares its steps 4–6
with the BEFORE run's. Prints one line per run (identical, or the first field that differs) and exits 1
when any differs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

COMMON = ["logging.wandb.mode=disabled", "logging.progress=false", "logging.log_every=1"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4"]
SINGLE = [sys.executable, "-m", "hybrid.train"]
RUNS = {
    "single": SINGLE + ["train.steps=6", "train.eval_every=3"],
    "tp2pp2-sp-llama-powersgd": TORCHRUN + ["-m", "hybrid.train", "parallel=tp2pp2", "model=llama-tiny",
                                            "parallel.sequence_parallel=true", "compression=powersgd",
                                            "train.steps=6", "train.global_batch_size=16", "train.eval_every=3"],
    "dp4-powersgd": TORCHRUN + ["-m", "hybrid.train", "parallel=dp", "compression=powersgd", "train.steps=6",
                                "train.micro_batch_size=4", "train.global_batch_size=16", "train.eval_every=0",
                                "checkpoint.every=3"],
    "diloco-2nodes": TORCHRUN + ["-m", "hybrid.train", "parallel=dp", "sync=diloco", "sync.inner_steps=2",
                                 "sync.scope=inter", "parallel.ranks_per_node=2", "compression=powersgd",
                                 "train.steps=6", "train.micro_batch_size=4", "train.global_batch_size=16",
                                 "train.eval_every=3"],
    "ps-2nodes": TORCHRUN + ["-m", "hybrid.train", "parallel=dp", "sync=ps", "sync.servers=2",
                             "parallel.ranks_per_node=2", "train.steps=6", "train.micro_batch_size=4",
                             "train.global_batch_size=16", "train.eval_every=3"],
}
TIMED_SUFFIXES = ("_s", "/s", "_gbps")  # seconds and bandwidths (bytes over a measured time)
TIMED_PARTS = ("time/", "overlap", "tokens_per_s", "gflops", "mfu", "memory", "peak")


def launch(tree: Path, argv: list[str], run_dir: Path, extra: list[str] = ()) -> None:
    """One run from `tree`'s folder into a fresh `run_dir` (its checkpoints under run_dir/checkpoints)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    args = [*argv, f"logging.dir={run_dir}", f"checkpoint.dir={run_dir}/checkpoints", *COMMON, *extra]
    done = subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"{tree.name}: {' '.join(argv[-6:])} failed:\n{done.stderr[-3000:]}")


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def timed(key: str) -> bool:
    """A wall-clock figure: seconds, a bandwidth, an overlap share, throughput, memory peaks."""
    return key.endswith(TIMED_SUFFIXES) or any(t in key for t in TIMED_PARTS)


def first_difference(a: list[dict], b: list[dict]) -> str | None:
    """The first (step, field) whose values differ bit for bit, timing fields aside; None when none does."""
    if len(a) != len(b):
        return f"{len(a)} records against {len(b)}"
    for x, y in zip(a, b):
        keys = sorted(k for k in set(x) | set(y) if not timed(k))
        for k in keys:
            if not same(x.get(k), y.get(k)):
                return f"step {x.get('step')}: {k} = {x.get(k)!r} against {y.get(k)!r}"
    return None


def same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--out", type=Path, default=Path("/tmp/hybrid-parity"))
    p.add_argument("--only", nargs="*", default=None)
    args = p.parse_args()
    bad = 0
    for name, argv in RUNS.items():
        if args.only and name not in args.only:
            continue
        dirs = [args.out / tree.name / name for tree in (args.before, args.after)]
        for tree, d in zip((args.before, args.after), dirs):
            launch(tree.resolve(), argv, d.resolve())
        diff = first_difference(records(dirs[0]), records(dirs[1]))
        bad += diff is not None
        print(f"{name}: {'identical (' + str(len(records(dirs[0]))) + ' records)' if diff is None else diff}")
    if not args.only or "resume" in args.only:
        bad += resume(args)
    return 1 if bad else 0


def resume(args: argparse.Namespace) -> int:
    """The AFTER tree resumes the BEFORE tree's step-3 checkpoint of dp4-powersgd; steps 4–6 against BEFORE's."""
    before = (args.out / args.before.name / "dp4-powersgd").resolve()
    step3 = next((before / "checkpoints").glob("*/step_0000003"))
    run_dir = (args.out / args.after.name / "resume-before-step3").resolve()
    launch(args.after.resolve(), RUNS["dp4-powersgd"], run_dir, [f"checkpoint.resume={step3}"])
    tail = [r for r in records(before) if r.get("step", 0) > 3]
    diff = first_difference(tail, records(run_dir))
    print(f"resume of the before tree's step 3 by the after tree: {'identical' if diff is None else diff}")
    return diff is not None


if __name__ == "__main__":
    sys.exit(main())

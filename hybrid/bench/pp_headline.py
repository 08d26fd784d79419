"""The headline run on CPU ranks: gpt-1b at tp2pp4 under torchrun, one short step; wall time and memory per rank.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.pp_headline     # ~2.5 min, ~20 GiB

`torchrun --nproc_per_node 8 -m hybrid.train model=gpt-1b parallel=tp2pp4`, one short step: wall time, the
logged step, peak RSS (VmHWM) per rank vs parameters per rank × 16 bytes. Not run (and reported so) when the
machine has less than HEADLINE_NEEDS_GIB available; killed if MemAvailable falls below 1 GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from hybrid.bench import common
from hybrid.bench.common import launch
from hybrid.bench.memory import proc_status_kb, sample_peaks
from hybrid.config import Config, compose_config
from hybrid.model import build_model
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.parallel.pp.pipeline import partition_layers

MODULE = "hybrid.bench.pp_headline"
GB = 2**30
HEADLINE = ["model=gpt-1b", "parallel=tp2pp4", "data.seq_len=64", "train.micro_batch_size=1",
            "train.global_batch_size=4", "train.steps=1", "train.eval_every=0", "logging.progress=false",
            "logging.wandb.mode=disabled"]
HEADLINE_NEEDS_GIB = 18


def build_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks counting the parameters "
                   "are killed")
    p.add_argument("--torchrun-timeout", type=float, default=900.0, help="seconds before torchrun is killed")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line."""
    return build_parser().parse_args(argv)


def reproduce_command(args: argparse.Namespace) -> str:
    """The command line that repeats this run, every setting spelled out."""
    return common.reproduce_command(MODULE, build_parser(), args)


def headline_command(log_dir: str) -> list[str]:
    """The headline command for one short step (torchrun --standalone: a free rendezvous port)."""
    return ["torchrun", "--standalone", "--nproc_per_node", "8", "-m", "hybrid.train", *HEADLINE,
            f"logging.dir={log_dir}"]


def stage_params_rank(rank: int, world: int, cfg: Config, vocab: int) -> list[int]:
    """Parameters of TP rank `rank`'s shard of every pipeline stage of `cfg` (built on the meta device)."""
    pp = cfg.parallel.pp
    group = ParallelContext.build(Layout.create(world, tp=world)).tp_group
    parts = partition_layers(cfg.model.n_layers, pp, cfg.parallel.stage_layers)
    with torch.device("meta"):
        return [sum(p.numel() for p in build_model(cfg.model, vocab, group, layers=parts[s], pre=s == 0,
                                                    post=s == pp - 1).parameters()) for s in range(pp)]


def run_headline(cmd: list[str], timeout: float) -> tuple[int, str, float, dict[str, int]]:
    """Run `cmd` in its own process group while sampling memory; (exit status, output, wall s, peaks)."""
    peaks: dict[str, int] = {}
    stop = threading.Event()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # its own process group: the guards kill it whole
    sampler = threading.Thread(target=sample_peaks, daemon=True, args=(proc.pid, stop, peaks, 0.5,
                               lambda: os.killpg(proc.pid, signal.SIGKILL)))
    sampler.start()
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log = proc.communicate()[0] + "\n(killed: timeout)"
    stop.set()
    sampler.join()
    return proc.returncode, log, time.perf_counter() - start, peaks


def section_headline(args: argparse.Namespace, out: Callable[[str], None]) -> dict[str, Any]:
    """Run the headline command once; wall time, the logged step, peak RSS per rank vs params × 16 bytes."""
    cfg = compose_config(HEADLINE)
    tp = cfg.parallel.tp
    params = launch(stage_params_rank, tp, cfg, cfg.model.vocab_size, timeout=args.timeout)[0]
    log_dir = tempfile.mkdtemp(prefix="hybrid-bench-pp-")
    cmd = headline_command(log_dir)
    out(f"\n## headline: {' '.join(cmd)}  (OMP_NUM_THREADS=1)")
    available = proc_status_kb(Path("/proc/meminfo").read_text(), "MemAvailable") / 2**20
    if available < HEADLINE_NEEDS_GIB:
        out(f"not run: {available:.1f} GiB available, it needs about {HEADLINE_NEEDS_GIB} GiB")
        return {"returncode": None, "available_gib": available, "params": params}
    code, log, wall, peaks = run_headline(cmd, args.torchrun_timeout)
    metrics = Path(log_dir, "metrics.jsonl")
    steps = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    step = next((s for s in steps if "loss" in s), {})
    out(f"exit {code}, wall {wall:.1f} s (start-up, data, build and 1 step), run dir {log_dir}")
    for key in ("loss", "grad_norm", "step_time_s", "tokens_per_s", "bytes_tp", "bytes_pp", "bytes_dp",
                "bytes_embedding"):
        out(f"  {key:16s} {step.get(key, 'missing')}")
    out("stage | params per rank (tp shard) | × 16 B (fp32 param+grad+2 AdamW moments) | peak VmHWM of its ranks")
    for s, n in enumerate(params):
        hwm = [peaks.get(str(r), 0) / 2**20 for r in range(s * tp, (s + 1) * tp)]
        out(f"{s:5d} | {n:26,d} | {n * 16 / GB:37.2f} GiB | {' / '.join(f'{h:.2f}' for h in hwm)} GiB")
    out(f"peak sum of RSS over all ranks {peaks.get('total', 0) / 2**20:.2f} GiB; expected ≈ Σ params × 16 B "
        f"= {sum(params) * tp * 16 / GB:.2f} GiB plus ~0.3–0.5 GiB of torch/python per rank, activations and "
        f"AdamW's foreach temporaries; least MemAvailable {peaks.get('min_available', 0) / 2**20:.2f} GiB "
        "(the run is killed below 1 GiB, to spare the machine's other processes)")
    if code:
        out("last output:\n" + log[-3000:])
    return {"returncode": code, "wall": wall, "step": step, "peaks": peaks, "params": params}


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark; returns its figures (for tests)."""
    return common.run_one(section_headline, args, reproduce_command(args), MODULE, out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit 0, or 1 when the headline run failed (a run not started for lack of memory is reported, not failed)."""
    return 0 if run(parse_args(argv))["returncode"] in (0, None) else 1


if __name__ == "__main__":
    sys.exit(main())

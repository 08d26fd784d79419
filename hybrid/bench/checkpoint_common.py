"""What the checkpoint benchmarks share: layouts named tp<t>pp<p>dp<d>, the run's config and command-line
options, and a real Trainer with its Checkpointer on synthetic tokens."""

from __future__ import annotations

import argparse
import importlib
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Optional

import torch

from hybrid.bench.common import check_models
from hybrid.bench.inputs import synthetic_corpus
from hybrid.compression.hooks import make_hook
from hybrid.config import Config, compose_config
from hybrid.parallel.context import ParallelContext
from hybrid.trainer import Trainer, build_chunks
from hybrid.validation import validate

LAYOUT_RE = re.compile(r"^tp(\d+)pp(\d+)dp(\d+)$")
CPU = torch.device("cpu")
MIB = 2**20


def add_run_options(p: argparse.ArgumentParser, model: str, timeout: float) -> None:
    """The options every checkpoint benchmark has: the model, layout and vocabulary, the batch, the folder, the
    timeout."""
    p.add_argument("--model", default=model, help="configs/model")
    p.add_argument("--layout", default="tp2pp2dp2", help="the layout of the ranks, tp<t>pp<p>dp<d>")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default: model.vocab_size, else 8192)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per microbatch")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step (all DP ranks)")
    p.add_argument("--dir", default=None, help="parent of the temporary checkpoint folder (default: the system's "
                   "temp dir; use local disk: a tmpfs would hold the checkpoints in memory)")
    p.add_argument("--timeout", type=float, default=timeout, help="seconds before a set of ranks is killed")


def check_run_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (parser error, exit 2) an unknown model, a malformed layout or a batch the layout cannot split."""
    check_models(p, args.model)
    if min(args.seq, args.micro_batch) < 1:
        p.error("--seq and --micro-batch must be >= 1")
    if not LAYOUT_RE.match(args.layout) or world(args.layout) < 2:
        p.error(f"a layout is tp<t>pp<p>dp<d> of at least 2 ranks, not {args.layout!r}")
    if args.global_batch % (args.micro_batch * layout(args.layout)["dp"]):
        p.error("--global-batch must be a multiple of --micro-batch · the layout's dp")


def layout(name: str) -> dict[str, int]:
    """{"tp": t, "pp": p, "dp": d} of a layout name tp<t>pp<p>dp<d>."""
    m = LAYOUT_RE.match(name)
    assert m is not None, name
    return dict(zip(("tp", "pp", "dp"), map(int, m.groups())))


def world(name: str) -> int:
    lay = layout(name)
    return lay["tp"] * lay["pp"] * lay["dp"]


def preload_dcp() -> None:
    """Import here what DCP imports lazily on a rank's first save or load (its fsspec storage layer, a few tenths
    of a CPU-second a process), so that every forked rank inherits it."""
    with suppress(ImportError):
        importlib.import_module("torch.distributed.checkpoint._fsspec_filesystem")


@contextmanager
def scratch(parent: Optional[str]) -> Iterator[Path]:
    """A temporary checkpoint folder under `parent` (None: the system's temp dir), removed at the end."""
    folder = Path(tempfile.mkdtemp(prefix="hybrid-bench-ckpt-", dir=parent))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def bench_cfg(args: argparse.Namespace, model: str, lay: str, root: Path, run: str, *overrides: str) -> Config:
    """The composed, validated config of one run at layout `lay` (fp32 on CPU, no eval); checkpoints in `root/run`."""
    sizes = layout(lay)
    cfg = compose_config([
        f"model={model}", "model.dropout=0.0", f"parallel.tp={sizes['tp']}", f"parallel.pp={sizes['pp']}",
        f"parallel.dp={sizes['dp']}", "parallel.name=bench", f"data.seq_len={args.seq}",
        f"train.micro_batch_size={args.micro_batch}", f"train.global_batch_size={args.global_batch}",
        "train.steps=1000000", "train.eval_every=0", "train.precision=fp32", "train.device=cpu",
        f"checkpoint.dir={root}", f"run_name={run}", "checkpoint.keep=1", *overrides])
    validate(cfg, world(lay), world(lay))
    return cfg


def make_trainer(cfg: Config, ctx: ParallelContext, vocab: int) -> Trainer:
    """A real Trainer of `cfg` on this rank (synthetic tokens), its Checkpointer of `cfg.checkpoint`."""
    torch.manual_seed(cfg.train.seed + ctx.pp_rank)
    hook, state = make_hook(cfg.compression, ctx.dp_group)
    corpus = synthetic_corpus(vocab, cfg.data.seq_len, 64)
    return Trainer(cfg, ctx, build_chunks(cfg, vocab, ctx), corpus, CPU, hook, state, log=lambda _: None)

"""Sharded checkpoints on gloo CPU ranks: save/load seconds and bytes vs one torch.save; an async save's step cost.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.checkpoint [--sections size,async] [--quick]

Everything is written under one temporary folder on local disk (--dir, default the system's temp dir), removed
at the end. Sections:

- size: --model at --layout (tp2pp2dp2: 8 forked gloo ranks), each a real `Trainer` whose AdamW state is
  created in place by `init_optimizer_state` (no step is trained: a gpt-350m step on 8 ranks sharing 2 cores
  is slow and its temporaries would add to a ~15 GB footprint, and a checkpoint's bytes and I/O do not depend
  on the values), the moments filled with constants so that the load can be checked. `Checkpointer.save`
  (sync DCP: every rank writes its own shards, fsync'ed; replicated tensors once), then every Trainer is
  dropped and a fresh one (other seed) loads it with `Checkpointer.load`; seconds are from a common barrier to
  the slowest rank. Then, in this process, the whole model (tp=1) with the same state:
  `torch.save({"model": state_dict, "optim": state_dict})` + fsync, dropped, and `torch.load` +
  `load_state_dict` into a fresh model and optimizer. Bytes on disk per file kind, against the analytic
  12·N (param, exp_avg, exp_avg_sq in fp32; N = `analytic_param_count` at that tp); DCP's index must hold
  exactly 12·N + 4·(one fp32 `step` per parameter) tensor bytes, every byte of the shard files must be an item
  of the index, and each tensor item carries at most DCP_FRAMING bytes of torch.save framing. Both loads are
  checked (parameter and moment checksums equal the saved ones). The files are read back from the page cache.
- async: --async-model at --async-layout (tp2pp2dp2: 8 ranks, the size section's layout), a real Trainer with
  `checkpoint.async=true` and a second, sync Checkpointer on the same Trainer. --warmup untimed steps, then
  --rounds rounds of: --steps steps with no save; a sync save (its blocking seconds); an async save (its
  blocking part: the manifest, a barrier, the Checkpointer's `Stager` copying the state into its CPU buffers,
  timed on its own, and the start of DCP's background write) followed at once by --steps steps while the write
  runs in a background thread, then `wait()`. The Stager keeps its buffers across saves: round 0's async save
  allocates them, later rounds copy into them. Step seconds are the slowest rank's; the in-flight window runs
  from the end of the blocking part to the last rank's completion; the overlap is the share of that window the
  steps covered.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from hybrid.bench import common
from hybrid.bench.common import check_models, parse_with_quick
from hybrid.bench.compression import table
from hybrid.bench.pp import descendants, proc_status_kb, sample_peaks
from hybrid.bench.ranks import launch
from hybrid.bench.tp import resolve_vocab, synthetic_corpus
from hybrid.checkpoint import MANIFEST, METADATA, Checkpointer, Stager, init_optimizer_state, read_manifest
from hybrid.compression.hooks import make_hook
from hybrid.config import compose_config, validate
from hybrid.model import analytic_param_count, build_model
from hybrid.optim import adamw
from hybrid.parallel.context import ParallelContext
from hybrid.trainer import Trainer, build_chunks

SECTIONS = ("size", "async")
LAYOUT_RE = re.compile(r"^tp(\d+)pp(\d+)dp(\d+)$")
CPU = torch.device("cpu")
MIB = 2**20
DCP_FRAMING = 2048
"""At most this many bytes of one DCP tensor item are not tensor data: DCP writes each tensor with torch.save
(a small zip: pickle, record headers, 64-byte alignment; ~1.5 KiB measured on torch 2.13)."""
EXP_AVG, EXP_AVG_SQ = 1e-3, 1e-6  # the constants the moments are filled with (checked after the loads)
LOW_MEMORY_KB = 2**20  # the ranks are killed when MemAvailable falls below 1 GiB (the machine is shared)

QUICK = {"model": "gpt-tiny", "async_model": "gpt-tiny", "seq": 32, "micro_batch": 1, "global_batch": 8,
         "steps": 2, "warmup": 1, "rounds": 1, "timeout": 300.0}


def build_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = argparse.ArgumentParser(prog="python -m hybrid.bench.checkpoint", description=__doc__.splitlines()[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    p.add_argument("--quick", action="store_true", default=None, help="both sections on gpt-tiny, seconds (the "
                   "smoke test): QUICK's values become the defaults; the reproduce command spells them out")
    p.add_argument("--model", default="gpt-350m", help="size: configs/model saved and loaded")
    p.add_argument("--layout", default="tp2pp2dp2", help="size: the sharded side's layout, tp<t>pp<p>dp<d>")
    p.add_argument("--async-model", default="gpt-125m", help="async: configs/model trained while a save is in flight")
    p.add_argument("--async-layout", default="tp2pp2dp2", help="async: layout, tp<t>pp<p>dp<d>")
    p.add_argument("--seq", type=int, default=64, help="async: tokens per sequence")
    p.add_argument("--micro-batch", type=int, default=1, help="async: sequences per microbatch")
    p.add_argument("--global-batch", type=int, default=8, help="async: sequences per step (all DP ranks)")
    p.add_argument("--steps", type=int, default=4, help="async: timed steps per contender per round")
    p.add_argument("--warmup", type=int, default=1, help="async: untimed steps before the first round")
    p.add_argument("--rounds", type=int, default=3,
                   help="async: rounds of (plain steps, sync save, async save + steps)")
    p.add_argument("--dir", default=None, help="parent of the temporary checkpoint folder (default: the system's "
                   "temp dir; use local disk: a tmpfs would hold the checkpoints in memory)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before a set of ranks is killed")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line; `--quick` makes QUICK's values the defaults (options given explicitly still win)."""
    p = build_parser()
    args = parse_with_quick(p, argv, QUICK, SECTIONS)
    check_models(p, args.model, args.async_model)
    if min(args.seq, args.micro_batch, args.steps, args.rounds) < 1 or args.warmup < 0:
        p.error("--seq, --micro-batch, --steps and --rounds must be >= 1, --warmup >= 0")
    for name in (args.layout, args.async_layout):
        if not LAYOUT_RE.match(name) or world(name) < 2:
            p.error(f"a layout is tp<t>pp<p>dp<d> of at least 2 ranks, not {name!r}")
    if any(args.global_batch % (args.micro_batch * layout(name)["dp"]) for name in (args.layout, args.async_layout)):
        p.error("--global-batch must be a multiple of --micro-batch · each layout's dp")
    return args


def reproduce_command(args: argparse.Namespace) -> str:
    """The command line that repeats this run, every setting spelled out."""
    return common.reproduce_command("hybrid.bench.checkpoint", build_parser(), args)


# ---- shared ----------------------------------------------------------------------------------------------------

def layout(name: str) -> dict[str, int]:
    """{"tp": t, "pp": p, "dp": d} of a layout name tp<t>pp<p>dp<d>."""
    m = LAYOUT_RE.match(name)
    assert m is not None, name
    return dict(zip(("tp", "pp", "dp"), map(int, m.groups())))


def world(name: str) -> int:
    lay = layout(name)
    return lay["tp"] * lay["pp"] * lay["dp"]


def bench_cfg(args: argparse.Namespace, model: str, lay: str, root: Path, run: str, *overrides: str) -> Any:
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


def make_trainer(cfg: Any, ctx: ParallelContext, vocab: int) -> Trainer:
    """A real Trainer of `cfg` on this rank (synthetic tokens), its Checkpointer of `cfg.checkpoint`."""
    torch.manual_seed(cfg.train.seed + ctx.pp_rank)
    hook, state = make_hook(cfg.compression, ctx.dp_group)
    corpus = synthetic_corpus(vocab, cfg.data.seq_len, 64)
    return Trainer(cfg, ctx, build_chunks(cfg, vocab, ctx), corpus, CPU, hook, state, log=lambda _: None)


def fill_moments(optimizer: torch.optim.Optimizer) -> None:
    init_optimizer_state(optimizer)
    for s in optimizer.state.values():
        s["exp_avg"].fill_(EXP_AVG)
        s["exp_avg_sq"].fill_(EXP_AVG_SQ)
        s["step"].fill_(7.0)


def checksums(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[float, float, float]:
    """fp64 sums of the parameters, of the moments and of the steps (compared before a save and after a load),
    summed 1 Mi elements at a time (no fp64 copy of a whole tensor)."""
    def total(t: torch.Tensor) -> float:
        return sum(float(c.double().sum()) for c in t.detach().reshape(-1).split(2**20))

    states = [optimizer.state[p] for p in model.parameters()]
    return (sum(total(p) for p in model.parameters()),
            sum(total(s["exp_avg"]) + total(s["exp_avg_sq"]) for s in states),
            sum(float(s["step"]) for s in states))


def same_sums(a: Sequence[float], b: Sequence[float]) -> bool:
    return all(abs(x - y) <= 1e-9 * max(1.0, abs(x)) for x, y in zip(a, b))


def slowest(results: list[dict[str, Any]], key: str) -> float:
    return max(r[key] for r in results)


class MemoryWatch:
    """Samples the ranks' summed RSS and the machine's MemAvailable while ranks run; kills this process's
    descendants (by pid) if MemAvailable falls below LOW_MEMORY_KB, so a shared machine is not pushed to OOM."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}
        self.stop = threading.Event()
        self.killed = False
        self.thread = threading.Thread(target=sample_peaks, args=(os.getpid(), self.stop, self.peaks, 0.25,
                                                                  self._kill, LOW_MEMORY_KB), daemon=True)

    def _kill(self) -> None:
        self.killed = True
        for pid in descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __enter__(self) -> MemoryWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()
        if self.killed:
            raise MemoryError(f"MemAvailable fell below {LOW_MEMORY_KB // 1024} MiB: the ranks were killed")

    def line(self) -> str:
        total, avail = self.peaks.get("total", 0) / 2**20, self.peaks.get("min_available", 0) / 2**20
        return (f"ranks' summed RSS peak {total:.2f} GiB (shared pages counted per rank), "
                f"least MemAvailable {avail:.2f} GiB")


# ---- size ------------------------------------------------------------------------------------------------------

def index_bytes(path: Path) -> dict[str, Any]:
    """Bytes of a DCP checkpoint folder by kind, and what its index says: tensor data (every chunk's
    numel · element size), tensor items and their lengths, byte items, and the shard bytes the index covers."""
    files = {f.name: f.stat().st_size for f in path.iterdir() if f.is_file()}
    md = dcp.FileSystemReader(str(path)).read_metadata()
    data = model = optim = tensor_len = bytes_len = tensor_items = byte_items = 0
    for key, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            size = meta.properties.dtype.itemsize
            n = sum(size * torch.Size(c.sizes).numel() for c in meta.chunks)
            data += n
            model += n if key.startswith("model.") else 0
            optim += n if key.startswith("optim.") else 0
    for index, info in md.storage_data.items():
        if isinstance(md.state_dict_metadata[index.fqn], BytesStorageMetadata):
            bytes_len += info.length
            byte_items += 1
        else:
            tensor_len += info.length
            tensor_items += 1
    shards = {k: v for k, v in files.items() if k.endswith(".distcp")}
    return {"files": files, "shards": sum(shards.values()), "shard_files": len(shards),
            "shard_min": min(shards.values()), "shard_max": max(shards.values()), "metadata": files[METADATA],
            "manifest": files[MANIFEST], "other": sum(files.values()) - sum(shards.values()),
            "total": sum(files.values()),
            "data": data, "model_data": model, "optim_data": optim, "tensor_len": tensor_len, "bytes_len": bytes_len,
            "tensor_items": tensor_items, "byte_items": byte_items, "keys": len(md.state_dict_metadata)}


def shard_files(files: dict[str, int]) -> dict[int, int]:
    """Bytes of the DCP shard files (`__<rank>_<i>.distcp`) summed by the rank that wrote them."""
    out: dict[int, int] = {}
    for name, size in files.items():
        if name.endswith(".distcp"):
            rank = int(name.removeprefix("__").split("_")[0])
            out[rank] = out.get(rank, 0) + size
    return out


def rss_mib(key: str = "VmRSS") -> float:
    """This process's resident set (or VmHWM: its peak) in MiB."""
    return proc_status_kb(Path("/proc/self/status").read_text(), key) / 1024


def size_rank(rank: int, world_size: int, cfg: Any, fresh_cfg: Any, vocab: int) -> dict[str, Any]:
    """Save this rank's state with Checkpointer.save, drop the Trainer, load into a fresh one (timed)."""
    ctx = ParallelContext.build(validate(cfg, world_size, world_size))
    rss = {"start": rss_mib()}
    trainer = make_trainer(cfg, ctx, vocab)
    fill_moments(trainer.optimizer)
    rss["built"] = rss_mib()
    before = checksums(trainer.model, trainer.optimizer)
    state_bytes = sum(3 * p.numel() * 4 for p in trainer.model.parameters())
    dist.barrier()
    start = time.perf_counter()
    path = trainer.checkpointer.save()
    save_s = time.perf_counter() - start
    rss["saved"] = rss_mib()
    del trainer  # freed here (GradSync holds its grad hooks weakly)
    gc.collect()
    rss["dropped"] = rss_mib()
    fresh = make_trainer(fresh_cfg, ctx, vocab)  # another seed: other weights until the load
    init_optimizer_state(fresh.optimizer)
    rss["fresh"] = rss_mib()
    differs = not same_sums(checksums(fresh.model, fresh.optimizer), before)
    manifest = read_manifest(path)
    dist.barrier()
    start = time.perf_counter()
    fresh.checkpointer.load(path, manifest)
    load_s = time.perf_counter() - start
    rss["loaded"], rss["peak"] = rss_mib(), rss_mib("VmHWM")
    after = checksums(fresh.model, fresh.optimizer)
    return {"rss": rss, "path": str(path), "save_s": save_s, "load_s": load_s, "state_bytes": state_bytes,
            "loaded": differs and same_sums(after, before), "coord": (ctx.coord.pp, ctx.coord.dp, ctx.coord.tp)}


def single_process(cfg: Any, vocab: int, folder: Path) -> dict[str, Any]:
    """The whole model (tp=1) with the same state in this process: torch.save + fsync, then torch.load +
    load_state_dict into a fresh model and optimizer. Seconds, bytes, and whether the load restored it."""
    path = folder / "single.pt"
    model = torch.nn.ModuleList([build_model(cfg.model, vocab, None, seed=cfg.train.seed)])
    optimizer = adamw(model, cfg.optim, cfg.train.lr)
    fill_moments(optimizer)
    before = checksums(model, optimizer)
    start = time.perf_counter()
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    save_s = time.perf_counter() - start
    del state, model, optimizer
    gc.collect()
    model = torch.nn.ModuleList([build_model(cfg.model, vocab, None, seed=cfg.train.seed + 1)])
    optimizer = adamw(model, cfg.optim, cfg.train.lr)  # no state yet: load_state_dict adopts the loaded
    start = time.perf_counter()
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    del state
    load_s = time.perf_counter() - start
    after = checksums(model, optimizer)
    size = path.stat().st_size
    path.unlink()
    return {"save_s": save_s, "load_s": load_s, "bytes": size, "loaded": same_sums(after, before)}


def size_figures(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Run the sharded save/load on 8 ranks and the single-process one; every figure of the size section."""
    cfg = bench_cfg(args, args.model, args.layout, folder, "sharded")
    fresh = bench_cfg(args, args.model, args.layout, folder, "sharded", f"train.seed={cfg.train.seed + 1}")
    vocab = resolve_vocab(cfg, None)
    with MemoryWatch() as watch:
        ranks = launch(size_rank, world(args.layout), cfg, fresh, vocab, timeout=args.timeout)
    path = Path(ranks[0]["path"])
    idx = index_bytes(path)
    shutil.rmtree(path.parent)
    gc.collect()
    single = single_process(cfg, vocab, folder)
    n_tp, n_one = analytic_param_count(cfg.model, vocab, cfg.parallel.tp), analytic_param_count(cfg.model, vocab, 1)
    n_tensors = sum(1 for _ in build_model_meta(cfg, vocab).parameters())  # one fp32 `step` per parameter
    return {"ranks": ranks, "index": idx, "single": single, "n_tp": n_tp, "n_one": n_one, "n_tensors": n_tensors,
            "memory": watch.line(), "held": sum(r["state_bytes"] for r in ranks)}


def build_model_meta(cfg: Any, vocab: int) -> torch.nn.Module:
    """The whole model on the meta device (shapes only)."""
    with torch.device("meta"):
        return build_model(cfg.model, vocab, None, seed=0)


def size_checks(f: dict[str, Any]) -> dict[str, bool]:
    """The exact checks of the size section."""
    idx = f["index"]
    analytic = 12 * f["n_tp"]
    return {
        "model data = 4·N": idx["model_data"] == 4 * f["n_tp"],
        "index data = 12·N + 4·params": idx["data"] == analytic + 4 * f["n_tensors"],
        "shard files = index items": idx["shards"] == idx["tensor_len"] + idx["bytes_len"],
        f"framing <= {DCP_FRAMING} B/tensor item":
            0 <= idx["tensor_len"] - idx["data"] <= DCP_FRAMING * idx["tensor_items"],
        "sharded load restored the state": all(r["loaded"] for r in f["ranks"]),
        "torch.load restored the state": f["single"]["loaded"],
    }


def section_size(args: argparse.Namespace, out: Callable[[str], None]) -> dict[str, Any]:
    """Save/load seconds and bytes: sharded DCP on 8 ranks vs one torch.save of the whole state."""
    folder = Path(tempfile.mkdtemp(prefix="hybrid-bench-ckpt-", dir=args.dir))
    try:
        f = size_figures(args, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    idx, single = f["index"], f["single"]
    save_s, load_s = slowest(f["ranks"], "save_s"), slowest(f["ranks"], "load_s")
    n_tp, n_one = f["n_tp"], f["n_one"]
    tp, n_ranks, dp = layout(args.layout)["tp"], world(args.layout), layout(args.layout)["dp"]
    out(f"\n## size: {args.model}, sharded at {args.layout} on {n_ranks} forked gloo ranks (Checkpointer.save / "
        f".load into a fresh Trainer) vs one process's torch.save / torch.load of the whole state (model + AdamW "
        f"moments). Optimizer state created by init_optimizer_state (no step trained); seconds: slowest rank, "
        f"fsync included on both sides; loads read back from the page cache.")
    rows = [
        [f"sharded DCP ({n_ranks} ranks)", f"{n_tp:,}", f"{12 * n_tp:,}", f"{idx['total']:,}",
         f"{idx['total'] / (12 * n_tp):.6f}",
         f"{save_s:.2f}", f"{load_s:.2f}", f"{idx['total'] / MIB / save_s:.0f}", f"{idx['total'] / MIB / load_s:.0f}"],
        ["torch.save (1 process)", f"{n_one:,}", f"{12 * n_one:,}", f"{single['bytes']:,}",
         f"{single['bytes'] / (12 * n_one):.6f}", f"{single['save_s']:.2f}", f"{single['load_s']:.2f}",
         f"{single['bytes'] / MIB / single['save_s']:.0f}", f"{single['bytes'] / MIB / single['load_s']:.0f}"],
        ["ratio sharded / single", "", "", f"{idx['total'] / single['bytes']:.4f}", "",
         f"{save_s / single['save_s']:.2f}", f"{load_s / single['load_s']:.2f}", "", ""],
    ]
    for line in table(["", "parameters N", "analytic 12·N B", "bytes on disk", "disk / analytic", "save s", "load s",
                       "save MiB/s", "load MiB/s"], rows):
        out(line)
    framing = idx["tensor_len"] - idx["data"]
    out(f"N: analytic_param_count (vocabulary padded for tp={tp} on the sharded side, tp=1 on the other; the tied "
        f"head counted once). Sharded bytes: {idx['shards']:,} in {idx['shard_files']} shard files "
        f"({idx['shard_min']:,}..{idx['shard_max']:,} each) + .metadata {idx['metadata']:,} + {MANIFEST} "
        f"{idx['manifest']:,}. Its index: {idx['keys']} keys, tensor data {idx['data']:,} B "
        f"= 12·N + 4·{f['n_tensors']} "
        f"(one fp32 step per parameter) over {idx['tensor_items']} tensor items, framing {framing:,} B "
        f"({framing / idx['tensor_items']:.0f} B per item: DCP torch.saves each item), {idx['byte_items']} byte items "
        f"(RNG + hook state per rank) {idx['bytes_len']:,} B. Shard file MiB by rank: "
        f"{', '.join(f'{v / MIB:.1f}' for _, v in sorted(shard_files(idx['files']).items()))}.")
    out(f"Dedup: the {n_ranks} ranks hold {f['held']:,} B of param + moments ({f['held'] / (12 * n_tp):.2f}× the "
        f"checkpoint's 12·N: {dp} DP replicas, TP-replicated norms/biases, the last stage's tied head); "
        f"the checkpoint's tensor data is {idx['data'] / (12 * n_tp):.6f}× of 12·N, i.e. every tensor written once. "
        f"Memory: {f['memory']}; one rank's peak (VmHWM) {max(r['rss']['peak'] for r in f['ranks']):,.0f} MiB.")
    checks = size_checks(f)
    out("checks: " + "; ".join(f"{k}: {'PASS' if v else 'FAIL'}" for k, v in checks.items()))
    return {"sharded": {"bytes": idx["total"], "save_s": save_s, "load_s": load_s, **idx}, "single": single,
            "n_tp": n_tp, "n_one": n_one, "n_tensors": f["n_tensors"], "held": f["held"], "checks": checks}


# ---- async -----------------------------------------------------------------------------------------------------

def timed_steps(trainer: Trainer, n: int) -> list[tuple[float, float]]:
    """(start, end) perf_counter of each of `n` train steps (CLOCK_MONOTONIC: comparable across the ranks)."""
    out = []
    for _ in range(n):
        start = time.perf_counter()
        trainer.train_step()
        out.append((start, time.perf_counter()))
    return out


class TimedStager(Stager):
    """The Checkpointer's Stager, recording each staging copy's (start, end) perf_counter."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[float, float]] = []

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        start = time.perf_counter()
        staged = super().stage(state)
        self.calls.append((start, time.perf_counter()))
        return staged

    def bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


def async_rank(rank: int, world_size: int, cfg: Any, sync_cfg: Any, vocab: int, steps: int, warmup: int,
               rounds: int) -> dict[str, Any]:
    """Per round: plain steps, a sync save (blocking seconds), an async save (blocking seconds, and its staging
    copy's within them) then steps while it is in flight. The async Checkpointer's Stager lives for the whole
    run: the first async save allocates its CPU buffers, the later ones copy into them."""
    ctx = ParallelContext.build(validate(cfg, world_size, world_size))
    trainer = make_trainer(cfg, ctx, vocab)  # checkpoint.async=true: its own gloo group, a background thread
    stager = trainer.checkpointer.stager = TimedStager()
    sync = Checkpointer(sync_cfg, ctx, CPU, trainer.checkpoint_states())
    timed_steps(trainer, warmup)
    out = []
    for _ in range(rounds):
        dist.barrier()
        plain = timed_steps(trainer, steps)
        dist.barrier()
        start = time.perf_counter()
        sync.save()
        sync_end = time.perf_counter()
        dist.barrier()
        start_async = time.perf_counter()
        trainer.checkpointer.save()
        staged = time.perf_counter()
        done: list[float] = []
        trainer.checkpointer.pending[0].add_done_callback(lambda _, d=done: d.append(time.perf_counter()))
        flight = timed_steps(trainer, steps)
        trainer.checkpointer.wait()
        waited = time.perf_counter()
        out.append({"plain": plain, "sync": (start, sync_end), "async": (start_async, staged, done[0], waited),
                    "copy": stager.calls[-1], "flight": flight})
    assert len(stager.calls) == rounds
    return {"rounds": out, "staging_bytes": stager.bytes()}


def step_seconds(ranks: list[list[tuple[float, float]]]) -> list[float]:
    """Each step's seconds: the slowest rank's."""
    return [max(r[k][1] - r[k][0] for r in ranks) for k in range(len(ranks[0]))]


def async_round(results: list[list[dict[str, Any]]], i: int) -> dict[str, Any]:
    """Round `i`'s figures over the ranks (one monotonic clock: times compare across ranks)."""
    rs = [r[i] for r in results]
    start = min(r["async"][0] for r in rs)
    staged = max(r["async"][1] for r in rs)
    done = max(r["async"][2] for r in rs)
    flight = [r["flight"] for r in rs]
    steps_start, steps_end = min(f[0][0] for f in flight), max(f[-1][1] for f in flight)
    window = max(done - staged, 1e-9)
    covered = max(0.0, min(done, steps_end) - max(staged, steps_start))
    in_flight = [k for k in range(len(flight[0])) if min(f[k][0] for f in flight) < done]
    flight_s = step_seconds(flight)
    return {"plain": step_seconds([r["plain"] for r in rs]), "flight": flight_s,
            "in_flight": [flight_s[k] for k in in_flight], "sync_s": max(r["sync"][1] - r["sync"][0] for r in rs),
            "block_s": staged - start, "copy_s": max(r["copy"][1] - r["copy"][0] for r in rs),
            "window_s": done - staged, "async_total_s": done - start,
            "overlap": covered / window, "wait_s": max(r["async"][3] for r in rs) - steps_end}


def section_async(args: argparse.Namespace, out: Callable[[str], None]) -> dict[str, Any]:
    """Step seconds while an async save is in flight vs none; async blocking part vs a sync save."""
    folder = Path(tempfile.mkdtemp(prefix="hybrid-bench-ckpt-", dir=args.dir))
    try:
        cfg = bench_cfg(args, args.async_model, args.async_layout, folder, "async", "checkpoint.async=true")
        sync_cfg = bench_cfg(args, args.async_model, args.async_layout, folder, "sync")
        vocab = resolve_vocab(cfg, None)
        with MemoryWatch() as watch:
            results = launch(async_rank, world(args.async_layout), cfg, sync_cfg, vocab, args.steps, args.warmup,
                             args.rounds, timeout=args.timeout)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rounds = [async_round([r["rounds"] for r in results], i) for i in range(args.rounds)]
    n = analytic_param_count(cfg.model, vocab, cfg.parallel.tp)
    staging_bytes = sum(r["staging_bytes"] for r in results)
    plain = [s for r in rounds for s in r["plain"]]
    flight = [s for r in rounds for s in r["flight"]]
    in_flight = [s for r in rounds for s in r["in_flight"]]
    tokens = args.global_batch * args.seq
    out(f"\n## async: {args.async_model} (N = {n:,}, checkpoint {12 * n / MIB:,.0f} MiB) at {args.async_layout} "
        f"on {world(args.async_layout)} ranks, "
        f"{args.global_batch} × {args.seq} tokens per step, {args.rounds} round(s) of {args.steps} steps with no save, "
        f"a sync save, then an async save followed at once by {args.steps} steps. Step seconds: the slowest rank. "
        f"Async blocking: manifest + barrier + the Checkpointer's staging copy (timed alone: slowest rank) + the "
        f"start of DCP's write; round 0's copy allocates the Stager's buffers, later rounds reuse them.")
    body = []
    for i, r in enumerate(rounds):
        body.append([str(i), f"{statistics.mean(r['plain']):.3f}", f"{statistics.mean(r['flight']):.3f}",
                     f"{statistics.mean(r['in_flight']):.3f} ({len(r['in_flight'])})",
                     f"{statistics.mean(r['flight']) / statistics.mean(r['plain']):.2f}×",
                     f"{r['sync_s']:.2f}", f"{r['block_s']:.2f}", f"{r['copy_s']:.2f}",
                     f"{r['block_s'] / r['sync_s']:.2f}×",
                     f"{r['window_s']:.2f}", f"{r['overlap']:.0%}", f"{r['wait_s']:.2f}"])
    for line in table(["round", "step s, no save", "step s, after async save", "step s, in flight (steps)",
                       "ratio after / none", "sync save s", "async blocking s", "of which staging copy s",
                       "blocking async / sync", "in-flight window s", "window overlapped by steps",
                       "wait() after steps s"], body):
        out(line)
    later = rounds[1:] or rounds  # buffers reused (round 0 allocates them)
    summary = {"plain_s": statistics.mean(plain), "flight_s": statistics.mean(flight),
               "in_flight_s": statistics.mean(in_flight), "sync_s": statistics.mean(r["sync_s"] for r in rounds),
               "block_s": statistics.mean(r["block_s"] for r in rounds),
               "copy_s": statistics.mean(r["copy_s"] for r in rounds),
               "first_block_s": rounds[0]["block_s"], "first_copy_s": rounds[0]["copy_s"],
               "reused_block_s": statistics.mean(r["block_s"] for r in later),
               "reused_copy_s": statistics.mean(r["copy_s"] for r in later),
               "reused_sync_s": statistics.mean(r["sync_s"] for r in later),
               "window_s": statistics.mean(r["window_s"] for r in rounds),
               "overlap": statistics.mean(r["overlap"] for r in rounds), "staging_bytes": staging_bytes}
    out(f"mean over rounds: step {summary['plain_s']:.3f} s with no save ({tokens / summary['plain_s']:.0f} tok/s), "
        f"{summary['flight_s']:.3f} s in the {args.steps} steps after an async save "
        f"(**{summary['flight_s'] / summary['plain_s']:.2f}×**), {summary['in_flight_s']:.3f} s for the steps started "
        f"while it was in flight (**{summary['in_flight_s'] / summary['plain_s']:.2f}×**); blocking: sync save "
        f"{summary['sync_s']:.2f} s, async {summary['block_s']:.2f} s "
        f"(**{summary['block_s'] / summary['sync_s']:.2f}×**), of which the staging copy {summary['copy_s']:.2f} s; "
        f"the write ran {summary['window_s']:.2f} s in the background, {summary['overlap']:.0%} of it overlapped by "
        f"steps. Memory: {watch.line()}.")
    reused = (f"later saves (buffers reused, mean of {len(later)}): {summary['reused_block_s']:.2f} s, copy "
              f"{summary['reused_copy_s']:.2f} s (**{summary['reused_block_s'] / summary['reused_sync_s']:.2f}×** "
              f"their sync saves' {summary['reused_sync_s']:.2f} s)" if len(rounds) > 1
              else "no later save (one round): none reused the buffers")
    out(f"async blocking, first save (allocates the buffers): {summary['first_block_s']:.2f} s, copy "
        f"{summary['first_copy_s']:.2f} s; {reused}. The Stager holds {staging_bytes / MIB:,.0f} MiB of CPU "
        f"buffers over the ranks for the whole run ({staging_bytes / (12 * n):.2f}× the checkpoint's 12·N: every "
        f"rank stages its whole state dict, DP replicas and TP-replicated tensors included).")
    return {"rounds": rounds, "n": n, **summary}


# ---- driver ----------------------------------------------------------------------------------------------------

def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the chosen sections in order; returns their figures (for tests)."""
    sections = (("size", section_size), ("async", section_async))
    return common.run_sections(sections, args, reproduce_command(args), "hybrid.bench.checkpoint", out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit 0, or 1 when an exact check of the size section failed (bytes vs the formula, a load)."""
    result = run(parse_args(argv))
    return 0 if all(result.get("size", {}).get("checks", {}).values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Sharded checkpoints on gloo CPU ranks: bytes on disk and save/load seconds of sharded DCP vs one torch.save.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.checkpoint_size [--quick]

Everything is written under one temporary folder on local disk (--dir, default the system's temp dir), removed
at the end. --model at --layout (tp2pp2dp2: 8 forked gloo ranks), each a real `Trainer` whose AdamW state is
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
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from hybrid.bench import common
from hybrid.bench.checkpoint_common import (
    MIB,
    add_run_options,
    bench_cfg,
    check_run_options,
    layout,
    make_trainer,
    preload_dcp,
    scratch,
    world,
)
from hybrid.bench.common import launch, parse_with_quick, table
from hybrid.bench.inputs import resolve_vocab
from hybrid.bench.memory import MemoryWatch, rss_mib
from hybrid.checkpoint import MANIFEST, METADATA, init_optimizer_state, read_manifest
from hybrid.config import Config
from hybrid.model import analytic_param_count, build_model
from hybrid.optim import adamw
from hybrid.parallel.context import ParallelContext
from hybrid.validation import validate

MODULE = "hybrid.bench.checkpoint_size"
DCP_FRAMING = 2048
"""At most this many bytes of one DCP tensor item are not tensor data: DCP writes each tensor with torch.save
(a small zip: pickle, record headers, 64-byte alignment; ~1.5 KiB measured on torch 2.13)."""
EXP_AVG, EXP_AVG_SQ = 1e-3, 1e-6  # the constants the moments are filled with (checked after the loads)
QUICK = {"model": "gpt-tiny", "vocab": 512, "seq": 16, "micro_batch": 1, "global_batch": 4, "timeout": 300.0}


def build_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "gpt-tiny with a 512-token vocabulary, seconds")
    add_run_options(p, model="gpt-350m", timeout=1800.0)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line; `--quick` makes QUICK's values the defaults (options given explicitly still win)."""
    p = build_parser()
    args = parse_with_quick(p, argv, QUICK)
    check_run_options(p, args)
    return args


def reproduce_command(args: argparse.Namespace) -> str:
    """The command line that repeats this run, every setting spelled out."""
    return common.reproduce_command(MODULE, build_parser(), args)


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


def size_rank(rank: int, world_size: int, cfg: Config, fresh_cfg: Config, vocab: int) -> dict[str, Any]:
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


def single_process(cfg: Config, vocab: int, folder: Path) -> dict[str, Any]:
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
    vocab = resolve_vocab(cfg, args.vocab)
    preload_dcp()
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


def build_model_meta(cfg: Config, vocab: int) -> torch.nn.Module:
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
    with scratch(args.dir) as folder:
        f = size_figures(args, folder)
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


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark; returns its figures (for tests)."""
    return common.run_one(section_size, args, reproduce_command(args), MODULE, out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit 0, or 1 when an exact check failed (bytes vs the formula, a load)."""
    return 0 if all(run(parse_args(argv))["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

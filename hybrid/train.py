"""Entry point: `torchrun --nproc_per_node N -m hybrid.train model=<m> parallel=<p> key=value ...`.

init → validate → process groups → data → model → Trainer.fit → clean shutdown. Bad input
(config, data, command line) is one `hybrid: error: ...` line on every rank and exit status 2.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from datetime import timedelta
from typing import Any

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from hybrid.config import CONFIG_DIR, ConfigError, compose_config, register_configs, validate

EXIT_BAD_INPUT = 2


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _fail(msg: str) -> None:
    """One readable line on this rank's stderr, then a non-zero exit (no traceback)."""
    rank = os.environ.get("RANK")
    prefix = f"[rank{rank}] " if rank is not None and _env_int("WORLD_SIZE", 1) > 1 else ""
    _say(f"{prefix}hybrid: error: {msg}")
    _wait_for_peers_to_report()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(EXIT_BAD_INPUT)


def _wait_for_peers_to_report(timeout_s: float = 5.0) -> None:
    """Under torchrun, linger until every rank has printed its error (or `timeout_s`), so the
    launcher, which stops all workers as soon as one exits, does not cut the others' lines.
    Uses torchrun's own rendezvous store; no process group is needed."""
    world = _env_int("WORLD_SIZE", 1)
    if world == 1 or "MASTER_ADDR" not in os.environ:
        return
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 0), is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        key = f"hybrid/failed/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        while store.add(key, 0) < world and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001  (best effort: never turn a clean error into a traceback)
        pass


def _device(cfg: Any) -> torch.device:
    want = cfg.train.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but CUDA is not available")
        torch.cuda.set_device(_env_int("LOCAL_RANK", 0))
        return torch.device("cuda", _env_int("LOCAL_RANK", 0))
    return torch.device("cpu")


def _init_distributed(device: torch.device) -> None:
    """NCCL on CUDA, gloo on CPU; a single process without torchrun needs no process group."""
    if "RANK" not in os.environ or dist.is_initialized():
        return
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def run(cfg: DictConfig) -> None:
    """Build everything from a composed config and train."""
    from hybrid.checkpoint import Checkpointer, plan_resume
    from hybrid.compression.hooks import make_hook
    from hybrid.data import prepare_data
    from hybrid.metrics import format_count
    from hybrid.model import analytic_param_count
    from hybrid.parallel import collectives as C
    from hybrid.parallel.context import ParallelContext
    from hybrid.parallel.rng import derive_seed
    from hybrid.trainer import Trainer, build_chunks

    world, rank = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0)
    layout = validate(cfg, world, _env_int("LOCAL_WORLD_SIZE", world))
    device = _device(cfg)
    corpus = prepare_data(cfg.data)
    vocab = cfg.model.vocab_size or corpus.vocab_size
    if vocab < corpus.vocab_size:
        raise ConfigError(f"model.vocab_size={vocab} is smaller than the tokenizer's {corpus.vocab_size} tokens")
    _init_distributed(device)
    ctx = ParallelContext.build(layout)
    for name in ("tp", "dp", "pp", "dp_intra", "dp_inter", "embedding"):
        C.name_group(getattr(ctx, f"{name}_group"), name)
    # dropout on replicated activations: the same stream on every TP rank, a different one per stage
    torch.manual_seed(derive_seed(cfg.train.seed, "stage", ctx.pp_rank))
    model = build_chunks(cfg, vocab, ctx).to(device)
    hook, state = make_hook(cfg.compression, ctx.dp_group, ctx.dp_intra_group, ctx.dp_inter_group)
    writer = rank == 0
    resume = plan_resume(cfg, vocab, writer, _warn)  # before anything is written: a bad checkpoint is bad input
    trainer = Trainer(cfg, ctx, model, corpus, device, hook, state)
    early: list[str] = []  # lines of the load, shown once the metrics sink exists
    trainer.checkpointer = Checkpointer(cfg, ctx, device, early.append)
    if resume:
        trainer.checkpointer.load(trainer, *resume)  # a checkpoint that cannot be read fails before any write
        if cfg.model.init_from:
            early.append(f"note: model.init_from={cfg.model.init_from} ignored: resuming {resume[0]} wins")
    elif cfg.model.init_from:
        early.append(_init_from(trainer.model, cfg.model, vocab))
    metrics = trainer.metrics = _metrics_logger(cfg, writer, trainer.step)
    trainer.checkpointer.log = metrics.message
    for line in early:
        metrics.message(line)  # rank 0 only
    if writer:
        n, analytic = trainer.n_params, analytic_param_count(cfg.model, vocab, layout.tp)
        metrics.message(layout.rank_map())
        if cfg.parallel.sequence_parallel and layout.tp == 1:
            metrics.message("note: parallel.sequence_parallel=true has no effect at tp=1")
        if layout.pp > 1:
            metrics.message(pipeline_summary(trainer.schedule, cfg))
        if cfg.compression.method != "none":
            metrics.message(compression_summary(cfg.compression, layout))
        metrics.message(f"model {cfg.model.name}: {format_count(n)} parameters (analytic {format_count(analytic)}, "
                        f"exact match: {n == analytic}), {trainer.flops_per_token / 1e9:.3f} GFLOP/token "
                        f"(6N + 12·L·h·s), vocab {vocab}, {trainer.num_microbatches} microbatch(es)/step, "
                        f"device {device}, run dir {cfg.logging.dir}")
    try:
        trainer.fit()
    finally:
        metrics.close()


def _init_from(model: Any, model_cfg: DictConfig, vocab: int) -> str:
    """Fill the chunks from the transformers folder `model.init_from` (no collective); a folder that
    does not fit the model is bad input (the model package's ModelConfigError becomes a ConfigError)."""
    from hybrid.model.family import ModelConfigError
    from hybrid.model.hf import load_pretrained

    try:
        return load_pretrained(model, model_cfg.init_from, model_cfg, vocab)
    except ModelConfigError as e:
        raise ConfigError(str(e)) from None


def compression_summary(c: DictConfig, layout: Any) -> str:
    """One start-up line: the DP hook, and under hierarchical how the DP groups split over nodes."""
    line = f"compression: {c.method} over dp={layout.dp}"
    if c.warmup_steps:
        line += f", exact for the first {c.warmup_steps} steps"
    if c.method != "hierarchical":
        return line + ("" if layout.dp > 1 else " (dp=1: nothing to exchange)")
    intra, inter = len(layout.dp_intra_node_groups()[0]), len(layout.dp_inter_node_groups()[0])
    line += f": exact inside a node ({intra} DP ranks), {c.inner} between nodes ({inter} DP ranks)"
    if intra == 1 or inter == 1:
        line += (f" — warning: with {layout.ranks_per_node} ranks per node one of the two hops is a single "
                 "rank, so this is plain " + ("exact sync" if inter == 1 else c.inner) +
                 " (set parallel.ranks_per_node to emulate nodes)")
    return line


def pipeline_summary(schedule: Any, cfg: DictConfig) -> str:
    """One start-up line: schedule, layers per part, and the simulator's bubble at unit costs."""
    from hybrid.parallel.pipeline import partition_layers
    from hybrid.parallel.schedules import simulate

    parts = partition_layers(cfg.model.n_layers, schedule.num_parts, cfg.parallel.stage_layers)
    sim = simulate(schedule)
    return (f"pipeline: schedule {schedule.name}, pp={schedule.pp} × {schedule.virtual_stages} chunk(s), "
            f"{schedule.microbatches} microbatches, layers per part {[len(r) for r in parts]}, "
            f"simulated bubble {sim.bubble:.3f} (forward:backward 1:2), peak in flight {sim.peak_in_flight}")


def _say(line: str) -> None:
    """One line on stderr in one write, so the lines of two ranks never interleave."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _warn(msg: str) -> None:
    _say(f"hybrid: {msg}")


def _metrics_logger(cfg: DictConfig, writer: bool, start_step: int = 0) -> Any:
    """Rank 0 writes metrics.jsonl, wandb and the progress bar; a wandb failure is bad input."""
    from hybrid.metrics import MetricsLogger

    try:
        return MetricsLogger(cfg.logging.dir, OmegaConf.to_container(cfg, resolve=True), is_writer=writer,
                   total_steps=cfg.train.steps, wandb_mode=cfg.logging.wandb.mode,
                   wandb_project=cfg.logging.wandb.project, wandb_entity=cfg.logging.wandb.entity,
                   progress=cfg.logging.progress, run_name=cfg.run_name, start_step=start_step)
    except RuntimeError as e:
        raise ConfigError(str(e)) from None


def _shutdown() -> None:
    """The measured clean exit for gloo: collect, barrier, destroy."""
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except ConfigError as e:
        _fail(str(e))
    _shutdown()


def _precheck(argv: list[str]) -> None:
    """Compose the config once with Hydra's compose API so that a bad override or an unknown
    group option becomes one readable line instead of Hydra's multi-line report."""
    if any(a.startswith("-") for a in argv):
        return  # Hydra's own flags (--cfg, --help, -m, …): let Hydra handle the command line
    try:
        compose_config([a for a in argv if not a.lstrip("+~").startswith(("hydra.", "hydra/"))])
    except Exception as e:  # noqa: BLE001  (any composition failure is bad input)
        _fail(_one_line(e))


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    msg = lines[0] if lines else type(e).__name__
    options = [ln for ln in lines[1:] if not ln.startswith(("Config search path", "provider=", "Available"))]
    if "Could not find" in msg and options:
        return f"{msg} (available: {', '.join(o for o in options if not o.endswith('_schema'))})"
    if msg.endswith("while composing config:") and len(lines) > 1:
        msg = f"{msg.removesuffix(' raised while composing config:')}: {lines[1]}"
    cause = e.__cause__
    if cause is not None and str(cause).strip():
        msg += " " + str(cause).strip().splitlines()[0]
    return msg


def main() -> None:
    register_configs()
    if _env_int("RANK", 0) != 0:  # only rank 0 writes Hydra's outputs and log file
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    _precheck(sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()

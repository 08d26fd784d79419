"""Entry point: `torchrun --nproc_per_node N -m hybrid.train model=<m> parallel=<p> key=value ...`.

init → validate → process groups → data → model → Trainer.fit → clean shutdown. Bad input
(config, data, command line) is one `hybrid: error: ...` line on every rank and exit status 2.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import hydra
import torch
import torch.distributed as dist

from hybrid.checkpoint import NonFiniteState
from hybrid.cli import EXIT_BAD_INPUT, EXIT_FAILED, App, env_int, exit_on_error, precheck, warn
from hybrid.comm_watch import CommDegraded
from hybrid.config import CONFIG_DIR, Config, ConfigError, register_configs
from hybrid.health import ReplicaDivergence
from hybrid.nonfinite import NonFiniteStop
from hybrid.parallel import collectives as C
from hybrid.parallel.timeouts import CollectiveFault, collective_fault, timeout_of
from hybrid.record import comm_env
from hybrid.record.runlog import RunLog, command_line, save_hydra_files
from hybrid.startup import WriteFault, check_wandb_key, hold_run_folders, write_fault
from hybrid.validation import validate

if TYPE_CHECKING:
    from hybrid.data import Corpus
    from hybrid.parallel.context import Layout
    from hybrid.parallel.pp.schedules import Schedule
    from hybrid.trainer import Trainer


RUN_ERRORS = ((ConfigError, EXIT_BAD_INPUT), (WriteFault, EXIT_FAILED), (NonFiniteState, EXIT_FAILED),
              (NonFiniteStop, EXIT_FAILED), (CollectiveFault, EXIT_FAILED), (ReplicaDivergence, EXIT_FAILED),
              (CommDegraded, EXIT_FAILED))
"""Bad input (config, data, checkpoint, the run's folders) exits 2; a write that failed while training, a
diverged (non-finite) state due to be checkpointed, a non-finite gradient the run stops on
(`train.on_nonfinite`), a collective that timed out or lost a peer, replicas found to differ
(`health.divergence_every`), or communication that stayed degraded under `health.comm_action=stop` (after saving), 1."""


def _device(cfg: Config) -> torch.device:
    want = cfg.train.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but CUDA is not available")
        torch.cuda.set_device(env_int("LOCAL_RANK", 0))
        return torch.device("cuda", env_int("LOCAL_RANK", 0))
    return torch.device("cpu")


def _init_distributed(device: torch.device, timeout_s: float) -> None:
    """gloo on CPU; on CUDA NCCL for CUDA tensors bound to this rank's device (`device_id`: no guessing from
    the global rank, barriers know their device) and gloo beside it for CPU tensors (the per-step signal flag:
    agreed without waiting for the device). `parallel.timeout_s` for the world's collectives; a single
    process without torchrun needs no process group."""
    if "RANK" not in os.environ or dist.is_initialized():
        return
    if device.type == "cuda":
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout_of(timeout_s), device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timeout_of(timeout_s))


def run(cfg: Config, log: Optional[RunLog] = None) -> None:
    """Build everything from a composed config and train. `log` (rank 0 under `main`) gets the run folder
    once the run is accepted: train.log opens and the `.hydra/` files are written then, not before."""
    from hybrid.data import prepare_data
    from hybrid.model import analytic_param_count

    place_sweep_job(cfg)
    world, rank = env_int("WORLD_SIZE", 1), env_int("RANK", 0)
    layout = validate(cfg, world, env_int("LOCAL_WORLD_SIZE", world))
    if world == 1:  # rank 0's answer needs no broadcast: a missing wandb key is refused before the data is built
        check_wandb_key(cfg)
    device = _device(cfg)
    corpus = prepare_data(cfg.data, init_from=cfg.model.init_from)
    vocab = cfg.model.vocab_size or corpus.vocab_size
    if vocab < corpus.vocab_size:
        raise ConfigError(f"model.vocab_size={vocab} is smaller than the data's {corpus.vocab_size} ids "
                          "(the tokenizer's size, or a token file's largest id + 1)")
    try:
        _init_distributed(device, cfg.parallel.timeout_s)
        # rank 0 locks and probes the run's folders and checks wandb's key: one answer for every rank (a broadcast)
        with hold_run_folders(cfg, analytic_param_count(cfg.model, vocab, layout.tp), rank == 0):
            _start(cfg, log, layout, device, corpus, vocab)
    except RuntimeError as e:  # a collective of the start-up (groups, resume plan, load) that timed out
        hang = collective_fault(e, None, cfg.parallel.timeout_s)
        if hang is None:
            raise
        raise CollectiveFault(with_flight(hang, cfg.logging.dir, rank)) from None


def _start(cfg: Config, log: Optional[RunLog], layout: Layout, device: torch.device, corpus: Corpus,
           vocab: int) -> None:
    """`run` once rank 0 holds the run's folders: groups, model, resume plan, then (accepted) the run."""
    from hybrid.checkpoint import plan_resume
    from hybrid.memory import default_memory
    from hybrid.memory import summary as memory_summary
    from hybrid.model import analytic_param_count
    from hybrid.parallel.context import ParallelContext
    from hybrid.parallel.rng import stage_seed
    from hybrid.plan.balance import resolve as resolve_stage_layers
    from hybrid.record.metrics import format_count
    from hybrid.sync import startup_lines
    from hybrid.trainer import Trainer, build_chunks

    balance_line = resolve_stage_layers(cfg, vocab, device.type)  # parallel.stage_layers=auto: the split it means
    ctx = ParallelContext.build(layout, cfg.parallel.timeout_s)
    # dropout on replicated activations: the same stream on every TP rank, a different one per stage and CP rank
    torch.manual_seed(stage_seed(cfg.train.seed, ctx.pp_rank, ctx.cp_rank))
    model = build_chunks(cfg, vocab, ctx).to(device)
    writer = ctx.rank == 0
    resume = plan_resume(cfg, vocab, writer, warn)  # before anything is written: a bad checkpoint is bad input
    if nothing_to_do(resume, cfg, writer):
        return
    trainer = Trainer(cfg, ctx, model, corpus, device)
    metrics = trainer.start(resume)  # loads (a checkpoint that cannot be read fails before any write), then logs
    log = log or RunLog(enabled=False)
    if writer:
        log.open(Path(cfg.logging.dir))
        save_hydra_files(cfg, Path(cfg.logging.dir))
        n, analytic = trainer.n_params, analytic_param_count(cfg.model, vocab, layout.tp)
        metrics.message(layout.rank_map())
        metrics.message(comm_env.binding_line())
        metrics.message(comm_env.line(comm_env.communication(comm_env.backend())))
        if cfg.parallel.sequence_parallel and layout.tp == 1:
            metrics.message("note: parallel.sequence_parallel=true has no effect at tp=1")
        if layout.pp > 1:
            metrics.message(pipeline_summary(trainer.schedule, cfg))
        if balance_line:
            metrics.message(balance_line)
        for line in startup_lines(cfg, layout):  # the DP exchange (`hybrid.sync`)
            metrics.message(line)
        metrics.message(memory_summary(cfg, layout, lambda c: build_chunks(cfg, vocab, c), device.type,
                                       default_memory(device.type, layout.ranks_per_node)))
        metrics.message(f"model {cfg.model.name}: {format_count(n)} parameters (analytic {format_count(analytic)}, "
                        f"exact match: {n == analytic}), {trainer.report.flops_per_token / 1e9:.3f} GFLOP/token "
                        f"(6N + 12·L·h·s), vocab {vocab}, {trainer.num_microbatches} microbatch(es)/step, "
                        f"device {device}, run dir {cfg.logging.dir}")
    _fit(trainer, log)


def _fit(trainer: Trainer, log: RunLog) -> None:
    """Train, summarize, close; a write that fails meanwhile (full disk, permissions) is a WriteFault, a
    collective that timed out or lost a peer a CollectiveFault (one line naming the group)."""
    try:
        _fit_or_stop(trainer, log)
    except CommDegraded:
        raise
    except BaseException as e:
        fault = write_fault(e, trainer.step)  # one line and exit 1 instead of a traceback
        if fault is not None:
            raise WriteFault(fault) from None
        hang = collective_fault(e, trainer.step, trainer.timeouts.now_s, trainer.timeouts.key)
        if hang is None:
            raise
        raise CollectiveFault(with_flight(hang, trainer.cfg.logging.dir, trainer.ctx.rank)) from None
    finally:
        trainer.close()


def _fit_or_stop(trainer: Trainer, log: RunLog) -> None:
    """Train and summarize (collective: after a fit every rank completed); under `health.comm_action=stop` an alert
    saves and summarizes first (`_stop_degraded`: a write failing there is a WriteFault as during training)."""
    try:
        trainer.fit()
    except CommDegraded as e:  # every rank raised it after the same step's record
        _stop_degraded(trainer, log, e)
        raise
    trainer.summarize(log.elapsed(), log.path)


def _stop_degraded(trainer: Trainer, log: RunLog, e: CommDegraded) -> None:
    """`health.comm_action=stop`: log the alerting step's record, save that step and write summary.json (collective:
    every rank stops at the same step), before the one error line and exit 1."""
    if trainer.metrics is not None:
        trainer.metrics.log(trainer.step, e.record)
    trainer.checkpointer.save()  # waits for a save still in flight first
    trainer.checkpointer.wait()
    trainer.summarize(log.elapsed(), log.path)


def with_flight(line: str, run_dir: str, rank: int) -> str:
    """`line` and where this rank's flight recorder (its last collectives) was written: `<run dir>/flight/`."""
    path = C.TIMER.flight.dump(Path(run_dir) / "flight", rank)
    return line + (f"; this rank's last collectives: {path}" if path else "")


def nothing_to_do(resume: Optional[tuple[Path, dict[str, Any]]], cfg: Config, writer: bool) -> bool:
    """Whether the checkpoint resumed is already at train.steps: then rank 0 says so in one line and the
    run ends (exit 0) before anything is written. Every rank has the same answer (plan_resume's broadcast)."""
    from hybrid.checkpoint import finished_line

    line = finished_line(*resume, cfg) if resume else None
    if line and writer:
        warn(line)
    return line is not None


def place_sweep_job(cfg: Config) -> None:
    """A sweep job (`-m`) writes into its own folder, Hydra's hydra.sweep.dir/hydra.sweep.subdir
    (multirun/<run_name>/<job number> by default: no timestamps, so every rank of a job names the same
    folder); a single run keeps logging.dir and checkpoint.dir."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    if "RANK" in os.environ and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
        raise ConfigError("a sweep (-m) under torchrun starts one process group per job, and the second one hangs "
                          "on torchrun's shared store (pytorch#135712): set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                          "(launch/*.sh do)")
    hc = HydraConfig.get()
    use_job_folder(cfg, str(Path(hc.sweep.dir) / str(hc.sweep.subdir)), list(hc.overrides.task))


def use_job_folder(cfg: Config, folder: str, overrides: list[str]) -> None:
    """The job's logging.dir is `folder` and its checkpoints go to `folder`/checkpoints; a logging.dir or
    checkpoint.dir on the command line would put every job in one place, so it is bad input here."""
    for override in overrides:
        if override.lstrip("+~").split("=", 1)[0] in ("logging.dir", "checkpoint.dir"):
            raise ConfigError(f"{override}: in a sweep (-m) each job writes into its own folder ({folder}); "
                              "move the sweep with hydra.sweep.dir=... instead")
    cfg.logging.dir = folder
    cfg.checkpoint.dir = f"{folder}/checkpoints"


def pipeline_summary(schedule: Schedule, cfg: Config) -> str:
    """One start-up line: schedule, layers per part, and the simulator's bubble at unit costs."""
    from hybrid.parallel.pp.pipeline import partition_layers
    from hybrid.parallel.pp.simulator import simulate

    parts = partition_layers(cfg.model.n_layers, schedule.num_parts, cfg.parallel.stage_layers)
    sim = simulate(schedule)
    return (f"pipeline: schedule {schedule.label}, pp={schedule.pp} × {schedule.virtual_stages} chunk(s), "
            f"{schedule.microbatches} microbatches, layers per part {[len(r) for r in parts]}, "
            f"simulated bubble {sim.bubble:.3f} (forward:backward 1:2), peak in flight {sim.peak_in_flight}")




def _shutdown() -> None:
    """The measured clean exit for gloo: collect, barrier, destroy."""
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def _hydra_main(cfg: Config) -> None:
    with RunLog(env_int("RANK", 0) == 0, command_line()) as log:  # rank 0's lines, also in train.log
        exit_on_error(lambda: run(cfg, log), RUN_ERRORS)  # one line per rank, exit 2 or 1 (hybrid.cli)
    _shutdown()


def main() -> None:
    register_configs()
    if env_int("RANK", 0) != 0:  # only rank 0 writes the run's .hydra/ files and train.log (hybrid.record.runlog)
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    precheck(sys.argv[1:], App.of(__name__, __file__))  # bad overrides: one line and exit 2, before Hydra
    _hydra_main()


if __name__ == "__main__":
    main()

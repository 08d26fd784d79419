"""The schema of what a run records and watches: `logging` (with `logging.wandb`), `profile` and `health`.

`hybrid.config.Config` holds one of each; they live here so the schema's groups fit rooms of their own size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class WandbConfig:
    # values left at these defaults yield to WANDB_MODE / WANDB_PROJECT / WANDB_ENTITY / WANDB_RUN_GROUP
    mode: str = "offline"  # offline | online | disabled
    project: str = "hybrid"
    entity: Optional[str] = None
    group: Optional[str] = None  # wandb's run group (e.g. one per sweep)
    tags: list[str] = field(default_factory=list)


@dataclass
class LoggingConfig:
    dir: str = "runs/${run_name}"  # everything of a run lives here; a sweep job (-m): its job folder
    log_every: int = 10  # steps between metrics.jsonl lines (torchtitan's 10); the progress bar moves every step
    progress: bool = True  # progress bar on rank 0
    timing: bool = True  # logged steps: time every collective (comm/ keys) and break the step down (time/ keys)
    traffic_map: bool = True  # the last step's bytes rank → rank: traffic.json (+ traffic.png with matplotlib)
    tensorboard: bool = False  # scalars under <dir>/tensorboard/ (needs the tensorboard package)
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class ProfileConfig:
    steps: list[int] = field(default_factory=list)  # [first, last]: torch.profiler traces of these steps
    dir: str = "${logging.dir}/profile"  # one Chrome/Perfetto trace per rank (+ a CUDA memory snapshot)
    memory: bool = True  # on CUDA, also record a memory snapshot of the profiled steps


@dataclass
class HealthConfig:
    straggler_every: int = 50  # steps between sharing every rank's compute time (an all-gather of a scalar); 0 = off
    straggler_threshold: float = 0.2  # name a rank computing this fraction above the median of its stage's ranks
    divergence_every: int = 200  # steps between checksums of what replicas must hold alike (DP, TP); 0 = off
    # communication alerts (hybrid.comm_watch), on the timed logged steps: each group against the run's own baseline
    comm_checks: int = 3  # checks in a row a figure must be worse before the one warning line; 0 = off
    comm_slowdown: float = 2.0  # worse = bus bandwidth this many times lower, or exposed time this many times higher
    comm_min_share: float = 0.05  # ... and the group's share of the step up by at least this much (noise stays quiet)
    comm_warmup: int = 3  # timed logged steps skipped before the baseline (compilation, allocator, first buckets)
    comm_baseline: int = 5  # timed logged steps whose median is a group's baseline
    comm_action: str = "warn"  # warn | stop (save the step reached, then exit 1: runs that must not limp)
    comm_preflight: str = ""  # a `hybrid-commbench --preflight --save FILE` result: its figures beside each alert

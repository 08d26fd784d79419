"""How DP replicas agree (`sync.mode`): the owner of the DP dimension. Each mode leaves TP and PP inside a
replica as they are, and is one module registered here (`plan.register_sync_mode`):

- `dp` (`dp.py`): synchronous data parallelism: every step's gradients averaged over the DP group through the
  compression hook (`parallel.dp.data.GradSync`), ZeRO-1's reduce-scatter, 1-bit Adam's optimizer.
- `diloco` (`diloco.py`; `sync=diloco`, `sync=local_sgd`): H local steps per replica, then an outer step on the
  averaged pseudo-gradient (`outer.OuterSync`). Under `sync.scope=inter` the DP ranks of a node still average
  their gradients every step (exactly); only the exchange between nodes waits H steps.
- `gossip` (`gossip.py`): each replica steps alone, then averages its parameters with its neighbours on a graph.
- `ps` (`ps.py`; `sync=ps`, `sync=ps_async`): workers push gradients to parameter-server shards hosted by the
  first DP ranks (`server.py`) and pull parameters, synchronously or with bounded staleness.

`build_plan` gives the trainer its `DPPlan` (gradient sync, optimizer, after-step work, checkpoint states,
records); `check` validates the `sync` and `compression` configs against the layout (one-line `ConfigError`s);
`startup_lines` and `mode_footprint` serve the start-up lines and the memory estimate. The compression library
(`hybrid.compression`) is used by the modes; nothing outside this package decides how the DP exchange runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from hybrid.compression.hooks import OPTIMIZER_SIDE
from hybrid.config import Config, ConfigError
from hybrid.parallel.dp.data import CommHook
from hybrid.sync import exchange
from hybrid.sync.diloco import DILOCO
from hybrid.sync.dp import SYNCHRONOUS_DP
from hybrid.sync.exchange import require
from hybrid.sync.footprint import Footprint
from hybrid.sync.gossip import GOSSIP
from hybrid.sync.outer_policy import inner_steps
from hybrid.sync.plan import DPPlan, ReplicaSync, SyncMode, get_sync_mode, register_sync_mode, sync_mode_names
from hybrid.sync.ps import PARAMETER_SERVER

if TYPE_CHECKING:
    from hybrid.parallel.context import Layout, ParallelContext

BUILT_IN = (SYNCHRONOUS_DP, DILOCO, GOSSIP, PARAMETER_SERVER)
SCOPES = ("dp", "inter")

__all__ = ["BUILT_IN", "DPPlan", "ReplicaSync", "SyncMode", "build_plan", "bytes_cut_by", "check", "mode_footprint",
           "register_sync_mode", "startup_lines", "sync_mode_names"]


def mode_of(cfg: Config) -> SyncMode:
    """The registered mode of `sync.mode` (ConfigError naming the known ones)."""
    try:
        return get_sync_mode(cfg.sync.mode)
    except KeyError:
        raise ConfigError(f"sync.mode={cfg.sync.mode!r} is not one of {', '.join(sync_mode_names())}") from None


def build_plan(cfg: Config, ctx: ParallelContext, model: nn.ModuleList,
               main: Optional[dict[nn.Parameter, torch.Tensor]] = None,
               hook: Optional[tuple[CommHook, Any]] = None) -> DPPlan:
    """The run's DP plan for `model` (bf16 parameters: `main` holds their fp32 main weights); `hook`: a
    (hook, state) to run instead of `compression=`'s (tests and benchmarks bring their own). Collective
    where the mode creates process groups of its own (every rank calls it)."""
    return mode_of(cfg).build(cfg, ctx, model, main, hook)


def startup_lines(cfg: Config, layout: Layout) -> list[str]:
    """The mode's start-up lines (its exchange, or a note when it has nothing to do at this layout)."""
    return mode_of(cfg).startup(cfg, layout)


def mode_footprint(cfg: Config, params: Sequence[torch.Tensor], sizes: Sequence[int], dp: int, share: int,
                   device: str, host: bool = True) -> Footprint:
    """What the mode holds on a rank training `params` (buckets of `sizes` elements) for the memory estimate."""
    return mode_of(cfg).footprint(cfg, params, sizes, dp, share, device, host)


def bytes_cut_by(cfg: Config) -> str:
    """What already cuts the DP exchange's bytes: the compression method under `sync=dp` ('none': an exact
    all-reduce every step), else the sync mode (DiLoCo, gossip and the parameter server exchange otherwise)."""
    return cfg.compression.method if cfg.sync.mode == "dp" else f"sync={cfg.sync.mode}"


CP_APART = ("hierarchical", *OPTIMIZER_SIDE)  # exchanges over DP's own node split or optimizer: not over CP × DP


def check(cfg: Config, layout: Layout) -> None:
    """The `sync` config against the layout and the other options, then the exchange's compression options,
    then the mode's own rules. Raises ConfigError (one line)."""
    s = cfg.sync
    mode = mode_of(cfg)
    require(s.scope in SCOPES, f"sync.scope={s.scope!r} is not one of {', '.join(SCOPES)}")
    require(s.inner_steps is not None or s.mode == "diloco", f"sync.inner_steps=null (H from train.steps) applies "
             f"to sync=diloco or sync=local_sgd; sync.mode={s.mode} needs a number")
    h = inner_steps(s, cfg.train.steps)
    require(h >= 1, f"sync.inner_steps must be >= 1, got {h}")
    require(1 <= s.fragments <= h, f"sync.fragments must be between 1 and sync.inner_steps={h}, got {s.fragments}")
    require(s.mode == "ps" or (s.servers == 1 and not s.asynchronous and s.max_staleness == 0 and not
                                s.staleness_weighting), "sync.servers, sync.asynchronous, sync.max_staleness and "
             "sync.staleness_weighting apply to sync=ps (the parameter server)")
    require(s.mode == "diloco" or (s.overlap_steps == 0 and s.overlap_mix == 0), "sync.overlap_steps and "
             "sync.overlap_mix apply to sync=diloco or sync=local_sgd (the outer exchange)")
    require(s.max_staleness == 0 or s.asynchronous, f"sync.max_staleness={s.max_staleness} needs "
             "sync.asynchronous=true (a synchronous server has none)")
    require(layout.cp == 1 or (s.mode == "dp" and cfg.compression.method not in CP_APART), f"parallel.cp="
            f"{layout.cp} averages gradients over CP and DP together: it runs with sync.mode=dp and compression "
            f"other than {', '.join(CP_APART)} (got sync.mode={s.mode}, compression={cfg.compression.method})")
    exchange.check(cfg, layout)
    mode.check(cfg, layout)


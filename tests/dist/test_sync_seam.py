"""The sync-mode seam is real: a mode defined here, through the public seam only, trains.

"param_average" is a mode no module of hybrid knows: each replica steps on its own gradients, then every
parameter is replaced by its mean over DP (one all-reduce per parameter after each optimizer step). Under a
linear optimizer (SGD with momentum, no clipping) that is synchronous DP's update, so trained at tp2pp2dp2
(8 gloo ranks, a 2-layer model, both configs composed before the ranks fork) its losses and weights equal
`sync=dp`'s within fp32 rounding. It is registered when this module
is imported (the forked or spawned ranks import it too); nothing else is changed: validation, the trainer, the
checkpoint's states, the records, the memory estimate and the start-up lines ask the registry.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from harness import run_ranks
from pp_helpers import Case, make_cfg
from test_sync import LINEAR, SMALL, TIMEOUT, modes_composed, train_modes

from hybrid.config import ConfigError, compose_config
from hybrid.parallel import collectives as C
from hybrid.parallel.context import Layout
from hybrid.sync import BUILT_IN, DPPlan, register_sync_mode, startup_lines, sync_mode_names
from hybrid.sync.footprint import Footprint
from hybrid.sync.replica import inner_optimizer, inner_sync, trained
from hybrid.validation import validate


class Averager:
    """After each optimizer step: every replica's weights ← their mean over DP (an all-reduce each)."""

    state = None  # no compression hook state

    def __init__(self, params: list[torch.nn.Parameter], group: Any, weights: Any) -> None:
        self.params, self.group, self.weights, self.rounds = params, group, weights, 0

    @torch.no_grad()
    def after_step(self, step: int, last: bool = False) -> list[int]:
        for p in self.params:
            w = self.weights.main_weight(p)
            C.all_reduce(w, self.group)
            w.div_(C.size(self.group))
        self.weights.loaded()
        self.rounds += 1
        return [0]

    def restart(self, step: int = 0) -> None:
        """Nothing kept beyond the replicas' own weights."""

    def record(self, steps: int) -> dict[str, float]:
        return {"param_average_rounds": float(self.rounds)}

    def state_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.rounds = int(sd["rounds"])


class ParamAverage:
    name = "param_average"

    def check(self, cfg: Any, layout: Layout) -> None:
        if cfg.optim.name != "sgd" or cfg.parallel.zero:
            raise ConfigError("sync.mode=param_average averages the weights of optim=sgd replicas (parallel.zero=0)")

    def build(self, cfg: Any, ctx: Any, model: torch.nn.ModuleList, main: Optional[dict], hook: Any) -> DPPlan:
        grad_sync = inner_sync(cfg, ctx, model, main)  # a replica alone
        optimizer = inner_optimizer(cfg, ctx, model, grad_sync, main)
        return DPPlan(grad_sync, optimizer, replica=Averager(trained(model), ctx.dp_group, optimizer),
                      same_norm=False)

    def footprint(self, cfg: Any, params: Any, sizes: Any, dp: int, share: int, device: str, host: bool
                  ) -> Footprint:
        return Footprint()  # averaged in place

    def startup(self, cfg: Any, layout: Layout) -> list[str]:
        return [f"sync: every parameter averaged over dp={layout.dp} after each step"]


PARAM_AVERAGE = register_sync_mode(ParamAverage())
MODE = ("sync.mode=param_average",)


def test_the_mode_is_known_through_the_seam_only() -> None:
    names = sync_mode_names()
    assert names[: len(BUILT_IN)] == ("dp", "diloco", "gossip", "ps") and "param_average" in names
    assert register_sync_mode(PARAM_AVERAGE) is PARAM_AVERAGE  # the same object again is harmless
    with pytest.raises(ValueError, match="already registered"):
        register_sync_mode(ParamAverage())
    cfg = make_cfg(Case(tp=2, pp=2), 8, extra=[*LINEAR, *MODE])  # validated
    assert startup_lines(cfg, Layout.create(8, tp=2, pp=2)) == ["sync: every parameter averaged over dp=2 after "
                                                                 "each step"]
    with pytest.raises(ConfigError, match="averages the weights of optim=sgd"):
        validate(compose_config([*MODE, "parallel=dp"]), world_size=2)
    with pytest.raises(ConfigError, match=r"sync.mode='nope' is not one of dp, diloco, gossip, ps, param_average"):
        validate(compose_config(["sync.mode=nope"]), world_size=1)


def test_a_mode_defined_in_a_test_trains_at_tp2pp2dp2_as_synchronous_dp() -> None:
    case, modes = Case(tp=2, pp=2, extra=SMALL), [LINEAR, (*LINEAR, *MODE)]
    modes_composed(case, 8, modes, 8, 4)  # composed here once, inherited by the forked ranks
    results = run_ranks(train_modes, 8, case, modes, 8, 4, timeout=TIMEOUT)
    for dp, averaged in results:
        torch.testing.assert_close(torch.tensor(averaged["losses"]), torch.tensor(dp["losses"]), rtol=1e-5, atol=1e-6)
        for name, w in dp["weights"].items():
            torch.testing.assert_close(averaged["weights"][name], w, rtol=1e-5, atol=1e-6, msg=name)
        assert averaged["record"] == {"param_average_rounds": 4.0}
        assert all(b["dp"] > 0 for b in averaged["bytes"])  # the average's all-reduces, counted on the DP group

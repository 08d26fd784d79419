"""DiLoCo's outer step chosen from the run (`hybrid.sync.outer_policy`): the auto rule on made-up cosine sequences
and pseudo-gradients, H from the run's length, the pinned settings' outer step against today's formula bit for bit,
and the start-up line (one process: the outer group is this rank alone, so Δ̄ is its own Δ)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from hybrid.config import compose_config
from hybrid.sync.outer import OuterSync
from hybrid.sync.outer_policy import AVERAGE, PAPER, OuterPolicy, auto_inner_steps, describe, pinned


def policy(**kw: Any) -> OuterPolicy:
    """The auto rule for a 1,000-step run at H=10 (100 rounds): cos > 0.5 in 3 rounds, 20 rounds left."""
    return OuterPolicy(None, **{"h": 10, "steps": 1000, "switch_cos": 0.5, "window": 3, "min_left": 20, **kw})


def feed(p: OuterPolicy, cosines: list[float], first: int = 1) -> list[str]:
    """Each cosine as the round ending after step 10·k; the modes after each."""
    modes = []
    for k, cos in enumerate(cosines, start=first):
        assert p.decides(10 * k, last=False) and not p.decides(10 * k + 1, last=False)
        p.decide(10 * k, cos)
        modes.append(p.mode)
    return modes


def test_agreeing_rounds_switch_to_nesterov_once_and_say_so() -> None:
    p = policy()
    assert feed(p, [math.nan, 0.9, 0.8, 0.7, -0.9]) == ["average"] * 3 + ["nesterov"] * 2  # one-way
    assert p.switch_step == 40 and p.step() == PAPER and p.rounds == 5
    line = p.observe(40, lambda: pytest.fail("the rule does not read the loss"))
    assert line is not None and line.startswith("sync: outer step → Nesterov lr 0.7 μ 0.9 after step 40")
    assert "0.900, 0.800, 0.700" in line and "96 outer rounds left" in line
    assert p.observe(50, lambda: 0.0) is None  # said once
    assert p.record(50) == {"sync_outer": "nesterov", "sync_outer_cos": -0.9}


def test_alternating_or_weak_agreement_stays_averaging() -> None:
    p = policy()
    assert set(feed(p, [0.9, -0.8] * 10 + [0.9, 0.9, 0.4] * 5)) == {"average"}
    assert p.step() == AVERAGE and p.switch_step is None and p.observe(350, lambda: 0.0) is None


def test_too_few_rounds_left_stays_averaging() -> None:
    """100-step run, H=10: after round 3 (step 30) only 7 rounds remain, fewer than 20."""
    p = policy(steps=100)
    assert set(feed(p, [0.99] * 8)) == {"average"}
    late = policy(steps=250)  # rounds 3–5 leave 22, 21, 20: the switch after round 5 at the latest
    assert feed(late, [0.1, 0.1, 0.1, 0.9, 0.9, 0.9, 0.9]) == ["average"] * 6 + ["average"]
    assert feed(policy(steps=250), [0.9] * 3) == ["average", "average", "nesterov"]


def test_rounds_end_where_the_last_fragment_lands_and_never_after_the_last_step() -> None:
    p = policy(overlap=2)
    assert [s for s in range(1, 40) if p.decides(s, last=False)] == [12, 22, 32]
    assert not p.decides(1000, last=True)
    assert not OuterPolicy(PAPER, 10, 1000).decides(10, last=False)  # pinned: nothing to decide


def test_the_run_state_resumes_the_decisions() -> None:
    p, q = policy(), policy()
    feed(p, [0.9, 0.9])
    q.load_run_state(p.run_state())
    assert feed(p, [0.9], first=3) == feed(q, [0.9], first=3) == ["nesterov"] and q.switch_step == p.switch_step


def test_h_from_the_run_and_the_pins() -> None:
    assert [auto_inner_steps(s) for s in (1, 19, 600, 2000, 10_000, 10**6)] == [1, 1, 30, 100, 500, 500]
    cases = {(): None, ("sync.outer=nesterov",): PAPER, ("sync.outer=average",): AVERAGE,
             ("sync.outer_lr=0.7", "sync.outer_momentum=0.9"): PAPER, ("sync.outer_momentum=0.5",): (0.7, 0.5),
             ("sync.outer_lr=1",): (1.0, 0.9)}
    for extra, want in cases.items():
        assert pinned(compose_config(["sync=diloco", *extra]).sync) == want, extra
    assert pinned(compose_config(["sync=local_sgd"]).sync) == AVERAGE


def test_the_start_up_line_says_what_the_outer_step_does_and_when() -> None:
    auto = compose_config(["sync=diloco", "train.steps=600"])
    line = describe(auto.sync, 600)
    assert line.startswith("sync: diloco, H=30 (from 600 steps: 20 outer rounds), outer step: averaging until")
    assert "never in this run" in line and "sync.outer=nesterov pins the paper's step" in line
    assert "never" not in describe(auto.sync, 20_000)
    assert describe(compose_config(["sync=local_sgd"]).sync, 600) == ("sync: diloco, H=50 (12 outer rounds), outer "
                                                                      "step: averaging (lr 1, no momentum)")
    assert describe(compose_config(["sync=diloco", "sync.outer=nesterov"]).sync, 600).endswith(
        "outer step: Nesterov lr 0.7 μ 0.9 (pinned)")


class Plain:
    """The inner optimizer a one-process OuterSync steps: the parameters are the fp32 weights."""

    state: dict[Any, Any] = {}
    moments = ()

    def main_weight(self, p: nn.Parameter) -> torch.Tensor:
        return p.data

    def loaded(self) -> None:
        pass


def outer_run(extra: tuple[str, ...], rounds: int = 4, move: Any = None) -> tuple[list[torch.Tensor], OuterSync]:
    """`rounds` outer steps at H=1 of two parameters, inner step k moving each by `move(k, shape)` (default: a
    fixed random draw): the anchors after."""
    cfg = compose_config(["sync=diloco", "sync.inner_steps=1", "train.steps=1000", *extra])
    params = [nn.Parameter(torch.randn(5, 3, generator=torch.Generator().manual_seed(i))) for i in range(2)]
    hook = lambda *_: pytest.fail("one rank: nothing exchanged")  # noqa: E731
    sync = OuterSync(cfg.sync, OuterPolicy.of(cfg.sync, 1000), params, None, hook, None, Plain())
    moves = torch.Generator().manual_seed(7)
    move = move or (lambda k, shape: torch.randn(shape, generator=moves))
    for step in range(1, rounds + 1):
        with torch.no_grad():
            for p in params:
                p.add_(move(step, p.shape))
        sync.after_step(step)
    return [sync.anchor[p] for p in params], sync


def reference(lr: float, mu: float, nesterov: bool, rounds: int = 4) -> list[torch.Tensor]:
    """The outer step as it was before the rule (the same operations): m ← μm + Δ; θ ← θ − lr(Δ + μm) or − lr·m."""
    anchors = [torch.randn(5, 3, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    momentum, moves = [torch.zeros_like(a) for a in anchors], torch.Generator().manual_seed(7)
    for _ in range(rounds):
        for a, m in zip(anchors, momentum):
            delta = a - (a + torch.randn(a.shape, generator=moves))
            update = delta
            if mu:
                m.mul_(mu).add_(delta)
                update = delta.add(m, alpha=mu) if nesterov else m
            a.sub_(update, alpha=lr)
    return anchors


@pytest.mark.parametrize("extra, step", [
    (("sync.outer_lr=0.7", "sync.outer_momentum=0.9"), (0.7, 0.9, True)),
    (("sync.outer=nesterov",), (0.7, 0.9, True)),
    (("sync.outer_momentum=0.5", "sync.nesterov=false"), (0.7, 0.5, False)),
    (("sync.outer=average",), (1.0, 0.0, False)),
    (("sync.outer_switch_cos=1",), (1.0, 0.0, False)),  # auto, never switching: the average
])
def test_pinned_settings_step_exactly_as_before(extra: tuple[str, ...], step: tuple[float, float, bool]) -> None:
    anchors, _ = outer_run(extra)
    for got, want in zip(anchors, reference(*step)):
        assert torch.equal(got, want)


def test_the_auto_rule_measures_consecutive_mean_pseudo_gradients() -> None:
    """Every inner step moving the same way: cos 1 from the second round, Nesterov after the fourth (3 rounds in a
    row); moving back and forth: cos −1, averaging throughout, the momentum buffer holding the last Δ̄."""
    _, same = outer_run((), rounds=6, move=lambda k, shape: torch.full(shape, 0.1))
    assert same.policy.rounds == 6 and same.policy.switch_step == 4 and math.isnan(same.policy.cosines[0])
    assert same.policy.cosines[1:] == pytest.approx([1.0] * 5)  # against the momentum once switched: still 1
    _, back = outer_run((), rounds=6, move=lambda k, shape: torch.full(shape, 0.1 * (-1) ** k))
    assert back.policy.cosines[1:] == pytest.approx([-1.0] * 5) and back.policy.mode == "average"
    p = next(iter(back.anchor))
    assert torch.allclose(back.momentum[p], torch.full(p.shape, -0.1))  # Δ̄ of step 6 (moved +0.1)

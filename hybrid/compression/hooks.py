"""DP comm hooks: PyTorch DDP's protocol `hook(state, bucket) -> Future[Tensor]` (the methods: `registry.py`).

A hook receives a bucket (`buffer()`, `index()`, `is_last()`, `parameters()`, `gradients()`,
`set_buffer()`) holding this rank's summed gradients, and returns a future whose value is the
DP *mean* of that buffer (exact or approximated). The same function runs in hybrid's `GradSync`
and in `torch.nn.parallel.DistributedDataParallel.register_comm_hook`, and PyTorch's own hooks
(`torch_fp16`, `torch_bf16`, `torch_powersgd`) run in `GradSync` unchanged.

Methods (`compression=<method>`, knobs under `compression.*`):
  none        exact fp32 all-reduce (mean)
  fp16, bf16  all-reduce of the gradients cast to 16 bits (2× fewer bytes)
  int8        block-wise int8, two-phase (all-to-all → average → all-gather), `codecs.py`
  sign        1 bit per element + a scale per block, two-phase, error feedback
  topk        the largest `fraction` of each chunk, values + indices, two-phase, error feedback
  powersgd    low-rank factors (in bf16), each matrix's rank following its error, error feedback, warm start,
              `powersgd.py`; ranks and first Qs from the exact warm-up's last mean (`start.py`); an untied token
              embedding as the rows a step touched, exactly, where cheaper (`rows.py`)
  dgc         top-k with Deep Gradient Compression's corrections (local clipping, sparsity warm-up; momentum
              correction and masking with `dgc_momentum` > 0), `dgc.py`
  onebit_adam  1-bit Adam: exact AdamW for `warmup_steps`, then the momentum, not the gradient, sent as
              sign bits (two-phase, error feedback), Adam's variance refreshed every k steps, `onebit_adam.py`
  zeroone_adam  0/1 Adam: variance refreshed on a growing schedule, momentum as signs, local steps, `zeroone_adam.py`
  hierarchical  exact inside a node, `inner` method between nodes, `hierarchical.py`

`make_hook` wraps every method in `Compression`, the hook state that adds what is common to all:
exact all-reduce for the first `warmup_steps` steps (null: sized from the run, `defaults.py`; or the codec of
`compression.warmup_method`; the last one's mean handed to the method's start, `start.py`), or,
under `compression.schedule=auto`, the stages `schedule.py` steps through (exact, `compression.stages`,
the method) as the loss settles; buckets of parameters kept exact (`compression.exact_params`); the
optional measurement of the relative compression error ‖ĝ − g‖/‖g‖, overall and per bucket (with each
bucket's rank or density: `bucket_figures`), and `state_dict()` / `load_state_dict()` for checkpoints.
Bytes are counted at the collective calls (`hybrid.parallel.collectives`); PyTorch's hooks call
`torch.distributed` themselves, so their module sees a counting proxy of it (`_CountingDist`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

from hybrid.compression import CompressionError, codecs
from hybrid.compression.defaults import resolved, sized
from hybrid.compression.hierarchical import HierarchicalState, hierarchical_hook
from hybrid.compression.plain import allreduce_hook
from hybrid.compression.registry import OPTIMIZER_SIDE, REGISTRY, Hook, check
from hybrid.compression.schedule import Plateau, StageSchedule
from hybrid.compression.start import warm_start
from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group

if TYPE_CHECKING:
    from hybrid.config import CompressionConfig


@dataclass
class Compression:
    """The state `make_hook`'s hook runs with: a method's (hook, state) plus warm-up or schedule, and metering.

    `schedule` (auto) picks each step's stage: 0 exact, i ≤ len(`ladder`) the ladder's (hook, state) i − 1,
    then the method; without one, the first `warmup_steps` steps are exact. Buckets whose parameters are
    all in `exact_params` (ids, set by the trainer from `compression.exact_params`) are always exact.

    `measure = True` (set by the trainer on a sample of the logged steps) adds one exact fp32 all-reduce
    per bucket, counted as `bytes_meter`, to report ‖ĝ − g‖ and ‖g‖; `take_error()` returns and clears them.
    """

    method: str
    group: Group
    hook: Hook
    state: Any
    warmup_steps: int = 0
    serial: bool = False  # wait for the previous bucket first: the hook issues collectives in callbacks
    meter_in_hook: bool = True  # False: the optimizer meters (onebit_adam's compressed momentum)
    iteration: int = 0  # steps whose last bucket was launched
    measure: bool = False
    schedule: Optional[StageSchedule] = None
    ladder: list[tuple[Hook, Any]] = field(default_factory=list)
    warmup: Optional[tuple[str, Hook, Any]] = None  # the warm-up's codec (`compression.warmup_method`); None: exact
    exact_params: frozenset[int] = frozenset()
    sized: bool = False  # warmup_steps was sized from the run (compression.warmup_steps=null): kept on resume
    _exact_buckets: dict[int, bool] = field(default_factory=dict)
    _sq: list[float] = field(default_factory=lambda: [0.0, 0.0])  # Σ‖ĝ − g‖², Σ‖g‖²
    _bucket_sq: dict[int, list[float]] = field(default_factory=dict)  # the same per bucket index
    _compressed: dict[int, int] = field(default_factory=dict)  # bucket → the last step that ran the method on it
    _pending: Optional[torch.futures.Future] = None

    def take_error(self) -> tuple[float, float]:
        out, self._sq = (self._sq[0], self._sq[1]), [0.0, 0.0]
        return out

    def bucket_figures(self) -> dict[int, dict[str, float]]:
        """The error budget's figures per bucket index (`hybrid.record.error_budget`): the metered Σ‖ĝ − g‖² and
        Σ‖g‖² (cleared), and the method's setting (`bucket_setting`: rank, density, …) for the buckets the last
        step compressed with it."""
        out = {i: {"err_sq": e, "ref_sq": r} for i, (e, r) in self._bucket_sq.items()}
        self._bucket_sq = {}
        setting = getattr(self.state, "bucket_setting", None)
        for i in [i for i, at in sorted(self._compressed.items()) if at == self.iteration - 1 and setting]:
            out.setdefault(i, {}).update(setting(i))
        return out

    def stage_at(self, step: int) -> int:
        """The stage of the step after `step` steps done: 0 exact, then the ladder's, then the method's."""
        if self.schedule is not None:
            return self.schedule.stage(step)
        return 0 if step < self.warmup_steps else 1 + len(self.ladder)

    def method_at(self, step: int) -> str:
        if self.schedule is not None:
            return self.schedule.method(step)
        return self.method if self.stage_at(step) else (self.warmup[0] if self.warmup else "none")

    def record(self, step: int) -> dict[str, Any]:
        """The metrics of the step after `step` steps done: the stage it ran, unless the hook is exact."""
        if self.method == "none":
            return {}
        return {"comm/compression_method": self.method_at(step), "comm/compression_stage": self.stage_at(step)}

    def observe(self, step: int, loss: Callable[[], float]) -> Optional[str]:
        """After step `step`: hand its training loss (`loss()`, the DP mean, alike on every rank: a host read,
        made only under an auto schedule) to the auto schedule; the line announcing a switch, else None."""
        return self.schedule.observe(step, loss()) if self.schedule is not None else None

    def run_state(self) -> Optional[dict[str, Any]]:
        """The auto schedule's decisions, or a warm-up sized from the run (`defaults.py`): run-level state, the
        same on every rank and layout-independent (the trainer's part of a checkpoint, not the per-rank blob)."""
        if self.schedule is not None:
            return self.schedule.state_dict()
        return {"warmup_steps": self.warmup_steps} if self.sized else None

    def load_run_state(self, state: dict[str, Any]) -> None:
        if self.schedule is not None and "names" in state:
            self.schedule.load_state_dict(state)
        elif self.sized and "warmup_steps" in state:
            self.warmup_steps = int(state["warmup_steps"])

    def starts_next(self) -> bool:
        """Whether the step under way is the fixed warm-up's last: the method takes over with the next."""
        return self.schedule is None and self.stage_at(self.iteration) == 0 and self.stage_at(self.iteration + 1) > 0

    def exact_steps(self) -> int:
        """Steps of the exact stage (1-bit Adam's warm-up, whose variance it freezes): decided or configured."""
        if self.schedule is not None and self.schedule.bounds:
            return self.schedule.bounds[0]
        return self.warmup_steps

    def kept_exact(self, bucket: Any) -> bool:
        """Whether every parameter of `bucket` is kept exact (`compression.exact_params`)."""
        i = bucket.index()
        if i not in self._exact_buckets:
            self._exact_buckets[i] = bool(self.exact_params) and all(id(p) in self.exact_params
                                                                     for p in bucket.parameters())
        return self._exact_buckets[i]

    def set_lookups(self, ids: frozenset[int]) -> None:
        """Name the lookup tables' parameters (`rows.py`) to every state that sends them as rows: the method's,
        the ladder's, a hierarchical method's inner one."""
        for state in (self.state, *(s for _, s in self.ladder)):
            state = getattr(state, "inner_state", state)
            if hasattr(state, "lookups"):
                state.lookups = ids

    def state_dict(self) -> dict[str, Any]:
        return {"method": self.method, "iteration": self.iteration, "hook": _state_dict(self.state),
                "ladder": [_state_dict(state) for _, state in self.ladder],
                "warmup": _state_dict(self.warmup[2]) if self.warmup else {}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd["method"] != self.method:
            raise ValueError(f"hook state is for compression={sd['method']}, this run uses {self.method}")
        self.iteration = sd["iteration"]
        _load_state_dict(self.state, sd["hook"])
        for (_, state), blob in zip(self.ladder, sd.get("ladder", [])):
            _load_state_dict(state, blob)
        if self.warmup and sd.get("warmup"):
            _load_state_dict(self.warmup[2], sd["warmup"])

    def add_error(self, exact: torch.Tensor, value: torch.Tensor, index: Optional[int] = None) -> None:
        """Account one compressed `value` against its `exact` counterpart in Σ‖ĝ − g‖² and Σ‖g‖² (and in bucket
        `index`'s, when given)."""
        err, ref = float((value - exact).pow(2).sum()), float(exact.pow(2).sum())
        self._sq = [self._sq[0] + err, self._sq[1] + ref]
        if index is not None:
            prev = self._bucket_sq.get(index, [0.0, 0.0])
            self._bucket_sq[index] = [prev[0] + err, prev[1] + ref]

    def _meter(self, exact: torch.Tensor, fut: torch.futures.Future, index: int) -> torch.Tensor:
        value = fut.value()
        value = value[0] if isinstance(value, list) else value
        self.add_error(exact, value, index)
        return value


def run_hook(st: Compression, bucket):  # noqa: ANN001, ANN201
    """The hook `make_hook` returns: the step's stage (exact, a ladder method, the method; exact for the
    buckets kept exact); meters the error when asked.

    `bucket` and the result are unannotated on purpose: DDP's `register_comm_hook` rejects any
    annotation but `dist.GradBucket` / `Future[Tensor]`, and ours would be strings here."""
    if st.serial and st._pending is not None:
        with C.TIMER.waiting(C.group_name(st.group)):
            st._pending.wait()
    exact = None
    if st.measure and st.meter_in_hook and C.size(st.group) > 1:
        exact = codecs.exact_mean(bucket.buffer(), st.group)  # counted as `meter`, not as training traffic
    stage, index = st.stage_at(st.iteration), bucket.index()
    if st.kept_exact(bucket):
        fut = allreduce_hook(st.group, bucket)
    elif stage == 0:
        fut = _warming(st, bucket)
    elif stage <= len(st.ladder):
        hook, state = st.ladder[stage - 1]
        fut = hook(state, bucket)
    else:
        st._compressed[index] = st.iteration
        fut = st.hook(st.state, bucket)
    if bucket.is_last():
        st.iteration += 1
    if exact is not None:
        fut = fut.then(lambda f: st._meter(exact, f, index))
    st._pending = fut
    return fut


def _warming(st: Compression, bucket):  # noqa: ANN001, ANN202
    """A warm-up step: the exact mean, or the warm-up codec's (`compression.warmup_method`); on the last one the
    method starts from that mean (`start.py`), put in `bucket` first."""
    fut = st.warmup[1](st.warmup[2], bucket) if st.warmup else allreduce_hook(st.group, bucket)
    return fut.then(lambda f: _started(st.state, bucket, f)) if st.starts_next() else fut


def _started(state: Any, bucket: Any, fut: torch.futures.Future) -> torch.Tensor:
    """The warm-up's last mean arrived: into `bucket` (where a codec's hook returned it apart), then let the method
    start from it (`start.py`)."""
    value = fut.value()
    value = value[0] if isinstance(value, list) else value
    if value.data_ptr() != bucket.buffer().data_ptr():
        bucket.buffer().copy_(value)
    warm_start(state, bucket)
    return value


def _state_dict(state: Any) -> Any:
    if hasattr(state, "state_dict"):
        return state.state_dict()
    if isinstance(state, PowerSGDState):
        return state.__getstate__()  # PyTorch's PowerSGD state (the process group left out)
    return {}


def _load_state_dict(state: Any, sd: Any) -> None:
    if hasattr(state, "load_state_dict"):
        state.load_state_dict(sd)
    elif isinstance(state, PowerSGDState):
        group = state.process_group
        state.__setstate__(sd)
        state.process_group = group


def _scheduled(comp: Compression, cfg: CompressionConfig, group: Group) -> Compression:
    """Under `schedule=auto`: the ladder of `compression.stages` and the schedule that finds the bounds."""
    if cfg.schedule == "auto":
        comp.ladder = [REGISTRY[m](cfg, group) for m in cfg.stages]
        comp.schedule = StageSchedule(["none", *cfg.stages, cfg.method], rule=Plateau(cfg.settle_window,
                                      cfg.settle_tol), min_steps=cfg.warmup_steps)
    return comp


SERIAL = ("torch_powersgd",)
"""Methods whose hook issues collectives from future callbacks: each bucket waits for the previous one
(`Compression.serial`), and nothing may run them across steps (`sync.overlap_steps`)."""


def make_hook(cfg: CompressionConfig, group: Group, dp_intra: Group = None, dp_inter: Group = None,
              steps: Optional[int] = None) -> tuple[Hook, Compression]:
    """The (hook, state) pair for `cfg` (the `compression` config) over the DP `group`, for a run of `steps`
    steps (a null `warmup_steps` is sized from it, `defaults.py`; None: unknown, no warm-up).

    Hierarchical uses `dp_intra` / `dp_inter` (ParallelContext's node-cut DP groups). The pair
    also works as `DistributedDataParallel.register_comm_hook(state, hook)`. Raises
    CompressionError for a bad config (`check`) or DP groups that hierarchical cannot use."""
    check(cfg)
    hook, comp = _make(resolved(cfg, steps), group, dp_intra, dp_inter)
    comp.sized = sized(cfg, steps)
    return hook, comp


def _make(cfg: CompressionConfig, group: Group, dp_intra: Group, dp_inter: Group) -> tuple[Hook, Compression]:
    warmup, serial = cfg.warmup_steps, False
    if cfg.method == "hierarchical":
        if C.size(dp_intra) * C.size(dp_inter) != C.size(group):
            raise CompressionError(f"compression=hierarchical needs node-cut DP groups covering the DP group: "
                             f"{C.size(dp_intra)} × {C.size(dp_inter)} ranks != {C.size(group)}")
        inner_hook, inner_state = REGISTRY[cfg.inner](cfg, dp_inter)
        hook, state = hierarchical_hook, HierarchicalState(dp_intra, dp_inter, inner_hook, inner_state)
    elif cfg.method.startswith("torch_"):
        from hybrid.compression.torch_hooks import make_torch_hook

        hook, state = make_torch_hook(cfg, group)
        warmup, serial = (0, True) if cfg.method in SERIAL else (warmup, False)
    elif cfg.method in OPTIMIZER_SIDE:
        hook, state = OPTIMIZER_SIDE[cfg.method](cfg, group)
        comp = Compression(cfg.method, group, hook, state, warmup, meter_in_hook=False)
        return run_hook, _scheduled(_warmed(comp, cfg, group), cfg, group)
    else:
        hook, state = REGISTRY[cfg.method](cfg, group)
    comp = Compression(cfg.method, group, hook, state, warmup, serial)
    return run_hook, _scheduled(_warmed(comp, cfg, group), cfg, group)


def _warmed(comp: Compression, cfg: CompressionConfig, group: Group) -> Compression:
    """The warm-up's codec (`compression.warmup_method`, built as that method over `group`), unless exact."""
    if cfg.warmup_method != "none":
        comp.warmup = (cfg.warmup_method, *REGISTRY[cfg.warmup_method](cfg, group))
    return comp

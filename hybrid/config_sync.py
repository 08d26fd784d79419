"""The schema of how DP replicas agree: `compression` (the DP exchange's codec and when it compresses) and `sync`
(every step, rarely, with neighbours, through servers).

`hybrid.config.Config` holds one of each; they live here so the schema's groups fit rooms of their own size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

SPARSIFIERS = frozenset({"topk", "dgc"})
"""The methods that read `compression.fraction` (directly, or as `hierarchical`'s inner method)."""
SCALED_CODECS = frozenset({"int8", "int4", "sign"})
"""The gradient exchanges whose codec may run on scaled values (and read `compression.scale`)."""
BLOCK_CODECS = SCALED_CODECS | {"onebit_adam", "zeroone_adam"}
"""The methods whose codec scales blocks of elements (and reads `compression.block_layout`)."""
METHOD_KNOBS: dict[str, frozenset[str]] = {"fraction": SPARSIFIERS, "dgc_momentum": frozenset({"dgc"}),
                                           "block_layout": BLOCK_CODECS, "scale": SCALED_CODECS,
                                           "var_refresh_every": frozenset({"onebit_adam", "zeroone_adam"}),
                                           "factor_dtype": frozenset({"powersgd"})}
"""`compression` knobs that only some methods read, and which: a change to one is a training change only where a
run's method reads it (the resume check), so an older checkpoint's value of a since-changed default does not stop
the runs of other methods."""
FORMERLY: dict[str, str] = {"factor_dtype": "fp32"}
"""`compression` knobs whose default is not what hybrid did before the knob existed: the value a checkpoint whose
config lacks the knob ran with (PowerSGD sent its factors in fp32), so the resume check sees the change."""


@dataclass
class CompressionConfig:
    # none | fp16 | bf16 | int8 | sign | topk | powersgd | dgc | hierarchical | onebit_adam | zeroone_adam | torch_fp16
    # | torch_bf16 | torch_powersgd
    method: str = "none"
    rank: int = 4  # powersgd, torch_powersgd: rank of the low-rank factors
    # topk, dgc: fraction of each chunk's elements sent, in (0, 1]; null: sized from the run (compression/defaults.py)
    fraction: Optional[float] = None
    block_size: int = 256  # int8, sign: elements sharing one fp32 scale
    # int8, int4, sign, 1-bit/0-1 Adam: auto lays row-parallel weights' gradients out column by column for the
    # codec (a block is one input channel: compression/layout.py); rows: every gradient as laid out
    block_layout: str = "auto"
    # int8, int4, sign: factored divides each gradient matrix by its rows' and columns' magnitude for the codec
    # (one more all-reduce of rows + cols floats per matrix); auto: factored for sign; none: every codec on the
    # values as they are (compression/scaling.py)
    scale: str = "auto"
    error_feedback: bool = True  # sign, topk, int4, powersgd, torch_powersgd: add last step's compression error back
    # steps of exact all-reduce before compressing (schedule=auto: at least, per stage); null: sized from the run,
    # warmup_share of train.steps (null: the method's own, compression/defaults.py); 0: compress from step 1
    warmup_steps: Optional[int] = None
    warmup_share: Optional[float] = None
    # the warm-up's exchange: none (exact fp32) | int8 | int4 | bf16 | fp16 (that codec instead, a fraction of the
    # bytes; schedule=fixed, not zeroone_adam, hierarchical or torch_*)
    warmup_method: str = "none"
    schedule: str = "fixed"  # fixed: exact for warmup_steps, then the method | auto: switch once the loss settles
    stages: list[str] = field(default_factory=list)  # auto: methods between exact and `method`, e.g. [bf16, int8]
    settle_window: int = 10  # auto: steps per window of the settling rule (2 windows compared)
    settle_tol: float = 0.02  # auto: settled when the loss's window mean fell by less than this (relative)
    exact_params: Optional[list[str]] = None  # kept exact: vectors (norms, biases), embeddings; null: auto's [vectors]
    min_compression_rate: float = 2.0  # powersgd: compress a matrix only if its factors are this much smaller
    seed: int = 0  # powersgd: seed of the first random factors (shared by the DP ranks)
    # powersgd's adaptive rank: each matrix's rank follows its measured error (`rank` is where it starts); 0: fixed
    target_error: float = 0.3  # grow a matrix's rank while ‖M̄ − M̂‖/‖M̄‖ is above this, shrink below half of it
    rank_window: int = 10  # steps whose error estimates make one decision
    max_rank: int = 32  # no matrix's rank above this
    min_ratio: float = 20.0  # the byte budget over the run, warm-up included: ranks grow only within it
    # powersgd: an untied token embedding sends the rows a step touched, exactly, when they cost no more than its
    # factors (compression/rows.py); false: factors, as every matrix
    lookup_rows: bool = True
    # powersgd: the dtype the factors P, Q travel in: bf16 (half the bytes: twice the rank in the same budget) | fp32
    factor_dtype: str = "bf16"
    inner: str = ""  # hierarchical: the method between nodes (exact inside a node)
    # dgc: momentum of the accumulated velocity (the paper's momentum correction, for an optimizer without momentum
    # of its own: optim=sgd optim.momentum=0 dgc_momentum=0.9); 0: AdamW's β₁ (or SGD's momentum) is the only one
    dgc_momentum: float = 0.0
    dgc_clip: float = 1.0  # dgc: local clipping of each bucket's gradient to dgc_clip / sqrt(dp); 0: off
    sparsity_warmup_steps: int = 0  # dgc: density decays exponentially from 1 to `fraction` over these steps
    # onebit_adam: after the warm-up, every k-th step all-reduces the gradient exactly (fp32) and refreshes Adam's
    # variance with it, v ← β₂ᵏ·v + (1 − β₂ᵏ)·ḡ²; null: k = half the variance's horizon, round(0.5 / (1 − β₂)) (10
    # at optim.beta2=0.95); 0: frozen at the warm-up's end (the paper's). zeroone_adam: the most steps between its
    # refreshes, each weighted by the steps it stands for (null: the same half horizon; 0: the paper's rule)
    var_refresh_every: Optional[int] = None
    # zeroone_adam (0/1 Adam): the variance refreshed at steps 2^⌊j/κ⌋ apart (j-th refresh) up to a freeze step,
    # the momentum sent as signs between; after the freeze, local steps between syncs 1, 2, 4, … apart
    var_freeze_step: int = 0  # the last step that may refresh the variance; 0: train.steps // 2
    var_update_scaler: int = 0  # κ: refreshes per gap length (16 in the paper); 0: the largest ≤ 16 whose
    # refreshes up to the freeze stay within 10% of train.steps
    local_step_scaler: int = 0  # steps after the freeze per doubling of the sync interval; 0: (train.steps −
    # freeze) / bit_length(local_step_clipper), so the longest interval is reached for the run's last part
    local_step_clipper: int = 16  # the longest sync interval (the paper's H); 1: no local steps
    measure_error: bool = True  # compression_error: one extra exact all-reduce per bucket (bytes_meter) on ...
    measure_every: int = 10  # ... every measure_every-th logged step (and the last)



@dataclass
class SyncConfig:
    """How DP replicas agree (`hybrid.sync`): gradients every step, or rarely, with neighbours, through servers."""

    name: str = "dp"  # label only; the config file name
    mode: str = "dp"  # dp (gradients every step) | diloco (local_sgd: its plain-averaging case) | gossip | ps
    # H: local optimizer steps between outer steps (gossip: between gossip rounds); diloco: null = from train.steps
    inner_steps: Optional[int] = 1
    # diloco's outer step: auto (averaging, then the paper's Nesterov once consecutive pseudo-gradients agree and
    # enough outer steps remain) | nesterov (the paper's: lr 0.7, momentum 0.9) | average (lr 1, no momentum)
    outer: str = "auto"
    outer_lr: Optional[float] = None  # set (or outer_momentum): the outer step pinned, the other 0.7 / 0.9 if null
    outer_momentum: Optional[float] = None  # pinned outer SGD momentum (today's: outer_lr=0.7 outer_momentum=0.9)
    nesterov: bool = True  # the outer SGD's momentum is Nesterov's (DiLoCo)
    outer_switch_cos: float = 0.9  # auto: Nesterov once the cosine of consecutive mean pseudo-gradients exceeds ...
    outer_switch_window: int = 3  # ... in this many outer rounds in a row ...
    outer_switch_left: int = 20  # ... while at least this many outer rounds remain in the run
    scope: str = "dp"  # dp: every DP replica syncs every H steps; inter: DP inside a node every step, between every H
    fragments: int = 1  # streaming: the model in F fragments, each synced every H steps, staggered by H/F
    overlap_steps: int = 0  # τ: inner steps an outer exchange runs behind the training (0: the exchange blocks)
    overlap_mix: float = 0.0  # α: the local weights' share when an overlapped outer step lands (0: the global's)
    topology: str = "ring"  # gossip's graph: ring | exponential | one_peer (dp a power of two) | complete
    servers: int = 1  # ps: parameter-server shards per (pp, tp) coordinate, served by DP ranks 0..servers-1
    asynchronous: bool = False  # ps: workers run ahead of the slowest by up to max_staleness versions
    max_staleness: int = 0  # ps (asynchronous): versions a worker's parameters may lag behind its clock
    staleness_weighting: bool = False  # ps: each gradient weighted 1/(1 + its staleness) in the server's mean

"""What every sync mode's exchange shares: the rules the compression options must satisfy against the rest
of the run, the start-up line that describes the hook, and the bytes its collectives and codecs hold.

The compression library (`hybrid.compression`) knows codecs and hooks; whether a run's DP exchange can use one
— with ZeRO-1's reduce-scatter, 1-bit Adam's optimizer, bf16 parameters, the run's length — is decided here,
once, for every mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

from hybrid.compression import codecs
from hybrid.compression.codecs import CODECS
from hybrid.compression.defaults import budget_phrase, density_phrase, warmup_of, warmup_phrase
from hybrid.compression.hooks import OPTIMIZER_SIDE
from hybrid.compression.onebit_adam import refresh_phrase
from hybrid.compression.scaling import phrase, run_scaled
from hybrid.compression.schedule import exact_kinds
from hybrid.compression.zero import REDUCE_SCATTER_CODECS, ZERO_METHODS
from hybrid.compression.zeroone_adam import ZeroOneSchedule
from hybrid.config import SPARSIFIERS, CompressionConfig, Config, ConfigError, ParallelConfig
from hybrid.parallel.layout import LayoutError
from hybrid.sync.zero import needs_hops, shard_lists, spans_nodes

if TYPE_CHECKING:
    from hybrid.parallel.context import Layout

F32 = 4
PARAM_CODECS = ("none", *codecs.PARAM_CODECS)
"""What ZeRO-3's parameter all-gather can run (`parallel.zero_param_codec`): exact, or block-wise int8 or fp8 (qwZ)."""


def require(ok: bool, msg: str) -> None:
    """A sync or compression rule: ConfigError with `msg` (one line) unless `ok`."""
    if not ok:
        raise ConfigError(msg)


def check(cfg: Config, layout: Layout) -> None:
    """The compression options against the optimizer, ZeRO-1, the precision, the buckets and the run's length.
    Raises ConfigError (one line)."""
    p, t, c = cfg.parallel, cfg.train, cfg.compression
    require(cfg.optim.name == "adamw" or (p.zero == 0 and c.method not in OPTIMIZER_SIDE),
             f"optim.name={cfg.optim.name} cannot run with parallel.zero={p.zero} or compression="
             f"{'|'.join(OPTIMIZER_SIDE)} (the distributed optimizer, 1-bit and 0/1 Adam are AdamW's)")
    check_zero(p, c)
    check_zero_group(p, layout)
    require(p.zero_param_codec in PARAM_CODECS, f"parallel.zero_param_codec={p.zero_param_codec} is not one of "
             f"{', '.join(PARAM_CODECS)}")
    require(p.zero_param_codec == "none" or p.zero == 3, f"parallel.zero_param_codec={p.zero_param_codec} encodes "
             "ZeRO-3's parameter all-gather: it needs parallel.zero=3")
    check_zero_hops(cfg, layout)
    require(p.zero != 3 or not t.compile, "parallel.zero=3 gathers and frees each block's parameters from hooks "
             "around it, which a compiled block cannot run: set train.compile=false or parallel.zero=2")
    require(t.precision != "bf16_params" or c.method not in OPTIMIZER_SIDE, "train.precision=bf16_params "
             f"keeps fp32 main weights that compression={c.method}'s optimizer does not: use train.precision=bf16 "
             "(autocast) or fp32 with it")
    check_block_size(c, p.bucket_mb, layout.dp)
    warm = warmup_of(c, t.steps)
    require(c.method == "none" or warm < t.steps, f"compression.warmup_steps={warm} is not shorter than the run "
             f"(train.steps={t.steps}): compression={c.method} would never start")
    first = max(2 * c.settle_window, c.warmup_steps or 0)  # the first step the auto schedule may switch after
    require(c.schedule != "auto" or first < t.steps, f"compression.settle_window={c.settle_window} leaves no step "
             f"to compress: the auto schedule compares two windows ({first} steps at least) and the run has "
             f"train.steps={t.steps}")
    require(c.method != "dgc" or c.sparsity_warmup_steps < t.steps, f"compression.sparsity_warmup_steps="
             f"{c.sparsity_warmup_steps} is not shorter than the run (train.steps={t.steps})")


def check_zero(p: ParallelConfig, c: CompressionConfig) -> None:
    """The distributed optimizer reduce-scatters each bucket: a method that needs the whole bucket (a codec,
    PowerSGD, 1-bit Adam's momentum) or a per-step stage change cannot run there."""
    require(p.zero in (0, 1, 2, 3), f"parallel.zero must be 0 (off), 1 (the distributed optimizer: Adam's moments "
             f"sharded over DP), 2 (gradients sharded too) or 3 (parameters too), got {p.zero}")
    require(p.zero in (1, 2) or not p.overlap_param_gather, "parallel.overlap_param_gather=true overlaps the "
             "distributed optimizer's parameter all-gather: it needs parallel.zero=1 or 2 (zero=3 gathers each "
             "block before its use, prefetching the next)")
    if p.zero == 0:
        return
    require(c.method in ZERO_METHODS, f"parallel.zero={p.zero} reduce-scatters the gradients, which "
             f"compression={c.method} cannot do (it needs each bucket whole): use compression="
             f"{'|'.join(ZERO_METHODS)}, or parallel.zero=0")
    require(c.schedule == "fixed" and not c.warmup_steps, f"parallel.zero={p.zero} runs one reduce-scatter dtype for "
             f"the whole run: compression.schedule={c.schedule} with warmup_steps={c.warmup_steps} needs "
             "schedule=fixed and warmup_steps=0")


def check_zero_group(p: ParallelConfig, layout: Layout) -> None:
    """`parallel.zero_group` (HSDP): dp, node or a number of ranks dividing dp, with a ZeRO stage, without CP."""
    if str(p.zero_group) == "dp":
        return
    try:
        layout.zero_shard_size(str(p.zero_group))
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    require(p.zero >= 1, f"parallel.zero_group={p.zero_group} shards ZeRO's state inside groups: it needs "
             "parallel.zero=1, 2 or 3")
    require(layout.cp == 1, f"parallel.zero_group={p.zero_group} with parallel.cp={layout.cp}: hybrid sharding "
             "over CP and DP together is not built; use parallel.zero_group=dp")


def check_zero_hops(cfg: Config, layout: Layout) -> None:
    """hpZ (`parallel.zero_hpz`) needs ZeRO-3 and a shard group across nodes with several of its ranks on each,
    qgZ's error feedback (`parallel.zero_grad_feedback`) a codec over such a group; both need the shard groups
    spread evenly over their nodes."""
    p = cfg.parallel
    if p.zero_hpz:
        require(p.zero == 3, "parallel.zero_hpz=true keeps a node's copy of ZeRO-3's gathered parameters: it needs "
                 "parallel.zero=3")
    shards = shard_lists(cfg, layout)[0] if p.zero else []
    if p.zero_hpz:
        require(spans_nodes(layout, shards), f"parallel.zero_hpz=true needs a ZeRO shard group across nodes with "
                 f"several of its ranks on each; here each has {len(shards[0])} rank(s), "
                 f"{layout.per_node(shards[0])} on a node (parallel.ranks_per_node={layout.ranks_per_node}, "
                 f"parallel.zero_group={p.zero_group})")
    hops = needs_hops(cfg, layout)
    require(not p.zero_grad_feedback or (hops and cfg.compression.method in REDUCE_SCATTER_CODECS),
            "parallel.zero_grad_feedback=true feeds back what qgZ's between-node hop loses: it needs "
            f"compression={'|'.join(REDUCE_SCATTER_CODECS)} under a ZeRO stage whose shard group spans nodes with "
            "several of its ranks on each")
    if hops:
        try:
            layout.node_split(shards)
        except LayoutError as e:
            raise ConfigError(str(e)) from None


def check_block_size(c: CompressionConfig, bucket_mb: float, dp: int) -> None:
    """A scale block of int8/sign is at most one DP rank's chunk of a full bucket: each chunk is padded to
    a whole number of blocks, so a larger block only allocates padding (at most doubling a chunk here)."""
    limit = max(1, int(bucket_mb * 2**20 / 4) // dp)
    require(c.block_size <= limit, f"compression.block_size={c.block_size} exceeds one DP rank's chunk of a "
             f"bucket ({limit} fp32 elements = parallel.bucket_mb={bucket_mb} MB / dp={dp}); each chunk is "
             "padded to whole blocks")


def zero2_copies(c: CompressionConfig, largest: Sequence[int], device: str, piece: int, node: int = 0) -> int:
    """ZeRO-2's and 3's transient gradient buffers, `largest` being the two largest buckets' sizes: a
    microbatch's round being filled and the one in flight (fp32; a codec's all-to-all blocks: none in flight), and
    a reduce-scatter's copies of its input — of the bucket, or of a `piece` of a larger one: its cast (16-bit, or a
    piece's columns copied out), gloo's copy on CPU — or a codec's encoded shards sent and received; over a shard
    group across nodes with `node` of its ranks on each (qgZ) the round laid out by local index, the node's sum of
    a 1/node part, and that part's encoded shards."""
    n = max(largest)
    if c.method in REDUCE_SCATTER_CODECS and node > 1:  # two hops, blocking
        part = n // node
        return F32 * (2 * n + part) + 2 * (part + 4 * part // c.block_size)
    if c.method in REDUCE_SCATTER_CODECS:  # blocking: no round in flight beside the one being encoded
        return F32 * n + 2 * (n + 4 * n // c.block_size)
    inp = min(n, piece)
    if c.method != "none":
        cast = 2 * inp  # the 16-bit copy a reduce-scatter sends
    else:
        cast = F32 * inp if n > piece else 0  # a piece's columns copied out; a whole fp32 bucket goes in place
    return F32 * sum(largest) + cast + (F32 * inp if device != "cuda" else 0)


def compression_summary(c: CompressionConfig, layout: Layout, steps: Optional[int], beta2: float,
                        tables: bool = False) -> str:
    """One start-up line: the DP hook, its warm-up (sized from a run of `steps` exchanges when null), 1-bit Adam's
    variance (its refreshes sized from AdamW's `beta2`), PowerSGD's lookup rows where the model has an untied token
    embedding (`tables`), and under hierarchical how the DP groups split over nodes."""
    line = f"compression: {c.method} over dp={layout.dp}"
    if c.schedule == "auto":
        line += (f", schedule auto: exact, then {' → '.join([*c.stages, c.method])}, each stage once the loss's "
                 f"{c.settle_window}-step mean falls < {c.settle_tol:.1%}" +
                 (f" (after {c.warmup_steps} steps at least)" if c.warmup_steps else ""))
    else:
        line += warmup_phrase(c, steps)
    kinds = exact_kinds(c.exact_params, c.schedule)
    if kinds and c.method != "none":
        line += f"; kept exact: {', '.join(kinds)}"
    if c.method == "onebit_adam":
        line += ("; AdamW during the warm-up, then the momentum sent as signs with the variance "
                 + refresh_phrase(c.var_refresh_every, beta2))
    line += phrase(c)
    if "powersgd" in (c.method, c.inner):
        line += powersgd_phrase(c, steps, tables)
    if c.method == "zeroone_adam" and steps:
        line += ": " + ZeroOneSchedule.of(c).sized(steps, beta2).describe()
    if {c.method, c.inner} & SPARSIFIERS:
        line += density_phrase(c, steps)
    if c.method == "dgc" and c.sparsity_warmup_steps:
        line += f", reached from 1 over {c.sparsity_warmup_steps} steps of density warm-up"
    if c.method != "hierarchical":
        return line + ("" if layout.dp > 1 else " (dp=1: nothing to exchange)")
    return line + hierarchical_split(c, layout)


def powersgd_phrase(c: CompressionConfig, steps: Optional[int], tables: bool) -> str:
    """The start-up line's account of PowerSGD (ours, flat or hierarchical's inner): its adaptive rank and budget,
    the dtype its factors travel in, and the token embedding's lookup rows where the model has an untied one."""
    line = ""
    if c.target_error > 0:
        line += (f"; {_start(c, steps)}, each matrix's following its measured error (grows above "
                 f"compression.target_error={c.target_error:g}, {budget_phrase(c, steps)}; target_error=0 fixes "
                 "the rank)")
    line += (f"; factors sent in {c.factor_dtype}" + (" (half the bytes: twice the rank in the same budget; "
             "compression.factor_dtype=fp32 sends them in full)" if c.factor_dtype == "bf16" else ""))
    if tables:
        line += ("; the token embedding sends the rows each step touched, exactly, where they cost no more than its "
                 "factors (compression.lookup_rows" + ("" if c.lookup_rows else "=false: factors instead") + ")")
    return line


def _start(c: CompressionConfig, steps: Optional[int]) -> str:
    """Where PowerSGD's ranks start: from the warm-up's last mean (`compression/start.py`; exact, or the warm-up
    codec's) or at `rank`."""
    if c.method == "powersgd" and c.schedule == "fixed" and warmup_of(c, steps):
        how = "exact" if c.warmup_method == "none" else c.warmup_method
        return (f"ranks to start from the {how} warm-up's last gradients (each matrix the least meeting the target, "
                f"at least {c.rank}, within the budget)")
    return f"rank {c.rank} to start"


def hierarchical_split(c: CompressionConfig, layout: Layout) -> str:
    """How hierarchical sync's two hops fall on the nodes (with a warning when one of them is a single rank)."""
    intra, inter = len(layout.dp_intra_node_groups()[0]), len(layout.dp_inter_node_groups()[0])
    line = f": exact inside a node ({intra} DP ranks), {c.inner} between nodes ({inter} DP ranks)"
    if intra == 1 or inter == 1:
        line += (f" — warning: with {layout.ranks_per_node} ranks per node one of the two hops is a single "
                 "rank, so this is plain " + ("exact sync" if inter == 1 else c.inner) +
                 " (set parallel.ranks_per_node to emulate nodes)")
    return line


def startup_lines(cfg: Config, layout: Layout, steps: Optional[int] = None, gradients: bool = False) -> list[str]:
    """The compression hook's start-up line, when the exchange is compressed (`steps`: the exchanges of the run,
    which size a null warm-up; None: it has none; `gradients`: it exchanges each step's gradients, whose lookup
    tables PowerSGD may send as rows)."""
    if cfg.compression.method == "none":
        return []
    tables = gradients and not cfg.model.tie_embeddings
    return [compression_summary(cfg.compression, layout, steps, cfg.optim.beta2, tables)]


def exchange_bytes(cfg: Config, sizes: Sequence[int], dp: int, device: str, node: int = 0) -> tuple[int, int]:
    """(copies, state) of the DP exchange for buckets of `sizes` elements: the copies its collectives hold
    while the buckets are in flight (a 16-bit copy of each for fp16/bf16; under ZeRO-1 on CPU, gloo's copy
    of each reduce-scatter's input, or int8's encoded shards sent and received; the block codecs' scales, one per
    bucket, `compression.scale`), and the compression state
    kept across steps (docs/memory.md); `node`: the shard group's ranks per node where it spans nodes (qgZ's
    two hops), else 0."""
    c = cfg.compression
    if dp == 1 or not sizes:
        return 0, 0
    feedback = F32 * sum(sizes) // node if node > 1 and cfg.parallel.zero_grad_feedback else 0  # qgZ's residuals
    if cfg.parallel.zero >= 2:  # ZeRO-2 and 3: the microbatch rounds
        return zero2_copies(c, sorted(sizes)[-2:], device, int(cfg.parallel.bucket_mb * 2**20) // F32, node), feedback
    if c.method in ("none", "fp16", "bf16", "torch_fp16", "torch_bf16"):
        cast = 2 * sum(sizes) if c.method != "none" else 0
        return max(cast, F32 * sum(sizes) if cfg.parallel.zero == 1 and device != "cuda" else 0), 0
    if cfg.parallel.zero == 1:  # int8's encoded reduce-scatter: the sent and the received shards, then gone
        return 2 * sum(n + 4 * n // c.block_size for n in sizes), feedback
    residuals = int(c.error_feedback and (c.method not in CODECS or CODECS[c.method].error_feedback))
    if c.method in ("powersgd", "torch_powersgd"):
        return 0, F32 * sum(sizes) * residuals
    local = 2 * F32 * sum(sizes) if c.method == "zeroone_adam" else 0  # 0/1 Adam's u and d (`ZeroOneAdam`)
    scales = F32 * sum(sizes) if run_scaled(c) else 0  # each bucket's scale while it is in flight
    return scales, F32 * (sum(sizes) * (1 + residuals) + sum(sizes) // dp * residuals) + local  # buffer, residuals

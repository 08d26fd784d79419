"""Structured configuration: one dataclass per Hydra config group, and where the config files are.

Hydra composes `configs/config.yaml` (the repository's top-level folder; the wheel ships it inside the
package as `hybrid/configs`, so an installed hybrid finds it from any folder) and the groups `model/`,
`parallel/`, `data/`, `optim/`, `compression/` against these schemas, so an unknown key or a value of the
wrong type is rejected before anything runs. `hybrid.validation.validate(cfg, world_size)` then checks
everything knowable before a process group exists, and raises `ConfigError` with one readable line.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, cast

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from hybrid.config_run import HealthConfig, LoggingConfig, ProfileConfig
from hybrid.config_run import WandbConfig as WandbConfig  # re-exported: the schema's groups are named from here
from hybrid.config_sync import FORMERLY as FORMERLY  # re-exported: what older hybrids ran where a default is new
from hybrid.config_sync import METHOD_KNOBS as METHOD_KNOBS  # re-exported: the knobs only some methods read
from hybrid.config_sync import SPARSIFIERS as SPARSIFIERS  # re-exported: the methods that read compression.fraction
from hybrid.config_sync import CompressionConfig, SyncConfig


class ConfigError(ValueError):
    """Bad user input (config, data path, command line): reported as one line, exit 2."""


@dataclass
class ModelConfig:
    name: str = "gpt-tiny"  # label only; the config file name
    family: str = "gpt"  # gpt (GPT-2: LayerNorm, GELU, learned positions, tied) | llama | any registered family
    n_layers: int = 4  # transformer blocks
    hidden: int = 256  # model width h
    n_heads: int = 4  # attention heads
    n_kv_heads: Optional[int] = None  # key/value heads (GQA); None = n_heads
    ffn_hidden: Optional[int] = None  # MLP inner width; None = 4h (gpt)
    vocab_size: Optional[int] = None  # None = the tokenizer's vocabulary size
    make_vocab_size_divisible_by: int = 128  # embedding rows padded to a multiple of this · tp
    max_seq_len: int = 1024  # learned positions (gpt) / RoPE cache length (llama)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # llama only
    tie_embeddings: bool = True  # output head shares the token embedding
    dropout: float = 0.0  # attention/residual dropout probability
    init_std: float = 0.02  # normal init std; output projections scaled by 1/sqrt(2L)
    init_from: Optional[str] = None  # transformers folder (config.json + weights) to start from; a resume wins


@dataclass
class ParallelConfig:
    name: str = "single"  # label only; the config file name
    tp: int = 1  # tensor-parallel size (ranks inside one node)
    pp: int = 1  # pipeline stages
    dp: Optional[int] = None  # data-parallel size; None = world / (tp·cp·pp)
    cp: int = 1  # context-parallel size: each rank holds seq_len / cp tokens of every sequence (load-balanced)
    cp_comm: str = "ring"  # ring (K/V passed around the CP ranks) | a2a (all-to-all over heads, Ulysses)
    schedule: str = "1f1b"  # a name in hybrid.parallel.pp.schedules.SCHEDULES: gpipe | 1f1b | interleaved | zb1p | zbv
    # zb1p, zbv: 1f1b = each rank leaves only as many weight passes waiting as keep it within the largest rank's
    # memory with 1F1B's unsplit backward (zb1p: 1F1B's; by the estimate); none = the schedule's own (ZB-H1: r on
    # rank r), the least bubble
    zb_memory: str = "1f1b"
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved)
    # layers per model part (pp·virtual_stages counts); None = equal counts; auto = even predicted times, the
    # embedding's and the head's included (hybrid.plan.balance)
    stage_layers: Any = None
    sequence_parallel: bool = False  # split norms/dropout along the sequence inside TP
    # TP's exchanges around its GEMMs: none (blocking), bulk (the backward's regather, input-gradient reduce-scatter
    # and all-reduce launched async, each behind the other gradient GEMM), chunked (bulk, and under SP every
    # all-gather → GEMM and GEMM → reduce-scatter pipelined around the TP ring a piece of the sequence at a time)
    tp_overlap: str = "bulk"
    tp_overlap_chunks: int = 0  # chunked: pieces each sequence is cut into, a multiple of tp (0 = tp)
    ranks_per_node: Optional[int] = None  # override of the detected node size (emulated nodes)
    allow_tp_across_nodes: bool = False  # permit a TP group spanning nodes (warns)
    allow_cp_across_nodes: bool = False  # permit a CP group spanning nodes (warns)
    bucket_mb: float = 25.0  # DP gradient bucket size in MB (fp32)
    zero: int = 0  # 1: the distributed optimizer (ZeRO-1): gradients reduce-scattered, Adam's moments sharded over DP;
    # 2: gradients kept only as shards too (reduce-scattered every microbatch, ZeRO-2); 3: parameters too (ZeRO-3)
    zero_group: str = "dp"  # ZeRO shards inside: dp (every DP rank), node (HSDP) or N ranks; all-reduced across
    zero_param_codec: str = "none"  # ZeRO-3's parameter all-gather: none, or int8 or fp8 (block-wise, qwZ)
    # ZeRO-3 across nodes (hpZ): keep a secondary copy of each step's gathered parameters sharded over the node, so
    # that every all-gather of a step but the first stays inside the node
    zero_hpz: bool = False
    # qgZ (compression=int8|int4 over a ZeRO shard group across nodes): keep what the between-node hop's encoding
    # lost (1/node of each bucket, fp32, per rank) and add it to the bucket's next round (error feedback)
    zero_grad_feedback: bool = False
    # ZeRO-1: leave the parameter all-gather in flight after the step; each block waits for its own parameters
    # when its next forward starts (Megatron's --overlap-param-gather)
    overlap_param_gather: bool = False
    # seconds a collective may wait for a peer before the run stops naming the group (every group gets it);
    # Megatron's 10 minutes: a checkpoint save or an eval on a slow rank must fit inside it
    timeout_s: float = 600.0
    # the same once the first step has completed (torchtitan's 100 s), but around checkpoint saves and evals, which
    # keep timeout_s: a hung rank then ends the run within about two minutes; 0 keeps timeout_s throughout
    train_timeout_s: float = 100.0


@dataclass
class DataConfig:
    name: str = "default"  # label only
    path: Optional[str] = MISSING  # local .txt/.jsonl/.json/.parquet file or folder, a datasets.save_to_disk
    #   folder, or a token file (.bin raw ids / .npy); null = embedded corpus (or data.dataset)
    dataset: Optional[str] = None  # hub dataset name (e.g. wikitext), read from the local HF datasets cache
    dataset_config: Optional[str] = None  # its configuration (e.g. wikitext-2-raw-v1)
    split: str = "train"  # split of a hub dataset or of a saved DatasetDict
    online: bool = False  # let `datasets` reach the hub (download, streaming); default: cache only, offline
    streaming: bool = False  # read data.dataset as a stream (needs online and max_chars or max_tokens)
    num_proc: Optional[int] = None  # processes tokenizing the corpus (datasets.map); None = this one
    text_field: str = "text"  # column holding the text in jsonl/parquet files, saved and hub datasets
    tokenizer: Optional[str] = None  # local transformers tokenizer folder; None = model.init_from's if it
    #   has one, else a BPE trained on the corpus
    token_dtype: Optional[str] = None  # dtype of a .bin token file: uint16 (None) | uint32 | int32
    vocab_size: int = 8192  # vocabulary of the BPE trained when `tokenizer` is None
    seq_len: int = 128  # tokens per training sequence
    eval_fraction: float = 0.01  # share of the packed sequences held out for eval
    cache_dir: Optional[str] = None  # None = $HYBRID_CACHE or ~/.cache/hybrid
    max_chars: Optional[int] = None  # cap on corpus characters read (quick experiments)
    max_tokens: Optional[int] = None  # cap on the token stream's length (cut where it is reached)


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | sgd (momentum SGD: linear in the gradients, as DiLoCo's equivalence needs)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # not applied to norms, biases and embeddings' padding
    warmup_steps: int = 10  # linear warmup from 0 to train.lr
    min_lr_ratio: float = 0.1  # cosine decays to train.lr · min_lr_ratio at train.steps
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    implementation: str = "fused"  # AdamW's kernels: fused (one per tensor, no temporaries) | foreach
    momentum: float = 0.0  # sgd only: heavy-ball momentum (0 = plain SGD)
    nesterov: bool = False  # sgd only: Nesterov momentum


def optimizer_moments(o: OptimConfig) -> int:
    """fp32 state tensors the optimizer keeps per parameter: AdamW's two, SGD's momentum buffer (if any)."""
    return 2 if o.name == "adamw" else int(o.momentum > 0)


@dataclass
class TrainConfig:
    steps: int = 100  # optimizer steps
    seed: int = 1234  # weights, data order, dropout
    micro_batch_size: int = 8  # sequences per microbatch per DP rank
    global_batch_size: int = 32  # sequences per step = micro batch · microbatches · dp
    lr: float = 3e-3  # peak learning rate
    eval_every: int = 25  # steps between evals; 0 disables
    eval_batches: int = 2  # held-out global batches (of global_batch_size sequences) per eval
    precision: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | fp32 | bf16 (autocast) | bf16_params
    # (Megatron-style: bf16 parameters and activations, fp32 main weights and gradients in the optimizer)
    device: str = "auto"  # auto | cpu | cuda
    recompute: str = "none"  # activations recomputed in the backward: none | selective (attention core, MLP act) | full
    compile: bool = False  # torch.compile (inductor; on CPU it needs a C++ compiler)
    compile_scope: str = "blocks"  # blocks (each transformer block) | model (each pipeline part's whole forward)
    compile_mode: str = "default"  # torch's: default | reduce-overhead (CUDA graphs) | max-autotune[-no-cudagraphs]
    # the head's linear and cross-entropy fused, head_chunk tokens at a time (never the whole fp32 logits):
    fused_head: str = "auto"  # auto (on when training on CUDA, off on CPU) | on | off
    head_chunk: int = 4096  # tokens per chunk of the fused head
    # a step whose gradient is not finite (NaN/inf) never updates the weights; then the run (hybrid.nonfinite):
    on_nonfinite: str = "stop"  # stop (exit 1, one line) | skip (the step, warned) | rewind (to the last checkpoint)
    max_skipped_steps: int = 5  # skip: steps skipped in a row, rewind: rewinds of one process, before it stops


@dataclass
class CheckpointFields:
    dir: str = "checkpoints"  # a run writes <dir>/<run_name>/step_XXXXXXX; a sweep job: <job folder>/checkpoints
    every: int = 0  # steps between saves; 0 disables
    keep: int = 3  # newest checkpoints kept
    resume: str = "none"  # none | auto (this run's newest, if any) | <path>
    allow_changes: bool = False  # resume although training settings (lr, seed, batch, optim, model, data, …) changed
    # signals that make every rank save the step reached and exit 0 (hybrid.checkpoint.preempt); [] disables
    save_on_signal: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])


# `checkpoint.async` (overlap the write with training) is a Python keyword, so the schema adds it to
# CheckpointFields by name; type checkers see CheckpointFields (read the flag as getattr(c, "async")).
if TYPE_CHECKING:
    CheckpointConfig = CheckpointFields
else:
    CheckpointConfig = dataclasses.dataclass(init=False, repr=False, eq=False)(
        type("CheckpointConfig", (CheckpointFields,), {"__annotations__": {"async": bool}, "async": False}))


@dataclass
class Config:
    # names checkpoints/<run_name>, runs/<run_name>, multirun/<run_name> and the wandb run: <model>-<layout>,
    # the layout being parallel.name while tp, pp, dp, virtual_stages are that group file's, else derived
    # from them (`parallel=dp parallel.tp=4` → tp4; see layout_label). Set it to continue a run under another layout.
    run_name: str = "${model.name}-${hybrid.layout:${parallel}}"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)


def config_dir(package: Path = Path(__file__).parent) -> str:
    """The folder of the Hydra config files: the wheel's package data (`hybrid/configs`, setup.py maps the
    top-level folder there) where hybrid is installed from a wheel, else the checkout's own `configs/` beside
    the package (a source tree or an editable install, which import hybrid from the checkout)."""
    packaged = package / "configs"
    return str(packaged if (packaged / "config.yaml").is_file() else package.parent / "configs")


CONFIG_DIR = config_dir()
_LAYOUT_KEYS = ("tp", "pp", "virtual_stages", "dp")


def layout_label(parallel: ParallelConfig) -> str:
    """The layout part of the default run name: `parallel.name` while tp, pp, virtual_stages and dp are
    those of the group file of that name (or no such file exists: a label of the user's), else derived."""
    path = Path(CONFIG_DIR) / "parallel" / f"{parallel.name}.yaml"
    if not path.is_file():
        return parallel.name
    same = tuple(getattr(parallel, k) for k in _LAYOUT_KEYS) == _group_layout(str(path), path.stat().st_mtime_ns)
    return parallel.name if same else derived_label(parallel.tp, parallel.pp, parallel.virtual_stages, parallel.dp)


@functools.lru_cache(maxsize=64)
def _group_layout(path: str, mtime_ns: int) -> tuple[Any, ...]:
    """tp, pp, virtual_stages, dp of the parallel group file at `path`, read once per version of the file: the
    run name resolves at every read of `run_name`, `logging.dir` or a checkpoint path (a merge costs ~10 ms)."""
    saved = OmegaConf.merge(OmegaConf.structured(ParallelConfig), OmegaConf.load(path))
    return tuple(saved[k] for k in _LAYOUT_KEYS)


def derived_label(tp: int, pp: int, virtual_stages: int, dp: Optional[int]) -> str:
    """`tp4`, `tp2pp2`, `pp4v2`, `tp2pp2dp2` (dp only when set): the names the group files use; `dp` for
    pure data parallelism over every rank, `single` for one process (dp=1)."""
    sizes = (("tp", tp), ("pp", pp), ("v", virtual_stages), ("dp", dp or 1))
    label = "".join(f"{k}{n}" for k, n in sizes if n > 1)
    return label or ("single" if dp == 1 else "dp")


_COMPOSED: dict[tuple[str, ...], bytes] = {}  # overrides → the composed config, pickled (see compose_config)


def compose_config(overrides: Sequence[str] = ()) -> Config:
    """The composed config for `overrides` (as on the command line), without running Hydra's app.

    Tools, benchmarks and tests use it; `hybrid.train` uses @hydra.main on the same files. Composing takes
    Hydra ~0.2 s, so each list of overrides is composed once per process (and inherited by forked children)
    and every call gets its own copy; overrides naming `hydra.*` (a search path: files that may change) are
    composed every time.
    """
    key = tuple(overrides)
    if any(o.lstrip("+~").startswith("hydra.") for o in key):
        return _compose(key)
    if key not in _COMPOSED:
        _COMPOSED[key] = pickle.dumps(_compose(key))
    return cast(Config, pickle.loads(_COMPOSED[key]))


def _compose(overrides: tuple[str, ...]) -> Config:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            return cast(Config, compose(config_name="config", overrides=list(overrides)))  # duck-typed
    finally:
        GlobalHydra.instance().clear()


def register_configs() -> None:
    """Register the root schema; `configs/config.yaml` lists it first in its defaults, so every
    group file merged under `model`, `parallel`, … is typed by that group's dataclass."""
    ConfigStore.instance().store(name="schema", node=Config)
    if not OmegaConf.has_resolver("hybrid.layout"):
        OmegaConf.register_new_resolver("hybrid.layout", layout_label)

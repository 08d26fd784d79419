"""What a checkpoint holds: one flat `torch.distributed.checkpoint` (DCP) state dict whose keys do
not depend on the layout; the load planner that reshards it; reading it back (`read_state`,
`load_weights`).

Keys (every rank contributes only what it holds; DCP writes each distinct shard once):

- `model.<global name>`: a parameter, by its global name (`layers.17.attn.qkv.weight`). A
  TP-sharded one is a DTensor `Shard(dim)` over the TP group's 1-D device mesh; a replicated
  one a plain tensor (DP and TP replicas are deduplicated by DCP's save planner).
  A fused parameter whose TP shard is a concatenation of per-part slices (QKV = [Q | K | V],
  SwiGLU's [gate | up]) is stored as one key per part, `model.<name>#<k>`: each part on its own
  is an evenly `Shard(0)`-ed tensor, which is what a DTensor can describe, so tp=2 parts load
  under tp=4 by DCP's own resharding.
- `optim.<key>.exp_avg`, `optim.<key>.exp_avg_sq` (sharded like the parameter), `optim.<name>.step`.
- `rng.pp<p>.dp<d>.tp<t>`, `hook.pp<p>.dp<d>.tp<t>`: per-rank blobs (RNG streams; the DP
  compression hook's residuals and factors), keyed by the rank's coordinates (`Coord.key`:
  `.cp<c>` before `.tp` at a CP index c > 0), restored only under the same layout.

The last pipeline stage's copy of a tied embedding (`head.weight`, `pp_duplicate`) is not
saved; it loads from `model.tok_embed.weight`. Embedding rows are padded to a multiple of
`make_vocab_size_divisible_by · tp`, so the global row count of `tok_embed.weight` and
`head.weight` depends on tp: `ReshardingLoadPlanner` lets exactly those keys differ in dim 0
and reads the overlapping rows (the real vocabulary); padding rows are never used.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor, Shard

from hybrid.checkpoint.files import CheckpointError, distributed, first_line, single_process_quiet
from hybrid.checkpoint.trust import safe_reader
from hybrid.parallel.params import param_info

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

VOCAB_PARAMS = ("tok_embed.weight", "head.weight")
"""Parameters whose rows are the padded vocabulary (row count depends on tp)."""
OPTIM_TENSORS = ("exp_avg", "exp_avg_sq")


class StateMismatch(ValueError):
    """The checkpoint's tensors do not fit this model (a key missing, a shape that differs)."""


class Optimizer(Protocol):
    """What a checkpoint reads of the trainer's optimizer (`hybrid.optim`'s classes): the parameter groups and
    per-parameter state keyed by the model's parameters (the state tensors named by an optional `moments`,
    AdamW's by default, created by an optional `fresh_state(p)`), the weight saved under a parameter's key
    (`main_weight`: fp32, the main copy under bf16 parameters) and `loaded()`, called once a load wrote them."""

    param_groups: list[dict[str, Any]]
    state: Any

    def main_weight(self, p: nn.Parameter) -> torch.Tensor: ...

    def loaded(self) -> None: ...


@dataclass
class Piece:
    """One checkpoint key's worth of this rank's data: a view into a local tensor."""

    key: str
    local: torch.Tensor  # view into the parameter (or its optimizer state)
    dim: Optional[int]  # the TP-sharded dim, None when replicated
    shape: tuple[int, ...]  # global shape of the key


def pieces(name: str, t: torch.Tensor, p: nn.Parameter) -> list[tuple[str, torch.Tensor, Optional[int], tuple]]:
    """(key, view of `t`, shard dim or None, global shape) per part of parameter `p` (global name
    `name`); `t` is `p` itself or a tensor of its shape (an Adam moment). A fused parameter is split
    into its parts under every layout (tp=1 included), so its keys never depend on tp."""
    fused, shard = param_info(p).parts, param_info(p).shard
    if fused is None or (shard is None and len(fused[1]) == 1):
        return [(name, t, None, tuple(t.shape))]
    dim, parts = fused
    size = shard.size if shard is not None else 1
    out, start = [], 0
    for k, n_global in enumerate(parts):
        shape = list(t.shape)
        shape[dim] = n_global
        key = name if len(parts) == 1 else f"{name}#{k}"
        out.append((key, t.narrow(dim, start, n_global // size), dim if size > 1 else None, tuple(shape)))
        start += n_global // size
    return out


def named_parameters(model: nn.ModuleList, duplicates: bool) -> Iterator[tuple[str, nn.Parameter]]:
    """(checkpoint name, parameter) of every chunk; the tied head copy of a last stage is named
    `tok_embed.weight` and only yielded with `duplicates` (loading, not saving)."""
    for chunk in model:
        for name, p in chunk.named_parameters():
            if param_info(p).pp_duplicate:
                if duplicates:
                    yield "tok_embed.weight", p
                continue
            yield name, p


def model_pieces(model: nn.ModuleList, optimizer: Optional[Optimizer], duplicates: bool) -> list[Piece]:
    """Every parameter and (with `optimizer`, whose state must exist) Adam moment of this rank as
    checkpoint pieces. A parameter's piece is the optimizer's `main_weight(p)`: `p` itself, or its fp32 main
    weight under bf16 parameters, so the files are an fp32 run's."""
    out: list[Piece] = []
    for name, p in named_parameters(model, duplicates):
        weight = p.detach() if optimizer is None else optimizer.main_weight(p)
        out += [Piece(f"model.{k}", v, d, s) for k, v, d, s in pieces(name, weight, p)]
        if optimizer is None:
            continue
        state = optimizer.state[p]
        for moment in moments(optimizer):
            out += [Piece(f"optim.{k}.{moment}", v, d, s) for k, v, d, s in pieces(name, state[moment], p)]
        if "step" in state:
            out.append(Piece(f"optim.{name}.step", state["step"], None, ()))
    return out


def moments(optimizer: Optimizer) -> tuple[str, ...]:
    """The state tensors a checkpoint holds per parameter: the optimizer's `moments` (AdamW's by default)."""
    return getattr(optimizer, "moments", OPTIM_TENSORS)


def first_nonfinite(found: list[Piece]) -> Optional[str]:
    """The global name of the first piece holding a NaN or an inf, else None (one pass over each tensor)."""
    return next((p.key for p in found if not bool(torch.isfinite(p.local).all())), None)


def init_optimizer_state(optimizer: Optimizer) -> None:
    """Create the optimizer's state (AdamW: zero moments, step 0; SGD: a zero momentum) for every parameter that
    has none yet, so that a load can fill it in place; the optimizer itself creates exactly this on its first
    step (`fresh_state`; fused AdamW keeps the step count on the parameter's device, foreach on the CPU)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if optimizer.state[p] or not moments(optimizer):
                continue
            if hasattr(optimizer, "fresh_state"):
                optimizer.state[p] = optimizer.fresh_state(p)
            else:
                on = p.device if group.get("fused") else torch.device("cpu")
                optimizer.state[p] = {"step": torch.zeros((), device=on), "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}


def to_dcp(piece: Piece, mesh: Optional[DeviceMesh]) -> torch.Tensor:
    """The value DCP sees: a DTensor `Shard(dim)` over the TP mesh for a sharded piece, else the tensor."""
    if piece.dim is None or mesh is None:
        return piece.local
    shape = torch.Size(piece.shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(piece.local, mesh, [Shard(piece.dim)], run_check=False, shape=shape, stride=stride)


def blob(obj: Any) -> bytes:
    """A per-rank Python object (RNG states, hook state) as bytes: one opaque DCP item."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unblob(data: bytes) -> Any:
    """A blob back as tensors and containers (`weights_only=True`: a crafted blob cannot run code)."""
    return torch.load(io.BytesIO(data), weights_only=True)


# ---- RNG ------------------------------------------------------------------------------------

def rng_state(model: nn.ModuleList) -> dict[str, Any]:
    """This rank's random streams: the default CPU (and CUDA) generator and each chunk's TP stream."""
    out: dict[str, Any] = {"cpu": torch.get_rng_state(), "tp": [chunk.rng.state_dict() for chunk in model]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(model: nn.ModuleList, state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    for chunk, tp_state in zip(model, state["tp"], strict=True):
        chunk.rng.load_state_dict(tp_state)


def derive_rng_state(model: nn.ModuleList, seed: int, step: int, pp_rank: int, cp_rank: int = 0) -> None:
    """Fresh streams for a rank whose saved ones do not exist (the layout changed): seeded from
    (seed, step, coordinates) as at start-up, so the continuation is reproducible."""
    from hybrid.parallel.rng import derive_seed, stage_seed

    torch.manual_seed(stage_seed(seed, pp_rank, cp_rank, "step", step))
    for chunk in model:
        chunk.rng.seed = derive_seed(chunk.rng.seed, "step", step)
        chunk.rng.load_state_dict({})


# ---- loading with vocabulary rows that may differ -------------------------------------------

class ReshardingLoadPlanner(DefaultLoadPlanner):
    """DCP's default load plan, except that keys of vocabulary-padded tensors may differ from the
    saved ones in their row count (dim 0): those read the rows both have. Any other difference in
    shape, and any missing key, raises `StateMismatch` naming the key."""

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        strict, relaxed = {}, []
        for key, obj in self.state_dict.items():
            md = saved.get(key)
            if md is None:
                raise StateMismatch(f"it has no {key!r}")
            if isinstance(md, TensorStorageMetadata) and isinstance(obj, torch.Tensor) and md.size != obj.size():
                if not (_vocab_rows(key) and md.size[1:] == obj.size()[1:]):
                    raise StateMismatch(f"{key} has shape {tuple(md.size)} there but {tuple(obj.size())} here")
                relaxed.append((key, md, obj))
            else:
                strict[key] = obj
        plan = create_default_local_load_plan(strict, self.metadata, True)
        for key, md, obj in relaxed:
            plan.items.extend(create_read_items_for_chunk_list(key, md, _chunks(obj)))
        return plan


def _vocab_rows(key: str) -> bool:
    """Whether `key` is a vocabulary-padded parameter (`model.<name>`) or one of its Adam moments."""
    name = key.split(".", 1)[1]
    for moment in OPTIM_TENSORS:
        name = name.removesuffix(f".{moment}")
    return name in VOCAB_PARAMS


def _chunks(obj: torch.Tensor) -> list[ChunkStorageMetadata]:
    if isinstance(obj, DTensor):
        return obj.__create_chunk_list__()
    return [ChunkStorageMetadata(offsets=torch.Size([0] * obj.dim()), sizes=obj.size())]


# ---- reading a checkpoint into live tensors -------------------------------------------------

def load_target(all_pieces: list[Piece], mesh: Optional[DeviceMesh]) -> tuple[dict[str, Any], list[Piece]]:
    """The DCP state dict to load into, and the pieces whose key appears twice on this rank (the tied
    head and the embedding on one rank): those are loaded once and copied after (`fill_copies`)."""
    state: dict[str, Any] = {}
    copies = []
    for piece in all_pieces:
        if piece.key in state:
            copies.append(piece)
        else:
            state[piece.key] = to_dcp(piece, mesh)
    return state, copies


def fill_copies(state: dict[str, Any], copies: list[Piece]) -> None:
    for piece in copies:
        value = state[piece.key]
        piece.local.copy_(value.to_local() if isinstance(value, DTensor) else value)


def read_state(state: dict[str, Any], path: Path) -> None:
    """`dcp.load` with the resharding planner (collective: DCP's plan exchange over the world); any
    failure is a CheckpointError naming `path`."""
    try:
        with single_process_quiet():
            dcp.load(state, storage_reader=safe_reader(str(path)), planner=ReshardingLoadPlanner(),
                     no_dist=not distributed())
    except CheckpointException as e:  # DCP wraps each rank's error (a BaseException): report the first
        failures = [exc for exc, _ in e.failures.values()]
        raise CheckpointError(_load_failure(path, failures[0] if failures else e)) from None
    except Exception as e:
        raise CheckpointError(_load_failure(path, e)) from None


def _load_failure(path: Path, e: BaseException) -> str:
    if isinstance(e, StateMismatch):
        return f"checkpoint {path} does not fit this model: {e}"
    return f"checkpoint {path} could not be read ({first_line(e)})"


def load_weights(model: nn.ModuleList, path: Path, mesh: Optional[DeviceMesh] = None) -> None:
    """Load only the parameters of checkpoint `path` into `model` (a ModuleList of chunks, any layout;
    `mesh`: the TP device mesh when tp > 1). Export and tools use it; training resumes with
    `Checkpointer.load`."""
    state, copies = load_target(model_pieces(model, None, True), mesh)
    read_state(state, path)
    fill_copies(state, copies)

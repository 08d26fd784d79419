"""ZeRO-3's parameters (`parallel.zero=3`): each block's parameters gathered just before use and freed after.

Every DP bucket's parameters live in one flat buffer (each `p.data` a view of it, as under ZeRO-1) whose storage
exists only while it is gathered: `FlatParams.free` resizes the storage to nothing, `FlatParams.launch` restores it
and **all-gathers** this rank's kept shard over DP into it (asynchronously; `wait` completes it). Autograd's
saved tensors are views of that storage, so the backward reads what was gathered last: the same values, since the
optimizer steps only between steps. Writes go through `.data`, so no saved tensor's version changes.

A *unit* is a transformer block, or the rest of a chunk (the embedding, the final norm, the head: its root);
its buckets hold its parameters only (`unit_params` gives `GradSync` the grouping). `Units` hooks each one:

- forward pre-hook: gather the unit (waiting for its prefetch), then prefetch the chunk's next block;
- forward post-hook: free a block — unless its backward has begun (a recomputation reruns it there) —, and on
  its output a gradient hook, which runs first in the unit's backward: gather the unit, prefetch the block before
  it. The root stays gathered from its forward until its backward is done (FSDP2's root);
- after the backward: free the unit once each of its parameters got its gradient of this microbatch (counted by
  a post-accumulate-grad hook; under a split backward that is in the weight pass).

Prefetching one unit ahead overlaps its all-gather with the current unit's compute; the waits are the DP group's
exposed time. Bytes: per microbatch each block is all-gathered twice (forward, backward), the root once; under
hpZ (`FlatParams.secondary`) every gather of a step but a unit's first runs inside the node.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Optional

import torch
from torch import nn

from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group
from hybrid.parallel.dp.sharded import shard_of

_DONE = object()  # an all-gather that completed when launched (a group of one)


class FlatParams:
    """One bucket's parameters: the flat buffer `full` (each parameter a view of it, its storage freed while not
    gathered) and this rank's kept shard of it, `shard`, which the optimizer updates. With a `codec` (qwZ:
    `parallel.zero_param_codec`) the shard is encoded and the encoded shards all-gathered, then decoded into
    `full` — every rank, its own shard included, computes with the same rounded weights; the kept shard stays
    exact. With a `secondary` group (hpZ: `parallel.zero_hpz`, the shard group's ranks on this node) the first
    gather of a step keeps this rank's 1/len(secondary) of what it gathered (`second`), and every later gather
    of the step — the backward's, the next microbatches' — all-gathers those over `secondary` only: inside the
    node, exact copies of the first gather's values. `stale()` (the optimizer's step, a load) drops them."""

    def __init__(self, full: torch.Tensor, shard: torch.Tensor, group: Group, codec: Any = None,
                 secondary: Group = None) -> None:
        self.full, self.shard, self.group, self.codec, self.secondary = full, shard, group, codec, secondary
        self.nbytes = full.numel() * full.element_size()
        self.work: Any = None
        self.encoded: Optional[torch.Tensor] = None  # the gathered encoded shards, until decoded
        self.second: Optional[torch.Tensor] = None  # hpZ: this rank's part of this step's gathered values
        self.coded: Optional[torch.Tensor] = None  # qwZ: the kept shard encoded, until it changes
        self.gathered = True  # built whole

    def launch(self) -> None:
        """Start gathering (restore the storage, all-gather the shards into it), unless gathered or in flight."""
        if self.gathered or self.work is not None:
            return
        self.full.untyped_storage().resize_(self.nbytes)
        if self.second is not None:  # hpZ: inside the node, from this step's secondary shards
            work = C.all_gather_flat(self.full.data, self.second, self.secondary, async_op=True)
            self.work = _DONE if work is None else work
            return
        out, inp = self.full.data, self.shard
        if self.codec is not None:
            inp = self._code()
            out = self.encoded = torch.empty(C.size(self.group) * inp.numel(), dtype=torch.uint8, device=inp.device)
        work = C.all_gather_flat(out, inp, self.group, async_op=True)
        self.work = _DONE if work is None else work

    def wait(self) -> None:
        """Gathered on return (launched here if it was not)."""
        self.launch()
        if self.work is not None and self.work is not _DONE:
            name = C.group_name(self.group if self.second is None else self.secondary)
            with C.TIMER.waiting(name, "all_gather"):  # comm/dp/all_gather/exposed_s
                self.work.wait()
        if self.encoded is not None:
            self._decode()
        if self.secondary is not None and self.second is None:
            self.second = shard_of(self.full.data, self.secondary).clone()
        self.work, self.gathered = None, True

    def _code(self) -> torch.Tensor:
        """The kept shard encoded: once a step (the shard changes only at the step, which calls `stale`)."""
        if self.coded is None:
            self.coded = self.codec.encode(_padded(self.shard.float(), self.codec.chunk_len(self.shard.numel())))
        return self.coded

    @torch.no_grad()
    def _decode(self) -> None:
        """Each rank's encoded shard decoded into its place in `full`."""
        k, n = self.shard.numel(), C.size(self.group)
        length = self.codec.chunk_len(k)
        for r, data in enumerate(self.encoded.view(n, -1)):
            self.full.data[r * k: (r + 1) * k].copy_(self.codec.decode(data, length)[:k])
        self.encoded = None

    def free(self) -> None:
        if self.work is not None:
            self.wait()  # never under an all-gather in flight
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def stale(self) -> None:
        """The kept shard changed (a step, a load): the next gather is over `group` again; hpZ's copy and qwZ's
        encoded shard are dropped."""
        self.second = self.coded = None


def _padded(x: torch.Tensor, length: int) -> torch.Tensor:
    return x if x.numel() == length else torch.cat([x, x.new_zeros(length - x.numel())])


def chunk_units(model: nn.ModuleList) -> list[tuple[nn.Module, list[nn.Parameter], list[nn.Module]]]:
    """Each chunk with its root's parameters (all but its blocks': the embedding, the final norm, the head) and its
    transformer blocks, in forward order."""
    out = []
    for chunk in model:
        blocks = list(chunk.layers.values()) if hasattr(chunk, "layers") else []
        inside = {id(p) for b in blocks for p in b.parameters()}
        out.append((chunk, [p for p in chunk.parameters() if id(p) not in inside], blocks))
    return out


def unit_groups(model: nn.ModuleList) -> list[tuple[bool, list[nn.Parameter]]]:
    """(is the root, its trainable parameters) of each unit — a chunk's root (all but its blocks'), then each
    block —, in registration order, chunk by chunk; units without any left out."""
    out = []
    for _, root, blocks in chunk_units(model):
        out.append((True, [p for p in root if p.requires_grad]))
        out += [(False, [p for p in b.parameters() if p.requires_grad]) for b in blocks]
    return [(root, ps) for root, ps in out if ps]


def unit_params(model: nn.ModuleList) -> list[list[nn.Parameter]]:
    """Each unit's trainable parameters: `GradSync`'s buckets under ZeRO-3 never span two units."""
    return [ps for _, ps in unit_groups(model)]


class Unit:
    """A block or a chunk's root: its buckets' `FlatParams`, whether its backward has begun, the gradients still
    due in it."""

    def __init__(self, flats: list[FlatParams], params: Sequence[nn.Parameter], root: bool) -> None:
        self.flats, self.n_params, self.root = flats, len(params), root
        self.in_backward = False
        self.arrived: set[int] = set()  # ids of the parameters whose gradient came since the unit was gathered

    def launch(self) -> None:
        for f in self.flats:
            f.launch()

    def wait(self) -> None:
        for f in self.flats:
            f.wait()

    def free(self) -> None:
        for f in self.flats:
            f.free()
        self.in_backward = False
        self.arrived.clear()


class Units:
    """ZeRO-3's hooks on `model`'s chunks and blocks over the `FlatParams` holding each parameter (see the
    module doc). `gather_all` / `free_all` for whoever reads or writes every parameter (a checkpoint, the
    optimizer's step)."""

    def __init__(self, model: nn.ModuleList, flat_of: dict[int, FlatParams]) -> None:
        self.units: list[Unit] = []
        for chunk, params, blocks in chunk_units(model):
            root = self._unit(params, flat_of, True)
            chain = [self._unit(list(b.parameters()), flat_of, False) for b in blocks]
            self._hook_chunk(chunk, root, chain)
            for i, block in enumerate(blocks):
                self._hook_block(block, chain[i], chain[i + 1] if i + 1 < len(chain) else None,
                                 chain[i - 1] if i else None)

    def _unit(self, params: list[nn.Parameter], flat_of: dict[int, FlatParams], root: bool) -> Optional[Unit]:
        flats = list({id(flat_of[id(p)]): flat_of[id(p)] for p in params if id(p) in flat_of}.values())
        if not flats:
            return None
        unit = Unit(flats, [p for p in params if id(p) in flat_of], root)
        for p in params:
            if id(p) in flat_of:
                p.register_post_accumulate_grad_hook(lambda q, u=unit: self._arrived(u, q))
        self.units.append(unit)
        return unit

    @staticmethod
    def _arrived(unit: Unit, p: nn.Parameter) -> None:
        """A gradient came: the unit is freed once each of its parameters has one (a parameter that never gets
        one keeps it gathered: memory, never a read of freed storage)."""
        unit.arrived.add(id(p))
        if len(unit.arrived) == unit.n_params:
            unit.free()

    def _hook_chunk(self, chunk: nn.Module, root: Optional[Unit], chain: list[Optional[Unit]]) -> None:
        first, last = (chain[0], chain[-1]) if chain else (None, None)

        def before(_m: nn.Module, _args: Any) -> None:
            _wait(root)
            _launch(first)

        def after(_m: nn.Module, _args: Any, out: Any) -> None:
            _on_backward(out, lambda: (_begin(root), _launch(last)))

        chunk.register_forward_pre_hook(before)
        chunk.register_forward_hook(after)

    def _hook_block(self, block: nn.Module, unit: Optional[Unit], nxt: Optional[Unit], prev: Optional[Unit]) -> None:
        def before(_m: nn.Module, _args: Any) -> None:
            _wait(unit)
            _launch(nxt)

        def after(_m: nn.Module, _args: Any, out: Any) -> None:
            if unit is not None and not unit.in_backward:
                unit.free()
            _on_backward(out, lambda: (_begin(unit), _launch(prev)))

        block.register_forward_pre_hook(before)
        block.register_forward_hook(after)

    def gather_all(self) -> None:
        for u in self.units:
            u.launch()
        for u in self.units:
            u.wait()

    def free_all(self) -> None:
        """Every unit freed and its hpZ copies dropped: the kept shards were just written (a step, a load)."""
        for u in self.units:
            u.free()
            for f in u.flats:
                f.stale()

    def flats(self) -> Iterable[FlatParams]:
        return (f for u in self.units for f in u.flats)


def _wait(unit: Optional[Unit]) -> None:
    if unit is not None:
        unit.wait()


def _launch(unit: Optional[Unit]) -> None:
    if unit is not None:
        unit.launch()


def _begin(unit: Optional[Unit]) -> None:
    """A unit's backward begins: gathered, and kept through any recomputation until its gradients are in."""
    if unit is not None:
        unit.in_backward = True
        unit.wait()


def _on_backward(out: Any, run: Any) -> None:
    """Run `run()` when the gradient of `out` (a tensor, or the first tensor of a tuple) is computed."""
    t = out if isinstance(out, torch.Tensor) else next((o for o in out if isinstance(o, torch.Tensor)), None)
    if t is not None and t.requires_grad:
        t.register_hook(lambda g: (run(), g)[1])

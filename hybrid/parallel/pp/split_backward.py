"""The split backward of zero-bubble schedules: input gradients now (I), weight gradients later (W).

A model part's backward is one autograd graph from its output to its input `x` (the received hidden
states) and its parameters. `backward_input` walks that graph once and sorts every parameter:

  deferred  reached from the input's side of the graph through exactly one node — its *frontier*
            node, e.g. a linear's matmul, whose backward yields both the input's gradient and the
            weight's. The input pass runs the frontier node for the input's gradient only (autograd
            computes an output of a node only when a requested input lies behind it) and keeps the
            gradient that flowed into it; `WeightGrads.run` later runs the same node once more, from
            that kept gradient, for the weight's gradient only.
  eager     anything else (a parameter the part uses twice, or one not on the input's side): its
            gradient is computed in the input pass, which costs little and keeps W free of double counts.

Both passes accumulate through autograd (AccumulateGrad), so `.grad` buckets, `main_grad` and the DP
sync's post-accumulate hooks see each parameter once per microbatch, as under a full backward. TP's region
ops sit on the input's side and run in the input pass; the weight pass runs only the collectives a weight's
own gradient needs (the sequence-parallel linear's regather: custom Functions ask `needed` what this pass
wants). The first part has no input to differentiate: its input pass does nothing and its W is the whole
backward, as in `torch.distributed.pipelining`. The graph is kept (`retain_graph`) between the passes, but
with the forward's saved tensors boxed (`SavedTensors`) the input pass empties every box the weight pass
will not open: from I to W a microbatch holds what W reads and the gradients kept for it.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable
from typing import Optional

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


def run_backward(roots: tuple, grads: tuple, inputs: tuple = (), retain: bool = False) -> None:
    """The autograd engine without `torch.autograd.backward`'s shape check: a sent activation's storage
    has been freed (see `pipeline._Run._free`), its autograd node is intact."""
    torch.autograd.Variable._execution_engine.run_backward(roots, grads, retain, False, inputs, True, True)


class WeightGrads:
    """What a part's input pass leaves for its weight pass: per frontier node, the gradient that flowed into
    it and the parameters behind it (or, on the first part, the whole deferred backward)."""

    def __init__(self) -> None:
        self.frontier: dict[Node, list[torch.Tensor]] = {}  # node → its deferred parameters
        self.grads: dict[Node, tuple[Optional[torch.Tensor], ...]] = {}  # node → gradient into it
        self.full: Optional[tuple[tuple, tuple]] = None  # (roots, grads): the first part's whole backward
        self.out: Optional[torch.Tensor] = None  # held: a custom Function's node lives only as long as its graph

    def run(self) -> None:
        """The weight pass: accumulate every deferred parameter's gradient (one engine call per frontier node,
        each computing only that node's weight outputs and the nodes between it and its parameters)."""
        if self.full is not None:
            run_backward(*self.full)
        for node, params in self.frontier.items():
            grads = self.grads.get(node, ())
            edges = [(GradientEdge(node, i), g) for i, g in enumerate(grads) if g is not None]
            if edges:
                run_backward(tuple(e for e, _ in edges), tuple(g for _, g in edges), tuple(params))
        self.frontier, self.grads, self.full, self.out = {}, {}, None, None


def backward_input(out: torch.Tensor, grad: Optional[torch.Tensor], x: Optional[torch.Tensor],
                   saved: Optional[SavedTensors] = None) -> WeightGrads:
    """The input pass of a part whose output is `out` (the loss on the last part, `grad` None) and input `x`
    (None on the first part): accumulate `x.grad` and the eager parameters' gradients; return the W work.
    `saved`: the part's saved tensors, boxed during its forward; those the weight pass will not read are
    emptied here."""
    work = WeightGrads()
    work.out = out  # its storage may be freed (sent): the tensor keeps the graph's nodes, not the data
    roots, grads = (out,), (grad if grad is not None else torch.ones_like(out),)
    if x is None or not x.requires_grad:
        work.full = (roots, grads)
        return work
    x_node = get_gradient_edge(x).node
    work.frontier, eager, branches = _sort_parameters(out.grad_fn, x_node)
    handles = [node.register_prehook(_keeper(work, node)) for node in work.frontier]
    try:
        run_backward(roots, grads, (x, *eager), retain=True)
    finally:
        for h in handles:
            h.remove()
    if saved is not None:
        saved.keep_only(branches)
    return work


class SavedTensors:
    """Saved-tensor hooks over one part's forward: every tensor autograd saves goes into a box. After the input
    pass, `keep_only` empties the boxes of every node the weight pass will not run (the input's path: attention
    probabilities, activations' inputs, …), so between the two passes a microbatch holds what its weight pass
    reads — each weight node's inputs — as the zero-bubble paper's implementation does, not its whole graph."""

    def __init__(self) -> None:
        self.boxes: list[list] = []  # one [tensor] per saved tensor

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> list:
        box = [t]
        self.boxes.append(box)
        return box

    @staticmethod
    def _unpack(box: list) -> torch.Tensor:
        if box[0] is None:
            raise RuntimeError("a tensor the split backward freed after its input pass was read again: a weight "
                               "node outside the weight pass's graph (report this with the model)")
        return box[0]

    def keep_only(self, nodes: Iterable[Node]) -> None:
        """Empty every box but those holding memory `nodes` saved (by storage: unpacking hands out aliases)."""
        keep = {_storage(t) for node in nodes for t in _saved_by(node)}
        for box in self.boxes:
            if box[0] is not None and _storage(box[0]) not in keep:
                box[0] = None
        self.boxes = []


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _saved_by(node: Node) -> list[torch.Tensor]:
    """The tensors `node` saved for its backward: its `_saved_*` fields, or a custom Function's `saved_tensors`."""
    values = [getattr(node, name) for name in dir(node) if name.startswith("_saved_")]
    if hasattr(node, "saved_tensors"):
        values += list(node.saved_tensors)
    flat = [v for item in values for v in (item if isinstance(item, (tuple, list)) else [item])]
    return [t for t in flat if isinstance(t, torch.Tensor)]


def edges_of(*tensors: Optional[torch.Tensor]) -> list[Optional[GradientEdge]]:
    """The gradient edges of a custom autograd Function's tensor inputs (None where none flows), kept by its
    forward for `needed`."""
    return [get_gradient_edge(t) if t is not None and t.requires_grad else None for t in tensors]


def needed(static: Iterable[bool], edges: Iterable[Optional[GradientEdge]]) -> list[bool]:
    """Which inputs of a custom autograd Function the running backward wants gradients for: its static
    `ctx.needs_input_grad`, narrowed to the edges the engine will execute. A split backward's input pass then
    skips the weights (and their collectives) and its weight pass the input, as autograd's own nodes do."""
    return [bool(n) and (e is None or _will_run(e)) for n, e in zip(static, edges)]


def _will_run(edge: GradientEdge) -> bool:
    try:
        return torch._C._will_engine_execute_node(edge.node)
    except RuntimeError:  # outside a backward, or torch.autograd.grad towards a leaf: assume it is wanted
        return True


def _keeper(work: WeightGrads, node: Node):
    def keep(grad_outputs: tuple) -> None:
        work.grads[node] = tuple(grad_outputs)
    return keep


def _sort_parameters(root: Node, x_node: Node) -> tuple[dict[Node, list[torch.Tensor]], list[torch.Tensor], set[Node]]:
    """(frontier node → deferred parameters, eager parameters, the nodes the weight pass runs: each deferred
    parameter's frontier node and the nodes between it and the parameter) of the graph under `root`."""
    parents = _parents(root)
    input_side = _reach(x_node, parents, stop=set())
    frontier: dict[Node, list[torch.Tensor]] = defaultdict(list)
    eager: list[torch.Tensor] = []
    branches: set[Node] = set()
    for node in list(parents):
        leaf = getattr(node, "variable", None)
        if leaf is None or node is x_node:
            continue
        reached = _reach(node, parents, stop=input_side)
        fronts = {n for n in reached if n in input_side}
        if len(fronts) == 1:
            frontier[fronts.pop()].append(leaf)
            branches |= reached
        else:
            eager.append(leaf)
    return dict(frontier), eager, branches


def _parents(root: Node) -> dict[Node, list[Node]]:
    """Every node under `root` → the nodes that feed gradient into it (the reverse of `next_functions`)."""
    parents: dict[Node, list[Node]] = {root: []}
    todo = deque([root])
    while todo:
        node = todo.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                todo.append(child)
            parents[child].append(node)
    return parents


def _reach(start: Node, parents: dict[Node, list[Node]], stop: set[Node]) -> set[Node]:
    """The nodes from which gradient reaches `start`: `start`, its parents, theirs, …, not going past `stop`
    (nodes of `stop` that are met are included, their parents are not)."""
    seen, todo = {start}, deque([start])
    while todo:
        node = todo.popleft()
        if node in stop and node is not start:
            continue
        for p in _unseen(parents.get(node, ()), seen):
            todo.append(p)
    return seen


def _unseen(nodes: Iterable[Node], seen: set[Node]) -> Iterable[Node]:
    for n in nodes:
        if n not in seen:
            seen.add(n)
            yield n

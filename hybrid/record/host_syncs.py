"""Counting the moments the host waits for the device: every read of a tensor's values into Python
(`item`, `float(t)`, `bool(t)`, `tolist`, `numpy`, a format, `.cpu()`) and every explicit
synchronisation (`torch.cuda.synchronize`, an event's or a stream's `synchronize`).

On CUDA each of them blocks the host until the device has run everything queued before it, so the host
cannot launch the next step's kernels while the device works; a step that reads nothing lets the host
run ahead. `HostSyncs` counts them on any device (on the CPU too, where a read costs nothing but is the
same line of code that stalls a GPU), attributed to the step `at` names. A tensor made on the host to hold a
host value (a signal flag agreed over gloo) is marked `t.host_only = True` and not counted. On CUDA,
`torch.cuda.set_sync_debug_mode("warn")` shows the same from inside the runtime (copies included).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

READS = frozenset({"item", "__float__", "__int__", "__bool__", "__index__", "tolist", "numpy", "__format__",
                   "cpu", "__repr__", "__str__"})
SYNCS = (("torch.cuda", torch.cuda, "synchronize"), ("torch.cuda.Event", torch.cuda.Event, "synchronize"),
         ("torch.cuda.Stream", torch.cuda.Stream, "synchronize"))


class HostSyncs(TorchFunctionMode):
    """A torch function mode counting host reads and synchronisations per step: `at` is the step the next
    ones count against (set it as each step starts); `by_step[step]` their number, `where[step]` by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.at = 0
        self.by_step: Counter[int] = Counter()
        self.where: dict[int, Counter[str]] = {}

    def note(self, kind: str) -> None:
        self.by_step[self.at] += 1
        self.where.setdefault(self.at, Counter())[kind] += 1

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in READS and not getattr(args[0] if args else None, "host_only", False):
            self.note(func.__name__)
        return func(*args, **(kwargs or {}))

    @contextmanager
    def counting(self) -> Iterator[HostSyncs]:
        """Count inside the block: this mode pushed, the explicit synchronisations wrapped."""
        with ExitStack() as stack:
            for name, owner, attr in SYNCS:
                stack.enter_context(self._wrapped(owner, attr, name))
            stack.enter_context(self)
            yield self

    @contextmanager
    def _wrapped(self, owner: Any, attr: str, name: str) -> Iterator[None]:
        original = getattr(owner, attr)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.note(f"{name}.{attr}")
            return original(*args, **kwargs)

        setattr(owner, attr, counted)
        try:
            yield
        finally:
            setattr(owner, attr, original)

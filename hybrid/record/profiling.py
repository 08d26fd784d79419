"""Profiler traces of chosen steps: `profile.steps=[first, last]`.

`StepProfiler` starts `torch.profiler` before step `first` and stops it after step `last`, then writes one
Chrome/Perfetto trace per rank (`<profile.dir>/trace_rank<r>.json`; open it in https://ui.perfetto.dev or
chrome://tracing). While it runs, `C.TIMER.profiling` labels every collective `comm:<group>:<op>` (the
profiler's own `gloo:`/`nccl:` events do not say which group ran them). On CUDA with `profile.memory`, the
allocator's history over the same steps is dumped as `memory_rank<r>.pickle` (for pytorch.org/memory_viz).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch

from hybrid.config import ProfileConfig
from hybrid.parallel import collectives as C

MEMORY_ENTRIES = 100_000  # allocator events kept for the snapshot (the newest ones)


class StepProfiler:
    """Profiles steps `cfg.steps[0]`..`cfg.steps[1]` (counted from 1) of one rank; a no-op without steps."""

    def __init__(self, cfg: ProfileConfig, rank: int, device: torch.device, say: Callable[[str], None]) -> None:
        steps = list(cfg.steps)
        self.first, self.last = (steps[0], steps[1]) if steps else (0, -1)
        self.dir, self.rank, self.say = Path(cfg.dir), rank, say
        self.cuda = device.type == "cuda"
        self.memory = cfg.memory and self.cuda
        self.prof: Optional[torch.profiler.profile] = None

    def before_step(self, step: int) -> None:
        """Start profiling if `step` is the first profiled step."""
        if step != self.first:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_ENTRIES)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
        self.prof.__enter__()
        C.TIMER.profiling = True

    def skipped(self, start_step: int) -> Optional[str]:
        """A note when a run resumed at `start_step` has already passed the first profiled step."""
        if self.first and start_step >= self.first:
            return (f"note: profile.steps=[{self.first},{self.last}] starts before the resumed step "
                    f"{start_step + 1}: nothing is profiled")
        return None

    def after_step(self, step: int) -> None:
        """Stop and write the trace (and memory snapshot) after the last profiled step."""
        if self.prof is not None and step == self.last:
            self.stop()

    def stop(self) -> None:
        """Stop a running profiler and write what it has (also when a run ends inside the window)."""
        if self.prof is None:
            return
        C.TIMER.profiling = False
        self.prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        trace = self.dir / f"trace_rank{self.rank}.json"
        self.prof.export_chrome_trace(str(trace))
        self.prof = None
        if self.memory:
            torch.cuda.memory._dump_snapshot(str(self.dir / f"memory_rank{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        self.say(f"profile: steps from {self.first} traced to {self.dir}/trace_rank<r>.json")

"""Sharded checkpoints through `torch.distributed.checkpoint` (DCP): save, find, resume (also under
another layout), keep the newest k.

One folder per step, `<checkpoint.dir>/<run name>/step_0000100/`:

    hybrid.json          the manifest, written first by rank 0: step, consumed samples, layout,
                         vocabulary, the resolved config
    tokenizer/           the run's tokenizer (rank 0), so that export needs nothing else
    __<rank>_<i>.distcp  each rank's own shards (DCP; a replicated tensor is written by one rank)
    .metadata            DCP's index of every shard, written last, by rank 0, through a rename

The rooms: `files` (step folders, completeness, `latest`, keep-k), `resume` (which checkpoint to
resume and whether it fits), `state` (the layout-independent state dict and its resharding load),
`stager` (the blocking copy of an async save), `checkpointer` (`Checkpointer`: save, load, cleanup),
`preempt` (save on a signal: the flag, and the ranks' agreement on it), `trust` (what is read or removed:
the restricted index reader, foreign folders, removal inside the run folder only).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {  # each name → its room, imported on first use: `preempt`'s or `files`' users (the validation, the
    # pre-launch check) do not load DCP (~1 s: DTensor, sympy) through the checkpointer
    "Checkpointer": "checkpointer",
    **dict.fromkeys(("FORMAT", "MANIFEST", "METADATA", "CheckpointError", "NonFiniteState", "find_latest",
                     "list_steps", "problem", "read_manifest", "run_root", "stale", "step_path"), "files"),
    **dict.fromkeys(("check_compatible", "config_changes", "finished_line", "layout_name", "layout_of", "model_shape",
                     "plan_resume", "refuse_changes", "resolve_resume", "training_changes"), "resume"),
    "Stager": "stager",
    **dict.fromkeys(("init_optimizer_state", "load_weights"), "state"),
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'hybrid.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hybrid.checkpoint.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


__all__ = sorted(_WHERE)

"""What a checkpoint folder must be before it is read or removed: ours, not planted, and inside the run.

- **Reading.** DCP's index `.metadata` is a pickle, and unpickling runs whatever the pickle names.
  `safe_reader` reads it with an unpickler that admits only the classes an index holds (DCP's metadata
  dataclasses, `torch.Size`, dtypes, paths), so a crafted index is refused (an `UnpicklingError` the
  callers report as a corrupt checkpoint) instead of executed. Our own per-rank blobs are read with
  `torch.load(weights_only=True)` (`state.unblob`). `untrusted` names a folder that someone else could
  have written: owned by another user, or writable by everyone.
- **Removing.** `remove_step` never follows a symbolic link and never removes a folder whose real
  path is not directly inside the run's real checkpoint folder.

Local file operations only; no collectives.
"""

from __future__ import annotations

import functools
import os
import pickle
import shutil
import stat
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
            ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath")}


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles a DCP index, refusing any global that is not one of the index's own types."""

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name) if _admitted(module, name) else None
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index (refused)")
        return found


def _admitted(module: str, name: str) -> bool:
    if (module, name) in _ALLOWED:
        return True
    if module == "torch":
        return isinstance(getattr(torch, name, None), torch.dtype)
    if module in _DCP_MODULES:  # a class defined there (a dataclass or an enum), never a function
        return isinstance(getattr(__import__(module, fromlist=[name]), name, None), type)
    return False


def read_index(stream: IO[bytes]) -> Metadata:
    """A DCP index from `stream`, through the restricted unpickler."""
    from torch.distributed.checkpoint.metadata import Metadata

    md = _IndexUnpickler(stream).load()
    if not isinstance(md, Metadata):
        raise pickle.UnpicklingError(f"the index holds a {type(md).__name__}, not DCP Metadata")
    return md


def safe_reader(path: str) -> Any:
    """DCP's file-system reader with `read_metadata` through `read_index` (no code runs on a load). DCP (~1 s of
    imports: DTensor, sympy) loads on the first read, not when a run that never reads a checkpoint imports this."""
    return _safe_reader_class()(path)


@functools.cache
def _safe_reader_class() -> type:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                md = read_index(f)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return _SafeReader


def untrusted(path: Path) -> Optional[str]:
    """Why `path` (a step folder, or a file in one) may hold what another user planted, else None:
    another owner, or write permission for everyone. Group write is allowed (team folders, and the
    user-private groups of umask 002)."""
    st = path.lstat()
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & stat.S_IWOTH:
        return f"is writable by every user (mode {stat.filemode(st.st_mode)})"
    return None


def inside(path: Path, root: Path) -> bool:
    """Whether `path`'s real location is directly inside `root`'s real location."""
    return path.resolve().parent == root.resolve()


def remove_step(path: Path, root: Path) -> Optional[str]:
    """Remove the step folder `path` of the run folder `root`; a symbolic link is unlinked, never followed.
    Returns why nothing was removed (not a folder inside `root`), else None."""
    if path.is_symlink():
        path.unlink()
        return None
    if not path.exists():
        return None
    if not path.is_dir() or not inside(path, root):
        return f"{path} is not a step folder inside {root}"
    shutil.rmtree(path)
    return None


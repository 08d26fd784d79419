"""Token files: pre-tokenized input read as a memmap, and the .npy file the cache builder appends to.

A pre-tokenized corpus (`data.path=tokens.bin` or `.npy`) is one stream of token ids, documents already
concatenated with whatever separator they carry: a .bin file is raw ids in `data.token_dtype` (uint16
unless told, nanoGPT's habit), a .npy file says its dtype in its header. Neither is copied: the trainer
packs views of the memmap. `NpyWriter` writes the cache's stream chunk by chunk, so no step of a build
holds the whole stream in memory.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import BinaryIO, Optional

import numpy as np

from hybrid.config import ConfigError

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "int32": np.int32}
TOKEN_SUFFIXES = (".bin", ".npy")
_SCAN = 1 << 24  # ids per chunk when scanning a token file for its largest id


def is_token_file(path: Optional[str]) -> bool:
    return path is not None and Path(path).suffix.lower() in TOKEN_SUFFIXES


def open_tokens(path: str, token_dtype: Optional[str]) -> np.ndarray:
    """The token file at `path` as a read-only 1-D memmap; ConfigError when it is not one."""
    p, where = Path(path).expanduser(), f"data.path={path}"
    if not p.is_file():
        raise ConfigError(f"{where} does not exist")
    if token_dtype is not None and token_dtype not in TOKEN_DTYPES:
        raise ConfigError(f"data.token_dtype={token_dtype} is not one of {', '.join(TOKEN_DTYPES)}")
    if p.suffix.lower() == ".bin":
        dtype, size = np.dtype(TOKEN_DTYPES[token_dtype or "uint16"]), p.stat().st_size
        if size == 0 or size % dtype.itemsize:
            raise ConfigError(f"{where}: {size} bytes is not a whole, non-zero number of {dtype} token ids "
                              "(set data.token_dtype=uint16|uint32|int32)")
        return np.memmap(p, dtype=dtype, mode="r")
    try:
        tokens = np.load(p, mmap_mode="r")
    except (ValueError, OSError, EOFError) as e:  # EOFError: an empty file
        raise ConfigError(f"{where} is not a readable .npy file: {' '.join(str(e).split())}") from None
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu" or tokens.size == 0:
        raise ConfigError(f"{where} holds a {tokens.dtype} array of shape {tokens.shape}; "
                          "a token file is a non-empty 1-D array of integer ids")
    if token_dtype is not None and np.dtype(TOKEN_DTYPES[token_dtype]) != tokens.dtype:
        raise ConfigError(f"data.token_dtype={token_dtype} contradicts {where}'s header ({tokens.dtype}); "
                          "leave data.token_dtype unset for .npy files")
    return tokens


def id_range(tokens: np.ndarray) -> tuple[int, int]:
    """(smallest, largest) id of a token memmap, read chunk by chunk."""
    lo, hi = None, None
    for start in range(0, tokens.size, _SCAN):
        chunk = np.asarray(tokens[start:start + _SCAN])
        lo = int(chunk.min()) if lo is None else min(lo, int(chunk.min()))
        hi = int(chunk.max()) if hi is None else max(hi, int(chunk.max()))
    return int(lo or 0), int(hi or 0)


def _header(dtype: np.dtype, n: int) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": np.lib.format.dtype_to_descr(dtype),
                                               "fortran_order": False, "shape": (n,)})
    return out.getvalue()


class NpyWriter:
    """Appends 1-D chunks to a .npy file and writes its header (the final length) on `close`.

    The header of a 1-D array is padded to 64-byte alignment, so its size does not depend on the length:
    the writer reserves it, streams the ids behind it, and fills it in last. `limit` caps the ids kept
    (`data.max_tokens`); `append` returns False once it is reached.
    """

    def __init__(self, path: Path, dtype: type[np.integer], limit: Optional[int] = None) -> None:
        self.path, self.dtype, self.limit, self.size = path, np.dtype(dtype), limit, 0
        self._reserved = len(_header(self.dtype, 0))
        self._fh: BinaryIO = open(path, "wb")  # noqa: SIM115 (closed by close)
        self._fh.write(b"\0" * self._reserved)

    def append(self, chunk: np.ndarray) -> bool:
        if self.limit is not None:
            chunk = chunk[: max(0, self.limit - self.size)]
        self._fh.write(np.ascontiguousarray(chunk, dtype=self.dtype).tobytes())
        self.size += len(chunk)
        return self.limit is None or self.size < self.limit

    def close(self) -> int:
        """Write the header and close; returns the number of ids written."""
        header = _header(self.dtype, self.size)
        if len(header) != self._reserved:
            raise RuntimeError(f"npy header grew from {self._reserved} to {len(header)} bytes")
        self._fh.seek(0)
        self._fh.write(header)
        self._fh.close()
        return self.size

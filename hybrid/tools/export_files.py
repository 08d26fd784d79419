"""The files of an exported folder that every supported transformers reads: the output folder's
parents and staging, the weights' dtype, and the fix-ups after transformers' own `save_pretrained`.

transformers 5 writes a few things that transformers 4 does not understand; the export rewrites
them so that one folder loads with `AutoModelForCausalLM`, `AutoTokenizer` and
`pipeline("text-generation")` on the oldest transformers hybrid declares and on the newest:

- tokenizer_config.json: transformers 5 tags a tokenizer that is only a `tokenizer.json` with its
  class `TokenizersBackend`; transformers 4 knows that generic class as `PreTrainedTokenizerFast`
  (an alias transformers 5 still reads). Other classes (GPT2Tokenizer, LlamaTokenizer, ...) exist in
  both and are kept. A tokenizer without a pad token gets pad = eos (as GPT-2 users do), and the keys
  that only record how the checkpoint's copy was loaded (`is_local`, `local_files_only`) are dropped.
- config.json: transformers 5 writes `dtype` and, for RoPE models, `rope_parameters`; transformers 4
  reads `torch_dtype` and `rope_theta` (`rope_scaling` for a non-default RoPE). Both spellings are
  written, with the same values.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import torch

from hybrid.data.tokenize import TOKENIZER_CLASSES

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LOAD_TIME_KEYS = ("is_local", "local_files_only")


def check_parents(out: Path) -> None:
    """`out`'s nearest existing ancestor must be a folder (the missing ones are created); OSError if not."""
    for parent in out.resolve().parents:
        if parent.exists():
            if not parent.is_dir():
                raise NotADirectoryError(f"out={out}: {parent} is not a folder")
            return


@contextlib.contextmanager
def staging(out: Path, pid: int) -> Iterator[Path]:
    """A fresh temporary folder next to `out` (its missing parents created first), removed at the end.
    If the body fails, the parents this created are removed again (those still empty), so a failed
    export leaves the file system as it was."""
    created = [p for p in out.absolute().parents if not p.exists()]  # deepest first
    tmp = out.parent / f".{out.name}.export-{pid}"
    shutil.rmtree(tmp, ignore_errors=True)
    done = False
    try:
        tmp.mkdir(parents=True)
        yield tmp
        done = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in [] if done else created:
            with contextlib.suppress(OSError):
                p.rmdir()


def cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`state` detached, contiguous and in `dtype`; tensors that share storage (a tied head) still do."""
    done: dict[int, torch.Tensor] = {}
    out = {}
    for name, t in state.items():
        key = t.untyped_storage().data_ptr()
        if key not in done:
            done[key] = t.detach().to(dtype).contiguous()
        out[name] = done[key]
    return out


def dtype_kwarg(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The keyword that gives `from_config`/`from_pretrained` a dtype: `dtype` from transformers 4.56 on,
    `torch_dtype` before (so the tool itself also runs on the oldest transformers hybrid declares)."""
    import transformers
    from packaging.version import Version

    return {"dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype": dtype}


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def _write(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def tokenizer_config(config: dict[str, Any], max_len: Optional[int], fast: bool) -> dict[str, Any]:
    """A tokenizer_config.json that transformers 4 and 5 both load: the class renamed where 5 has its
    own name (or `PreTrainedTokenizerFast` when none is given and there is a tokenizer.json: `fast`),
    pad = eos when none, load-time keys dropped, `model_max_length` capped at `max_len` (the model's
    positions)."""
    out = {k: v for k, v in config.items() if k not in LOAD_TIME_KEYS}
    cls = out.get("tokenizer_class") or ("PreTrainedTokenizerFast" if fast else None)
    if cls is not None:
        out["tokenizer_class"] = TOKENIZER_CLASSES.get(cls, cls)
    if out.get("pad_token") is None and out.get("eos_token") is not None:
        out["pad_token"] = out["eos_token"]
    if max_len is not None and int(out.get("model_max_length", max_len)) > max_len:
        out["model_max_length"] = max_len
    return out


def copy_tokenizer(src: Path, dst: Path, max_len: Optional[int]) -> bool:
    """Copy the checkpoint's tokenizer files from `src` into `dst`, tokenizer_config.json rewritten
    (`tokenizer_config`); False when `src` holds no tokenizer."""
    if not src.is_dir():
        return False
    for f in src.iterdir():
        if f.is_file():
            shutil.copy2(f, dst / f.name)
    path = dst / "tokenizer_config.json"
    if path.is_file():
        _write(path, tokenizer_config(_read(path), max_len, (dst / "tokenizer.json").is_file()))
    return True


def legacy_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json with transformers 4's spellings added next to transformers 5's (same values):
    `torch_dtype` for `dtype`; `rope_theta` (and `rope_scaling` unless the RoPE is the default one)
    for `rope_parameters`."""
    out = dict(config)
    if "dtype" in out:
        out.setdefault("torch_dtype", out["dtype"])
    rope = out.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        out.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            out.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    return out


def finish_config(folder: Path) -> None:
    """Rewrite `folder`/config.json with `legacy_config`."""
    _write(folder / "config.json", legacy_config(_read(folder / "config.json")))

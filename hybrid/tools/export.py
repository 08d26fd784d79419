"""Export a checkpoint (saved under any layout) as a transformers model folder.

    python -m hybrid.tools.export checkpoint=checkpoints/gpt-tiny-tp2pp2/step_0000100 out=exported/gpt-tiny
    python -m hybrid.tools.export checkpoint=checkpoints/gpt-tiny-tp2pp2 out=exported/gpt-tiny force=true
    python -m hybrid.tools.export checkpoint=checkpoints/gpt-tiny-tp2pp2 out=exported/gpt-tiny-bf16 dtype=bf16

Keys (key=value): checkpoint (a step folder, or a run folder: its newest complete checkpoint), out (the
folder to write; it must not exist or be empty unless force=true; missing parent folders are
created), force (true | false: replace a non-empty out), dtype (fp32 | bf16, default fp32: the
weights' dtype in model.safetensors and config.json), verify (true | false, default true: load the
written folder with transformers in that dtype and compare its logits with ours before publishing it:
max |Δlogits| within 1e-3 (fp32) or 3e-2 (bf16) of max(1, max |logits|)).

One process, no process group: the model is rebuilt from the checkpoint's manifest (its `config`
model section and the real vocabulary), its weights loaded with `hybrid.checkpoint.load_weights`
(resharded from whatever layout saved them), converted with `hybrid.model.hf.to_hf_state_dict`, and
written by transformers' own `save_pretrained` (config.json, generation_config.json,
model.safetensors without the tied head), plus the checkpoint's tokenizer with a pad token (= eos);
`export_files` rewrites what transformers 5 writes and transformers 4 cannot read (the tokenizer's
class, config.json's `dtype` and `rope_parameters`), so the folder loads with both. Everything is
written to a temporary folder next to `out` and renamed into place at the end, so a failure leaves
`out` as it was (and removes the parent folders it created). Bad input (or an unwritable out) is
one `hybrid: error: ...` line on stderr and exit status 2; a failed verification is such a line and
exit status 1.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, cast

import torch
from torch import nn

from hybrid.checkpoint import MANIFEST, CheckpointError, find_latest, list_steps, problem, read_manifest
from hybrid.cli import EXIT_BAD_INPUT, EXIT_FAILED, UsageError, run_tool, warn
from hybrid.config import ConfigError, ModelConfig
from hybrid.model.family import ModelConfigError
from hybrid.tools.export_files import (
    DTYPES,
    cast_state,
    check_parents,
    copy_tokenizer,
    dtype_kwarg,
    finish_config,
    staging,
)
from hybrid.tools.keys import boolean, key_values

KEYS = ("checkpoint", "out", "force", "dtype", "verify")
EOS_TOKEN = "<|endoftext|>"
VERIFY_IDS = (2, 16)  # the batch of random token ids the verification runs
# max |Δlogits| allowed, relative to max(1, max |logits|): a conversion bug is O(1); bf16 weights and
# arithmetic move tiny models' logits by ~0.4% of their largest
VERIFY_RTOL = {"fp32": 1e-3, "bf16": 3e-2}


class VerifyError(RuntimeError):
    """transformers does not reproduce our model from the written folder (a bug, not bad input): exit 1."""


@dataclass
class Options:
    """The parsed command line."""

    checkpoint: Path
    out: Path
    force: bool = False
    verify: bool = True
    dtype: str = "fp32"


@dataclass
class Report:
    """What an export did."""

    checkpoint: Path
    out: Path
    family: str
    step: int
    n_tensors: int
    tokenizer: bool
    dtype: str
    max_abs_diff: Optional[float]  # max |Δlogits| of the verification (None: not verified)


def parse_args(argv: list[str]) -> Options:
    """Turn `key=value` words into Options; raise UsageError on anything else."""
    seen = key_values(argv, KEYS)
    for key in ("checkpoint", "out"):
        if not seen.get(key):
            raise UsageError(f"{key}= is required (python -m hybrid.tools.export checkpoint=<dir> out=<dir>)")
    flags = {key: boolean(key, seen[key]) for key in ("force", "verify") if key in seen}
    dtype = seen.get("dtype", "fp32")
    if dtype not in DTYPES:
        raise UsageError(f"dtype must be {' or '.join(DTYPES)}, got {dtype!r}")
    return Options(Path(seen["checkpoint"]), Path(seen["out"]), dtype=dtype, **flags)


def resolve_checkpoint(path: Path) -> Path:
    """The complete checkpoint `path` names: itself, or a run folder's newest complete one (newer,
    incomplete ones are skipped with a warning line each; none complete is one error line)."""
    if path.is_dir() and not (path / MANIFEST).exists() and list_steps(path):
        skipped: list[str] = []
        latest = find_latest(path, skipped.append)
        if latest is None:
            raise CheckpointError(f"checkpoint={path}: no complete checkpoint in that folder "
                                  f"({len(skipped)} incomplete or corrupt step folder(s) skipped)")
        for msg in skipped:
            warn(msg)
        return latest
    why = problem(path)
    if why is not None:
        raise CheckpointError(f"checkpoint={path} {why}")
    return path


def check_out(out: Path, force: bool) -> None:
    """`out` may be new (under missing parents too), an empty folder, or (force=true) a folder to
    replace; never a file, nor under one."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"out={out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UsageError(f"out={out} exists and is not empty (force=true replaces it)")
    try:
        check_parents(out)
    except NotADirectoryError as e:
        raise UsageError(str(e)) from None


def model_config(manifest: dict[str, Any], path: Path) -> tuple[ModelConfig, int]:
    """The checkpoint's model config (typed by ModelConfig; fields unknown to it dropped, missing ones
    defaulted) and its real vocabulary."""
    from omegaconf import OmegaConf

    try:
        saved = manifest["config"]["model"]
        vocab = int(manifest["model_shape"]["vocab_size"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"checkpoint {path}: its {MANIFEST} lacks the model config or vocab_size") from None
    base = OmegaConf.structured(ModelConfig)
    cfg = OmegaConf.merge(base, {k: v for k, v in saved.items() if k in base})
    if _lm_class(cfg.family) is None:
        raise CheckpointError(f"checkpoint {path}: model.family={cfg.family} has no transformers counterpart")
    return cast(ModelConfig, cfg), vocab  # duck-typed


def _lm_class(family: str) -> Optional[str]:
    """The transformers LM class of the registered `family`, or None (unknown, or no counterpart)."""
    from hybrid.model.family import family_names, get_family

    spec = get_family(family).hf if family in family_names() else None
    return spec.lm_class if spec is not None else None


def load_model(path: Path, cfg: ModelConfig, vocab: int) -> nn.Module:
    """The whole model in one process, its weights read from checkpoint `path` (DCP reshards any layout)."""
    from hybrid.checkpoint import load_weights
    from hybrid.model import build_model

    model = build_model(cfg, vocab)
    load_weights(nn.ModuleList([model]), path)
    return model.eval()


def token_ids(tokenizer_dir: Path) -> dict[str, Optional[int]]:
    """bos/eos/pad ids for the transformers config from the checkpoint's tokenizer (pad falls back to
    eos when the tokenizer has none, as `generate` would); all None without a tokenizer or an EOS."""
    from transformers import AutoTokenizer

    if not tokenizer_dir.is_dir():
        return {}
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    eos = tok.eos_token_id
    if eos is None:
        return {}
    bos = tok.bos_token_id if tok.bos_token_id is not None else eos
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}


def write_folder(folder: Path, model: nn.Module, cfg: ModelConfig, vocab: int, tokenizer_dir: Path,
                 dtype: str) -> int:
    """The checkpoint's tokenizer (`copy_tokenizer`: pad = eos, a class transformers 4 knows), then
    transformers' `save_pretrained` from a model skeleton on the meta device given our converted state
    dict in `dtype` (so no second fp32 copy of the weights is built): config.json (with the tokenizer's
    bos/eos/pad ids and transformers 4's spellings: `finish_config`), generation_config.json,
    model.safetensors (a tied lm_head is left out, as transformers does). Returns the number of tensors."""
    from transformers import AutoModelForCausalLM

    from hybrid.model.hf import export_hf_state_dict, hf_config

    ids = token_ids(folder) if copy_tokenizer(tokenizer_dir, folder, getattr(cfg, "max_seq_len", None)) else {}
    state = cast_state(export_hf_state_dict(model, cfg, vocab), DTYPES[dtype])  # tp=1: no collective
    config = hf_config(cfg, vocab, **ids)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, **dtype_kwarg(DTYPES[dtype]))
    skeleton.save_pretrained(str(folder), state_dict=dict(state))  # it empties the dict it is given
    finish_config(folder)
    return len(state)


@torch.no_grad()
def verify(folder: Path, model: nn.Module, vocab: int, dtype: str) -> float:
    """Load `folder` with `AutoModelForCausalLM.from_pretrained` in `dtype` (no missing, unexpected or
    mismatched keys allowed) and compare its logits (computed in `dtype`) with our fp32 `full_logits`
    on random ids, within VERIFY_RTOL[dtype]; the max |Δlogits|."""
    from transformers import AutoModelForCausalLM

    theirs, info = AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True,
                                                        **dtype_kwarg(DTYPES[dtype]))
    bad = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v} | (
        {"error_msgs": info["error_msgs"]} if info.get("error_msgs") else {})
    if bad:
        raise VerifyError(f"transformers loads {folder} with {bad}")
    seq = min(VERIFY_IDS[1], getattr(model.cfg, "max_seq_len", VERIFY_IDS[1]))
    ids = torch.randint(0, vocab, (VERIFY_IDS[0], seq), generator=torch.Generator().manual_seed(0))
    ours, ref = model.full_logits(ids), theirs.eval()(ids).logits.float()
    diff = (ours - ref).abs().max().item()
    if not diff <= VERIFY_RTOL[dtype] * max(1.0, ref.abs().max().item()):
        raise VerifyError(f"transformers' logits ({dtype}) differ from ours by up to {diff:.3g}")
    return diff


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No progress bars or info lines from transformers while it saves and loads (errors still show)."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def publish(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` to `out` (a previous `out` is moved aside first and removed after)."""
    mask = os.umask(0)
    os.umask(mask)
    for f in tmp.rglob("*"):  # transformers writes model.safetensors 0600 through a temp file
        if f.is_file():
            f.chmod(0o666 & ~mask)
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        out.rename(old)
    try:
        tmp.rename(out)
    except OSError:
        if old.exists():
            old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def export(opts: Options) -> Report:
    """Check the input, then convert and write (into a temp folder, published at the end)."""
    path = resolve_checkpoint(opts.checkpoint)
    check_out(opts.out, opts.force)
    manifest = read_manifest(path)
    cfg, vocab = model_config(manifest, path)
    model = load_model(path, cfg, vocab)
    with staging(opts.out, os.getpid()) as tmp:
        with _quiet_transformers():
            n = write_folder(tmp, model, cfg, vocab, path / "tokenizer", opts.dtype)
            diff = verify(tmp, model, vocab, opts.dtype) if opts.verify else None
        publish(tmp, opts.out)
    return Report(path, opts.out, cfg.family, int(manifest["step"]), n, (path / "tokenizer").is_dir(), opts.dtype,
                  diff)


def render(r: Report) -> str:
    hf = _lm_class(r.family)
    files = ", ".join(sorted(f.name for f in r.out.iterdir()))
    check = ("not verified (verify=false)" if r.max_abs_diff is None else
             f"verified: transformers loads it with no missing/unexpected keys, max |Δlogits| = {r.max_abs_diff:.3g}"
             f" ({r.dtype} forward vs ours in fp32)")
    tok = "" if r.tokenizer else " (the checkpoint has no tokenizer: none written)"
    return (f"exported {r.checkpoint} (step {r.step}) as {hf} to {r.out}: {r.n_tensors} tensors in {r.dtype}; "
            f"{check}\nfiles: {files}{tok}")


EXIT_CODES = (((ConfigError, ModelConfigError, OSError), EXIT_BAD_INPUT),  # bad input, or an unwritable out
              (VerifyError, EXIT_FAILED))


def main(argv: list[str] | None = None) -> int:
    """The command line: print the report and return 0; one error line and 2 (bad input) or 1."""
    return run_tool(__doc__, argv, lambda args: render(export(parse_args(args))), EXIT_CODES)


if __name__ == "__main__":
    sys.exit(main())

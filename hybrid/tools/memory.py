"""Will it fit? Each rank's memory for a training config, before anything is launched.

    hybrid-memory model=gpt-1b parallel=tp2pp4 train.micro_batch_size=4
    hybrid-memory model=gpt-350m parallel.zero=1 train.recompute=full --world 8 --memory 3GiB --device cpu

Any override `python -m hybrid.train` takes; `--world N` (default: tp·pp·dp, dp 1 when unset), `--vocab N`
(default: model.vocab_size, else GPT-2's 50257), `--device cpu|cuda` (default: cuda when a GPU is visible),
`--memory SIZE` (bytes, or with KiB/MiB/GiB; default: the GPU's memory, or on CPU this machine's memory
shared by the ranks of one node). Prints, per pipeline stage (its first TP rank: the others differ only in
vocabulary padding), parameters, gradients, optimizer state, activations as the schedule holds them and
buffers, their total, whether the largest fits, and the largest micro batch that would. The estimate is
`hybrid.memory`'s; the process's own overhead (the CUDA context, Python and torch) is not in it. Bad input
is one `hybrid: error: ...` line and exit status 2.
"""

from __future__ import annotations

import copy
import re
import sys
from typing import TYPE_CHECKING, Any, Optional

import torch

from hybrid.cli import EXIT_BAD_INPUT, UsageError, run_tool
from hybrid.config import ConfigError, compose_config
from hybrid.memory import default_memory, largest_micro_batch, meta_stages, micro_of, stage_estimates, training_schedule
from hybrid.overrides import App, check
from hybrid.parallel.context import Layout
from hybrid.record.metrics import format_bytes
from hybrid.validation import validate

if TYPE_CHECKING:
    from hybrid.config import Config

UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
         "gb": 10**9}
FLAGS = ("--world", "--vocab", "--device", "--memory")
PRECISIONS = {"fp32": "fp32 weights and activations",
              "bf16_params": "bf16 weights and activations, fp32 main weights and gradients"}
"""How the estimate counts `train.precision` (autocast's bf16 is counted as fp32: an upper bound)."""


def parse_size(text: str) -> int:
    """'24GiB', '3.5 GB', '1000000' → bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise UsageError(f"--memory {text!r} is not a size (e.g. 24GiB, 80GB, 1000000)")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def split_flags(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """(Hydra overrides, {flag: value})."""
    words, flags = list(argv), {}
    for flag in FLAGS:
        if flag in words:
            i = words.index(flag)
            if i + 1 >= len(words):
                raise UsageError(f"{flag} needs a value")
            flags[flag] = words.pop(i + 1)
            words.pop(i)
    bad = [w for w in words if w.startswith("-")]
    if bad:
        raise UsageError(f"unknown flag {bad[0]}; flags: {', '.join(FLAGS)}, the rest are config overrides")
    return words, flags


def report(cfg: Config, vocab: int, layout: Layout, device_type: str, memory: int) -> list[str]:
    """The table and the verdict."""
    from hybrid.plan.balance import resolve
    from hybrid.trainer import build_chunks

    t, p = cfg.train, cfg.parallel
    balance = resolve(cfg, vocab, device_type)  # parallel.stage_layers=auto: the split a run would take
    chunks = meta_stages(layout, lambda ctx: build_chunks(cfg, vocab, ctx))
    stages = stage_estimates(cfg, layout, chunks, device_type)
    schedule = training_schedule(cfg, layout, chunks, micro_of(cfg, device_type)).label if layout.pp > 1 else ""
    counted = PRECISIONS.get(t.precision, PRECISIONS["fp32"])
    cp = f" cp{layout.cp} ({p.cp_comm}: seq {cfg.data.seq_len // layout.cp} a rank)" if layout.cp > 1 else ""
    lines = [f"memory per rank: {cfg.model.name}, tp{layout.tp}{cp} pp{layout.pp} dp{layout.dp}, micro batch "
             f"{t.micro_batch_size} × seq {cfg.data.seq_len}, {schedule or 'one stage'}, "
             f"zero {p.zero}, recompute {t.recompute}, {device_type} ({counted})"] + ([balance] if balance else []) + [
             f"{'stage':>5} {'params':>11} {'grads':>11} {'optimizer':>11} {'activations':>12} {'buffers':>11} "
             f"{'total':>11}"]
    for i, e in enumerate(stages):
        lines.append(f"{i:>5} " + " ".join(f"{format_bytes(x):>11}" for x in (e.params, e.grads, e.optimizer))
                     + f" {format_bytes(e.activations):>12} {format_bytes(e.buffers):>11} {format_bytes(e.total):>11}")
    worst = max(e.total for e in stages)
    verdict = "fits" if worst <= memory else "does not fit"
    largest = largest_micro_batch(cfg, layout, chunks, device_type, memory)
    lines.append(f"largest rank: {format_bytes(worst)} of {format_bytes(memory)}: {verdict}; largest micro batch "
                 f"that fits: {largest if largest else 'none, not even 1'}")
    return lines + (zero_advice(cfg, layout, chunks, device_type, memory) if worst > memory else [])


def zero_advice(cfg: Config, layout: Layout, chunks: list[Any], device_type: str, memory: int) -> list[str]:
    """When the run does not fit: the largest rank under each higher ZeRO stage the run allows, up to the first
    that fits (ZeRO shards over the DP ranks: none with one)."""
    lines: list[str] = []
    for zero in range(cfg.parallel.zero + 1, 4 if layout.cp * layout.dp > 1 else 0):
        other = copy.deepcopy(cfg)
        other.parallel.zero = zero
        try:
            validate(other, layout.world)
        except ConfigError:
            continue
        worst = max(e.total for e in stage_estimates(other, layout, chunks, device_type))
        fits = worst <= memory
        lines.append(f"with parallel.zero={zero}: {format_bytes(worst)}: {'fits' if fits else 'does not fit'}")
        if fits:
            break
    return lines


def body(argv: list[str]) -> str:
    overrides, flags = split_flags(argv)
    check(overrides, App("hybrid.train", None))  # a bad override or group option: one readable line
    try:
        cfg = compose_config(overrides)
        p = cfg.parallel
        world = int(flags.get("--world", p.tp * p.pp * (p.dp or 1)))
        layout = validate(cfg, world)
        vocab = int(flags.get("--vocab", cfg.model.vocab_size or 50257))
    except ValueError as e:
        raise UsageError(str(e)) from None
    device_type = flags.get("--device", "cuda" if torch.cuda.is_available() else "cpu")
    if device_type not in ("cpu", "cuda"):
        raise UsageError(f"--device {device_type!r} is not cpu or cuda")
    memory = parse_size(flags["--memory"]) if "--memory" in flags else default_memory(device_type,
                                                                                     layout.ranks_per_node)
    return "\n".join(report(cfg, vocab, layout, device_type, memory))


def main(argv: Optional[list[str]] = None) -> int:
    return run_tool(__doc__, argv, body, ((UsageError, EXIT_BAD_INPUT), (ConfigError, EXIT_BAD_INPUT)))


if __name__ == "__main__":
    sys.exit(main())

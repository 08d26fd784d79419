"""Parameter counts and model FLOPs/token of every `configs/model` config, counted against the formula.

    PYTHONPATH=. python -m hybrid.bench.model_size [--seq-len S] [--models gpt-1b llama-1b]

Each model is built whole (tp=1, one stage) on the meta device, so no weights are allocated:
the counted parameters are the real module's (a tied head counted once). The analytic count is
`hybrid.model.analytic_param_count`; FLOPs/token = 6N + 12·L·h·s (`hybrid.record.metrics.model_flops_per_token`).
The vocabulary is `model.vocab_size`, or the default BPE's `data.vocab_size` where the config leaves it
to the tokenizer (the tiny models); it is padded to a multiple of `make_vocab_size_divisible_by`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from hybrid.config import CONFIG_DIR, ModelConfig, compose_config
from hybrid.model import analytic_param_count, build_model
from hybrid.record.metrics import format_count, model_flops_per_token


def model_names() -> list[str]:
    """Every config of the `model` group, by file name."""
    return sorted(p.stem for p in (Path(CONFIG_DIR) / "model").glob("*.yaml"))


def counted_params(cfg: ModelConfig, vocab: int) -> int:
    """Parameters of the whole model built on the meta device (shapes only, nothing allocated)."""
    with torch.device("meta"):
        model = build_model(cfg, vocab)
    return sum(p.numel() for p in model.parameters())


def size_row(name: str, seq_len: Optional[int]) -> dict[str, Any]:
    """Counted and analytic parameters and FLOPs/token of config `name` at `seq_len` (default: its max)."""
    m = compose_config([f"model={name}"])
    cfg, vocab = m.model, m.model.vocab_size or m.data.vocab_size
    s = seq_len or cfg.max_seq_len
    n, analytic = counted_params(cfg, vocab), analytic_param_count(cfg, vocab)
    flops = model_flops_per_token(n, cfg.n_layers, cfg.hidden, s)
    analytic_flops = 6.0 * analytic + 12.0 * cfg.n_layers * cfg.hidden * s
    return {"model": name, "family": cfg.family, "layers": cfg.n_layers, "hidden": cfg.hidden, "vocab": vocab,
            "seq_len": s, "params": n, "analytic": analytic, "flops_per_token": flops,
            "analytic_flops": analytic_flops, "match": n == analytic and flops == analytic_flops}


def table(rows: list[dict[str, Any]]) -> str:
    """One line per model: shape, counted vs analytic parameters, GFLOP/token and the match flag."""
    lines = ["model      | family | L  | h    | vocab  | seq  | params counted      | analytic      | "
             "GFLOP/token | match",
             "-----------|--------|----|------|--------|------|---------------------|---------------|"
             "-------------|------"]
    for r in rows:
        counted = f"{r['params']} ({format_count(r['params'])})"
        lines.append(f"{r['model']:10s} | {r['family']:6s} | {r['layers']:2d} | {r['hidden']:4d} | {r['vocab']:6d} | "
                     f"{r['seq_len']:4d} | {counted:19s} | {r['analytic']:13d} | {r['flops_per_token'] / 1e9:11.4f} | "
                     f"{r['match']}")
    return "\n".join(lines)


def run(models: Sequence[str], seq_len: Optional[int], out: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Print the table for `models`; returns its rows."""
    rows = [size_row(name, seq_len) for name in models]
    out(table(rows))
    out("FLOPs/token = 6N + 12·L·h·s (training: forward + backward), N = the counted parameters; "
        "match = counted N and FLOPs equal the analytic ones exactly")
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hybrid.bench.model_size", description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=None, help="sequence length s of the attention term "
                   "(default: each model's max_seq_len)")
    p.add_argument("--models", nargs="+", default=None, help="configs/model names (default: all)")
    args = p.parse_args(argv)
    known = model_names()
    unknown = [m for m in args.models or [] if m not in known]
    if unknown:
        p.error(f"unknown model config(s) {', '.join(unknown)}; known: {', '.join(known)}")
    if args.seq_len is not None and args.seq_len < 1:
        p.error("--seq-len must be >= 1")
    rows = run(args.models or known, args.seq_len)
    return 0 if all(r["match"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

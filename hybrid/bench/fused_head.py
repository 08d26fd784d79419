"""What the fused head (`train.fused_head`) saves on this CPU: peak memory and time of the last stage's head and
loss, forward and backward, fused against unfused.

    OMP_NUM_THREADS=2 PYTHONPATH=. python -m hybrid.bench.fused_head [--model gpt-125m] [--vocab 0] [--batch 8]
        [--seq 1024] [--chunk 4096] [--rounds 4] [--threads 2]

One process builds the model's last pipeline part without layers — the final norm and the head over the padded
vocabulary (gpt-125m: hidden 768, 50,257 tokens padded to 50,304) — and runs it on the same hidden states and
targets both ways: unfused (`column_linear` + `vocab_parallel_cross_entropy`: the whole fp32 logits) and fused
(`hybrid.parallel.tp.fused_head`, `--chunk` tokens at a time). The parameters' gradient buffers exist before, as in
training. Round 0 measures each side's peak of CPU tensor memory (`testing.activations.tracked_peak`, the
profiler's allocation records) beside the estimate's (`hybrid.memory`: the head's kept tensors + its transient);
rounds 1.. time forward + backward, alternating the order (AB BA AB …): each side's median wall and the median of
the per-round ratios fused / unfused. The two sides' losses and gradients must agree within fp32 rounding.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from hybrid.bench.common import check_models, reproduce_command, table, timed
from hybrid.config import compose_config
from hybrid.memory import loss_columns
from hybrid.memory_terms import Micro, ends_bytes, head_transient
from hybrid.model import build_model
from hybrid.record.metrics import format_bytes
from hybrid.testing.activations import tracked_peak

MODULE = "hybrid.bench.fused_head"
SIDES = ("unfused", "fused")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-125m", help="a configs/model name (its hidden size and vocabulary)")
    p.add_argument("--vocab", type=int, default=0, help="vocabulary (0: the model's, else GPT-2's 50,257)")
    p.add_argument("--batch", type=int, default=8, help="sequences per microbatch")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--chunk", type=int, default=4096, help="tokens per chunk of the fused head (train.head_chunk)")
    p.add_argument("--rounds", type=int, default=4, help="timed rounds, each side once per round")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    return p


class Head:
    """The last part without layers, its inputs and gradient buffers: `run(side)` is one forward and backward."""

    def __init__(self, args: argparse.Namespace) -> None:
        cfg = compose_config([f"model={args.model}"]).model
        self.cfg, vocab = cfg, args.vocab or cfg.vocab_size or 50257
        self.model = build_model(cfg, vocab, layers=range(cfg.n_layers, cfg.n_layers), pre=False, post=True)
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(args.batch, args.seq, cfg.hidden, generator=gen).requires_grad_()
        self.labels = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
        self.chunk = args.chunk
        for p in (self.x, *self.model.parameters()):
            p.grad = torch.zeros_like(p)  # as the DP buckets hold them in training

    def run(self, side: str) -> float:
        self.model.set_fused_head("on" if side == "fused" else "off", self.chunk)
        for p in (self.x, *self.model.parameters()):
            p.grad.zero_()
        loss = self.model(self.x, self.labels)
        loss.backward()
        return float(loss.detach())

    def grads(self) -> list[torch.Tensor]:
        return [p.grad.clone() for p in (self.x, *self.model.parameters())]

    def estimate(self, side: str, b: int, s: int) -> int:
        """The estimate's head: what it keeps (`ends_bytes` of a last part) and its transient."""
        m = Micro(b, s, head_chunk=self.chunk if side == "fused" else 0)
        vocab = loss_columns(self.model, 1)
        return ends_bytes(self.cfg, m, vocab, False, True) + head_transient(self.cfg, m, vocab)


def wall(run: Callable[[], Any]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure(args: argparse.Namespace, head: Head) -> dict[str, Any]:
    """Round 0: each side's peak, loss and gradients; then the timed rounds, alternating the order."""
    out: dict[str, Any] = {"peak": {}, "loss": {}, "grads": {}, "walls": {s: [] for s in SIDES}}
    for side in SIDES:
        out["peak"][side] = tracked_peak(lambda s=side: out["loss"].__setitem__(s, head.run(s)))
        out["grads"][side] = head.grads()
    for i in range(args.rounds):
        for side in SIDES if i % 2 == 0 else reversed(SIDES):
            out["walls"][side].append(wall(lambda s=side: head.run(s)))
    return out


def agree(out: dict[str, Any]) -> bool:
    """Loss and every gradient within fp32 rounding (rtol 1e-4, atol 1e-6: 8 K tokens' sums in another order)."""
    pairs = [(torch.tensor(out["loss"]["fused"]), torch.tensor(out["loss"]["unfused"])),
             *zip(out["grads"]["fused"], out["grads"]["unfused"])]
    return all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in pairs)


def report(args: argparse.Namespace, head: Head, out: dict[str, Any]) -> list[str]:
    ratios = [f / u for f, u in zip(out["walls"]["fused"], out["walls"]["unfused"])]
    rows = [[side, format_bytes(out["peak"][side]), format_bytes(head.estimate(side, args.batch, args.seq)),
             f"{statistics.median(out['walls'][side]):.2f}"] for side in SIDES]
    peak = out["peak"]["fused"] / out["peak"]["unfused"]
    return [f"{args.model}: {args.batch} × {args.seq} tokens, hidden {head.cfg.hidden}, vocabulary "
            f"{head.model.padded_vocab} (padded), fused chunks of {args.chunk} tokens, {args.threads} threads", "",
            *table(["head", "peak", "estimate", "median s"], rows), "",
            f"peak fused / unfused {peak:.3f}×; time fused / unfused: median {statistics.median(ratios):.3f}× "
            f"(rounds {', '.join(f'{r:.3f}' for r in ratios)}); losses {out['loss']['unfused']:.6f} vs "
            f"{out['loss']['fused']:.6f}, gradients agree: {agree(out)}"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    check_models(p, args.model)
    if min(args.batch, args.seq, args.chunk, args.rounds, args.threads) < 1 or args.vocab < 0:
        p.error("--batch, --seq, --chunk, --rounds and --threads must be >= 1, --vocab >= 0")
    torch.set_num_threads(args.threads)

    def body() -> dict[str, Any]:
        head = Head(args)
        out = measure(args, head)
        print("\n".join(report(args, head, out)))
        return out

    timed(MODULE, reproduce_command(MODULE, p, args), print, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())

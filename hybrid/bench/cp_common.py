"""What the context-parallelism benchmarks share: the model and sequence they run."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, Optional

from hybrid.bench.common import check_models, parse_with_quick


def add_shape(p: argparse.ArgumentParser, layers: int = 4) -> None:
    """--model cut to --layers layers on --batch sequences of --seq tokens; --timeout per set of ranks."""
    p.add_argument("--model", default="gpt-tiny", help="a configs/model name")
    p.add_argument("--layers", type=int, default=layers, help="layers of the model")
    p.add_argument("--seq", type=int, default=8192, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences per microbatch")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a set of ranks is killed")


def parse(p: argparse.ArgumentParser, argv: Optional[Sequence[str]], quick: dict[str, Any]) -> argparse.Namespace:
    """`argv` through `p` (with `--quick`'s values as defaults), the model checked to exist."""
    args = parse_with_quick(p, argv, quick)
    check_models(p, args.model)
    return args

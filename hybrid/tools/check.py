"""Check a training command line once, before launching its ranks.

    hybrid-check --world 8 model=gpt-1b parallel=tp2pp4          # then: torchrun --nproc_per_node 8 ...
    hybrid-check --world 16 --ranks-per-node 8 -m train.lr=1e-3,3e-3 parallel=tp2pp2

The rest of the command line is `python -m hybrid.train`'s (overrides, Hydra's flags, `-m` sweeps: every
job). One process composes what the ranks would compose and runs the same validation for the world the
launch will start (`--world N`, default: the layout's own tp·pp·dp with dp 1 when unset; `--ranks-per-node
M`, default: the world on one node), and loads `data.tokenizer` when one is given. Exit status 0 and one
`hybrid: config ok: ...` line on stdout when the ranks would start; else the one `hybrid: error: ...` line
the ranks would print, once, and exit status 2 (not one line per rank followed by torchrun's failure
summary). launch/local.sh, multinode.sh and slurm.sbatch run it before torchrun. What needs the data
itself or a checkpoint (the vocabulary, `checkpoint.resume`'s checkpoint) is still checked by the ranks.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from hybrid.cli import EXIT_BAD_INPUT, UsageError, run_tool
from hybrid.config import ConfigError
from hybrid.overrides import App, check, hydra_args
from hybrid.validation import validate

if TYPE_CHECKING:
    from hybrid.config import Config

FLAGS = ("--world", "--ranks-per-node")


def leading_flags(argv: list[str]) -> tuple[dict[str, int], list[str]]:
    """({flag: value} of the FLAGS that open `argv`, the rest: hybrid.train's own command line)."""
    flags: dict[str, int] = {}
    while argv and argv[0] in FLAGS:
        if len(argv) < 2 or not argv[1].isdigit() or int(argv[1]) < 1:
            raise UsageError(f"{argv[0]} needs a positive whole number, got {argv[1] if len(argv) > 1 else 'none'}")
        flags[argv[0]], argv = int(argv[1]), argv[2:]
    return flags, argv[1:] if argv[:1] == ["--"] else argv


def world_of(cfg: Config, flags: dict[str, int]) -> int:
    """`--world`, else the layout's own size (dp 1 when unset)."""
    p = cfg.parallel
    return flags.get("--world", p.tp * p.pp * (p.dp or 1))


def check_job(cfg: Config, flags: dict[str, int], seen: list[str]) -> None:
    """Validate one job's config as the ranks would (`validation.validate`), then its tokenizer folder."""
    from hybrid.data.tokenize import load_tokenizer, resolve_tokenizer

    world = world_of(cfg, flags)
    layout = validate(cfg, world, flags.get("--ranks-per-node", world))
    folder = resolve_tokenizer(cfg.data.tokenizer, cfg.model.init_from)
    if folder is not None:
        load_tokenizer(Path(folder))
    seen.append(f"world {world} = {layout.describe()}")


def body(argv: list[str]) -> str:
    """The one `config ok` line, or a ConfigError (one line, exit 2): what the ranks would refuse."""
    flags, rest = leading_flags(list(argv))
    if hydra_args(rest) is None:  # hybrid.train would stop in Hydra's own parser
        raise UsageError(f"{' '.join(rest)!r} is not a command line hybrid.train parses (Hydra's flags, e.g. -m, go "
                         "before the overrides; python -m hybrid.train --help)")
    seen: list[str] = []
    check(rest, App("hybrid.train", None), lambda cfg: check_job(cfg, flags, seen))  # every job of a sweep
    jobs = f" ({len(seen)} jobs)" if len(seen) > 1 else ""
    return f"hybrid: config ok: {seen[0] if seen else 'nothing to compose'}{jobs}"


def refusal(argv: Sequence[str], world: int = 1) -> Optional[str]:
    """The ConfigError message `hybrid.train` refuses `argv` with on `world` ranks of one node before its data
    step, found in this process: the pre-check's composition (`hybrid.overrides.check` with hybrid.train's App,
    as `hybrid.cli.precheck` calls it: Hydra's errors, keys the schema lacks), then `validate` on each composed
    job, as `hybrid.train.run` calls it. None when both accept it."""
    try:
        check(list(argv), App("hybrid.train", None), lambda cfg: validate(cfg, world, world))
    except ConfigError as e:
        return str(e)
    return None


def main(argv: Optional[list[str]] = None) -> int:
    """`hybrid-check`'s exit status: 0 when the ranks would start, 2 on bad input (no process group, no collective)."""
    return run_tool(__doc__, argv, body, ((ConfigError, EXIT_BAD_INPUT),))


if __name__ == "__main__":
    sys.exit(main())

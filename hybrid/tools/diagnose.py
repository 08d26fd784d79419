"""Report the cluster as the trainer sees it: nodes, ranks, devices, versions, hosts (NUMA, NICs,
`nvidia-smi topo -m`), the launcher's environment, the measured p2p bandwidth between every pair of
ranks, warnings about a layout on those links, and the TP size the links suggest.

    torchrun --nproc_per_node 8 -m hybrid.tools.diagnose parallel=tp2pp2 --json diag.json --png bw.png
    torchrun --nproc_per_node 4 -m hybrid.tools.diagnose parallel.ranks_per_node=2    # 2 emulated nodes
    python -m hybrid.tools.diagnose                                                   # one process

Options:
  --size BYTES   bytes per transfer; K/M/G = KiB/MiB/GiB, KB/MB/GB decimal (default 16M on GPU, 4M on CPU)
  --iters N      timed ping-pongs per pair; the median one counts (default 10)
  --warmup N     untimed ping-pongs per pair before them (default 1)
  --serial       one pair at a time (default: tournament rounds, every rank in one pair per round)
  --json PATH    also write the report as JSON (written by rank 0)
  --png PATH     also write the bandwidth matrix as a heat map
  --timeout S    seconds a collective may take before the run fails (default 300; a process group
                 that is already initialised keeps its own)
  --strict       exit status 1 when there is a warning
  --nccl         also print the NCCL settings advised for the machines found, each with its reason
                 (debug output for one run, P2P level, NVLS, IB adapters, socket interface, RoCE GID)
Every key=value word is a hybrid.train override (parallel=tp2pp2, parallel.tp=2, parallel.ranks_per_node=2,
compression=powersgd, …): the layout the warnings judge, composed and validated as hybrid.train does.
Exit status: 0 report written, 1 warnings under --strict, 2 bad input (one `hybrid: error:` line per rank).
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional, TextIO

import torch
import torch.distributed as dist

from hybrid import cli
from hybrid.cli import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, UsageError, env_int, error_line, say
from hybrid.config import Config, ConfigError, compose_config
from hybrid.diagnostics import DiagnosticsError
from hybrid.diagnostics import advice as A
from hybrid.diagnostics.heatmap import write_heatmap
from hybrid.diagnostics.nccl_advice import advise
from hybrid.diagnostics.pairwise import measure
from hybrid.diagnostics.report import Probe, Report, render, size_text
from hybrid.diagnostics.system import Facts, gather_facts, node_size, rank_facts
from hybrid.parallel.context import Layout, LayoutError
from hybrid.sync import bytes_cut_by
from hybrid.validation import layout_of, validate

KNOWN_ERRORS = (ConfigError, DiagnosticsError, LayoutError)
UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30,
         "kb": 10**3, "mb": 10**6, "gb": 10**9}
MAX_SIZE = 2**34
DEFAULT_SIZE = {"cuda": 16 * 2**20, "cpu": 4 * 2**20}


@dataclass
class Options:
    size: Optional[int] = None  # None: DEFAULT_SIZE of the device
    iters: int = 10
    warmup: int = 1
    serial: bool = False
    json: Optional[str] = None
    png: Optional[str] = None
    timeout: float = 300.0
    strict: bool = False
    nccl: bool = False
    overrides: list[str] = field(default_factory=list)


SWITCHES = ("--serial", "--strict", "--nccl")
VALUED = ("--size", "--iters", "--warmup", "--json", "--png", "--timeout")


def parse_size(text: str) -> int:
    """`16M`, `64KiB`, `1000000`, `1 GB` → bytes; UsageError when it is not a size in [1 B, 16 GiB]."""
    found = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    unit = found.group(2).lower() if found else None
    if found is None or unit not in UNITS:
        raise UsageError(f"--size must be a byte count such as 4M, 64KiB or 1000000, got {text!r}")
    n = int(found.group(1)) * UNITS[unit]
    if not 1 <= n <= MAX_SIZE:
        raise UsageError(f"--size must be between 1 byte and {size_text(MAX_SIZE)}, got {text!r}")
    return n


def _number(name: str, text: str, low: float, kind: type = int) -> float:
    """`text` as `kind` (int or float) no smaller than `low` (exclusive for floats), else UsageError."""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value < low or (kind is float and value <= low):
        raise UsageError(f"{name} must be {'an integer' if kind is int else 'a number'} "
                         f"{'>=' if kind is int else '>'} {low:g}, got {text!r}")
    return value


def _set(opts: Options, name: str, value: str) -> None:
    if name == "--size":
        opts.size = parse_size(value)
    elif name in ("--iters", "--warmup"):
        setattr(opts, name[2:], int(_number(name, value, 1 if name == "--iters" else 0)))
    elif name == "--timeout":
        opts.timeout = _number(name, value, 0.0, float)
    elif not value:
        raise UsageError(f"{name} needs a file name")
    else:
        setattr(opts, name[2:], value)


def parse_args(argv: list[str]) -> Options:
    """Options and overrides from the words of the command line; UsageError on anything else."""
    opts, words = Options(), iter(argv)
    for word in words:
        name, eq, value = word.partition("=")
        if word.startswith("--") and name in SWITCHES and not eq:
            setattr(opts, name[2:], True)
        elif word.startswith("--") and name in VALUED:
            value = value if eq else next(words, None)
            if value is None or (not eq and value.startswith("--")):
                raise UsageError(f"{name} needs a value")
            _set(opts, name, value)
        elif name in SWITCHES:
            raise UsageError(f"{name} takes no value")
        elif word.startswith("-"):
            raise UsageError(f"unknown option {name!r}; expected one of {', '.join(SWITCHES + VALUED)} or -h")
        elif eq and name:
            opts.overrides.append(word)
        else:
            raise UsageError(f"expected an option or a key=value override, got {word!r}")
    return opts


def compose(overrides: list[str]) -> Config:
    """The config of `overrides`, as hybrid.train composes it; a Hydra error is one ConfigError line."""
    try:
        return compose_config(overrides)
    except Exception as e:  # noqa: BLE001  (any composition failure is bad input: Hydra's many kinds)
        raise ConfigError(cli.one_line(e)) from None


def wants_cuda(cfg: Config) -> bool:
    """train.device as hybrid.train reads it: auto = CUDA when available; cuda without CUDA is bad input."""
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but CUDA is not available")
    return cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())


def init_group(timeout_s: float, cuda: bool) -> bool:
    """Under torchrun, create the default group (NCCL on cuda:LOCAL_RANK with `cuda`, else gloo) with
    `timeout_s` on every collective; True if this call created it (and must destroy it)."""
    if dist.is_initialized() or "RANK" not in os.environ:
        return False
    timeout = timedelta(seconds=timeout_s)
    if not cuda:
        dist.init_process_group("gloo", timeout=timeout)
        return True
    device = torch.device("cuda", env_int("LOCAL_RANK", 0))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=timeout, device_id=device)  # bound device: barriers know it
    return True


def device_and_backend(cuda: bool) -> tuple[torch.device, str]:
    """The device the transfers use: the current CUDA device under an NCCL group (or in one process with
    `cuda`), else the CPU; and the group's backend ("none" without a group)."""
    backend = str(dist.get_backend()) if dist.is_initialized() else "none"
    cuda = "nccl" in backend if dist.is_initialized() else cuda
    return (torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")), backend


def resolve_layout(cfg: Config, facts: list[Facts]) -> tuple[Layout, str, list[A.Finding]]:
    """The layout of `cfg` on this world, validated as hybrid.train does; the source of the node size; a
    `config_refused` note when the layout fits but the rest of the config would not pass hybrid.train's
    checks. A layout that does not fit is a ConfigError."""
    world, p = len(facts), cfg.parallel
    hosts_size = node_size([f["node_key"] for f in facts])
    detected = hosts_size or env_int("LOCAL_WORLD_SIZE", world)
    source = (f"parallel.ranks_per_node={p.ranks_per_node}" if p.ranks_per_node else
              "hosts" if hosts_size else f"LOCAL_WORLD_SIZE={detected}")
    with warnings.catch_warnings():  # TP across nodes: reported as a finding, not a Python warning
        warnings.simplefilter("ignore")
        try:
            return validate(cfg, world, detected), source, []
        except ConfigError as e:
            refused = str(e)
        layout = layout_of(cfg, world, detected)
    return layout, source, [A.Finding("config_refused", f"the layout fits, but hybrid.train would refuse this "
                                      f"config: {refused}")]


def is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def diagnose(opts: Options, cfg: Config) -> Report:
    """Gather every rank's facts, check the layout, measure the matrix, judge it. Collective."""
    device, backend = device_and_backend(wants_cuda(cfg))
    first_local = os.environ.get("LOCAL_RANK", "0") == "0"
    facts = gather_facts(rank_facts(device, backend, with_host=first_local))
    layout, source, notes = resolve_layout(cfg, facts)
    probe = Probe(opts.size or DEFAULT_SIZE[device.type], opts.iters, opts.warmup, opts.serial)
    matrix = measure(probe.size, probe.iters, probe.warmup, device, probe.serial)
    method = bytes_cut_by(cfg)
    found = (notes + A.node_findings(layout, [f["hostname"] for f in facts])
             + A.version_findings([f["versions"] for f in facts])
             + A.findings(layout, matrix, method, zero=cfg.parallel.zero, zero_group=str(cfg.parallel.zero_group)))
    return Report(facts, layout, source, matrix, probe, method, found,
                  A.suggest(layout, matrix) if layout.world > 1 else None,
                  nccl=advise(facts, layout.tp, cfg.parallel.tp_overlap) if opts.nccl else None)


def write_outputs(rep: Report, opts: Options, out: TextIO) -> str:
    """Rank 0's part: print the report, write the JSON and the PNG; an error message, or ''."""
    out.write(render(rep) + "\n")
    out.flush()
    try:
        if opts.json:
            with open(opts.json, "w", encoding="utf-8") as f:
                json.dump(rep.to_json(), f, indent=1, allow_nan=False)
        if opts.png:
            write_heatmap(rep.matrix, opts.png, f"p2p bandwidth, {size_text(rep.probe.size)} ping-pong", "GB/s",
                          A.node_of(rep.layout))
    except OSError as e:
        return f"cannot write {e.filename}: {e.strerror or e}"
    return ""


def agreed(message: str) -> str:
    """Rank 0's message on every rank (`broadcast_object_list`), so every rank exits the same way."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return message
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def run(argv: Optional[list[str]] = None, out: Optional[TextIO] = None) -> int:
    """The tool on this process (inside an initialised group, or creating one under torchrun); rank 0
    writes the report to `out` (stdout). Returns the exit status; bad input is one line on stderr."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in cli.HELP for a in argv):
        if env_int("RANK", 0) == 0:
            print(__doc__.strip())
        return EXIT_OK
    owned, known, code = False, False, EXIT_BAD_INPUT
    try:
        opts = parse_args(argv)
        cfg = compose(opts.overrides)
        owned = init_group(opts.timeout, wants_cuda(cfg))
        rep = diagnose(opts, cfg)
        problem = agreed(write_outputs(rep, opts, out or sys.stdout) if is_writer() else "")
        if problem:
            raise DiagnosticsError(problem)
        code, known = (EXIT_FAILED if opts.strict and rep.warnings else EXIT_OK), True
    except KNOWN_ERRORS as e:  # the same error on every rank: parsing, config and layout are the same there
        say(error_line(str(e)))
        known = True
    finally:
        if owned:  # barrier only when every rank got here the known way (a bug on one rank must not wait)
            gc.collect()
            if known:
                dist.barrier()
            dist.destroy_process_group()
    return code


def main(argv: Optional[list[str]] = None) -> int:
    """`hybrid-diagnose` / `python -m hybrid.tools.diagnose`: `run`, and after bad input a short wait so
    torchrun does not cut the other ranks' error lines."""
    code = run(argv)
    if code == EXIT_BAD_INPUT:
        cli.wait_for_peers_to_report()
    return code


if __name__ == "__main__":
    sys.exit(main())

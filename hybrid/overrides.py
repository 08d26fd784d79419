"""Hydra's command line read before Hydra runs it: which flags it carries, which jobs a sweep makes,
the config each job composes to (with the user's search path), and keys the schema does not have.

`hybrid.cli.precheck` turns what goes wrong here into one line. The flags are parsed by Hydra's own
parser (the one `@hydra.main` uses) and the search path is built the way `@hydra.main` builds it
(`--config-path`, `--config-dir`, `hydra.searchpath=[...]`), so the check composes what the run
will compose. Both come from Hydra's `_internal` package (`get_args_parser`,
`create_automatic_config_search_path`, `Hydra.create_main_hydra2`, as `hydra.initialize_config_dir`
uses them); tests/unit/test_cli_hydra.py notices when a Hydra release moves them. Nothing here is
distributed: every rank checks its own command line, no collective.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import io
import os
import re
import typing
import warnings
from collections.abc import Callable, Iterator
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from hybrid.config import CONFIG_DIR, Config, ConfigError, register_configs

if typing.TYPE_CHECKING:
    from hydra.core.override_parser.types import Override

PRINT_AND_EXIT = ("help", "hydra_help", "shell_completion", "info", "experimental_rerun")
"""Hydra flags after which nothing is composed for a run: they print something and exit (or rerun a
pickled config), so a pre-check has nothing to add. `--version` exits inside the parser itself."""
MAX_JOBS = 64
"""Compositions a sweep's pre-check makes at most (each takes ~0.1 s)."""


class App(typing.NamedTuple):
    """Where `@hydra.main` sits, as Hydra sees it: the script's file when it runs as `__main__`
    (`python -m hybrid.train`), else its module (a console script); the other one is None."""

    module: Optional[str]
    file: Optional[str]

    @classmethod
    def of(cls, name: str, file: str) -> App:
        """From a module's `__name__` and `__file__`."""
        return cls(None, file) if name == "__main__" else cls(name, None)


def hydra_args(argv: list[str]) -> Optional[argparse.Namespace]:
    """`argv` parsed by Hydra's own argument parser; None when the parser would print and exit by itself
    (`--version`, a malformed flag): Hydra then reports it in its own words."""
    from hydra._internal.utils import get_args_parser

    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        try:
            return get_args_parser().parse_args(argv)
        except SystemExit:
            return None


def wants_check(args: Optional[argparse.Namespace]) -> bool:
    """Whether this command line composes a config for a run (or prints it: `--cfg`)."""
    return args is not None and not any(getattr(args, flag) for flag in PRINT_AND_EXIT)


def is_multirun(args: argparse.Namespace) -> bool:
    return bool(args.multirun) or any(o.replace(" ", "") == "hydra.mode=MULTIRUN" for o in args.overrides)


@contextlib.contextmanager
def hydra_for(args: argparse.Namespace, app: App) -> Iterator[None]:
    """A global Hydra with the search path `@hydra.main(config_path=CONFIG_DIR)` at `app` builds for `args`:
    `--config-path` replaces the primary folder (a relative one is relative to the app's file, or its
    package when it runs as a module), `--config-dir` is added before the schemas."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_automatic_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    path = create_automatic_config_search_path(app.file, app.module, args.config_path or CONFIG_DIR)
    if args.config_dir is not None:
        folder = os.path.abspath(args.config_dir)
        if not os.path.isdir(folder):
            raise ConfigError(f"--config-dir {folder} is not a folder")
        path.prepend("command-line", f"file://{folder}", anchor=SearchPathQuery(provider="schema"))
    GlobalHydra.instance().clear()
    try:
        Hydra.create_main_hydra2(task_name="precheck", config_search_path=path)
        yield
    finally:
        GlobalHydra.instance().clear()


def parse(overrides: list[str]) -> list[Override]:
    """Hydra's reading of the overrides; group globs (`model=glob(*)`) list the options of the global Hydra."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    hydra = GlobalHydra.instance().hydra
    return OverridesParser.create(config_loader=hydra.config_loader if hydra else None).parse_overrides(overrides)


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The override lists worth composing for a `--multirun` sweep: every swept key at its first value,
    then each other value once with the rest at their first (a typo in any value is found without the
    full product of the sweep); at most MAX_JOBS. Empty when a sweep is not a list (a sweeper plugin's
    interval or tag): that plugin reads it, not the basic sweeper."""
    from hydra.errors import HydraException

    try:
        parsed = parse(overrides)
    except HydraException as e:  # a malformed override or sweep
        raise ConfigError(one_line(e)) from None
    if any(o.is_sweep_override() and not o.is_discrete_sweep() for o in parsed):
        return []
    values = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
              else [str(o.input_line)] for o in parsed]
    first = [v[0] for v in values]
    others = [first[:i] + [v] + first[i + 1:] for i, vs in enumerate(values) for v in vs[1:]]
    return [first, *others][:MAX_JOBS]


def compose_job(args: argparse.Namespace, overrides: list[str]) -> DictConfig:
    """The job config (no `hydra` node) that Hydra composes for `overrides`, or ConfigError with Hydra's
    error as one line. Hydra's warnings (a search path entry that is not there) end that line; when
    composition succeeds they are dropped here, and the run's own composition gives them again."""
    from hydra import compose

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            return compose(config_name=args.config_name or "config", overrides=overrides)
        except Exception as e:  # noqa: BLE001  (any composition failure is bad input)
            raise ConfigError(one_line(e) + "".join(f" ({w.message})" for w in said)) from None


def one_line(e: BaseException) -> str:
    """Hydra's composition error as one line: its first line, the options it lists, its cause, and the
    nearest option or schema key to the one it could not find."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.startswith("See https://hydra.cc")]
    msg = lines[0] if lines else type(e).__name__
    override = getattr(e, "override", None)  # Hydra's OverrideParseException
    if isinstance(override, str):
        return f"could not parse the override '{override}': {lines[-1] if lines else msg}"
    options = [ln for ln in lines[1:] if not ln.startswith(("Config search path", "provider=", "Available"))]
    if "Could not find" in msg and options:
        options = [o for o in options if not o.endswith("_schema")]
        return f"{msg} (available: {', '.join(options)}){closest(msg, options)}"
    if msg.endswith("not found.") and len(lines) > 1:  # a primary config folder or module: where Hydra looked
        return f"{msg} {lines[1]}"
    if msg.endswith("while composing config:") and len(lines) > 1:
        msg = f"{msg.removesuffix(' raised while composing config:')}: {lines[1]}"
    cause = e.__cause__
    if cause is not None and str(cause).strip():
        msg += " " + str(cause).strip().splitlines()[0]
    if missing := re.match(r"Could not override '([^']+)'", msg):
        msg += suggestion(missing.group(1))
    return msg


def closest(msg: str, options: list[str]) -> str:
    """' — did you mean gpt-tiny?' for "Could not find 'model/gpt-tinny'" and the group's options."""
    wanted = re.search(r"Could not find '(?:[^'/]*/)*([^'/]+)'", msg)
    close = difflib.get_close_matches(wanted.group(1), options, n=1) if wanted else []
    return f" — did you mean {close[0]}?" if close else ""


def schema_fields(kind: type) -> dict[str, object]:
    """A schema dataclass's fields and their (resolved) types."""
    hints = typing.get_type_hints(kind)
    return {f.name: hints[f.name] for f in dataclasses.fields(kind)}


def unknown_keys(values: dict, kind: type = Config, path: str = "") -> Iterator[str]:
    """Dotted keys of a composed config that its schema lacks (added with `+key=` or `++key=`; Hydra
    accepts them and nothing would read them)."""
    fields = schema_fields(kind)
    for key, value in values.items():
        sub = fields.get(str(key))
        if sub is None:
            yield f"{path}{key}"
        elif isinstance(value, dict) and dataclasses.is_dataclass(sub):
            yield from unknown_keys(value, typing.cast(type, sub), f"{path}{key}.")


def suggestion(key: str, kind: type = Config) -> str:
    """For a dotted `key` the schema lacks: ' — did you mean train.lr?' (the closest key of the node where
    `key` leaves the schema), or the keys that node has when none is close."""
    done: list[str] = []
    for part in key.split("."):
        fields = schema_fields(kind)
        if part not in fields:
            close = difflib.get_close_matches(part, list(fields), n=1)
            if close:
                return f" — did you mean {'.'.join([*done, close[0]])}?"
            return f" — {'.'.join(done) or 'the config'} has: {', '.join(fields)}"
        done.append(part)
        if not dataclasses.is_dataclass(fields[part]):
            return ""
        kind = typing.cast(type, fields[part])
    return ""


def check_keys(cfg: DictConfig, overrides: list[str]) -> None:
    """ConfigError for the first key of `cfg` that the schema lacks, naming the override that added it."""
    for key in unknown_keys(typing.cast(dict, OmegaConf.to_container(cfg, resolve=False))):
        given = next((o for o in overrides if f"{o.lstrip('+~').partition('=')[0]}.".startswith(f"{key}.")), key)
        raise ConfigError(f"unknown key '{key}' in {given}: the schema has no such key{suggestion(key)}")


def check(argv: list[str], app: App, each: Optional[Callable[[DictConfig], None]] = None) -> None:
    """Compose what `argv` would run (each job of a sweep, see sweep_jobs) and check its keys, then hand each
    job's config to `each` (`hybrid-check` validates it there); raises Hydra's composition error or ConfigError.
    Flags that only print (PRINT_AND_EXIT) check nothing."""
    args = hydra_args(argv)
    if args is None or not wants_check(args):
        return
    with hydra_for(args, app):
        for overrides in sweep_jobs(args.overrides) if is_multirun(args) else [args.overrides]:
            cfg = compose_job(args, overrides)
            check_keys(cfg, overrides)
            if each is not None:
                each(cfg)

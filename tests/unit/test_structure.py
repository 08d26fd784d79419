"""The house rules of `hybrid/`, checked on the source (see docs/architecture.md, "Who imports whom").

- The import graph of `hybrid/` has no cycle, counting imports inside functions too.
- Every import follows the layering rules: each room may import only the rooms listed for it.
- Imports under `if TYPE_CHECKING:` never run, so they are left out of both rules above; beyond its
  layering rules, such a type-only import may name only a schema of `hybrid.config` (`ModelConfig`, …),
  so a lower room states in its hints which config it reads without depending on config at run time.
- No module outside `hybrid/bench/` is longer than `MAX_LINES`.
- No run of `DUP_LINES` significant lines appears twice in `hybrid/` (argparse boilerplate aside).
- docs/architecture.md's room table names every room of `RULES` once, and each row's "may import" cell
  names exactly the rooms `RULES` grants its rooms: the page cannot drift from the rules.
"""

from __future__ import annotations

import ast
import functools
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hybrid"
MAX_LINES = 350
DUP_LINES = 6

# room → the rooms it may import (a room is a module or a package prefix; its own prefix is always allowed).
# Lower layers first; the order of this table is the layering of docs/architecture.md.
RULES: dict[str, tuple[str, ...]] = {
    "hybrid.parallel": (),
    "hybrid.compression": ("hybrid.parallel.collectives",),
    "hybrid.model": ("hybrid.parallel.collectives", "hybrid.parallel.params", "hybrid.parallel.tp",
                     "hybrid.parallel.rng", "hybrid.parallel.recompute", "hybrid.parallel.pp.actions",
                     "hybrid.parallel.cp"),
    "hybrid.testing": (),
    "hybrid.config_run": (),
    "hybrid.config_sync": (),
    "hybrid.config": ("hybrid.config_run", "hybrid.config_sync"),
    "hybrid.lifeline": (),
    "hybrid.rdzv_timeout": (),
    "hybrid.sync": ("hybrid.config", "hybrid.parallel", "hybrid.compression", "hybrid.optim"),
    "hybrid.validation": ("hybrid.config", "hybrid.parallel", "hybrid.compression", "hybrid.model",
                          "hybrid.checkpoint.preempt", "hybrid.sync", "hybrid.comm_watch"),
    "hybrid.overrides": ("hybrid.config",),
    "hybrid.cli": ("hybrid.config", "hybrid.overrides"),
    "hybrid.data": ("hybrid.config",),
    "hybrid.sampler": (),
    "hybrid.record": (),  # the run record's package; its modules are rooms of their own below
    "hybrid.record.metrics": (),
    "hybrid.record.host_syncs": (),
    "hybrid.record.comm_env": (),
    "hybrid.record.error_budget": (),
    "hybrid.record.wandb_run": ("hybrid.record.metrics",),
    "hybrid.record.sinks": ("hybrid.record.metrics", "hybrid.record.wandb_run"),
    "hybrid.record.runlog": ("hybrid.config", "hybrid.record.metrics", "hybrid.record.sinks",
                             "hybrid.record.wandb_run"),
    "hybrid.optim": ("hybrid.parallel", "hybrid.compression"),
    "hybrid.optim.zeroone_adam": ("hybrid.parallel", "hybrid.compression", "hybrid.optim"),
    "hybrid.checkpoint": ("hybrid.config", "hybrid.parallel", "hybrid.model"),
    "hybrid.memory_terms": ("hybrid.model",),
    "hybrid.memory": ("hybrid.config", "hybrid.parallel", "hybrid.model", "hybrid.record.metrics", "hybrid.sync",
                      "hybrid.memory_terms"),
    "hybrid.record.profiling": ("hybrid.config", "hybrid.parallel"),
    "hybrid.nonfinite": ("hybrid.config", "hybrid.parallel", "hybrid.checkpoint"),
    "hybrid.record.comm_report": ("hybrid.parallel",),
    "hybrid.record.traffic_map": ("hybrid.parallel",),
    "hybrid.record.report": ("hybrid.config", "hybrid.parallel", "hybrid.record.metrics", "hybrid.record.comm_report",
                             "hybrid.record.error_budget", "hybrid.record.traffic_map", "hybrid.diagnostics"),
    "hybrid.comm_watch": ("hybrid.config", "hybrid.parallel", "hybrid.record.comm_report"),
    "hybrid.health": ("hybrid.config", "hybrid.parallel", "hybrid.comm_watch"),
    "hybrid.trainer": ("hybrid.config", "hybrid.parallel", "hybrid.model", "hybrid.data", "hybrid.sampler",
                       "hybrid.record.metrics", "hybrid.optim", "hybrid.checkpoint", "hybrid.record.profiling",
                       "hybrid.record.report", "hybrid.record.sinks", "hybrid.record.runlog", "hybrid.nonfinite",
                       "hybrid.health", "hybrid.memory", "hybrid.sync", "hybrid.record.comm_env"),
    "hybrid.startup": ("hybrid.cli", "hybrid.config", "hybrid.record.metrics", "hybrid.record.wandb_run",
                       "hybrid.record.runlog", "hybrid.checkpoint"),
    "hybrid.train": ("hybrid.cli", "hybrid.config", "hybrid.validation", "hybrid.parallel", "hybrid.sync",
                     "hybrid.model", "hybrid.data", "hybrid.record.metrics", "hybrid.checkpoint", "hybrid.trainer",
                     "hybrid.record.runlog", "hybrid.startup", "hybrid.memory", "hybrid.nonfinite", "hybrid.health",
                     "hybrid.plan", "hybrid.record.comm_env", "hybrid.comm_watch"),
    "hybrid.diagnostics": ("hybrid.parallel", "hybrid.record.comm_env"),
    "hybrid.plan": ("hybrid.config", "hybrid.overrides", "hybrid.parallel", "hybrid.model", "hybrid.memory",
                    "hybrid.testing"),
    "hybrid.tools": ("hybrid.cli", "hybrid.config", "hybrid.validation", "hybrid.parallel", "hybrid.model",
                     "hybrid.checkpoint", "hybrid.data", "hybrid.trainer", "hybrid.diagnostics", "hybrid.memory",
                     "hybrid.record.metrics", "hybrid.overrides", "hybrid.sync", "hybrid.plan"),
    "hybrid.bench": ("hybrid",),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The hybrid module `name` refers to (a submodule, or the package whose attribute it is)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking(node: ast.AST) -> bool:
    """`node` is an `if TYPE_CHECKING:` (or `if typing.TYPE_CHECKING:`) statement."""
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_names(module: str, type_only: bool = False) -> set[str]:
    """The dotted hybrid names (`hybrid.config.ModelConfig`) `module` imports at run time, anywhere in its
    body (functions included); with `type_only`, those it imports inside `if TYPE_CHECKING:` blocks instead."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    hints = {id(n) for block in ast.walk(tree) if _type_checking(block) for stmt in block.body for n in ast.walk(stmt)}
    out: set[str] = set()
    for node in ast.walk(tree):
        if (id(node) in hints) != type_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("hybrid")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("hybrid"):
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def imports_of(module: str, type_only: bool = False) -> set[str]:
    """Every hybrid module `module` imports at run time (with `type_only`: for type hints only)."""
    return {m for n in imported_names(module, type_only) if (m := _resolve(n)) and m != module}


@functools.cache
def graph() -> dict[str, set[str]]:
    """The run-time graph (TYPE_CHECKING imports left out), worked out by the first test that reads it, not at
    collection (~2 CPU-s in every xdist worker)."""
    return {m: imports_of(m) for m in MODULES}


def _schemas() -> set[str]:
    """`hybrid.config.<name>` of every schema: the config dataclasses and assigned classes named *Config (those of
    `hybrid.config_run` and `hybrid.config_sync`, re-exported by `hybrid.config`, under both names)."""
    names = set()
    rooms = ("hybrid.config", "hybrid.config_run", "hybrid.config_sync")
    for module in rooms:
        tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
        names |= {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        names |= {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
                  if isinstance(t, ast.Name)}
    return {f"{m}.{n}" for n in names if n.endswith("Config") for m in rooms}


SCHEMAS = _schemas()


def _under(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def room_of(module: str) -> str | None:
    rooms = [r for r in RULES if _under(module, r)]
    return max(rooms, key=len) if rooms else None


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` as a path [a, b, …, a], or [] when it is acyclic."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_the_checker_finds_cycles_and_accepts_dags() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycles() -> None:
    cycle = find_cycle(graph())
    assert not cycle, "import cycle: " + " → ".join(cycle)


def test_every_module_has_a_room() -> None:
    assert [m for m in MODULES if m != "hybrid" and room_of(m) is None] == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "hybrid"))
def test_imports_follow_the_layering(module: str) -> None:
    room = room_of(module)
    allowed = (room, *RULES[room])
    bad = sorted(n for n in graph()[module] if not any(_under(n, r) for r in allowed) and n != "hybrid")
    assert bad == [], f"{module} (room {room}) may import only {', '.join(allowed)}"


def test_type_checking_imports_stay_out_of_the_runtime_graph() -> None:
    assert "hybrid.config.ModelConfig" in SCHEMAS and "hybrid.config.CheckpointConfig" in SCHEMAS
    assert "hybrid.config.ConfigError" not in SCHEMAS
    assert "hybrid.config" in imports_of("hybrid.model.layers", type_only=True)
    assert "hybrid.config" not in graph()["hybrid.model.layers"]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "hybrid"))
def test_type_only_imports_go_beyond_the_layering_only_to_schemas(module: str) -> None:
    room = room_of(module)
    allowed = (room, *RULES[room])
    beyond = sorted(n for n in imported_names(module, type_only=True)
                    if (m := _resolve(n)) and m not in (module, "hybrid") and not any(_under(m, r) for r in allowed))
    bad = [n for n in beyond if n not in SCHEMAS]
    assert bad == [], f"{module} (room {room}) may name beyond {', '.join(allowed)} only hybrid.config's schemas"


def test_modules_stay_small() -> None:
    sizes = {m: len(p.read_text(encoding="utf-8").splitlines()) for m, p in MODULES.items()}
    big = {m: n for m, n in sizes.items() if n > MAX_LINES and room_of(m) != "hybrid.bench"}
    assert big == {}, f"modules over {MAX_LINES} lines"


_SKIP = re.compile(r"^(#|from |import |[\]\)\}\[\(\{,:]+$|\"\"\"|return$|else:$|try:$|pass$|@)")


def significant_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, stripped text) of the lines that carry logic: no blanks, comments, imports, docstring
    delimiters, lone punctuation or argparse boilerplate."""
    out = []
    for i, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = " ".join(raw.split())
        if line and not _SKIP.match(line) and ".add_argument(" not in line:
            out.append((i, line))
    return out


def duplicate_runs(files: dict[str, Path], n: int) -> list[str]:
    """Places where the same `n` significant lines stand twice (in one file or two)."""
    seen: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for name, path in files.items():
        lines = significant_lines(path)
        for k in range(len(lines) - n + 1):
            window = tuple(text for _, text in lines[k:k + n])
            seen[window].append(f"{name}:{lines[k][0]}")
    return [" ~ ".join(places) for places in seen.values() if len(places) > 1]


def test_the_duplicate_finder_sees_a_copy(tmp_path: Path) -> None:
    body = "".join(f"x{i} = f(x{i - 1})\n" for i in range(1, 8))
    (tmp_path / "a.py").write_text(body)
    (tmp_path / "b.py").write_text("y = 0\n" + body)
    assert len(duplicate_runs({"a": tmp_path / "a.py", "b": tmp_path / "b.py"}, DUP_LINES)) == 2


def test_no_copied_logic() -> None:
    assert duplicate_runs(MODULES, DUP_LINES) == []


# ---- docs/architecture.md's room table is held to RULES ----------------------------------------

ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _room(name: str) -> str | None:
    """A room as the page names it (`parallel/`, `config.py`) → its RULES key; None for what is no module."""
    key = "hybrid." + name.removesuffix("/").removesuffix(".py").replace("/", ".")
    return key if key in RULES else None


def table_rows() -> list[tuple[list[str], str]]:
    """Each row of the page's room table: its rooms (RULES keys) and its 'may import' cell."""
    lines = ARCHITECTURE.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| room |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = line.strip().strip("|").split(" | ")
        rooms = [r for r in map(_room, re.findall(r"`([^`]+)`", cells[0])) if r]
        rows.append((rooms, cells[-1]))
    return rows


def test_the_architecture_table_names_every_room_once() -> None:
    named = [room for rooms, _ in table_rows() for room in rooms]
    assert sorted(named) == sorted(RULES), "docs/architecture.md's room table and RULES name different rooms"


@pytest.mark.parametrize("row", range(len(table_rows())))
def test_the_architecture_table_says_what_each_room_may_import(row: int) -> None:
    """A row's 'may import' cell names exactly the rooms RULES lets its rooms import (`hybrid` = anything)."""
    rooms, cell = table_rows()[row]
    granted = {r for room in rooms for r in RULES[room]}
    allowed = {"anything"} if granted == {"hybrid"} else {r.removeprefix("hybrid.") for r in granted}
    known = {r.removeprefix("hybrid.") for r in (*RULES, *(x for v in RULES.values() for x in v))}
    named = {n for n in re.findall(r"`([^`]+)`", cell) if n in known} | ({"anything"} if "anything" in cell else set())
    assert named == allowed, f"docs/architecture.md, row of {', '.join(rooms)}"

"""The command line's edge (hybrid/cli.py): one error line, exit codes, Hydra's errors as one line.

The entry points themselves are run in tests/unit/test_config.py (hybrid.train), test_schedules.py
(the schedule tool), tests/dist/test_export.py and tests/e2e (torchrun).
"""

from __future__ import annotations

import pytest

from hybrid import cli
from hybrid.compression import CompressionError
from hybrid.config import ConfigError, compose_config
from hybrid.parallel.pp.schedules import ScheduleError

CODES = (((cli.UsageError, ScheduleError), cli.EXIT_BAD_INPUT), (RuntimeError, cli.EXIT_FAILED))


def test_error_line_names_the_rank_only_among_several(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert cli.error_line("x") == "hybrid: error: x"
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert cli.error_line("x") == "hybrid: error: x"
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert cli.error_line("x") == "[rank3] hybrid: error: x"


@pytest.mark.parametrize("error,code", [(cli.UsageError("bad key"), 2), (ScheduleError("bad sizes"), 2),
                                        (RuntimeError("verify failed"), 1)])
def test_run_tool_turns_known_errors_into_one_line_and_their_status(
        error: Exception, code: int, capsys: pytest.CaptureFixture[str]) -> None:
    def body(argv: list[str]) -> str:
        raise error

    assert cli.run_tool("doc", ["a=1"], body, CODES) == code
    out, err = capsys.readouterr()
    assert out == "" and err == f"hybrid: error: {error}\n"


def test_run_tool_prints_the_report_or_the_help_and_lets_bugs_raise(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run_tool("the doc\n", ["a=1"], lambda argv: f"report {argv}", CODES) == 0
    assert capsys.readouterr().out == "report ['a=1']\n"
    assert cli.run_tool("  the doc\n", ["a=1", "--help"], lambda argv: pytest.fail("ran"), CODES) == 0
    assert capsys.readouterr().out == "the doc\n"
    with pytest.raises(KeyError):
        cli.run_tool("doc", [], lambda argv: {}["x"], CODES)

    def compression(argv: list[str]) -> str:
        raise CompressionError("x")  # not a ConfigError: validation.validate translates it, a tool does not

    with pytest.raises(CompressionError):
        cli.run_tool("doc", [], compression)


def test_exit_on_error_ends_with_status_2_on_a_config_error(capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert cli.exit_on_error(lambda: 7) == 7

    def bad() -> None:
        raise ConfigError("train.lr must be > 0, got 0")

    with pytest.raises(SystemExit) as e:
        cli.exit_on_error(bad)
    assert e.value.code == cli.EXIT_BAD_INPUT
    assert capsys.readouterr().err == "hybrid: error: train.lr must be > 0, got 0\n"


@pytest.mark.parametrize("overrides,needle", [
    (["parallel=tp9"], "Could not find 'parallel/tp9' (available: dp, pp2,"),
    (["train.nope=1"], "Could not override 'train.nope'."),
    (["train.lr=abc"], "Error merging override train.lr=abc"),
])
def test_one_line_of_a_hydra_composition_error(overrides: list[str], needle: str) -> None:
    with pytest.raises(Exception) as e:
        compose_config(overrides)
    line = cli.one_line(e.value)
    assert "\n" not in line and needle in line, line

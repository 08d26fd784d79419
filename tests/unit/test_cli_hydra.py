"""`hybrid.cli.precheck` with Hydra's own flags and `hydra.*` overrides (hybrid/overrides.py).

- The pre-check composes with the run's search path: a user's config folder given with
  `hydra.searchpath=[file://…]` or `--config-dir` is found; without it the same group option is not.
- Hydra flags that run or show a config (`-m`/`--multirun`, `--cfg job`, `-cn`, `-cp`) keep the one-line
  errors; flags that only print (`--help`, `--hydra-help`, `--info`, `-sc`, `--version`) skip the check.
- A `--multirun` sweep composes each swept value once; its jobs are checked against Hydra's
  `BasicSweeper.split_arguments` (every job one of the sweep's, every value of the sweep in some job).
- Keys the schema lacks (`+train.foo=1`, `++model.hiden=3`, `train.lrr=1`) are one line naming the
  nearest key of that schema node (difflib), or that node's keys when none is close.
- The real entry point of `python -m hybrid.train` (forked): a user's model file from a search-path folder
  trains one step; a misspelt key is one line with the suggestion and exit status 2.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from hybrid import cli, overrides
from hybrid.config import CONFIG_DIR
from hybrid.testing.cli_runs import run_forked

ROOT = Path(__file__).resolve().parents[2]
MY_TINY = "name: my-tiny\nn_layers: 2\nhidden: 64\nn_heads: 2\nmax_seq_len: 64\n"
QUICK = ["data.seq_len=64", "data.max_chars=200000", "train.global_batch_size=4", "train.micro_batch_size=4",
         "train.eval_batches=1", "train.steps=1", "logging.wandb.mode=disabled", "logging.progress=false"]


@pytest.fixture
def user_configs(tmp_path: Path) -> Path:
    """A user's own config folder outside the package: model/my-tiny.yaml."""
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "my-tiny.yaml").write_text(MY_TINY)
    return tmp_path / "conf"


def refused(argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    """The one line precheck prints for `argv` (it must exit with status 2)."""
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as e:
        cli.precheck(argv)
    err = capsys.readouterr().err
    assert e.value.code == cli.EXIT_BAD_INPUT and err.count("\n") == 1 and err.startswith("hybrid: error: "), err
    return err.strip()


def test_a_search_path_folder_is_composed(user_configs: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    assert "Could not find 'model/my-tiny'" in refused(["model=my-tiny"], capsys, monkeypatch)
    cli.precheck([f"hydra.searchpath=[file://{user_configs}]", "model=my-tiny"])
    cli.precheck(["--config-dir", str(user_configs), "model=my-tiny", "--cfg", "job"])
    cli.precheck(["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled",
                  "hydra.run.dir=/tmp/x"])  # what rank > 0 adds to its command line
    line = refused(["hydra.searchpath=[file:///nonexistent/conf]", "model=my-tiny"], capsys, monkeypatch)
    assert "Could not find 'model/my-tiny'" in line and "/nonexistent/conf is not available" in line


@pytest.mark.parametrize("flags", [["-m"], ["--multirun"], ["--cfg", "job"], ["-cn", "config"], ["-cp", CONFIG_DIR],
                                   ["--config-name=config"], ["-m", "hydra.sweep.dir=/tmp/x"]])
def test_hydra_flags_keep_the_one_line_errors(flags: list[str], capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    line = refused([*flags, "model=gpt-tinny"], capsys, monkeypatch)
    assert "Could not find 'model/gpt-tinny'" in line and line.endswith("did you mean gpt-tiny?")


def test_a_missing_primary_config_is_one_line(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    assert "Cannot find primary config 'nope'" in refused(["-cn", "nope"], capsys, monkeypatch)
    assert "is not a folder" in refused(["-cd", "/nonexistent/conf"], capsys, monkeypatch)


def test_a_relative_config_path_starts_where_hydra_starts_it(capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Like Hydra: from train.py's folder under `python -m`, from its package for a console script
    (the checkout's `configs/` is a folder beside the package, not the module `hybrid.configs`, so only the
    first finds it)."""
    script = cli.App.of("__main__", str(ROOT / "hybrid" / "train.py"))
    cli.precheck(["-cp", "../configs", "--cfg", "job"], script)
    with pytest.raises(SystemExit):
        cli.precheck(["-cp", "nope"], script)
    assert f"config directory '{(ROOT / 'hybrid').resolve() / 'nope'}'" in capsys.readouterr().err
    line = refused(["-cp", "configs"], capsys, monkeypatch)  # the default App: the module hybrid.train
    assert "Primary config module 'hybrid.configs' not found" in line


@pytest.mark.parametrize("flags", [["--help"], ["-h"], ["--hydra-help"], ["--info"], ["--info", "defaults"],
                                   ["-sc", "install=bash"], ["--shell-completion", "query=bash"], ["--version"]])
def test_flags_that_only_print_skip_the_check(flags: list[str]) -> None:
    cli.precheck([*flags, "model=gpt-tinny"])  # no SystemExit: Hydra prints and exits by itself


@pytest.mark.parametrize("sweep,needle", [
    (["model=gpt-tiny,gpt-tinny"], "Could not find 'model/gpt-tinny'"),
    (["train.lr=1e-3,abc", "model=gpt-tiny"], "Error merging override train.lr=abc"),
    (["train.steps=range(1,3)", "+train.lrr=1,2"], "unknown key 'train.lrr' in +train.lrr=1"),
    (["train.lr=[1"], "could not parse the override 'train.lr=[1'"),
])
def test_a_sweep_with_a_bad_value_fails_at_once(sweep: list[str], needle: str, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    assert needle in refused(["-m", *sweep], capsys, monkeypatch)


def test_a_sweep_of_good_values_passes() -> None:
    cli.precheck(["-m", "train.lr=1e-3,2e-3", "model=glob(gpt-t*)", "train.steps=range(1,4)"])


def test_a_run_with_a_sweep_value_is_one_line(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    assert "Ambiguous value for argument 'train.lr=1,2'" in refused(["train.lr=1,2"], capsys, monkeypatch)


def test_sweep_jobs_cover_every_value_of_the_basic_sweeper() -> None:
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    argv = ["model=gpt-tiny,llama-tiny", "train.lr=1e-3,2e-3,3e-3", "train.steps=5", "++train.seed=range(0,2)"]
    reference = [job for batch in BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(argv), None)
                 for job in batch]
    jobs = overrides.sweep_jobs(argv)
    assert all(job in reference for job in jobs) and len(jobs) == 1 + 1 + 2 + 1 < len(reference)
    assert set(itertools.chain(*reference)) == set(itertools.chain(*jobs))
    assert overrides.sweep_jobs(["train.lr=interval(0,1)"]) == []  # a sweeper plugin's sweep: not ours to read


@pytest.mark.parametrize("argv,needle", [
    (["+train.foo=1"], "unknown key 'train.foo' in +train.foo=1: the schema has no such key — train has: steps,"),
    (["++model.hiden=3"], "unknown key 'model.hiden' in ++model.hiden=3: the schema has no such key — did you mean "
                          "model.hidden?"),
    (["++logging.wandb.mod=x"], "— did you mean logging.wandb.mode?"),
    (["+trian.lr=1"], "unknown key 'trian' in +trian.lr=1: the schema has no such key — did you mean train?"),
    (["train.lrr=1"], "Could not override 'train.lrr'. Key 'lrr' not in 'TrainConfig' — did you mean train.lr?"),
])
def test_unknown_keys_are_one_line_with_a_suggestion(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    assert needle in refused(argv, capsys, monkeypatch)


def test_known_keys_added_with_plus_plus_are_fine() -> None:
    cli.precheck(["++train.lr=1e-3", "++logging.wandb.mode=disabled", "~model"])


def test_suggestion_walks_the_schema() -> None:
    assert overrides.suggestion("train.lrr") == " — did you mean train.lr?"
    assert overrides.suggestion("logging.wandb.projekt") == " — did you mean logging.wandb.project?"
    assert overrides.suggestion("train.lr.x") == ""  # below a leaf: nothing to suggest
    assert overrides.suggestion("zzz").startswith(" — the config has: run_name, model, parallel")
    assert list(overrides.unknown_keys({"train": {"lr": 1, "x": 2}, "model": {"name": "a"}, "y": {}})) == \
        ["train.x", "y"]


def test_a_users_model_from_a_search_path_folder_trains(user_configs: Path, tmp_path: Path) -> None:
    """The real entry point in a forked child (hybrid.testing.cli_runs), as `python -m hybrid.train` runs it."""
    import hybrid.train

    r = run_forked(hybrid.train.main, [f"hydra.searchpath=[file://{user_configs}]", "model=my-tiny", *QUICK,
                                       f"logging.dir={tmp_path / 'run'}"], tmp_path,
                   {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}, timeout_s=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "model my-tiny:" in r.stdout + r.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == [1]


@pytest.mark.parametrize("argv,needle", [(["train.lrr=1"], "did you mean train.lr?"),
                                         (["-m", "model=gpt-tiny,gpt-tinny"], "did you mean gpt-tiny?")])
def test_a_misspelt_override_is_one_line_and_exit_2(argv: list[str], needle: str, tmp_path: Path) -> None:
    """The real entry point in a forked child (hybrid.testing.cli_runs; tests/e2e/test_bad_inputs.py checks
    that a fork refuses as a fresh process does)."""
    import hybrid.train

    r = run_forked(hybrid.train.main, [*argv, *QUICK, f"logging.dir={tmp_path / 'run'}"], tmp_path,
                   {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"})
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("hybrid: error: "), r.stderr[-3000:]
    assert lines[0].endswith(needle)

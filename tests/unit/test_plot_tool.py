"""`python -m hybrid.tools.plot`: a real run's metrics.jsonl (and a copy with scaled losses) drawn as PNGs;
one line per run in the overlay, eval lines, the tokens axis from the run's config, figures without
their keys skipped with a note, bad input one line and exit 2."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

from hybrid.testing.cli_runs import run_forked
from hybrid.tools import plot
from hybrid.tools.plot_figures import (
    Skipped,
    budget_figure,
    bytes_figure,
    compression_figure,
    loss_figure,
    time_figure,
)
from hybrid.tools.plot_series import load_run, moving_average, parse_lines

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVAL_EVERY, SCALE = 3, 2, 1.25


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real single-process run of gpt-tiny: 3 steps, an eval at step 2, timing on (the default); the real
    entry point in a forked child (hybrid.testing.cli_runs)."""
    import hybrid.train

    tmp = tmp_path_factory.mktemp("plot")
    argv = ["model=gpt-tiny", f"train.steps={STEPS}", f"train.eval_every={EVAL_EVERY}", "train.global_batch_size=8",
            "train.micro_batch_size=4", "train.eval_batches=1", "data.seq_len=64", "data.max_chars=200000",
            "logging.wandb.mode=disabled", "logging.progress=false", "logging.traffic_map=false", "run_name=x",
            "logging.log_every=1",
            f"logging.dir={tmp}/x", f"checkpoint.dir={tmp}/ck"]
    done = run_forked(hybrid.train.main, argv, tmp, {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"},
                      timeout_s=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return tmp / "x"


@pytest.fixture(scope="module")
def scaled(real: Path) -> Path:
    """A copy of the real run with losses × SCALE and the DP keys a two-rank run carries."""
    folder = real.parent / "scaled"
    shutil.copytree(real / ".hydra", folder / ".hydra")
    lines = []
    for line in (real / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        for k in ("loss", "eval_loss"):
            if k in rec:
                rec[k] *= SCALE
        if "loss" in rec:
            rec |= {"bytes_dp": 1e6 * rec["step"], "compression_ratio": 4.0, "compression_error": 0.1 / rec["step"],
                    "compression/b0/rank": 4.0 + rec["step"], "compression/b1/rank": 2.0,
                    "compression/b0/error": 0.2, "compression/b1/error": 0.3 / rec["step"]}
        lines.append(json.dumps(rec))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def drawn(fig: Figure) -> list[tuple[str, list[float], list[float]]]:
    """(label, x, y) of the figure's lines (faint raw lines and eval lines have labels with a leading `_`)."""
    return [(ln.get_label(), list(ln.get_xdata()), list(ln.get_ydata())) for ln in fig.axes[0].get_lines()]


def labelled(fig: Figure) -> dict[str, tuple[list[float], list[float]]]:
    """The figure's lines by label, for the labels that occur once."""
    return {label: (xs, ys) for label, xs, ys in drawn(fig)}


def test_overlay_writes_every_figure_and_the_pngs_load(real: Path, scaled: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from matplotlib.image import imread

    out = tmp_path / "plots"
    assert plot.main([str(real), str(scaled / "metrics.jsonl"), "--out", str(out), "--smooth", "2"]) == 0
    printed = [ln.strip() for ln in capsys.readouterr().out.splitlines()[1:]]
    names = {Path(p).name for p in printed}
    assert names == {"loss_step.png", "loss_tokens.png", "throughput_step.png", "bytes_step.png",
                     "compression_step.png", "budget_step.png", "time.png"}
    assert sorted(printed) == sorted(str(p) for p in out.iterdir())
    for p in printed:
        img = imread(p)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_loss_figure_has_one_line_per_run_and_eval_points(real: Path, scaled: Path) -> None:
    runs = [load_run(str(real), "a"), load_run(str(scaled), "b")]
    fig = loss_figure(runs)
    lines = labelled(fig)
    records = [json.loads(ln) for ln in (real / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [k for k in lines if not k.startswith("_")] == ["a", "b", "training", "eval"]  # two style keys
    assert not lines["training"][0] and not lines["eval"][0]
    assert lines["a"] == ([r["step"] for r in train], [r["loss"] for r in train])
    assert lines["b"][1] == pytest.approx([r["loss"] * SCALE for r in train])
    evals = [(xs, ys) for label, xs, ys in drawn(fig) if label == "_eval"]
    ev = [r for r in records if "eval_loss" in r]  # every eval_every steps and after the last
    assert [r["step"] for r in ev][0] == EVAL_EVERY
    assert evals == [([r["step"] for r in ev], [r["eval_loss"] * k for r in ev]) for k in (1, SCALE)]


def test_tokens_axis_is_step_times_batch_times_seq_len(real: Path) -> None:
    cfg = yaml.safe_load((real / ".hydra" / "config.yaml").read_text())
    per_step = cfg["train"]["global_batch_size"] * cfg["data"]["seq_len"]
    xs, _ = labelled(loss_figure([load_run(str(real), "a")], x="tokens"))["a"]
    assert xs == [s * per_step for s in range(1, STEPS + 1)]


def test_smoothing_draws_the_moving_average_over_a_faint_raw_line(scaled: Path) -> None:
    lines = labelled(loss_figure([load_run(str(scaled), "b")], smooth=2))
    raw = lines["_raw"][1]
    assert lines["b"][1] == pytest.approx([raw[0], (raw[0] + raw[1]) / 2, (raw[1] + raw[2]) / 2])
    assert moving_average([1.0, 2.0, 3.0, 4.0], 3) == pytest.approx([1.0, 1.5, 2.0, 3.0])


def test_a_figure_without_its_keys_is_skipped_with_a_note(real: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    run = load_run(str(real))  # one process: no bytes sent, no compression keys
    for figure in (bytes_figure, compression_figure, budget_figure):
        with pytest.raises(Skipped):
            figure([run])
    bare = tmp_path / "bare"  # no .hydra/config.yaml: no tokens axis
    bare.mkdir()
    shutil.copy(real / "metrics.jsonl", bare / "metrics.jsonl")
    assert plot.main([str(bare), "--only", "loss,bytes,compression,time"]) == 0
    out, err = capsys.readouterr()
    notes = err.strip().splitlines()
    assert [n.split()[2] for n in notes] == ["loss_tokens.png", "bytes_step.png", "compression_step.png"]
    assert all(n.startswith("hybrid: note:") for n in notes)
    assert {p.name for p in (bare / "plots").iterdir()} == {"loss_step.png", "time.png"}
    assert time_figure([run]).axes[0].get_yticklabels()[0].get_text() == "x"


def test_last_line_per_step_wins_and_grouped_names_read() -> None:
    text = "\n".join(json.dumps(r) for r in [
        {"step": 1, "train/loss": 5.0}, {"step": 2, "train/loss": 4.0}, {"step": 2, "eval/loss": 4.5},
        {"step": 2, "train/loss": 3.9}, {"step": 3, "loss": 3.0, "note": "text", "lr": None}]) + '\n{"step": 4, "lo'
    steps = parse_lines(text, "m")  # the unfinished last line (a run still writing) is left out
    assert steps == {1: {"loss": 5.0}, 2: {"loss": 3.9, "eval_loss": 4.5}, 3: {"loss": 3.0}}


def test_the_same_input_writes_the_same_bytes(real: Path, tmp_path: Path) -> None:
    for d in ("a", "b"):
        assert plot.main([str(real), "--only", "loss", "--x", "step", "--out", str(tmp_path / d)]) == 0
    assert (tmp_path / "a" / "loss_step.png").read_bytes() == (tmp_path / "b" / "loss_step.png").read_bytes()


@pytest.mark.parametrize("args, needle", [
    (["{tmp}/nope"], "no such run folder"),
    (["{tmp}"], "has no metrics.jsonl"),
    (["{empty}"], "has no records"),
    (["{bad}"], "line 1 is not JSON"),
    (["{nostep}"], "no integer 'step'"),
    (["{real}", "--only", "loss,pie"], "unknown figure pie"),
    (["{real}", "--x", "time"], "--x must be step or tokens"),
    (["{real}", "--smooth", "0"], "--smooth must be >= 1"),
    (["{real}", "--labels", "a,b"], "2 label(s) for 1 run(s)"),
    (["{real}", "--out"], "--out needs a value"),
    (["{real}", "--png", "x"], "unknown option"),
    ([], "expected at least one run"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], needle: str, real: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    files = {"empty": "", "bad": "{not json\n", "nostep": '{"loss": 1.0}\n'}
    for name, text in files.items():
        (tmp_path / f"{name}.jsonl").write_text(text)
    paths = {"tmp": tmp_path, "real": real, **{n: tmp_path / f"{n}.jsonl" for n in files}}
    assert plot.main([a.format(**paths) for a in args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hybrid: error:") and needle in err[0]


def test_matplotlib_loads_only_when_a_figure_is_drawn() -> None:
    """matplotlib is a core dependency, imported inside the drawing functions: importing the trainer's report
    and the drawing tools (start-up of every run and tool) does not load it. In a forked child that first
    forgets every hybrid and matplotlib module this process loaded, so they are imported anew."""
    def main() -> None:
        for name in [m for m in sys.modules if m.split(".")[0] in ("hybrid", "matplotlib", "mpl_toolkits")]:
            del sys.modules[name]
        for module in ("hybrid.record.report", "hybrid.tools.plot", "hybrid.tools.schedule", "hybrid.tools.traffic",
                       "hybrid.tools.diagnose"):
            importlib.import_module(module)
        print(sorted(m for m in sys.modules if m.split(".")[0] == "matplotlib"))

    r = run_forked(main, [], ROOT, timeout_s=120, prog="python")
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr[-3000:] + r.stdout


def test_the_error_budget_draws_a_line_per_bucket(scaled: Path) -> None:
    """One panel per figure the buckets carry (error, rank), one line per bucket, named by it."""
    fig = budget_figure([load_run(str(real_run_of(scaled)), "plain"), load_run(str(scaled), "b")])
    assert [ax.get_title().split()[0] for ax in fig.axes] == ["‖ĝ", "PowerSGD"]
    for ax in fig.axes:
        assert sorted(line.get_label() for line in ax.get_lines()) == ["b0", "b1"]
    rank = {line.get_label(): list(line.get_ydata()) for line in fig.axes[1].get_lines()}
    assert rank["b0"] == [4.0 + s for s in range(1, STEPS + 1)] and rank["b1"] == [2.0] * STEPS


def real_run_of(scaled: Path) -> Path:
    return scaled.parent / "x"

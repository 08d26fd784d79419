"""Tests for hybrid.record.metrics: FLOPs formula, JSONL sink semantics, wandb folders, lazy wandb import."""

from __future__ import annotations

import io
import json
import math
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from hybrid.record.metrics import format_count, jsonable, mfu, model_flops_per_token, peak_flops
from hybrid.record.sinks import MetricsLogger
from hybrid.testing.cli_runs import CliRun, run_forked


class _Block(nn.Module):
    """Bias-free, norm-free attention + MLP block: every FLOP is a matmul the formula models."""

    def __init__(self, hidden: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.fc1 = nn.Linear(hidden, 4 * hidden, bias=False)
        self.fc2 = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.n_heads, -1).transpose(1, 2) for t in self.qkv(x).split(h, dim=-1))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(h // self.n_heads)
        att = att.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(x)))


class _TinyGPT(nn.Module):
    """Token embedding tied to the output head, no positions: N counts exactly the matmul weights."""

    def __init__(self, vocab: int, hidden: int, n_layers: int, n_heads: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(_Block(hidden, n_heads) for _ in range(n_layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return x @ self.emb.weight.t()


def test_flops_formula_matches_flop_counter() -> None:
    """6N + 12·L·h·s per token equals torch's FLOP count of one forward + backward."""
    vocab, hidden, n_layers, n_heads, batch, seq = 96, 32, 3, 4, 2, 24
    model = _TinyGPT(vocab, hidden, n_layers, n_heads)
    idx = torch.randint(0, vocab, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        logits = model(idx)
        F.cross_entropy(logits.view(-1, vocab), idx.view(-1)).backward()
    n_params = sum(p.numel() for p in model.parameters())
    per_token = model_flops_per_token(n_params, len(model.blocks), model.emb.embedding_dim, seq)
    assert counter.get_total_flops() == pytest.approx(per_token * batch * seq, rel=1e-12)


def test_peak_flops_and_mfu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Known GPUs map to their dense bf16 peak; CPU and unknown devices give None."""
    assert peak_flops(torch.device("cpu")) is None
    names = {"NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H200": 989e12,
             "NVIDIA H100 PCIe": 756e12, "NVIDIA L4": 121e12,
             "Tesla T4": None}
    for name, expected in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_a, n=name: n)
        assert peak_flops(torch.device("cuda", 0)) == expected
    assert mfu(1000.0, 2e9, 4, 1e12) == pytest.approx(1000.0 * 2e9 / 4e12)
    assert mfu(1000.0, 2e9, 4, None) is None


def test_format_count() -> None:
    """Compact counts with 3-4 significant digits."""
    assert format_count(1_010_000_000) == "1.01B"
    assert format_count(124_439_808) == "124.4M"
    assert format_count(12_345.6) == "12.3K"
    assert format_count(950) == "950"


def test_jsonable_makes_strict_json() -> None:
    """Tensors and numpy scalars become numbers; NaN/inf become null; the result passes strict json.dumps."""
    np = pytest.importorskip("numpy")
    raw = {"a": torch.tensor(2.5), "b": torch.tensor(3), "c": np.float32(1.5), "d": np.int64(7),
           "e": float("nan"), "f": torch.tensor(float("inf")), "g": [torch.tensor(1.0), 2], "h": True}
    clean = jsonable(raw)
    assert clean == {"a": 2.5, "b": 3, "c": 1.5, "d": 7, "e": None, "f": None, "g": [1.0, 2], "h": True}
    assert type(clean["d"]) is int
    json.dumps(clean, allow_nan=False)


def _read(path: Path) -> list[dict]:
    def reject(const: str) -> None:
        raise AssertionError(f"non-strict JSON constant {const}")

    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


def _metrics(step: int) -> dict:
    return {"loss": torch.tensor(4.0 - 0.1 * step), "lr": 1e-3, "grad_norm": float("nan"),
            "tokens_per_s": 1234.5, "step_time_s": 0.25, "step": -1}


def test_only_the_writer_writes(tmp_path: Path) -> None:
    """A non-writer rank creates nothing; the writer writes one strict-JSON line per call, step first."""
    with MetricsLogger(str(tmp_path / "other"), {}, is_writer=False, total_steps=3, wandb_mode="offline") as m:
        assert m.log(0, _metrics(0)) is None
        m.log_eval(0, 1.0)
        m.message("invisible")
    assert not (tmp_path / "other").exists()
    run = tmp_path / "run"
    with MetricsLogger(str(run), {}, is_writer=True, total_steps=3, wandb_mode="disabled", progress=False) as m:
        for step in range(1, 4):
            m.log(step, _metrics(step))
        m.log_eval(3, torch.tensor(3.5))
    lines = _read(run / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3, 3]
    assert list(lines[0]) == ["step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"]
    assert lines[1]["loss"] == pytest.approx(3.8) and lines[1]["grad_norm"] is None
    assert lines[3] == {"step": 3, "eval_loss": 3.5}


def test_fresh_run_truncates_and_resume_drops_later_steps(tmp_path: Path) -> None:
    """start_step=0 starts the file anew; resuming at k keeps steps <= k (and drops a torn last line)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("stale\n")
    with MetricsLogger(str(tmp_path), {}, True, 10, wandb_mode="disabled", progress=False) as m:
        for step in range(1, 7):
            m.log(step, _metrics(step))
        m.log_eval(4, 2.5)
        m.log_eval(6, 2.0)
    with open(path, "a") as f:
        f.write('{"step": 7, "loss": 3.')  # a line cut by a crash
    with MetricsLogger(str(tmp_path), {}, True, 10, wandb_mode="disabled", progress=False, start_step=4) as m:
        assert [r["step"] for r in _read(path)] == [1, 2, 3, 4, 4]
        m.log(5, _metrics(5))
    assert [r["step"] for r in _read(path)] == [1, 2, 3, 4, 4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    with MetricsLogger(str(tmp_path), {}, True, 10, wandb_mode="disabled", progress=False) as m:
        m.log(1, _metrics(1))
    assert [r["step"] for r in _read(path)] == [1]


def test_lines_are_flushed_before_close(tmp_path: Path) -> None:
    """Each line reaches the file at once, so a killed run keeps what it logged."""
    m = MetricsLogger(str(tmp_path), {}, True, 5, wandb_mode="disabled", progress=False)
    m.log(1, _metrics(1))
    assert len(_read(tmp_path / "metrics.jsonl")) == 1
    m.close()
    m.close()  # idempotent
    assert m.log(2, _metrics(2)) is None


class _FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty", [True, False])
def test_progress_and_messages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tty: bool) -> None:
    """Bar (terminal) or plain lines (pipe) show loss, lr and tokens/s; evals and messages print as lines."""
    err = _FakeTerminal() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    with MetricsLogger(str(tmp_path), {}, True, 4, wandb_mode="disabled", progress=True, start_step=1) as m:
        m.log(2, {"loss": 2.34567, "lr": 3e-4, "tokens_per_s": 45678.0})
        m.update_progress(3)
        m.log_eval(3, 2.0)
        m.message("hello from rank 0")
    out = err.getvalue()
    assert "loss=2.346 lr=3.00e-04 tok/s=45.7K" in out
    assert "step 3: eval_loss 2.0000" in out and "hello from rank 0" in out
    assert "3/4" in out
    if not tty:
        assert "\r" not in out and out.splitlines()[0].startswith("step 2/4 loss=2.346")


def _run_python(code: str, cwd: Path, home: Path, timeout: float = 60) -> CliRun:
    """Run `code` as `__main__` in a forked child (hybrid.testing.cli_runs: a real process, without a fresh
    interpreter's seconds of imports) with HOME and the CWD in tmp, no WANDB_*/XDG_*/NETRC variables set and
    no wandb module loaded (the parent's, if any, forgotten: the child imports its own, as a fresh process)."""
    def main() -> None:
        for key in [k for k in os.environ if k.startswith(("WANDB_", "XDG_", "NETRC"))]:
            del os.environ[key]  # XDG defaults now point into HOME
        for name in [m for m in sys.modules if m.split(".")[0] == "wandb"]:
            del sys.modules[name]
        exec(compile(textwrap.dedent(code), "<test>", "exec"), {"__name__": "__main__"})

    return run_forked(main, [], cwd, {"HOME": str(home)}, timeout_s=timeout, prog="python")


@pytest.fixture
def sandbox(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(cwd, home, run_dir) under tmp, cwd and home empty."""
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    home.mkdir()
    return cwd, home, tmp_path / "run"


def test_wandb_offline_keeps_its_files_in_run_dir(sandbox: tuple[Path, Path, Path]) -> None:
    """An offline wandb run writes under run_dir only: nothing lands in the CWD or in HOME."""
    pytest.importorskip("wandb")  # a machine without it (a GPU image) skips; CI has it
    cwd, home, run = sandbox
    proc = _run_python(f"""
        from hybrid.record.sinks import MetricsLogger
        with MetricsLogger({str(run)!r}, {{"model": {{"hidden": 32}}}}, True, 3, wandb_mode="offline",
                           progress=False, run_name="t") as m:
            for step in range(1, 4):
                m.log(step, {{"loss": 1.0 / step, "lr": 1e-3, "tokens_per_s": 10.0}})
            m.log_eval(3, 0.5)
    """, cwd, home)
    assert proc.returncode == 0, proc.stderr
    assert list(cwd.rglob("*")) == [] and list(home.rglob("*")) == []
    runs = list((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert len(_read(run / "metrics.jsonl")) == 4


def test_wandb_online_without_credentials_is_one_clear_error(sandbox: tuple[Path, Path, Path]) -> None:
    """Online mode with no API key fails fast with a RuntimeError instead of prompting or hanging."""
    pytest.importorskip("wandb")  # a machine without it (a GPU image) skips; CI has it
    cwd, home, run = sandbox
    proc = _run_python(f"""
        from hybrid.record.sinks import MetricsLogger
        try:
            MetricsLogger({str(run)!r}, {{}}, True, 3, wandb_mode="online", progress=False)
        except RuntimeError as e:
            print("ERR", e)
    """, cwd, home, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "ERR wandb online mode needs credentials" in proc.stdout
    assert list(cwd.rglob("*")) == []


def test_disabled_mode_and_non_writers_never_import_wandb(sandbox: tuple[Path, Path, Path]) -> None:
    """wandb is imported lazily: not with mode=disabled, not on non-writer ranks."""
    cwd, home, run = sandbox
    proc = _run_python(f"""
        import sys
        from hybrid.record.sinks import MetricsLogger
        with MetricsLogger({str(run)!r}, {{}}, True, 2, wandb_mode="disabled", progress=False) as m:
            m.log(0, {{"loss": 1.0}})
        with MetricsLogger({str(run)!r} + "-r1", {{}}, False, 2, wandb_mode="offline") as m:
            m.log(0, {{"loss": 1.0}})
        assert "wandb" not in sys.modules, "wandb was imported"
        print("OK")
    """, cwd, home)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr

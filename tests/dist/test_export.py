"""transformers export (`python -m hybrid.tools.export`) and import (`model.init_from`) under any layout.

One world-4 launch trains a tiny GPT (tied embeddings) and a tiny Llama (GQA, untied head), 2 layers each,
at tp2pp2 for 2 steps each (fp32, VOCAB=201 with make_vocab_size_divisible_by=1: 202 embedding rows at tp=2,
so a padding row is stripped on export) with a 201-token WordLevel tokenizer whose EOS is
`<|endoftext|>`, and saves a checkpoint at step 2; every stage also sends back its gathered weights.
Then, in the test process:

- export: the GPT run folder through the command line (`main` as `python -m` calls it, in a real process
  forked from the test process, `run_forked`: its exit status and stdout, without a fresh interpreter's
  seconds of imports; the newest complete checkpoint), the Llama step folder through `export()`.
  `AutoModelForCausalLM.from_pretrained` loads each with no missing/unexpected/mismatched keys, its state
  dict equals the ranks' trained weights converted with `to_hf_state_dict` bit for bit, and its logits
  (transformers' own forward, fp32, sdpa attention) equal our `full_logits` of the ranks' weights within
  LOGITS_TOL; the config carries the tokenizer's ids and the tokenizer loads.
- import: a second world-4 launch starts from the exported Llama folder with `load_pretrained`
  (`model.init_from`) under tp1pp2dp2 and tp2pp1dp2: right after loading, the gathered weights equal
  the folder's tensors bit for bit (padding rows zero); the losses of 3 steps equal those of a
  single process started from the same folder through transformers' `state_dict()` and
  `load_hf_into` (the reference) within LOSS_TOL, and differ from a run from random weights.
- `hybrid.train.run` (one process) starts from `model.init_from` and says so; with a resume as well,
  the resume wins and a note says init_from was ignored.
- both exports load on transformers 4 as well (the floor itself: tests/e2e/test_export_floor.py):
  tokenizer_config.json names `PreTrainedTokenizerFast` (not transformers 5's `TokenizersBackend`),
  pad = eos in the tokenizer, config.json and generation_config.json, config.json carries 4.x's
  `torch_dtype` (and `rope_theta` for Llama) next to 5.x's `dtype` (`rope_parameters`).
- `dtype=bf16` into `out=exported/deeper/gpt-bf16` (relative, missing parents created): every
  tensor in model.safetensors is our converted weight rounded to bf16 bit for bit, config.json says
  bfloat16, `AutoModelForCausalLM` (dtype "auto") loads it in bf16 and its logits are within
  BF16_RTOL of our fp32 logits; `AutoTokenizer` and `pipeline("text-generation")` (greedy, 3 tokens)
  work on the folder. A failed export (its verification broken on purpose) removes the parent folders
  it created.
- bad input: missing, partial (no .metadata) and corrupt checkpoints, an existing non-empty `out`,
  an `out` under a file, unknown or missing keys, a bad dtype: exit 2, one `hybrid: error:` line on
  stderr, `out` untouched, no temp folder left (once through a fresh `python -m hybrid.tools.export`);
  `init_from` folders that do not fit the model: one-line ModelConfigError naming the field (hybrid.train
  reports it as a ConfigError).
- `load_pretrained` also reads a sharded `model.safetensors.index.json` folder with base-model names.

Measured (fp32, logits of magnitude < 1): max |Δlogits| GPT 1.8e-7, Llama 1.5e-7 (the tool's own
verification: 2.4e-7, 1.2e-7); import losses vs the single-process reference: 0 (tp1pp2dp2),
0 (tp2pp1dp2), while a run from random weights differs by ~0.6.

Both launches' configs are composed in the test process before the ranks fork (`compose_config`'s memo), whose
heap is frozen while they run (`run_frozen`); the tokenizer is built there too (the ranks import no transformers).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from pp_helpers import VOCAB, Case, layout_context, make_cfg
from test_dp import synthetic_corpus
from tp_helpers import run_frozen

from hybrid.checkpoint import METADATA, step_path
from hybrid.compression.hooks import make_hook
from hybrid.config import ConfigError
from hybrid.model import build_model
from hybrid.model.family import ModelConfigError
from hybrid.model.hf import from_hf_state_dict, load_hf_into, load_pretrained, to_hf_state_dict
from hybrid.parallel.context import ParallelContext
from hybrid.parallel.params import full_state_dict
from hybrid.testing.cli_runs import CliRun, run_forked
from hybrid.tools.export import Options, export
from hybrid.trainer import Trainer, build_chunks

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 240
SAVE_STEP = 2
IMPORT_STEPS = 3
EOS = "<|endoftext|>"
FAMILIES = {"gpt": ("model.n_layers=2",),
            "llama": ("model.n_layers=2", "model.n_kv_heads=2", "model.tie_embeddings=false")}
LOGITS_TOL = {"atol": 1e-5, "rtol": 1e-5}  # fp32, two implementations (ours vs transformers' sdpa)
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-5}  # as tests/dist/pp_helpers.py: the same math under another layout
# bf16 keeps 8 significant bits (a rounding moves a value by up to 2^-9 ≈ 2e-3 relative); a bf16 forward
# of a few layers accumulates several such errors: allowed, 3e-2 of the largest fp32 logit (at least 1)
BF16_RTOL = 3e-2
IMPORT_LAYOUTS = [Case("llama", tp=1, pp=2), Case("llama", tp=2, pp=1)]


def word_tokenizer() -> Any:
    """A 201-token WordLevel tokenizer (`<|endoftext|>` = 0 = the synthetic corpus's eos), as transformers'."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {EOS: 0} | {f"w{i}": i for i in range(1, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS)


def _cfg(family: str, case: Case, world: int, *extra: str) -> Any:
    return make_cfg(Case(family, case.tp, case.pp), world, extra=[*FAMILIES[family], *extra])


def _trainer(cfg: Any, ctx: ParallelContext, tokenizer: Any = None) -> Trainer:
    torch.manual_seed(1234 + ctx.pp_rank)
    corpus = synthetic_corpus(vocab=VOCAB)
    corpus.tokenizer = tokenizer
    hook, state = make_hook(cfg.compression, ctx.dp_group)
    return Trainer(cfg, ctx, build_chunks(cfg, VOCAB, ctx), corpus, torch.device("cpu"), hook, state)


def _gathered(trainer: Trainer) -> dict[str, torch.Tensor] | None:
    """This stage's TP-gathered weights (a collective over TP), kept by TP rank 0 of DP rank 0."""
    out: dict[str, torch.Tensor] = {}
    for chunk in trainer.model:
        out.update(full_state_dict(chunk, trainer.ctx.tp_group))
    c = trainer.ctx.coord
    return out if c.tp == 0 and c.dp == 0 else None


def save_cfg(family: str, world: int, root: Path) -> Any:
    """The config `save_runs` trains `family` under (composed in the test process before the ranks fork)."""
    return _cfg(family, Case(tp=2, pp=2), world, f"checkpoint.dir={root}", f"run_name={family}",
                f"train.steps={SAVE_STEP}", f"checkpoint.every={SAVE_STEP}")


def save_runs(rank: int, world: int, root: Path, tokenizer: Any) -> dict[str, Any]:
    """Rank function: train each family at tp2pp2 for SAVE_STEP steps and save a checkpoint (with `tokenizer`,
    built in the test process: the ranks need not import transformers)."""
    ctx = layout_context(world, Case(tp=2, pp=2))
    out: dict[str, Any] = {}
    for family in FAMILIES:
        trainer = _trainer(save_cfg(family, world, root), ctx, tokenizer)
        while trainer.step < SAVE_STEP:
            trainer.train_step()
            trainer.checkpointer.after_step(trainer.step)
        trainer.checkpointer.wait()
        out[family] = _gathered(trainer)
    return out


def merged_weights(results: list[dict[str, Any]], family: str) -> dict[str, torch.Tensor]:
    """The whole model's weights from the stages (the last stage's tied head copy dropped)."""
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        if r[family] is not None:
            merged.update(r[family])
    if "pos_embed.weight" in merged or "head.weight" not in _whole(family).state_dict():
        merged.pop("head.weight", None)
    return merged


def _whole(family: str) -> torch.nn.Module:
    return build_model(_cfg(family, Case(), 1).model, VOCAB, seed=0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("export")
    torch.set_num_threads(1)
    for family in FAMILIES:
        save_cfg(family, 4, root / "ckpt")
    return root, run_frozen(save_runs, 4, root / "ckpt", word_tokenizer(), timeout=TIMEOUT)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m hybrid.tools.export` in a fresh interpreter."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "hybrid.tools.export", *args], capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=ROOT, env=env)


def run_cli_forked(*args: str) -> CliRun:
    """The command line as `python -m hybrid.tools.export` runs it (`sys.exit(main())`), in a forked process."""
    from hybrid.tools.export import main

    return run_forked(lambda: sys.exit(main()), args, ROOT, {"OMP_NUM_THREADS": "1"}, timeout_s=TIMEOUT,
                      prog="python -m hybrid.tools.export")


@pytest.fixture(scope="module")
def exported(saved: tuple[Path, list[dict[str, Any]]]) -> dict[str, Path]:
    """gpt: the run folder through the command line (a forked process); llama: the step folder through export()."""
    root = saved[0]
    r = run_cli_forked(f"checkpoint={root / 'ckpt' / 'gpt'}", f"out={root / 'hf-gpt'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"exported {step_path(root / 'ckpt' / 'gpt', SAVE_STEP)} (step {SAVE_STEP})" in r.stdout, r.stdout
    assert "no missing/unexpected keys, max |Δlogits|" in r.stdout, r.stdout
    report = export(Options(step_path(root / "ckpt" / "llama", SAVE_STEP), root / "hf-llama"))
    assert report.max_abs_diff is not None and report.tokenizer
    return {"gpt": root / "hf-gpt", "llama": root / "hf-llama"}


def load_hf(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    return model.eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_loads_in_transformers_with_equal_logits(family: str, saved: Any, exported: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    folder, weights = exported[family], merged_weights(saved[1], family)
    names = sorted(p.name for p in folder.iterdir())
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(names), names
    assert not list(folder.parent.glob(f".{folder.name}.*")), "a temp folder was left behind"
    theirs = load_hf(folder)
    assert type(theirs).__name__ == ("GPT2LMHeadModel" if family == "gpt" else "LlamaForCausalLM")
    assert weights["tok_embed.weight"].shape[0] == VOCAB + 1  # tp=2 padding
    ours = _trained(family, saved[1])
    cfg = ours.cfg
    expected = to_hf_state_dict(dict(ours.named_parameters()), cfg, VOCAB)
    got = theirs.state_dict()
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k
    assert (got["lm_head.weight"].data_ptr() == got[next(iter(got))].data_ptr()) == (family == "gpt")
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours.full_logits(ids), **LOGITS_TOL)
    hf_cfg = json.loads((folder / "config.json").read_text())
    assert (hf_cfg["bos_token_id"], hf_cfg["eos_token_id"], hf_cfg["pad_token_id"]) == (0, 0, 0)
    assert hf_cfg["vocab_size"] == VOCAB and hf_cfg["tie_word_embeddings"] == (family == "gpt")
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert tok.eos_token == EOS and tok("w5 w7")["input_ids"] == [5, 7]
    _check_transformers_4_files(folder, "float32")


def _trained(family: str, results: list[dict[str, Any]]) -> torch.nn.Module:
    """Our whole model (fp32) with the ranks' trained weights, vocabulary padding stripped."""
    ours = _whole(family)
    assert ours.padded_vocab == VOCAB
    ours.load_state_dict({k: v[:VOCAB] if k in ("tok_embed.weight", "head.weight") else v
                          for k, v in merged_weights(results, family).items()}, strict=True)
    return ours.eval()


def _check_transformers_4_files(folder: Path, dtype: str) -> None:
    """What transformers 4 needs: a tokenizer class it knows, pad = eos everywhere, its config spellings."""
    from transformers import AutoTokenizer

    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and tok_cfg["pad_token"] == EOS, tok_cfg
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert tok.pad_token == EOS and tok.pad_token_id == tok.eos_token_id == 0
    hf_cfg = json.loads((folder / "config.json").read_text())
    gen_cfg = json.loads((folder / "generation_config.json").read_text())
    assert hf_cfg["pad_token_id"] == gen_cfg["pad_token_id"] == 0
    assert hf_cfg["torch_dtype"] == hf_cfg["dtype"] == dtype
    if "rope_parameters" in hf_cfg:
        assert hf_cfg["rope_theta"] == hf_cfg["rope_parameters"]["rope_theta"]


def test_bf16_export_into_new_parents_loads_with_auto_classes_and_pipeline(
        tmp_path: Path, saved: Any, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, pipeline

    from hybrid.tools.export import main

    monkeypatch.chdir(tmp_path)
    out = Path("exported") / "deeper" / "gpt-bf16"  # relative, as in the README; no parent exists
    ckpt = step_path(saved[0] / "ckpt" / "gpt", SAVE_STEP)
    assert main([f"checkpoint={ckpt}", f"out={out}", "dtype=bf16"]) == 0
    assert "tensors in bf16; verified" in capsys.readouterr().out
    assert sorted(p.name for p in out.parent.iterdir()) == ["gpt-bf16"]  # no temp folder left
    ours = _trained("gpt", saved[1])
    expected = to_hf_state_dict(dict(ours.named_parameters()), ours.cfg, VOCAB)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(k for k in expected if k != "lm_head.weight")  # tied head left out
        for k in f.keys():
            assert torch.equal(f.get_tensor(k), expected[k].to(torch.bfloat16)), k
    _check_transformers_4_files(out, "bfloat16")
    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype="auto").eval()
    assert theirs.dtype == torch.bfloat16
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref, got = ours.full_logits(ids), theirs(ids).logits.float()
    assert (got - ref).abs().max().item() <= BF16_RTOL * max(1.0, ref.abs().max().item())
    generated = pipeline("text-generation", model=str(out))("w5 w7", max_new_tokens=3, min_new_tokens=3,
                                                            do_sample=False, return_tensors=True)
    assert generated[0]["generated_token_ids"][:2] == [5, 7] and len(generated[0]["generated_token_ids"]) == 5


def test_a_failed_export_removes_the_parents_it_created(tmp_path: Path, saved: Any, capsys: pytest.CaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from hybrid.tools import export as tool

    def broken(*args: Any) -> float:
        raise tool.VerifyError("transformers' logits differ from ours by up to 1")

    monkeypatch.setattr(tool, "verify", broken)
    ckpt = step_path(saved[0] / "ckpt" / "gpt", SAVE_STEP)
    code, lines = _main(capsys, f"checkpoint={ckpt}", f"out={tmp_path / 'new' / 'deeper' / 'out'}")
    assert code == 1 and lines == ["hybrid: error: transformers' logits differ from ours by up to 1"], lines
    assert list(tmp_path.iterdir()) == []


def import_cfg(case: Case, world: int, folder: Path) -> Any:
    return _cfg("llama", case, world, f"model.init_from={folder}", f"train.steps={IMPORT_STEPS}")


def import_runs(rank: int, world: int, folder: Path, cases: list[Case]) -> list[dict[str, Any]]:
    """Rank function: per layout, a fresh Trainer initialised from `folder`, then IMPORT_STEPS steps."""
    out = []
    for case in cases:
        ctx = layout_context(world, case)
        cfg = import_cfg(case, world, folder)
        trainer = _trainer(cfg, ctx)
        line = load_pretrained(trainer.model, cfg.model.init_from, cfg.model, VOCAB)
        loaded = _gathered(trainer)
        losses = [trainer.train_step().loss for _ in range(IMPORT_STEPS)]
        out.append({"case": str(case), "line": line, "coord": ctx.coord, "loaded": loaded, "losses": losses})
    return out


def single_process_losses(folder: Path | None) -> list[float]:
    """The reference: one process, weights from transformers' `state_dict()` (or random: None)."""
    cfg = _cfg("llama", Case(), 1, f"train.steps={IMPORT_STEPS}")
    trainer = _trainer(cfg, layout_context(1, Case()))
    if folder is not None:
        load_hf_into(trainer.model[0], load_hf(folder).state_dict(), cfg.model, VOCAB)
    return [trainer.train_step().loss for _ in range(IMPORT_STEPS)]


def test_init_from_under_other_layouts_matches_single_process(exported: dict[str, Path]) -> None:
    from safetensors.torch import load_file

    folder = exported["llama"]
    torch.set_num_threads(1)
    for case in IMPORT_LAYOUTS:  # composed (and validated: init_from is read) here, inherited by the ranks
        import_cfg(case, 4, folder)
    results = run_frozen(import_runs, 4, folder, IMPORT_LAYOUTS, timeout=TIMEOUT)
    ref, fresh = single_process_losses(folder), single_process_losses(None)
    assert abs(ref[0] - fresh[0]) > 1e-3, (ref, fresh)  # the import changed the starting point
    cfg = _cfg("llama", Case(), 1).model
    hf_state = load_file(str(folder / "model.safetensors"))
    for i, case in enumerate(IMPORT_LAYOUTS):
        expected = from_hf_state_dict(hf_state, cfg, VOCAB, case.tp)  # padding rows: zero
        merged: dict[str, torch.Tensor] = {}
        for r in results:
            run = r[i]
            assert run["line"].startswith(f"model: initialised from {folder} (transformers llama"), run["line"]
            torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref), **LOSS_TOL,
                                       msg=lambda m, c=run["case"]: f"{c}: {m}")
            merged.update(run["loaded"] or {})
        assert sorted(merged) == sorted(expected), str(case)
        for name, w in expected.items():
            assert torch.equal(merged[name], w), (str(case), name)


# ---- bad input --------------------------------------------------------------------------------

def _main(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, list[str]]:
    from hybrid.tools.export import main

    code = main(list(args))
    err = capsys.readouterr().err
    return code, err.strip().splitlines()


def _partial(root: Path, saved_root: Path) -> Path:
    """A copy of the llama checkpoint without `.metadata` (a save that did not finish)."""
    part = root / "partial" / "step_0000002"
    shutil.copytree(step_path(saved_root / "ckpt" / "llama", SAVE_STEP), part)
    (part / METADATA).unlink()
    return part


def _corrupt(root: Path, saved_root: Path) -> Path:
    """A copy of the llama checkpoint with a truncated shard."""
    bad = root / "corrupt" / "step_0000002"
    shutil.copytree(step_path(saved_root / "ckpt" / "llama", SAVE_STEP), bad)
    shard = sorted(bad.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    return bad


def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path: Path, saved: Any,
                                                          capsys: pytest.CaptureFixture) -> None:
    ckpt = step_path(saved[0] / "ckpt" / "gpt", SAVE_STEP)
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    out = tmp_path / "out"
    partial, corrupt = _partial(tmp_path, saved[0]), _corrupt(tmp_path, saved[0])
    cases = [
        ((f"checkpoint={tmp_path / 'nope'}", f"out={out}"), "does not exist"),
        ((f"checkpoint={partial}", f"out={out}"), ".metadata is missing"),
        ((f"checkpoint={partial.parent}", f"out={out}"), "no complete checkpoint"),
        ((f"checkpoint={corrupt}", f"out={out}"), "is corrupt"),
        ((f"checkpoint={ckpt}", f"out={existing}"), "not empty (force=true replaces it)"),
        ((f"checkpoint={ckpt}", f"out={existing / 'keep.txt' / 'out'}"), "keep.txt is not a folder"),
        ((f"checkpoint={ckpt}", f"out={out}", "dtype=fp16"), "dtype must be fp32 or bf16, got 'fp16'"),
        ((f"checkpoint={ckpt}", f"out={out}", "colour=red"), "unknown key 'colour'"),
        ((f"checkpoint={ckpt}",), "out= is required"),
        ((f"checkpoint={ckpt}", f"out={out}", "force=maybe"), "force must be true or false"),
    ]
    for args, needle in cases:
        code, lines = _main(capsys, *args)
        assert code == 2 and len(lines) == 1 and lines[0].startswith("hybrid: error: ") and needle in lines[0], \
            (args, code, lines)
        assert not out.exists() and [p.name for p in existing.iterdir()] == ["keep.txt"]
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], args
    r = run_cli(f"checkpoint={partial}", f"out={existing}")  # the real process, once
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("hybrid: error: "), r.stderr
    assert (existing / "keep.txt").read_text() == "mine"


def test_force_replaces_out(tmp_path: Path, saved: Any, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    ckpt = step_path(saved[0] / "ckpt" / "gpt", SAVE_STEP)
    code, _ = _main(capsys, f"checkpoint={ckpt}", f"out={out}", "force=true", "verify=false")
    assert code == 0 and not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_init_from_that_does_not_fit_is_one_line(tmp_path: Path, exported: dict[str, Path]) -> None:
    cfg = _cfg("llama", Case(), 1).model
    model = torch.nn.ModuleList([build_model(cfg, VOCAB)])
    cases = [(exported["gpt"], "holds a transformers 'gpt2' model, but model.family=llama"),
             (tmp_path, "no config.json")]
    bad = tmp_path / "bad"
    shutil.copytree(exported["llama"], bad)
    hf = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(hf | {"num_key_value_heads": 4, "intermediate_size": 64}))
    cases.append((bad, "n_kv_heads=4 there, 2 here; ffn_hidden=64 there, 128 here"))
    for folder, needle in cases:
        with pytest.raises(ModelConfigError) as e:  # hybrid.train turns it into a ConfigError
            load_pretrained(model, folder, cfg, VOCAB)
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="is not a transformers model folder"):  # validate(), before anything runs
        _cfg("llama", Case(), 1, f"model.init_from={tmp_path}")
    with pytest.raises(ModelConfigError, match="vocab_size=201 there, 300 here"):
        load_pretrained(torch.nn.ModuleList([build_model(cfg, 300)]), exported["llama"], cfg, 300)


def test_train_run_starts_from_init_from_unless_resuming(tmp_path: Path, saved: Any, exported: dict[str, Path],
                                                         capsys: pytest.CaptureFixture) -> None:
    """hybrid.train.run itself (one process): init_from loads and says so; with a resume it is ignored."""
    from hybrid.train import run

    text = tmp_path / "words.txt"
    gen = torch.Generator().manual_seed(0)
    text.write_text("\n".join(" ".join(f"w{int(i)}" for i in torch.randint(1, VOCAB, (40,), generator=gen))
                              for _ in range(40)))
    folder = exported["llama"]
    base = [f"data.path={text}", f"data.tokenizer={folder}", f"data.cache_dir={tmp_path / 'cache'}",
            "logging.progress=false", "logging.wandb.mode=disabled", f"model.init_from={folder}"]
    resume = step_path(saved[0] / "ckpt" / "llama", SAVE_STEP)
    resumed = ["train.steps=3", f"checkpoint.resume={resume}", "checkpoint.allow_changes=true"]  # other data
    for name, extra in (("init", ["train.steps=1"]), ("resume", resumed)):
        run(_cfg("llama", Case(), 1, *base, *extra, f"logging.dir={tmp_path / name}"))
        err = capsys.readouterr().err
        if name == "init":
            assert f"model: initialised from {folder} (transformers llama" in err, err
        else:
            assert f"note: model.init_from={folder} ignored: resuming {resume} wins" in err, err
            assert "initialised from" not in err and f"resumed {resume} at step {SAVE_STEP}" in err, err


def test_init_from_reads_sharded_and_base_model_folders(tmp_path: Path, exported: dict[str, Path]) -> None:
    """A `model.safetensors.index.json` over two shards, with GPT2Model's names (no `transformer.`
    prefix, no lm_head), loads the same weights as the exported folder."""
    from safetensors.torch import load_file, save_file

    src = exported["gpt"]
    state = {k.removeprefix("transformer."): v for k, v in load_file(str(src / "model.safetensors")).items()}
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    folder = tmp_path / "sharded"
    folder.mkdir()
    shutil.copy(src / "config.json", folder)
    for file, keys in shards.items():
        save_file({k: state[k].contiguous() for k in keys}, str(folder / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = _cfg("gpt", Case(), 1).model
    models = [torch.nn.ModuleList([build_model(cfg, VOCAB, seed=s)]) for s in (1, 2)]
    load_pretrained(models[0], src, cfg, VOCAB)
    load_pretrained(models[1], folder, cfg, VOCAB)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b), name

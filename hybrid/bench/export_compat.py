"""Does an exported folder load on the oldest transformers hybrid declares, and give the same logits?

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.export_compat [--transformers 4.46.3 ...] [--venv DIR]

1. venvs: per `--transformers` version a venv with `--system-site-packages` (this interpreter's torch,
   numpy, safetensors, ... are used, never downloaded: a constraint file pins torch to the installed
   version) into which pip installs `transformers==<version>` and what pip resolves for it (an older
   tokenizers and huggingface_hub shadow the installed ones inside the venv only). Cached under
   `--venv` (default `$HYBRID_CACHE/venvs/transformers-<version>`, else `~/.cache/hybrid/venvs/...`)
   and reused while its stamp matches (version, interpreter, torch).
2. checkpoints: a tiny GPT and a tiny Llama (2 layers, width 64; the Llama with rope_theta=50000, so a
   RoPE setting that only transformers 5 reads would show in the logits), each trained one step by
   `hybrid.train.run` in this process on generated text: the data pipeline's own byte-level BPE, saved
   by the checkpointer with the current transformers.
3. export: each checkpoint with `hybrid.tools.export` (this environment's transformers, its own check
   against our logits included) in fp32 and in bf16: four folders.
4. load: `export_compat_load.py` (torch + transformers only) runs on the four folders in this
   environment (the reference) and in each venv: AutoTokenizer, AutoModelForCausalLM in the folder's
   dtype, logits on a fixed batch, pipeline("text-generation") greedy for 4 tokens.

A version passes when every folder loads with no missing/unexpected keys as the family's class, in
the folder's dtype, with pad = eos in tokenizer and config, the prompt's ids and (fp32) the generated
ids equal to the reference's, 4 new tokens, and max |Δlogits| vs the reference within 1e-4 (fp32) or
3e-2 (bf16) of max(1, max |logits|). One table row per transformers version; exit status 0 when all
pass, 1 when one fails (or cannot be installed), 2 for a bad command line.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from hybrid.bench.common import table, verdict

MODULE = "hybrid.bench.export_compat"
FLOOR = "4.46.3"
LOADER = Path(__file__).with_name("export_compat_load.py")
FAMILIES = {"gpt": ("model=gpt-tiny",),
            "llama": ("model=llama-tiny", "model.n_kv_heads=1", "model.ffn_hidden=176", "model.rope_theta=50000")}
CLASSES = {"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
DTYPES = ("fp32", "bf16")
RTOL = {"fp32": 1e-4, "bf16": 3e-2}  # max |Δlogits| between versions, relative to max(1, max |logits|)
TEXT = "the quick brown fox"
INSTALL_TIMEOUT_S = 600
LOAD_TIMEOUT_S = 300


class InstallError(RuntimeError):
    """pip could not install the version into its venv."""


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    p.add_argument("--transformers", nargs="+", default=[FLOOR], help="versions to test (default: the floor)")
    p.add_argument("--venv", default=None, help="the venv folder (one version only; default: "
                   "$HYBRID_CACHE/venvs/transformers-<version>)")
    args = p.parse_args(argv)
    if args.venv is not None and len(args.transformers) != 1:
        p.error("--venv names the venv of one version; give one --transformers version with it")
    return args


def venv_dir(version: str, override: Optional[str]) -> Path:
    """`override`, else `$HYBRID_CACHE/venvs/transformers-<version>` (the data cache's root, as hybrid.data)."""
    if override is not None:
        return Path(override)
    root = Path(os.environ.get("HYBRID_CACHE") or Path.home() / ".cache" / "hybrid").expanduser()
    return root / "venvs" / f"transformers-{version}"


def _stamp(version: str) -> str:
    return json.dumps({"transformers": version, "python": sys.executable, "torch": torch.__version__})


def _run(cmd: Sequence[str], timeout: float, env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, env=env)


def _venv_env() -> dict[str, str]:
    """The environment of a venv's processes: no PYTHONPATH or user site that could shadow its packages."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return env | {"PYTHONNOUSERSITE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def make_venv(path: Path) -> Path:
    """A fresh venv at `path` that sees this interpreter's packages (--system-site-packages, plus a .pth
    to this interpreter's site-packages when it is itself a venv) and a `constraints.txt` pinning torch to
    the installed build; returns its python."""
    import site

    shutil.rmtree(path, ignore_errors=True)
    bare = ["--without-pip"] if _host_pip() else []  # this interpreter's pip installs into it (`_create_venv`)
    _run([sys.executable, "-m", "venv", "--system-site-packages", *bare, path], 120).check_returncode()
    python = path / "bin" / "python"
    if sys.prefix != sys.base_prefix:
        purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], 60).stdout.strip()
        (Path(purelib) / "hybrid-parent-site.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    (path / "constraints.txt").write_text(f"torch=={torch.__version__}\n")
    return python


def _create_venv(path: Path, version: str) -> None:
    """`make_venv`, then pip: `transformers==version` with torch pinned to the installed one."""
    python = make_venv(path)
    pip = [sys.executable, "-m", "pip", "--python", python] if _host_pip() else [python, "-m", "pip"]
    r = _run([*pip, "install", "-q", "--disable-pip-version-check", "--no-compile", "-c", path / "constraints.txt",
              f"transformers=={version}"], INSTALL_TIMEOUT_S, _venv_env())
    if r.returncode != 0:
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("ERROR")] or r.stderr.splitlines()[-1:]
        raise InstallError(f"pip install transformers=={version}: {' '.join(lines)[:300]}")


def _host_pip() -> bool:
    """Whether this interpreter's pip can install into another interpreter (`--python`, pip >= 22.3): the venv then
    needs no pip of its own (ensurepip: ~7 CPU-s). With `--no-compile` the install takes 8 CPU-s instead of 20;
    what the load imports compiles then."""
    try:
        import pip
    except ImportError:
        return False
    return tuple(int(x) for x in pip.__version__.split(".")[:2] if x.isdigit()) >= (22, 3)


def venv_ready(path: Path, version: str) -> bool:
    """Whether `path` holds a finished venv of transformers==`version` for this interpreter and torch."""
    stamp = path / ".hybrid-venv.json"
    return stamp.is_file() and stamp.read_text() == _stamp(version) and (path / "bin" / "python").exists()


def ensure_venv(path: Path, version: str) -> Path:
    """The python of a venv with transformers==`version` at `path`: reused when ready, else (re)built
    under a file lock (two runs never build the same venv at once); the stamp is written last."""
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if not venv_ready(path, version):
            _create_venv(path, version)
            (path / ".hybrid-venv.json").write_text(_stamp(version))
    return path / "bin" / "python"


def _text(n_words: int = 4000, seed: int = 0) -> str:
    words = ("the quick brown fox jumps over a lazy dog while seven birds sing of far away hills and "
             "rivers that run to the sea").split()
    rng = np.random.default_rng(seed)
    return "\n".join(" ".join(words[i] for i in rng.integers(0, len(words), 40)) for _ in range(n_words // 40))


def make_checkpoint(work: Path, family: str) -> Path:
    """A tiny model of `family` trained one step by `hybrid.train.run` on generated text; its checkpoint."""
    from hybrid.checkpoint import step_path
    from hybrid.config import compose_config
    from hybrid.train import run

    (work / "corpus.txt").write_text(_text())
    cfg = compose_config([*FAMILIES[family], "model.n_layers=2", "model.hidden=64", "model.n_heads=2",
                          "model.max_seq_len=64", "parallel=single", "data=local", f"data.path={work / 'corpus.txt'}",
                          "data.vocab_size=300", f"data.cache_dir={work / 'cache'}", "data.seq_len=32",
                          "train.steps=1", "train.micro_batch_size=4", "train.global_batch_size=4",
                          "train.eval_every=0", "train.device=cpu", "checkpoint.every=1",
                          f"checkpoint.dir={work / 'ckpt'}", f"run_name={family}",
                          f"logging.dir={work / 'logs' / family}", "logging.progress=false",
                          "logging.wandb.mode=disabled"])
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        run(cfg)
    return step_path(work / "ckpt" / family, 1)


def export_folders(work: Path) -> tuple[dict[str, Path], dict[str, float]]:
    """The four exported folders (family × dtype) and the export's own max |Δlogits| vs our model."""
    from hybrid.tools.export import Options, export

    folders, checks = {}, {}
    for family in FAMILIES:
        ckpt = make_checkpoint(work, family)
        for dtype in DTYPES:
            name = f"{family}-{dtype}"
            report = export(Options(ckpt, work / "exported" / name, dtype=dtype))
            folders[name], checks[name] = report.out, float(report.max_abs_diff or 0.0)
    return folders, checks


def run_loader(python: Path | str, spec: Path, out: Path, env: Optional[dict[str, str]]) -> dict[str, Any]:
    """`export_compat_load.py` under `python`; its result.json (the tensors stay in `out`)."""
    r = _run([python, LOADER, spec, out], LOAD_TIMEOUT_S, env)
    if r.returncode != 0 or not (out / "result.json").is_file():
        tail = r.stderr.strip().splitlines()[-1:] or ["no output"]
        return {"versions": {}, "error": f"the loader exited {r.returncode}: {tail[0][:300]}"}
    return json.loads((out / "result.json").read_text())


def folder_problems(name: str, got: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    """What is wrong with one folder's result `got` (the reference's `ref` gives the expected ids)."""
    family, dtype = name.split("-")
    if "error" in got:
        return [f"{name}: {got['error']}"]
    want = {"model": CLASSES[family], "dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype],
            "pad_token_id": got["eos_token_id"], "config_pad_token_id": got["eos_token_id"],
            "prompt_ids": ref.get("prompt_ids")}
    if dtype == "fp32":
        want["generated_ids"] = ref.get("generated_ids")
    bad = [f"{name}: {k}={got.get(k)!r}, expected {v!r}" for k, v in want.items() if got.get(k) != v]
    if got.get("eos_token_id") is None or len(got.get("generated_ids", [])) != 4:
        bad.append(f"{name}: eos {got.get('eos_token_id')}, generated {got.get('generated_ids')}")
    return bad


def logits_diff(name: str, out: Path, ref_out: Path) -> tuple[float, bool]:
    """max |Δlogits| of `name` between a version's and the reference's, and whether it is within RTOL."""
    got, ref = torch.load(out / f"{name}.pt"), torch.load(ref_out / f"{name}.pt")
    diff = (got - ref).abs().max().item()
    return diff, diff <= RTOL[name.split("-")[1]] * max(1.0, ref.abs().max().item())


def compare(result: dict[str, Any], out: Path, ref: dict[str, Any], ref_out: Path) -> tuple[dict[str, float],
                                                                                           list[str]]:
    """One version against the reference: the max |Δlogits| per dtype (of the folders that loaded)
    and the list of problems."""
    if "error" in result:
        return {}, [result["error"]]
    problems: list[str] = []
    diffs: dict[str, float] = {}
    for name, got in result["folders"].items():
        found = folder_problems(name, got, ref["folders"].get(name, {}))
        if not found:
            diff, ok = logits_diff(name, out, ref_out)
            dtype = name.split("-")[1]
            diffs[dtype] = max(diffs.get(dtype, 0.0), diff)
            found = [] if ok else [f"{name}: max |Δlogits| {diff:.3g} vs the reference"]
        problems += found
    return diffs, problems


def row(version: str, result: dict[str, Any], diffs: dict[str, float], problems: list[str],
        reference: bool) -> list[Any]:
    v = result.get("versions", {})
    folders = result.get("folders", {})
    loaded = sum("error" not in f for f in folders.values())
    toks = sorted({f["tokenizer"] for f in folders.values() if "tokenizer" in f}) or ["-"]
    cells = [f"{d:.3g}" if d is not None else "-" for d in (diffs.get(t) for t in DTYPES)]
    return [v.get("transformers", version) + (" (current)" if reference else ""), v.get("tokenizers", "-"),
            v.get("huggingface_hub", "-"), f"{loaded}/{len(FAMILIES) * len(DTYPES)}", ", ".join(toks),
            *(["ref", "ref"] if reference else cells), verdict(not problems)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    print(f"# {MODULE} — python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"transformers {importlib.metadata.version('transformers')} (current)\n# command: "
          f"OMP_NUM_THREADS=1 PYTHONPATH=. python -m {MODULE} --transformers {' '.join(args.transformers)}"
          + (f" --venv {args.venv}" if args.venv else ""), flush=True)
    pythons: dict[str, Any] = {}
    for version in args.transformers:
        try:
            pythons[version] = ensure_venv(venv_dir(version, args.venv), version)
        except (InstallError, subprocess.SubprocessError, OSError) as e:
            pythons[version] = e
    with tempfile.TemporaryDirectory(prefix="hybrid-export-compat-") as tmp:
        rows, failed, notes = _load_everywhere(Path(tmp), pythons)
    print("\n".join(table(["transformers", "tokenizers", "huggingface_hub", "folders loaded", "AutoTokenizer",
                           "max abs Δlogits fp32", "max abs Δlogits bf16", "result"], rows)))
    print("\n".join(notes) + f"\n# {time.perf_counter() - t0:.0f} s", flush=True)
    return 1 if failed else 0


def _load_everywhere(work: Path, pythons: dict[str, Any]) -> tuple[list[list[Any]], bool, list[str]]:
    """Export the four folders, load them here (the reference) and under each version; rows and notes."""
    folders, checks = export_folders(work)
    spec = work / "spec.json"
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0)).tolist()
    spec.write_text(json.dumps({"folders": {k: str(v) for k, v in folders.items()}, "ids": ids, "text": TEXT}))
    ref = run_loader(sys.executable, spec, work / "ref", {**os.environ, "OMP_NUM_THREADS": "1"})
    _, ref_problems = compare(ref, work / "ref", ref, work / "ref")
    rows = [row("current", ref, {}, ref_problems, True)]
    notes = ["# export's own check (ours vs current transformers): "
             + ", ".join(f"{k} {v:.3g}" for k, v in checks.items())] + [f"# current: {p}" for p in ref_problems]
    for version, python in pythons.items():
        if isinstance(python, Exception):
            rows.append([version, "-", "-", "-", "-", "-", "-", verdict(False)])
            notes.append(f"# {version}: cannot install: {python}")
            continue
        out = work / f"v{version}"
        result = run_loader(python, spec, out, _venv_env())
        diffs, problems = compare(result, out, ref, work / "ref")
        if result.get("versions", {}).get("transformers", version) != version:
            problems.append(f"the venv runs transformers {result['versions']['transformers']}, not {version}")
        rows.append(row(version, result, diffs, problems, False))
        notes += [f"# {version}: {p}" for p in problems]
    return rows, bool(ref_problems) or any(r[-1] != verdict(True) for r in rows), notes


if __name__ == "__main__":
    sys.exit(main())

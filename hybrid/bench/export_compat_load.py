"""Load exported folders the way users do, under whatever transformers this interpreter has.

    python hybrid/bench/export_compat_load.py SPEC.json OUT_DIR

Run by path, never as `hybrid.bench...`: it imports only torch and transformers, so it runs in a
venv whose transformers differs from the one hybrid needs (`hybrid.bench.export_compat`). SPEC holds
`folders` (name → exported folder), `ids` (a batch of token ids) and `text` (a prompt). For each
folder: `AutoTokenizer.from_pretrained`, `AutoModelForCausalLM.from_pretrained` in the folder's own
dtype (`torch_dtype="auto"` on 4.x, `dtype="auto"` on 5.x; no missing or unexpected keys allowed),
its logits on `ids` (saved as OUT_DIR/<name>.pt, in fp32), and `pipeline("text-generation")` on the
folder path, greedy, 4 new tokens. OUT_DIR/result.json: the library versions and, per folder, the
classes, dtype, pad/eos ids, the prompt's ids, the generated ids, or the error that stopped it.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

NEW_TOKENS = 4
LIBRARIES = ("transformers", "tokenizers", "huggingface_hub", "torch", "safetensors")


def dtype_auto() -> dict[str, str]:
    """`dtype="auto"` under transformers 5 (`torch_dtype` is its deprecated spelling); `torch_dtype` on 4.x."""
    return {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": "auto"}


@torch.no_grad()
def load_one(folder: str, ids: list[list[int]], text: str, out: Path) -> dict[str, Any]:
    """Everything a user does with `folder`; the logits go to `out`."""
    tok = AutoTokenizer.from_pretrained(folder)
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, **dtype_auto())
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise RuntimeError(f"loading info {bad}")
    torch.save(model.eval()(torch.tensor(ids)).logits.float(), out)
    pipe = pipeline("text-generation", model=folder, **dtype_auto())
    gen = pipe(text, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, return_tensors=True)
    prompt = tok(text)["input_ids"]
    return {"model": type(model).__name__, "dtype": str(model.dtype).removeprefix("torch."),
            "tokenizer": type(tok).__name__, "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
            "config_pad_token_id": model.config.pad_token_id, "prompt_ids": prompt,
            "generated_ids": [int(i) for i in gen[0]["generated_token_ids"]][len(prompt):]}


def main(argv: list[str]) -> int:
    spec, out = json.loads(Path(argv[0]).read_text(encoding="utf-8")), Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.set_num_threads(1)
    result: dict[str, Any] = {"versions": {n: importlib.metadata.version(n) for n in LIBRARIES}, "folders": {}}
    for name, folder in spec["folders"].items():
        try:
            result["folders"][name] = load_one(folder, spec["ids"], spec["text"], out / f"{name}.pt")
        except Exception as e:  # noqa: BLE001  (any failure is this version's result, reported by the caller)
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            result["folders"][name] = {"error": f"{type(e).__name__}: {first}"}
    (out / "result.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The export's folder fix-ups (`hybrid.tools.export_files`), without a model or a checkpoint.

- the data pipeline's own byte-level BPE tokenizer, saved by the installed transformers and copied
  by `copy_tokenizer`: its tokenizer_config.json names a class that transformers 4 has
  (`PreTrainedTokenizerFast`, not transformers 5's `TokenizersBackend`), pad = eos, no load-time
  keys, `model_max_length` capped; `AutoTokenizer` loads it and encodes exactly as the
  `tokenizers` library does from the same tokenizer.json;
- classes both major versions know are kept, an existing pad token too;
- config.json gets transformers 4's `torch_dtype` and `rope_theta` (`rope_scaling` for a non-default
  RoPE) next to transformers 5's `dtype` and `rope_parameters`;
- `cast_state` keeps a tied head tied; `staging` creates missing parents, and removes them again
  (and the temporary folder) when the body fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybrid.data import EOS_TOKEN
from hybrid.data.tokenize import train_tokenizer
from hybrid.tools.export_files import cast_state, copy_tokenizer, legacy_config, staging, tokenizer_config

DOCS = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs"] * 20


def test_the_data_pipelines_tokenizer_is_written_for_transformers_4_and_5(tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    src, dst = tmp_path / "ckpt-tokenizer", tmp_path / "out"
    train_tokenizer(DOCS, 300).save_pretrained(str(src))
    dst.mkdir()
    assert copy_tokenizer(src, dst, max_len=64) and not copy_tokenizer(tmp_path / "none", dst, 64)
    written = json.loads((dst / "tokenizer_config.json").read_text())
    assert written["tokenizer_class"] == "PreTrainedTokenizerFast", written
    assert written["pad_token"] == written["eos_token"] == EOS_TOKEN and written["model_max_length"] == 64
    assert not {"is_local", "local_files_only"} & set(written)
    tok = AutoTokenizer.from_pretrained(str(dst))
    assert tok.pad_token_id == tok.eos_token_id == tok.convert_tokens_to_ids(EOS_TOKEN)
    raw = Tokenizer.from_file(str(src / "tokenizer.json"))
    text = "the lazy  fox\n packs five jugs"
    assert tok(text)["input_ids"] == raw.encode(text).ids and tok.decode(tok(text)["input_ids"]) == text


@pytest.mark.parametrize(("given", "fast", "expected"), [
    ("TokenizersBackend", True, "PreTrainedTokenizerFast"),
    (None, True, "PreTrainedTokenizerFast"),
    (None, False, None),
    ("GPT2Tokenizer", True, "GPT2Tokenizer"),
    ("LlamaTokenizerFast", True, "LlamaTokenizerFast"),
])
def test_tokenizer_class_names(given: str | None, fast: bool, expected: str | None) -> None:
    config = {"eos_token": "</s>", "pad_token": "<pad>", "model_max_length": 16}
    out = tokenizer_config(config | ({"tokenizer_class": given} if given else {}), 1024, fast)
    assert out.get("tokenizer_class") == expected
    assert out["pad_token"] == "<pad>" and out["model_max_length"] == 16  # kept: already set, already smaller


def test_config_gets_transformers_4_spellings() -> None:
    llama = {"dtype": "bfloat16", "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}}
    assert legacy_config(llama) == llama | {"torch_dtype": "bfloat16", "rope_theta": 50000.0}
    scaled = {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}
    assert legacy_config(scaled)["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert legacy_config({"model_type": "gpt2"}) == {"model_type": "gpt2"}


def test_cast_state_keeps_a_tied_head_tied() -> None:
    emb = torch.randn(5, 3)
    out = cast_state({"wte.weight": emb, "lm_head.weight": emb, "h.weight": torch.randn(3, 3)}, torch.bfloat16)
    assert out["wte.weight"] is out["lm_head.weight"] and out["wte.weight"].dtype == torch.bfloat16
    assert torch.equal(out["wte.weight"], emb.to(torch.bfloat16)) and out["h.weight"].dtype == torch.bfloat16


def test_staging_creates_parents_and_removes_them_on_failure(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b" / "model"
    with pytest.raises(RuntimeError, match="boom"), staging(out, 7) as tmp:
        assert tmp.is_dir() and tmp.parent == out.parent
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    with staging(out, 7) as tmp:
        tmp.rename(out)  # what publish does
    assert out.is_dir() and sorted(p.name for p in out.parent.iterdir()) == ["model"]

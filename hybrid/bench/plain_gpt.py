"""A plain GPT-2 in the nanoGPT style, for `bench.vs_plain_loop`: what a PyTorch user writes by hand.

One `nn.Module`: token and learned position embeddings, pre-norm blocks (LayerNorm, fused qkv Linear,
`scaled_dot_product_attention(is_causal=True)`, output Linear; LayerNorm, Linear → GELU(tanh) → Linear),
a final LayerNorm and a head tied to the token embedding; the loss is `F.cross_entropy` on the logits.
It loads a `GPT2LMHeadModel` state dict (`hybrid.model.hf.to_hf_state_dict` of a hybrid gpt model), so
both loops start from the same weights and their first losses agree to rounding.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.config import ModelConfig
from hybrid.model.family import ffn_hidden


class Block(nn.Module):
    """LayerNorm → causal self-attention → residual; LayerNorm → GELU MLP → residual."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden
        self.heads = cfg.n_heads
        self.ln_1, self.ln_2 = nn.LayerNorm(h, eps=cfg.norm_eps), nn.LayerNorm(h, eps=cfg.norm_eps)
        self.c_attn, self.attn_proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.c_fc, self.mlp_proj = nn.Linear(h, ffn_hidden(cfg)), nn.Linear(ffn_hidden(cfg), h)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in self.c_attn(x).split(h, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.attn_proj(y.transpose(1, 2).reshape(b, s, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    """The whole model in one module; `forward(ids, targets)` returns the mean cross-entropy."""

    def __init__(self, cfg: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, cfg.hidden)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.hidden)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


HF_NAMES = {"ln_1": "ln_1", "ln_2": "ln_2", "c_attn": "attn.c_attn", "attn_proj": "attn.c_proj",
            "c_fc": "mlp.c_fc", "mlp_proj": "mlp.c_proj"}
"""PlainGPT block module → GPT2LMHeadModel's; its Conv1D weights are stored [in, out], ours [out, in]."""


def hf_to_plain(hf: Mapping[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """A GPT2LMHeadModel state dict renamed (and its Conv1D weights transposed) for `PlainGPT`."""
    out = {"wte.weight": hf["transformer.wte.weight"], "wpe.weight": hf["transformer.wpe.weight"],
           "ln_f.weight": hf["transformer.ln_f.weight"], "ln_f.bias": hf["transformer.ln_f.bias"]}
    for i in range(n_layers):
        for ours, theirs in HF_NAMES.items():
            w = hf[f"transformer.h.{i}.{theirs}.weight"]
            out[f"h.{i}.{ours}.weight"] = w if ours.startswith("ln") else w.t().contiguous()
            out[f"h.{i}.{ours}.bias"] = hf[f"transformer.h.{i}.{theirs}.bias"]
    return out

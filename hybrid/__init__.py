"""hybrid: a Megatron-style hybrid-parallel (DP × TP × PP) LLM trainer on PyTorch."""

import os

from hybrid.lifeline import hold

hold(os.environ)  # under torchrun, this process dies with its agent; first, before torch is even imported

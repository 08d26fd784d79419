"""hybrid: a Megatron-style hybrid-parallel (DP × TP × PP) LLM trainer on PyTorch."""

"""DP gradient communication hooks (the DDP comm-hook protocol)."""

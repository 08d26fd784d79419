"""Which samples a step reads: the DP-sharded, resumable training order and the eval batches.

`StepSampler` and `eval_indices` pick the same global samples for every (dp, microbatches) layout
with the same global batch, so a run resumed under another layout continues the same stream.
`batch_from` turns packed samples of seq_len + 1 tokens into (input_ids, labels).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class StepSampler:
    """Deterministic, DP-sharded, resumable sample order (Megatron's consumed-samples convention).

    The stream is perm(seed, 0) ++ perm(seed, 1) ++ ... over range(num_samples); a step consumes
    stream positions [consumed, consumed + G), G = micro_batch_size · num_microbatches · dp_size.
    Microbatch j of DP rank d reads positions consumed + j·dp_size·mbs + d·mbs + [0, mbs), so the
    set of samples of a step depends only on G, never on how it is split.
    """

    def __init__(self, num_samples: int, micro_batch_size: int, num_microbatches: int, dp_size: int,
                 dp_rank: int, seed: int, consumed_samples: int = 0) -> None:
        if min(num_samples, micro_batch_size, num_microbatches, dp_size) < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"bad sampler arguments: num_samples={num_samples} mbs={micro_batch_size} "
                             f"microbatches={num_microbatches} dp={dp_size} rank={dp_rank}")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.num_samples, self.micro_batch_size, self.num_microbatches = num_samples, micro_batch_size, num_microbatches
        self.dp_size, self.dp_rank, self.seed = dp_size, dp_rank, int(seed)
        self._consumed = int(consumed_samples)
        self._perms: dict[int, np.ndarray] = {}

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.dp_size

    @property
    def consumed_samples(self) -> int:
        return self._consumed

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            rng = np.random.default_rng([self.seed % (1 << 64), epoch])
            self._perms[epoch] = rng.permutation(self.num_samples)
        return self._perms[epoch]

    def indices_at(self, positions: np.ndarray) -> np.ndarray:
        """Sample indices at the given stream positions."""
        epochs, offsets = np.divmod(np.asarray(positions, dtype=np.int64), self.num_samples)
        out = np.empty_like(offsets)
        for e in np.unique(epochs):
            mask = epochs == e
            out[mask] = self._perm(int(e))[offsets[mask]]
        return out

    def next_step(self) -> list[np.ndarray]:
        """This rank's index array for each microbatch of the next step; advances consumed_samples by G."""
        mbs, stride = self.micro_batch_size, self.dp_size * self.micro_batch_size
        base = self._consumed + self.dp_rank * mbs
        out = [self.indices_at(base + j * stride + np.arange(mbs)) for j in range(self.num_microbatches)]
        self._consumed += self.global_batch_size
        return out

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self._consumed, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved position; the saved seed wins so the stream continues exactly."""
        self._consumed, self.seed = int(state["consumed_samples"]), int(state["seed"])
        self._perms.clear()


def batch_from(samples: np.ndarray, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), both int64 [len(idx), seq_len], from packed samples of seq_len + 1 tokens."""
    rows = np.asarray(samples[np.asarray(idx, dtype=np.int64)], dtype=np.int64)
    return torch.from_numpy(np.ascontiguousarray(rows[:, :-1])), torch.from_numpy(np.ascontiguousarray(rows[:, 1:]))


def eval_indices(num_eval: int, micro_batch_size: int, dp_size: int, dp_rank: int,
                 num_batches: int) -> list[np.ndarray]:
    """This rank's eval microbatches: global eval batch b covers positions b·G' + [0, G'), G' = mbs·dp,
    rank d takes b·G' + d·mbs + [0, mbs); positions wrap modulo num_eval. The global set is the first
    num_batches·mbs·dp positions, so it is layout-independent when that product is."""
    if num_eval < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"bad eval arguments: num_eval={num_eval} dp={dp_size} rank={dp_rank}")
    stride = micro_batch_size * dp_size
    return [(b * stride + dp_rank * micro_batch_size + np.arange(micro_batch_size)) % num_eval
            for b in range(num_batches)]

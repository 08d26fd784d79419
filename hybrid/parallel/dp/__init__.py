"""Data-parallel gradient mechanics: which parameters share a bucket (`buckets.py`), `GradSync` and
`finalize_grads` (`data.py`: the bucketed comm hooks launched inside the backward), and the gradient reads
and sums every optimizer shares (`grads.py`). How replicas agree is `hybrid.sync`'s."""

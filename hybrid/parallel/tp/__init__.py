"""Tensor parallelism: column- and row-parallel linear layers, the vocabulary-parallel embedding and
cross-entropy, sequence parallelism (`tensor.py`); its region ops live in `parallel/collectives.py`."""

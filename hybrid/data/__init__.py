"""Data: documents → tokenizer → token stream → packed samples.

`prepare_data(cfg.data, init_from=cfg.model.init_from)` returns a `Corpus`. Its parts:
- `sources`: where documents come from (the embedded stdlib corpus, local files, a `save_to_disk`
  folder, a hub dataset from the local cache or streamed), each as a one-column `datasets` table;
- `tokenize`: the trained byte-level BPE or a local transformers tokenizer, and the encoding;
- `build`: the cache builder, on disk at every step (`datasets.map` into Arrow, then into tokens.npy);
- `cache`: the key, the lock, the atomic publication of an entry;
- `tokens`: pre-tokenized .bin/.npy input read as a memmap, and the .npy writer;
- `corpus`: `prepare_data`, `Corpus`, packing.
"""

from hybrid.data.corpus import Corpus, prepare_data
from hybrid.data.tokenize import EOS_TOKEN, encode_documents

__all__ = ["EOS_TOKEN", "Corpus", "encode_documents", "prepare_data"]

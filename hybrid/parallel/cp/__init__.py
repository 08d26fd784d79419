"""Context parallelism: each CP rank holds `seq_len / cp` tokens of every sequence.

`sharding.py` lays the sequence out load-balanced (2·cp chunks, rank i holding chunks i and 2·cp−1−i, so every
rank does the same causal attention work) and gives each token its true position; `blocks.py` is attention on
one pair of sequence blocks with its log-sum-exp (torch's fused CPU kernel, or fp32 math with seeded dropout),
and the merge of partial results; `ring.py` is ring attention
(K/V blocks passed around the CP ring, each transfer overlapped with the block in hand), its communication in
`comm.py`; `ulysses.py` is the all-to-all alternative (whole sequences of 1/cp of the heads).
"""

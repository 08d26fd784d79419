"""hybrid.rdzv_timeout: torchrun's rendezvous-timeout traceback becomes one line; everything else passes
through unchanged, and a line that cannot begin a traceback is let out before its newline arrives."""

from __future__ import annotations

import pytest

from hybrid.rdzv_timeout import Filter

LINE = "multinode.sh: error: timed out"
AGENT = b"""Traceback (most recent call last):
  File "/venv/bin/torchrun", line 8, in <module>
    sys.exit(main())
             ^^^^^^
  File "/venv/torch/distributed/elastic/rendezvous/dynamic_rendezvous.py", line 680, in run
    raise RendezvousTimeoutError
torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError
"""
RANK = b"""[rank1]: step 3\r\nTraceback (most recent call last):
  File "train.py", line 1, in <module>
ValueError: boom

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "train.py", line 3, in <module>
KeyError: 'RendezvousTimeoutError'
"""


def through(data: bytes, size: int) -> bytes:
    """`data` fed in pieces of `size` bytes, then what is held at the end."""
    f = Filter(LINE)
    return b"".join(f.feed(data[i:i + size]) for i in range(0, len(data), size)) + f.release()


@pytest.mark.parametrize("size", [1, 7, 1 << 16])
def test_the_timeout_traceback_becomes_one_line_and_the_rest_is_unchanged(size: int) -> None:
    assert through(b"ok\n" + AGENT, size) == b"ok\n" + LINE.encode() + b"\n"
    assert through(RANK, size) == RANK
    assert through(b"50%|#####     | 5/10\r60%|###", size) == b"50%|#####     | 5/10\r60%|###"


def test_only_what_may_begin_a_traceback_waits_for_its_newline() -> None:
    f = Filter(LINE)
    assert f.feed(b"step 1/10") == b"step 1/10"  # cannot begin a traceback: out at once
    assert f.feed(b" loss 2.3\nTrace") == b" loss 2.3\n"
    assert f.release() == b"Trace"  # after a pause, what waited goes out, and the rest of its line follows
    assert f.feed(b"back (most recent call last):\n") == b"back (most recent call last):\n"

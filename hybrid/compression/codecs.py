"""int8, int4, sign (1-bit) and top-k: codecs run by one two-phase compressed all-reduce.

Summing compressed values directly would overflow int8 and lose sign bits, so every codec here
runs the same exchange (the scheme of 1-bit Adam's compressed all-reduce):

  1. pad the bucket to n chunks of L elements (n = DP size), encode each chunk to E bytes;
  2. **all-to-all**: rank j receives chunk j from every rank;
  3. decode the n copies of chunk j, average them in fp32, encode the average again;
  4. **all-gather** the re-encoded chunks; every rank decodes the whole bucket.

Each rank sends (n−1)·E bytes in each collective, against the 2(n−1)/n·4·N bytes of a ring
all-reduce of N fp32 elements: the ratio is 4N/(n·E) whatever n is. The counted payload per
bucket is `payload_bytes` = 2·n·E (the all-to-all's input plus the all-gather's output).

Error feedback (sign, top-k): the *worker* residual keeps what step 1 lost on this rank, the
*server* residual what step 3 lost on the chunk this rank owns; both are added back next step,
so the applied updates track the true gradients' sum (residuals stay bounded).

A codec is anything with the four methods of `Codec`. `CODECS` registers each under its
`compression=<method>` name with how to build it from the compression config and whether it runs
with error feedback; `hooks.py` turns every entry into a two-phase method. A new codec is one
class and one line there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from hybrid.compression.defaults import density_of
from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group

if TYPE_CHECKING:
    from hybrid.config import CompressionConfig

_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


@runtime_checkable
class Codec(Protocol):
    """A chunk encoding for the two-phase exchange. `encode` takes a float32 chunk of `chunk_len(n)`
    elements (n elements are the rank's share, padding added) and returns `encoded_bytes(length)`
    uint8s; `decode(data, length)` returns the float32 approximation of the chunk."""

    def chunk_len(self, n: int) -> int:
        """The padded length of a chunk that must hold `n` elements (a multiple of the codec's block)."""

    def encoded_bytes(self, length: int) -> int:
        """Bytes of one encoded chunk of `length` elements (the same on every rank: all-to-all needs it)."""

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """float32 chunk → uint8 bytes."""

    def decode(self, data: torch.Tensor, length: int) -> torch.Tensor:
        """uint8 bytes → float32 chunk of `length` elements."""


def _f32_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


class Int8Codec:
    """Block-wise absmax int8: one fp32 scale per `block` elements (x ≈ q · absmax/127)."""

    LEVELS = 127  # q in [−LEVELS, LEVELS]

    def __init__(self, block: int) -> None:
        self.block = block

    def chunk_len(self, n: int) -> int:
        return _round_up(n, self.block)

    def encoded_bytes(self, length: int) -> int:
        return self._packed_bytes(length) + 4 * (length // self.block)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        blocks = x.view(-1, self.block)
        scale = blocks.abs().amax(dim=1) / self.LEVELS
        q = torch.where(scale[:, None] > 0, blocks / scale.clamp_min(1e-30)[:, None], 0.0)
        return torch.cat([self._pack(q.round_().clamp_(-self.LEVELS, self.LEVELS)), _f32_bytes(scale)])

    def decode(self, data: torch.Tensor, length: int) -> torch.Tensor:
        n = self._packed_bytes(length)
        q = self._unpack(data[:n]).view(-1, self.block)
        scale = data[n:].clone().view(torch.float32)  # copied: a row may start unaligned
        return (q * scale[:, None]).view(-1)

    def _packed_bytes(self, length: int) -> int:
        return length

    def _pack(self, q: torch.Tensor) -> torch.Tensor:
        return q.to(torch.int8).view(torch.uint8).view(-1)

    def _unpack(self, data: torch.Tensor) -> torch.Tensor:
        return data.view(torch.int8).float()


class Int4Codec(Int8Codec):
    """Block-wise absmax int4: q in [−7, 7] (x ≈ q · absmax/7), two to a byte as q + 8 in each nibble, one fp32
    scale per `block` elements: 6.4× fewer bytes than fp32 at blocks of 32 (ZeRO++'s gradient quantization)."""

    LEVELS = 7

    def chunk_len(self, n: int) -> int:
        return _round_up(n, math.lcm(self.block, 2))

    def _packed_bytes(self, length: int) -> int:
        return length // 2

    def _pack(self, q: torch.Tensor) -> torch.Tensor:
        nibbles = (q + 8).to(torch.uint8).view(-1, 2)
        return nibbles[:, 0] << 4 | nibbles[:, 1]

    def _unpack(self, data: torch.Tensor) -> torch.Tensor:
        return torch.stack([data >> 4, data & 15], dim=1).view(-1).float() - 8


class Fp8Codec(Int8Codec):
    """Block-wise scaled fp8 (e4m3): each block divided by absmax/448 (e4m3's largest finite value) and rounded to
    fp8, one fp32 scale per `block` elements — int8's bytes, a relative error of at most 2⁻⁴ per element instead
    of an absolute one of absmax/254 (kinder to a block's small values, coarser for its large ones)."""

    LEVELS = 448

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        blocks = x.view(-1, self.block)
        scale = blocks.abs().amax(dim=1) / self.LEVELS
        q = torch.where(scale[:, None] > 0, blocks / scale.clamp_min(1e-30)[:, None], 0.0)
        return torch.cat([q.clamp_(-self.LEVELS, self.LEVELS).to(torch.float8_e4m3fn).view(torch.uint8).view(-1),
                          _f32_bytes(scale)])

    def _unpack(self, data: torch.Tensor) -> torch.Tensor:
        return data.view(torch.float8_e4m3fn).float()


class SignCodec:
    """1 bit per element (the sign, 8 per byte) and one fp32 scale per block: the block's mean
    |x|, which minimises ‖x − scale·sign(x)‖ for a fixed sign pattern."""

    def __init__(self, block: int) -> None:
        self.block = block

    def chunk_len(self, n: int) -> int:
        return _round_up(n, math.lcm(self.block, 8))

    def encoded_bytes(self, length: int) -> int:
        return length // 8 + 4 * (length // self.block)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.view(-1, self.block).abs().mean(dim=1)
        bits = (x >= 0).view(-1, 8).to(torch.uint8) * _BIT_WEIGHTS.to(x.device)
        return torch.cat([bits.sum(dim=1, dtype=torch.uint8), _f32_bytes(scale)])

    def decode(self, data: torch.Tensor, length: int) -> torch.Tensor:
        packed = data[: length // 8]
        bits = (packed[:, None] & _BIT_WEIGHTS.to(data.device)) > 0
        signs = bits.view(-1, self.block).float() * 2 - 1
        scale = data[length // 8:].clone().view(torch.float32)  # copied: a row may start unaligned
        return (signs * scale[:, None]).view(-1)


class TopKCodec:
    """The k = ⌈fraction·L⌉ largest-magnitude elements of a chunk: int32 indices + fp32 values."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction

    def k(self, length: int) -> int:
        return max(1, math.ceil(self.fraction * length))

    def chunk_len(self, n: int) -> int:
        return max(n, 1)

    def encoded_bytes(self, length: int) -> int:
        return 8 * self.k(length)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        idx = x.abs().topk(self.k(x.numel()), sorted=False).indices
        return torch.cat([_f32_bytes(idx.to(torch.int32)), _f32_bytes(x[idx])])

    def decode(self, data: torch.Tensor, length: int) -> torch.Tensor:
        k = self.k(length)
        idx = data[: 4 * k].view(torch.int32).long()
        out = torch.zeros(length, dtype=torch.float32, device=data.device)
        return out.index_put_((idx,), data[4 * k:].view(torch.float32))


@dataclass(frozen=True)
class CodecSpec:
    """A registered codec: how to build it from the `compression` config, and whether the method
    runs with error feedback (when `compression.error_feedback` is on)."""

    build: Callable[[CompressionConfig], Codec]
    error_feedback: bool


CODECS: dict[str, CodecSpec] = {
    "int8": CodecSpec(lambda cfg: Int8Codec(cfg.block_size), error_feedback=False),
    "int4": CodecSpec(lambda cfg: Int4Codec(cfg.block_size), error_feedback=True),  # 15 levels: int8's error × 17
    "sign": CodecSpec(lambda cfg: SignCodec(cfg.block_size), error_feedback=True),
    "topk": CodecSpec(lambda cfg: TopKCodec(density_of(cfg, None)), error_feedback=True),
}
"""`compression=<method>` → the codec its two-phase hook runs (see `registry.REGISTRY`). A config `make_hook` has
resolved carries top-k's density as a number; an unresolved one (no run length) gets the floor (`density_of`)."""

PARAM_CODECS: dict[str, Callable[[int], Codec]] = {"int8": Int8Codec, "fp8": Fp8Codec}
"""`parallel.zero_param_codec=<name>` → the codec of ZeRO-3's parameter all-gather (qwZ), by block size."""


def _round_up(n: int, multiple: int) -> int:
    return max(1, math.ceil(n / multiple)) * multiple


def chunk_len(codec: Codec, numel: int, n: int) -> int:
    """Elements per rank's chunk for a bucket of `numel` elements over `n` ranks."""
    return codec.chunk_len(math.ceil(numel / n))


def payload_bytes(codec: Codec, numel: int, n: int) -> int:
    """Counted bytes of one bucket: all-to-all input n·E plus all-gather output n·E."""
    if n == 1:
        return 0
    return 2 * n * codec.encoded_bytes(chunk_len(codec, numel, n))


@dataclass
class TwoPhaseState:
    """A codec, the DP group, and the error-feedback residuals per bucket index."""

    codec: Codec
    group: Group
    error_feedback: bool
    worker: dict[int, torch.Tensor] = field(default_factory=dict)  # n·L: what encoding lost here
    server: dict[int, torch.Tensor] = field(default_factory=dict)  # L: what re-encoding our chunk lost
    scratch: dict[int, torch.Tensor] = field(default_factory=dict)  # n·L working buffer (not state)
    stream: Optional[Any] = None  # CUDA: the codec's own stream (torch.cuda.Stream), made on first use

    def bucket_setting(self, index: int) -> dict[str, float]:
        """The error budget's figure (`hybrid.record.error_budget`): top-k's (and DGC's) density."""
        return {"density": self.codec.fraction} if isinstance(self.codec, TopKCodec) else {}

    def state_dict(self) -> dict[str, Any]:
        return {"worker": dict(self.worker), "server": dict(self.server)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.worker, self.server = dict(sd["worker"]), dict(sd["server"])


def _residual(store: dict[int, torch.Tensor], index: int, like: torch.Tensor) -> torch.Tensor:
    """The stored residual of bucket `index`, zeroed if missing or of another size (DDP rebuilds)."""
    r = store.get(index)
    if r is None or r.shape != like.shape:
        r = store[index] = torch.zeros_like(like)
    return r


def _padded(st: TwoPhaseState, idx: int, buf: torch.Tensor, size: int) -> torch.Tensor:
    """`buf` copied into bucket `idx`'s padded working buffer (kept across steps: no allocation per call)."""
    x = st.scratch.get(idx)
    if x is None or x.numel() != size or x.device != buf.device:
        x = st.scratch[idx] = torch.zeros(size, dtype=torch.float32, device=buf.device)
    x[: buf.numel()].copy_(buf)
    x[buf.numel():].zero_()
    return x


def done(value: torch.Tensor) -> torch.futures.Future:
    """A future that already holds `value` (no communication was needed)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def exact_mean(t: torch.Tensor, group: Group) -> torch.Tensor:
    """The exact DP mean of `t`, the error meter's reference: one fp32 all-reduce counted under the
    `meter` name (`bytes_meter`), never as training traffic (`bytes_dp`), and timed apart as `meter`."""
    exact = t.clone()
    with C.TIMER.collective(C.group_name(group), "meter"):
        dist.all_reduce(exact, group=group)
    C.COUNTER.record("meter", "all_reduce", exact, C.size(group))
    return exact.div_(C.size(group))


def two_phase_hook(st: TwoPhaseState, bucket: Any) -> torch.futures.Future:
    """all-to-all of encoded chunks → average own chunk → re-encode → all-gather (see module doc)."""
    return two_phase_mean(st, bucket.buffer(), bucket.index())


def two_phase_mean(st: TwoPhaseState, buf: torch.Tensor, idx: int) -> torch.futures.Future:
    """The DP mean of the flat fp32 `buf` through the two-phase exchange, written into `buf` (the future's
    value), with `idx`'s residuals: a gradient bucket's, or (1-bit Adam) a momentum buffer's.

    On CUDA the whole exchange (encode, collectives, decode) is queued on the state's own stream, after the
    compute stream's work so far, and the host returns at once: the codec's kernels run beside the rest of
    the backward instead of in line with it. The future is CUDA-aware: waiting on it makes the waiter's
    stream wait for the codec's. On CPU the gather stays in flight and is decoded by its callback."""
    n = C.size(st.group)
    if n == 1:
        return done(buf)  # nothing to exchange, so nothing to lose
    if not buf.is_cuda:
        return _exchange(st, buf, idx, n)
    if st.stream is None:
        st.stream = torch.cuda.Stream(buf.device)
    st.stream.wait_stream(torch.cuda.current_stream(buf.device))
    with torch.cuda.stream(st.stream):
        _exchange(st, buf, idx, n).wait()  # NCCL's waits order the codec's stream, not the host
        fut: torch.futures.Future = torch.futures.Future(devices=[buf.device])
        fut.set_result(buf)  # records an event on the codec's stream
    return fut


def _exchange(st: TwoPhaseState, buf: torch.Tensor, idx: int, n: int) -> torch.futures.Future:
    """`two_phase_mean`'s exchange on the current stream: all-to-all, average, re-encode, all-gather."""
    length = chunk_len(st.codec, buf.numel(), n)
    x = _padded(st, idx, buf, n * length)
    if st.error_feedback:
        x += _residual(st.worker, idx, x)
    sent = torch.stack([st.codec.encode(c) for c in x.view(n, length)])
    if st.error_feedback:  # worker residual = x − decode(sent), chunk by chunk, in place
        worker = st.worker[idx].view(n, length)
        for c, e in enumerate(sent):
            torch.sub(x[c * length: (c + 1) * length], st.codec.decode(e, length), out=worker[c])
        st.worker[idx][buf.numel():] = 0  # padding is not gradient: nothing to carry over
    received = torch.empty_like(sent)
    C.all_to_all(received, sent, st.group)
    mine = sum(st.codec.decode(e, length) for e in received) / n
    valid = max(0, min(length, buf.numel() - C.rank(st.group) * length))  # our chunk's real elements
    mine[valid:] = 0
    if st.error_feedback:
        mine = mine + _residual(st.server, idx, mine)
    encoded = st.codec.encode(mine)
    if st.error_feedback:
        st.server[idx] = mine - st.codec.decode(encoded, length)
        st.server[idx][valid:] = 0
    gathered = torch.empty_like(sent)
    work = C.all_gather_flat(gathered, encoded, st.group, async_op=not buf.is_cuda)

    def decode_all(_: Any = None) -> torch.Tensor:
        for j, e in enumerate(gathered):  # chunk by chunk into the bucket: no full-size temporary
            part = buf[j * length: (j + 1) * length]
            part.copy_(st.codec.decode(e, length)[: part.numel()])
        return buf

    return done(decode_all()) if work is None else work.get_future().then(decode_all)

"""What of the DP gradient exchange the backward leaves exposed: gradients become final layer by layer, fill buckets
that launch in order, and a link carries one bucket at a time.

hybrid's DP sync (`parallel/dp/data.py`) lays parameters into buckets of `parallel.bucket_mb` in reverse
registration order — the order the backward finishes them — and launches bucket k once its gradients are final
and bucket k − 1 has launched; under ZeRO the buckets are cut inside units (a block's parameters: `assign_units`).
The gradients a stage's backward finishes, in order: an untied head's (its backward runs first), each of its
layers' in turn, and last the embedding's (a tied head's gradient is the embedding's, final only when the
embedding's backward ends it). So the last layer's buckets and the embedding's launch together as the backward
ends, behind whatever the link still carries: that queue, not a uniform spread, is the exposed tail — measured on 2
emulated nodes (`bench.plan_cpu --nodes 2`), three of a dp8 step's seven buckets launched in the backward's last
0.1 s and waited 0.9 s on the link.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """Gradient elements that become final together, `at` a fraction of the backward."""

    elements: float
    at: float


def segments(layer_elements: float, layers: int, embedding: float, early: float) -> list[Segment]:
    """A stage's gradients in the order its backward finishes them: `early` ones at once (an untied head's, other
    chunks' layers), `layers` equal layers at equal steps, the embedding (a tied head's included) at the end."""
    out = [Segment(early, 0.0)] if early else []
    out += [Segment(layer_elements, (i + 1) / layers) for i in range(layers)]
    return out + ([Segment(embedding, 1.0)] if embedding else [])


def total(parts: list[Segment]) -> float:
    """The elements of all `parts`."""
    return sum(p.elements for p in parts)


def exposed(parts: list[Segment], seconds: float, backward: float, bucket: float, per_unit: bool) -> float:
    """Seconds the exchange (`seconds` for all of `parts`' elements) runs past the end of a `backward` of that
    length, buckets of `bucket` elements (cut at each part when `per_unit`: ZeRO's units) launched in order onto a
    link carrying one at a time."""
    elements = total(parts)
    launched = free = 0.0
    for size, at in _buckets(parts, bucket, per_unit):
        launched = max(launched, at * backward)
        free = max(free, launched) + seconds * size / elements
    return max(0.0, free - backward)


def _buckets(parts: list[Segment], bucket: float, per_unit: bool) -> list[tuple[float, float]]:
    """(elements, the fraction of the backward when they are all final) of each bucket, in launch order."""
    out: list[tuple[float, float]] = []
    filled = 0.0
    for part in parts:
        left = part.elements
        while left > 0:
            take = min(left, bucket - filled)
            filled, left = filled + take, left - take
            if filled >= bucket or (per_unit and left == 0):
                out.append((filled, part.at))
                filled = 0.0
    return out + ([(filled, parts[-1].at)] if filled else [])

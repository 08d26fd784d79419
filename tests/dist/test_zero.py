"""The distributed optimizer (ZeRO-1 and 2, `parallel.zero=1|2`) on gloo ranks against references.

One world-4 launch trains a 4-layer model's distributed optimizer at dp4, tp2dp2 (GPT and Llama), tp2dp2 with
sequence parallelism, pp2dp2 interleaved and, with the gradients reduce-scattered in bf16, dp4; beside them the
same layouts with the plain optimizer. Each must match the single-process run (losses, gradient norms, weights:
the pipeline tests' tolerances); the bf16 and the int8 (encoded all-to-all) reduce-scatters track the exact run
as closely as the plain bf16 and two-phase int8 all-reduces do. Under ZeRO-1 each DP rank holds the Adam moments
of its shard only: summed over DP ranks they are the plain optimizer's moments exactly; DP traffic is one
reduce-scatter and one all-gather of every (padded) bucket per step. (tp2pp2dp2 and interleaved tp2pp2dp2 run in
test_pp.py's world-8 launch; the checkpoint of an unsharded run resumed with ZeRO-1 at another DP size in
test_checkpoint.py's.)

ZeRO-3 (`parallel.zero=3`) runs dp4, tp2dp2, Llama tp2dp2 with SP, pp2dp2 under 1f1b, interleaved, zb1p and zbv (both
tied copies on one rank), full and selective recomputation, large buckets in pieces, bf16 and int8 reduce-scatters:
each matches the single process and equals ZeRO-2 bit for bit (and ZeRO-1 at one microbatch per step), keeps only
parameter and gradient shards after a step, and all-gathers each block twice and each root once per microbatch.
ZeRO-2 (`parallel.zero=2`) is ZeRO-3's gradient path; it runs alone at dp4, pp2dp2, zbv, with the overlapped
all-gather and the compressed reduce-scatters: a reduce-scatter per microbatch, only gradient shards kept. torch's
FSDP2 on the same blocks trains as ZeRO-3 does.

A second launch saves a ZeRO-2 or ZeRO-3 checkpoint (2 layers) at dp4 and resumes it at dp4 (bit for bit), at dp2
with ZeRO-1 (and 3), at dp2 without ZeRO, and in a single process: the same loss curve.

Both launches' configs are composed in the test process before the ranks fork (`compose_config`'s memo), whose
heap is frozen while they run (`run_frozen`).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from pp_helpers import TIMEOUT, Case, assert_matches_reference, make_cfg, train_case, train_cases
from test_checkpoint import (
    SAVE_AT,
    STEPS,
    _cfg,
    _check_resharded,
    _resume,
    _saved,
    _train,
    _weights,
    resume_cfgs,
    resume_runs,
)
from tp_helpers import run_frozen

from hybrid.bench import zero_vs_fsdp2
from hybrid.checkpoint import step_path
from hybrid.compression.codecs import Fp8Codec, Int4Codec, Int8Codec
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.parallel.dp.buckets import SHARD_ALIGN

L4 = ("model.n_layers=4",)  # the launch's model: a layer per part of the interleaved pp2 × 2
L2 = ("model.n_layers=2",)  # the checkpoint's


def case(family: str = "gpt", *extra: str, **layout: Any) -> Case:
    """A run of the launch: the 4-layer `family` in `layout` (tp, pp, schedule, v, sp, zero), overrides `extra`."""
    return Case(family, extra=(*extra, *L4), **layout)


OVERLAP = ("parallel.overlap_param_gather=true",)
ZERO = [case(zero=1), case(tp=2, zero=1), case("llama", tp=2, zero=1), case(tp=2, sp=True, zero=1),
        case(pp=2, schedule="interleaved", v=2, zero=1),
        case("gpt", *OVERLAP, zero=1), case("gpt", *OVERLAP, pp=2, schedule="interleaved", v=2, zero=1)]
BF16 = ("compression=bf16",)
INT8 = ("compression=int8", "compression.block_size=32")
INT4 = ("compression=int4", "compression.block_size=32")
PLAIN = [case(tp=2), case(), case("gpt", *BF16), case("gpt", *BF16, zero=1),  # the plain optimizer; bf16 both ways
         case("gpt", *INT8), case("gpt", *INT8, zero=1),  # int8: two-phase all-reduce; encoded reduce-scatter
         case("gpt", *INT4), case("gpt", *INT4, zero=1)]
ONE_BUCKET = ("parallel.bucket_mb=25",)  # a V placement's two tied copies on rank 0 would share a bucket by size
PIECES = ("parallel.bucket_mb=0.005",)  # 1,310 elements: the larger parameters' buckets reduce-scattered in pieces
ZERO2 = [case(zero=2), case(pp=2, zero=2), case("gpt", *ONE_BUCKET, pp=2, schedule="zbv", v=2, zero=1),
         case("gpt", *ONE_BUCKET, pp=2, schedule="zbv", v=2, zero=2), case("gpt", *OVERLAP, pp=2, zero=2)]
"""ZeRO-2 where ZeRO-3 has no counterpart (the overlapped all-gather) and the partners of ZeRO-3's bit-for-bit test;
ZeRO-3's layouts run ZeRO-2's gradient path, equal to it bit for bit."""
ZERO2_COMPRESSED = [case("gpt", *BF16, zero=2), case("gpt", *INT8, zero=2), case("gpt", *INT4, zero=2)]
FULL, SELECTIVE = ("train.recompute=full",), ("train.recompute=selective",)
ZERO3 = [case(zero=3), case(tp=2, zero=3), case("llama", tp=2, sp=True, zero=3), case(pp=2, zero=3),
         case(pp=2, schedule="interleaved", v=2, zero=3), case(pp=2, schedule="zb1p", zero=3),
         case("gpt", *ONE_BUCKET, pp=2, schedule="zbv", v=2, zero=3), case("gpt", *FULL, zero=3),
         case("llama", *SELECTIVE, pp=2, zero=3), case("gpt", *PIECES, tp=2, zero=3)]
ZERO3_COMPRESSED = [case("gpt", *BF16, zero=3), case("gpt", *INT8, zero=3)]
QWZ = ("parallel.zero_param_codec=int8", "compression.block_size=32")  # the parameter all-gather in int8
FP8 = ("parallel.zero_param_codec=fp8", "compression.block_size=32")  # the same bytes, scaled e4m3 values
ZERO_QWZ = [case("gpt", *QWZ, zero=3), case("gpt", *QWZ, pp=2, zero=3), case("gpt", *FP8, zero=3)]
AUTOCAST = ("train.precision=bf16",)  # bf16 matmuls under autocast: ZeRO-3 against ZeRO-1, bit for bit
ZERO_AUTOCAST = [case("gpt", *AUTOCAST, zero=3), case("gpt", *AUTOCAST, zero=1)]
HSDP = ("parallel.zero_group=2",)  # dp4 as two shard groups of 2 ranks, the shards all-reduced across the pairs
ZERO_HSDP = [case("gpt", *HSDP, zero=1), case("gpt", *HSDP, zero=2),
             case("llama", "parallel.ranks_per_node=2", "parallel.zero_group=node", zero=3)]  # 2 emulated nodes
NODES = ("parallel.ranks_per_node=2",)  # dp4 over 2 emulated nodes of 2 ranks
HPZ = (*NODES, "parallel.zero_hpz=true")  # the step's later all-gathers inside the node
ZERO_PP = [case("gpt", *HPZ, zero=3), case("gpt", *NODES, *INT4, zero=2),  # hpZ; qgZ: int4 across, exact inside
           case("llama", *HPZ, *QWZ, "compression=int4", zero=3),  # ZeRO++: qwZ + hpZ + qgZ
           case("gpt", *NODES, *INT4, "parallel.zero_grad_feedback=true", zero=2)]  # qgZ with error feedback
WORLD = 4


@functools.cache
def launched() -> dict[str, list[dict[str, Any]]]:
    torch.set_num_threads(1)
    cases = (ZERO + PLAIN + ZERO2 + ZERO2_COMPRESSED + ZERO3 + ZERO3_COMPRESSED + ZERO_HSDP + ZERO_AUTOCAST + ZERO_QWZ
             + ZERO_PP)
    for run in cases:  # composed here once, inherited by the forked ranks
        make_cfg(run, WORLD)
    results = run_frozen(train_cases, WORLD, cases, timeout=TIMEOUT)
    return {str(c): [r[i] for r in results] for i, c in enumerate(cases)}


@functools.cache
def reference(family: str) -> dict[str, Any]:
    """The single-process run of the launch's `family` model (the global batch as 4 microbatches)."""
    torch.set_num_threads(1)
    r = train_case(ParallelContext.single(), case(family), 1)
    assert r["losses"][-1] < r["losses"][0], r["losses"]
    assert r["n_params"] == r["analytic_params"]
    return r


@pytest.mark.parametrize("run", ZERO, ids=str)
def test_zero1_matches_single_process(run: Case) -> None:
    results = launched()[str(run)]
    assert_matches_reference(results, reference(run.family))


@pytest.mark.parametrize("method", ["bf16", "int8", "int4"])
def test_zero1_compressed_reduce_scatter_tracks_exact_training_as_the_all_reduce_does(method: str) -> None:
    """fp16/bf16: the reduce-scatter in 16 bits; int8, int4: each shard encoded, one all-to-all, the shard's owner
    sums the decoded copies (the two-phase all-reduce's first half; its re-encoded second half is not run)."""
    exact = reference("gpt")["losses"]
    plain, zero = (launched()[str(c)][0]["losses"] for c in PLAIN if c.extra and method in c.extra[0])
    gap = lambda losses: max(abs(a - b) / b for a, b in zip(losses, exact))  # noqa: E731
    assert 0 < gap(zero) < 2e-2 and gap(zero) < 4 * gap(plain) + 1e-4, (zero, plain, exact)


@pytest.mark.parametrize("run", ZERO[-2:], ids=str)
def test_overlapped_parameter_gather_is_the_waited_one_bit_for_bit(run: Case) -> None:
    """With the all-gather left in flight after the step (each block's forward waits for its own buckets),
    every loss, norm, byte and weight equals the run that waits at the end of the step."""
    waited = launched()[str(replace(run, extra=L4))]
    for a, b in zip(launched()[str(run)], waited):
        assert a["inflight"] > 0 and b["inflight"] == 0, (a["inflight"], b["inflight"])
        assert (a["losses"], a["norms"], a["bytes"]) == (b["losses"], b["norms"], b["bytes"])
        if a["state"] is not None:
            assert all(torch.equal(a["state"][k], v) for k, v in b["state"].items())


@pytest.mark.parametrize("run", [case(tp=2, zero=1), case(zero=1)], ids=str)
def test_zero1_moments_are_the_plain_optimizers_split_over_dp(run: Case) -> None:
    """Σ over DP ranks of the moments each rank updates = the plain optimizer's (a partition, exactly);
    each rank allocates 1/dp of them plus its share of the buckets' padding (< SHARD_ALIGN per bucket)."""
    zero = launched()[str(run)]
    plain = launched()[str(replace(run, zero=0))]
    dp = WORLD // (run.tp * run.pp)
    for coord_tp in range(run.tp):
        ours = [r for r in zero if r["coord"][2] == coord_tp]
        full = next(r for r in plain if r["coord"][2] == coord_tp)["moments"][0]
        assert len(ours) == dp and sum(r["moments"][0] for r in ours) == full
        for r in ours:
            padding = sum(padded - numel for numel, padded in r["bucket_numel"])
            assert r["moments"][1] * dp == full + 8 * padding, (r["coord"], r["moments"], full, padding)
            assert padding < len(r["bucket_numel"]) * dp * SHARD_ALIGN


@pytest.mark.parametrize("run", ZERO + [c for c in PLAIN if c.zero and c.extra], ids=str)
def test_zero1_dp_bytes_are_one_reduce_scatter_and_one_all_gather_per_bucket(run: Case) -> None:
    """Per step and rank: the reduce-scatter counts its input (every padded bucket, in the reduce dtype; int8,
    int4: the all-to-all's input, each of the dp shards encoded), the all-gather its output (every padded bucket
    in fp32), and the norm's one fp32 scalar is all-reduced."""
    rs_bytes = 2 if BF16[0] in run.extra else 4
    codec = Int4Codec(32) if INT4[0] in run.extra else Int8Codec(32)
    for r in launched()[str(run)]:
        padded = sum(p for _, p in r["bucket_numel"])
        want = {("dp", "reduce_scatter"): rs_bytes * padded, ("dp", "all_gather"): 4 * padded, ("dp", "all_reduce"): 4}
        if INT8[0] in run.extra or INT4[0] in run.extra:
            encoded = sum(WORLD * codec.encoded_bytes(codec.chunk_len(p // WORLD)) for _, p in r["bucket_numel"])
            want = {("dp", "all_to_all"): encoded} | {k: v for k, v in want.items() if k[1] != "reduce_scatter"}
        for step in r["bytes"]:
            assert {k: b for k, b in step.items() if k[0] == "dp"} == want, (str(run), r["coord"], step)


@pytest.mark.parametrize("run", ZERO2, ids=str)
def test_zero2_matches_single_process(run: Case) -> None:
    results = launched()[str(run)]
    assert_matches_reference(results, reference(run.family))


@pytest.mark.parametrize("run", [case(zero=2), case("gpt", *ONE_BUCKET, pp=2, schedule="zbv", v=2, zero=2)], ids=str)
def test_zero2_is_zero1_bit_for_bit_with_one_microbatch_and_near_with_more(run: Case) -> None:
    """dp4 runs one microbatch per step: ZeRO-2's one reduce-scatter is ZeRO-1's, bit for bit. pp2dp2 runs two:
    ZeRO-2 sums the microbatches' reduce-scatters where ZeRO-1 reduce-scatters their sum (another rounding)."""
    for a, b in zip(launched()[str(run)], launched()[str(replace(run, zero=1))]):
        same = (a["losses"], a["norms"]) == (b["losses"], b["norms"])
        assert same or a["microbatches"] > 1, (a["microbatches"], a["losses"], b["losses"])  # more: rounding may agree
        torch.testing.assert_close(torch.tensor(a["norms"]), torch.tensor(b["norms"]), rtol=1e-6, atol=0)
        if a["state"] is not None and a["microbatches"] == 1:
            assert all(torch.equal(a["state"][k], v) for k, v in b["state"].items())


@pytest.mark.parametrize("run", ZERO2 + ZERO2_COMPRESSED, ids=str)
def test_zero2_keeps_gradient_shards_only(run: Case) -> None:
    """After a step each rank holds its 1/dp shard of every padded bucket (fp32) and no bucket buffer, no `.grad`;
    ZeRO-1 holds every bucket whole."""
    for r in launched()[str(run)]:
        padded = sum(p for _, p in r["bucket_numel"])
        dp = WORLD // (run.tp * run.pp)
        assert r["grad_bytes"] == 4 * padded // (dp if run.zero == 2 else 1), (r["coord"], r["grad_bytes"], padded)
        assert r["grads_none"] == (run.zero == 2)


@pytest.mark.parametrize("run", ZERO2 + ZERO2_COMPRESSED, ids=str)
def test_zero2_reduce_scatters_every_microbatch(run: Case) -> None:
    """Per step and rank: each microbatch reduce-scatters every padded bucket (the reduce dtype; int8, int4: the
    encoded all-to-all's input), the parameters are all-gathered once (fp32), the norm is one fp32 scalar."""
    if run.zero == 1:
        return
    rs_bytes = 2 if BF16[0] in run.extra else 4
    codec = Int4Codec(32) if INT4[0] in run.extra else Int8Codec(32)
    for r in launched()[str(run)]:
        m, padded = r["microbatches"], sum(p for _, p in r["bucket_numel"])
        want = {("dp", "reduce_scatter"): m * rs_bytes * padded, ("dp", "all_gather"): 4 * padded,
                ("dp", "all_reduce"): 4}
        if INT8[0] in run.extra or INT4[0] in run.extra:
            encoded = sum(WORLD * codec.encoded_bytes(codec.chunk_len(p // WORLD)) for _, p in r["bucket_numel"])
            want = {("dp", "all_to_all"): m * encoded} | {k: v for k, v in want.items() if k[1] != "reduce_scatter"}
        for step in r["bytes"]:
            assert {k: b for k, b in step.items() if k[0] == "dp"} == want, (str(run), r["coord"], step)


@pytest.mark.parametrize("method", ["bf16", "int8", "int4"])
def test_zero2_compressed_reduce_scatter_tracks_exact_training_as_zero1s_does(method: str) -> None:
    exact = reference("gpt")["losses"]
    zero1, zero2 = (launched()[str(c)][0]["losses"] for c in PLAIN[3::2] + ZERO2_COMPRESSED
                    if method in c.extra[0] and c.zero)
    gap = lambda losses: max(abs(a - b) / b for a, b in zip(losses, exact))  # noqa: E731
    assert 0 < gap(zero2) < 2e-2 and gap(zero2) < 4 * gap(zero1) + 1e-4, (zero2, zero1, exact)


@pytest.mark.parametrize("run", ZERO3, ids=str)
def test_zero3_matches_single_process(run: Case) -> None:
    results = launched()[str(run)]
    assert_matches_reference(results, reference(run.family))


@pytest.mark.parametrize("run", [case(zero=3), case(pp=2, zero=3), case("gpt", *ONE_BUCKET, pp=2, schedule="zbv", v=2,
                                                                        zero=3), ZERO_AUTOCAST[0]], ids=str)
def test_zero3_is_zero2_bit_for_bit_and_zero1_with_one_microbatch(run: Case) -> None:
    """Only where the parameters live differs: the buckets, their shards, the reductions and the sums are ZeRO-2's
    (and ZeRO-1's, but for its one reduce-scatter of the microbatches' sum)."""
    for stage in (1, 2):
        other = launched().get(str(replace(run, zero=stage)))
        if other is None:
            continue
        for a, b in zip(launched()[str(run)], other):
            if stage == 2 or a["microbatches"] == 1:
                assert (a["losses"], a["norms"]) == (b["losses"], b["norms"]), (stage, a["losses"], b["losses"])
                if a["state"] is not None:
                    assert all(torch.equal(a["state"][k], v) for k, v in b["state"].items())


@pytest.mark.parametrize("run", ZERO3 + ZERO3_COMPRESSED, ids=str)
def test_zero3_keeps_parameter_shards_only(run: Case) -> None:
    """After a step each rank keeps its 1/dp of every padded bucket's parameters (fp32) and gathers nothing, and
    its gradients are shards (ZeRO-2's)."""
    dp = WORLD // (run.tp * run.pp)
    for r in launched()[str(run)]:
        padded = sum(p for _, p in r["bucket_numel"])
        assert r["zero3"]["kept"] == 4 * padded // dp and r["zero3"]["gathered"] == 0, (r["coord"], r["zero3"])
        assert r["grad_bytes"] == 4 * padded // dp and r["grads_none"]


@pytest.mark.parametrize("run", [c for c in ZERO3 + ZERO3_COMPRESSED if c.schedule in ("1f1b", "interleaved")],
                         ids=str)
def test_zero3_gathers_each_block_twice_and_each_root_once_per_microbatch(run: Case) -> None:
    """Per step and rank: every block's buckets all-gathered before its forward and again before its backward,
    the chunk's root (embedding, final norm, head) once (kept from its forward through its backward), per
    microbatch (fp32); the gradients reduce-scattered per microbatch as under ZeRO-2; the norm one scalar."""
    rs_bytes = 2 if BF16[0] in run.extra else 4
    for r in launched()[str(run)]:
        m, padded = r["microbatches"], sum(p for _, p in r["bucket_numel"])
        gathered = sum(n * (1 if root else 2) for root, n in r["zero3"]["units"])
        want = {("dp", "all_gather"): 4 * m * gathered, ("dp", "all_reduce"): 4}
        want |= {("dp", "all_to_all"): m * sum(WORLD * Int8Codec(32).encoded_bytes(Int8Codec(32).chunk_len(p // WORLD))
                                           for _, p in r["bucket_numel"])} if INT8[0] in run.extra else \
            {("dp", "reduce_scatter"): m * rs_bytes * padded}
        for step in r["bytes"]:
            assert {k: b for k, b in step.items() if k[0] == "dp"} == want, (str(run), r["coord"], step)


@pytest.mark.parametrize("method", ["bf16", "int8"])
def test_zero3_compressed_reduce_scatter_is_zero2s(method: str) -> None:
    zero2, zero3 = (launched()[str(c)][0]["losses"] for c in ZERO2_COMPRESSED + ZERO3_COMPRESSED
                    if method in c.extra[0])
    assert zero2 == zero3


@pytest.mark.parametrize("run", ZERO_QWZ, ids=str)
def test_zero3_encoded_parameter_gather_tracks_exact_training_at_a_quarter_of_the_bytes(run: Case) -> None:
    """qwZ: each all-gather moves every rank's shard encoded (int8 or scaled fp8, block-wise scales): dp × the
    encoded bytes of its padded chunk, per block twice and per root once a microbatch; the kept shards stay exact,
    so the losses stay within the codec's rounding of the exact ZeRO-3 run's (fp8's 2⁻⁴ relative steps: wider)."""
    fp8 = FP8[0] in run.extra
    codec = Fp8Codec(32) if fp8 else Int8Codec(32)
    exact = launched()[str(replace(run, extra=L4))][0]["losses"]
    for r in launched()[str(run)]:
        gap = max(abs(a - b) / b for a, b in zip(r["losses"], exact))
        assert 0 < gap < (1e-2 if fp8 else 1e-3), (r["losses"], exact)
        dp = WORLD // (run.tp * run.pp)
        per_gather = {n: dp * codec.encoded_bytes(codec.chunk_len(n // dp)) for _, n in r["zero3"]["flats"]}
        want = r["microbatches"] * sum(per_gather[n] * (1 if root else 2) for root, n in r["zero3"]["flats"])
        for step in r["bytes"]:
            assert step[("dp", "all_gather")] == want, (r["coord"], step, want)


@pytest.mark.parametrize("run", ZERO_HSDP, ids=str)
def test_hybrid_sharding_matches_single_process_and_moves_the_shards_once_across_groups(run: Case) -> None:
    """HSDP: each ZeRO stage inside groups of 2 DP ranks. Per step and rank: the reduce-scatters, the all-gathers
    and the norm over the shard group (`dp_intra`), one all-reduce of this rank's gradient shards over the other
    group (`dp_inter`: 4 bytes per padded element / 2); each rank keeps half of every bucket."""
    results = launched()[str(run)]
    assert_matches_reference(results, reference(run.family))
    for r in results:
        m, padded = r["microbatches"], sum(p for _, p in r["bucket_numel"])
        gathers = sum(n * (1 if root else 2) for root, n in r["zero3"]["units"]) * m if run.zero == 3 else padded
        want = {("dp_intra", "reduce_scatter"): 4 * padded * (m if run.zero >= 2 else 1), ("dp_intra", "all_reduce"): 4,
                ("dp_intra", "all_gather"): 4 * gathers, ("dp_inter", "all_reduce"): 4 * padded // 2}
        for step in r["bytes"]:
            assert {k: b for k, b in step.items() if k[0].startswith("dp")} == want, (str(run), r["coord"], step)
        if run.zero == 3:
            assert r["zero3"]["kept"] == 4 * padded // 2


def test_hpz_is_zero3_bit_for_bit_and_gathers_across_nodes_once_a_step() -> None:
    """hpZ over 2 nodes: each unit's first all-gather of a step over the DP group (4 bytes per padded element),
    every later one (the backward's; the next microbatches') over the node (`dp_intra`) from the secondary copy
    of what the first gathered: the same values, so the same run as plain ZeRO-3, bit for bit."""
    run = ZERO_PP[0]
    for r, plain in zip(launched()[str(run)], launched()[str(case(zero=3))]):
        assert (r["losses"], r["norms"]) == (plain["losses"], plain["norms"])
        m, units = r["microbatches"], r["zero3"]["units"]
        inside = sum(n * (m - 1 if root else 2 * m - 1) for root, n in units)
        for step in r["bytes"]:
            assert step[("dp", "all_gather")] == 4 * sum(n for _, n in units), (r["coord"], step)
            assert step[("dp_intra", "all_gather")] == 4 * inside, (r["coord"], step)


def two_hop_bytes(r: dict[str, Any], codec: Int8Codec) -> dict[tuple[str, str], int]:
    """qgZ's counted bytes per step over 2 nodes of 2: per microbatch each padded bucket reduce-scattered in fp32
    inside the node, then its node half's encoded all-to-all across (two shards of a quarter)."""
    m, sizes = r["microbatches"], [p for _, p in r["bucket_numel"]]
    return {("dp_intra", "reduce_scatter"): 4 * m * sum(sizes),
            ("dp_inter", "all_to_all"): m * sum(2 * codec.encoded_bytes(codec.chunk_len(p // 4)) for p in sizes)}


def test_qgz_reduces_inside_the_node_exactly_and_sends_int4_across() -> None:
    """qgZ (ZeRO-2, int4, dp4 on 2 nodes; with and without error feedback): the two hops' bytes, and training
    within int4's reach of the exact run, as close as the one-hop encoded reduce-scatter (the same int4 blocks,
    over node sums)."""
    exact = reference("gpt")["losses"]
    flat = launched()[str(ZERO2_COMPRESSED[2])][0]["losses"]
    gap = lambda losses: max(abs(a - b) / b for a, b in zip(losses, exact))  # noqa: E731
    for r in launched()[str(ZERO_PP[1])] + launched()[str(ZERO_PP[3])]:  # without and with error feedback
        assert 0 < gap(r["losses"]) < 2e-2 and gap(r["losses"]) < 4 * gap(flat) + 1e-4, (r["losses"], flat)
        padded = sum(p for _, p in r["bucket_numel"])
        want = two_hop_bytes(r, Int4Codec(32)) | {("dp", "all_gather"): 4 * padded, ("dp", "all_reduce"): 4}
        for step in r["bytes"]:
            assert {k: b for k, b in step.items() if k[0].startswith("dp")} == want, (r["coord"], step)


def test_zero_plus_plus_tracks_zero3_and_sends_across_nodes_a_fraction_of_its_bytes() -> None:
    """qwZ + hpZ + qgZ (Llama, ZeRO-3, dp4 on 2 nodes): losses within int8/int4 rounding of the single process;
    per step the first all-gathers int8 over DP, the rest inside the node, the gradients in two hops; what leaves
    the node is the DP group's half and the across hop's half of their payloads."""
    run = ZERO_PP[2]
    exact = reference("llama")["losses"]
    p8, p4 = Int8Codec(32), Int4Codec(32)
    for r in launched()[str(run)]:
        assert max(abs(a - b) / b for a, b in zip(r["losses"], exact)) < 2e-2, (r["losses"], exact)
        m, units = r["microbatches"], r["zero3"]["units"]
        first = sum(4 * p8.encoded_bytes(p8.chunk_len(n // 4)) for _, n in r["zero3"]["flats"])
        inside = 4 * sum(n * (m - 1 if root else 2 * m - 1) for root, n in units)
        want = two_hop_bytes(r, p4) | {("dp", "all_gather"): first, ("dp_intra", "all_gather"): inside,
                                       ("dp", "all_reduce"): 4}
        for step in r["bytes"]:
            assert {k: b for k, b in step.items() if k[0].startswith("dp")} == want, (r["coord"], step)


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_checkpoint_resumes_across_stages_and_dp_sizes(tmp_path: Path, zero: int) -> None:
    """Saved under ZeRO-2 or 3 at dp4; resumed there (bit for bit), at dp2 under ZeRO-1 (and 3), at dp2 without
    ZeRO and in one process: the same loss curve (the files are the plain optimizer's, whatever the stage)."""
    resharded = [Case(tp=2, zero=1), Case(tp=2), *([Case(tp=2, zero=3)] if zero == 3 else [])]
    torch.set_num_threads(1)
    resume_cfgs(WORLD, tmp_path, Case(zero=zero), resharded, L2)
    results = run_frozen(resume_runs, WORLD, tmp_path, Case(zero=zero), resharded, L2, timeout=TIMEOUT)
    for r in results:  # the same layout: moments and step count restored through the gathered view
        assert r["same"]["losses"] == r["base"]["losses"][SAVE_AT:]
        assert all(torch.equal(r["same_final"][name], w) for name, w in r["final"].items())
    for label in map(str, resharded):
        loaded: dict[str, torch.Tensor] = {}
        for r in results:
            loaded.update(r[label]["loaded"] or {})
        for r in results:
            _check_resharded(label, dict(loaded), r[label]["losses"], results)
    path = step_path(tmp_path / "base", SAVE_AT)
    single = _resume(_cfg(Case(), 1, tmp_path, "single", *L2), ParallelContext.single(), path)
    _check_resharded("single", _weights(single), _train(single), results)
    assert _saved(results) and STEPS > SAVE_AT


TINY = ("model.hidden=64", "model.n_heads=4", "model.ffn_hidden=128", "model.max_seq_len=32")
HSDP_NODES = ("parallel.ranks_per_node=2", "parallel.zero_group=node")


def fsdp2_and_zero3(rank: int, world: int) -> list[tuple[list[float], list[float]]]:
    """Rank function: three steps of hybrid's ZeRO-3, then of FSDP2 on the same model, batches and optimizer; then
    hybrid's HSDP and FSDP2's (sharded inside each of 2 emulated nodes, replicated across)."""
    data, out = zero_vs_fsdp2.corpus(32), []
    for extra, node in (((), 0), (HSDP_NODES, 2)):
        cfg = zero_vs_fsdp2.config("gpt-tiny", 2, world, 32, 2, 3, *TINY, *extra)
        ctx = ParallelContext.build(Layout.create(world, ranks_per_node=node or None))
        out.append(([f() for f in zero_vs_fsdp2.zero3_steps(cfg, ctx, data, 3)],
                    [f() for f in zero_vs_fsdp2.fsdp2_steps(cfg, ctx, data, 3, node)]))
    return out


def test_zero3_and_hsdp_train_as_torch_fsdp2_does() -> None:
    """torch's `fully_shard` on every block and the chunk (its units and root) is the reference: the same losses;
    and over a (replicate, shard) mesh, HSDP's."""
    torch.set_num_threads(1)
    for extra in ((), HSDP_NODES):  # composed here, inherited by the ranks
        zero_vs_fsdp2.config("gpt-tiny", 2, WORLD, 32, 2, 3, *TINY, *extra)
    for pairs in run_frozen(fsdp2_and_zero3, WORLD, timeout=TIMEOUT):
        for ours, theirs in pairs:
            assert ours[0] != ours[-1]  # the updates moved the model
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=1e-5)

"""`hybrid-plan`'s model against references: the ring collective's cost against nccl-tests' bus factors, the pipeline's
bubble against 1F1B's closed form, TP exposure ordered by overlap mode, the memory filter against `hybrid-memory`'s
estimate of the same config, a `hybrid-diagnose` report's links read back, the published rows (Megatron-LM 2021,
NVIDIA's Llama 3.1 recipes) within 20 %; the command line end to end, its JSON and its bad input as one line, exit
2."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from hybrid.bench import plan_cpu, plan_published
from hybrid.config import compose_config
from hybrid.memory import meta_stages, stage_estimates
from hybrid.parallel.context import Layout
from hybrid.plan import exchange
from hybrid.plan.cost import Micro, Shape, collective_s, layer_pass, shape_of
from hybrid.plan.hardware import Cluster, Device, Link, PlanError, from_diagnose, link_of, preset
from hybrid.plan.predict import Candidate, Prediction, predict, stage_elements
from hybrid.plan.search import Job, candidates, configured, fastest, peak_memory
from hybrid.tools.plan import main
from hybrid.trainer import build_chunks
from hybrid.validation import validate

GPT = Shape(layers=8, hidden=1024, heads=16, kv_heads=16, ffn=4096, vocab=50304, swiglu=False)
H100 = preset("dgx-h100", 2)


def test_a_ring_collective_costs_its_bus_bytes_over_the_link_plus_hop_latencies() -> None:
    link = Link(100e9, 1e-5)
    assert collective_s("all_gather", 8e9, 4, link) == pytest.approx(3 * 1e-5 + 0.75 * 8e9 / 100e9)
    assert collective_s("all_reduce", 8e9, 4, link) == pytest.approx(6 * 1e-5 + 1.5 * 8e9 / 100e9)
    assert collective_s("all_reduce", 8e9, 1, link) == 0.0


def test_tp_exposure_falls_from_blocking_to_bulk_to_chunked_and_tp_splits_the_gemms() -> None:
    dev, link = H100.device, H100.intra
    exposed = {mode: layer_pass(GPT, Micro(4, 2048, tp=4), dev, "none", mode, link).tp_exposed
               for mode in ("none", "bulk", "chunked")}
    assert exposed["none"] > exposed["bulk"] > exposed["chunked"] >= 0
    one, four = (layer_pass(GPT, Micro(4, 2048, tp=tp), dev, "none", "none", link) for tp in (1, 4))
    assert one.tp_exposed == 0.0 and 2.0 < one.forward / four.forward < 4.0  # GEMMs / 4, kernel launches not
    full = layer_pass(GPT, Micro(4, 2048, tp=4), dev, "full", "none", link)
    assert full.backward == pytest.approx(four.backward + four.forward)  # the forward again


def test_the_pipeline_bubble_is_1f1bs_closed_form_without_communication() -> None:
    slow = replace(H100, intra=Link(1e30, 0.0), inter=Link(1e30, 0.0))  # free links: only the schedule's idle time
    one = predict(GPT, Candidate(1, 1, 16, micro=1, zero=0), slow, 64, 1024)
    four = predict(GPT, Candidate(1, 4, 4, micro=1, zero=0), slow, 64, 1024)
    microbatches = 64 // 4
    assert four.parts["bubble"] / four.parts["compute"] == pytest.approx(3 / microbatches, rel=0.35)  # (pp−1)/m
    assert one.parts["bubble"] == pytest.approx(0.0, abs=1e-12)


def test_zero_stages_cost_their_exchanges_and_nothing_on_free_links() -> None:
    """ZeRO-2 reduce-scatters every microbatch, ZeRO-3 also gathers the parameters twice a microbatch and not after
    the step: on free links every stage predicts the same step; over Ethernet between nodes ZeRO-2 costs at least
    ZeRO-1; the bytes are the per-microbatch collectives' (4 microbatches, bf16 parameters, fp32 gradients)."""
    free = replace(H100, intra=Link(1e30, 0.0), inter=Link(1e30, 0.0))
    slow = replace(H100, inter=link_of("eth-100g"))

    def at(cluster: Cluster, zero: int) -> Prediction:
        return predict(GPT, Candidate(1, 1, 16, micro=1, zero=zero), cluster, 64, 1024)

    assert at(free, 1).step_s == pytest.approx(at(free, 2).step_s) == pytest.approx(at(free, 3).step_s)
    assert at(slow, 2).step_s >= at(slow, 1).step_s and at(slow, 3).parts["dp_total"] > at(slow, 2).parts["dp_total"]
    share = stage_elements(GPT, Candidate(1, 1, 16)) * 15 / 16
    assert [at(slow, z).bytes["dp"] for z in range(4)] == pytest.approx(
        [8 * share, 4 * share + 2 * share, 4 * 4 * share + 2 * share, 4 * 4 * share + 8 * 2 * share])


def test_ranks_sharing_cores_wait_on_a_slow_link_between_nodes_only_beyond_their_backward() -> None:
    """CPU ranks with no core to spare (4 a node on 1 core): a DP exchange across nodes costs its copies over the
    node's own link while the wire hides behind the backward, and beyond that the wire's tail past the backward
    (`plan.tail`) — so a somewhat slower link costs less than its extra wire time, and once the queue is exposed
    every extra second on the wire is a second of the step."""
    cpu = Device("cpu", 50e9, 2**34, 5e9, gemm=1.0, attention=0.5, kind="cpu", cores=1)
    local, shape, c = Link(1e9, 1e-4), replace(GPT, layers=2, vocab=8192), Candidate(1, 1, 8, micro=2, zero=0)

    def at(inter: Link) -> Prediction:
        return predict(shape, c, Cluster(cpu, 4, 2, local, inter), 16, 256, act=4)

    def step(inter: Link) -> float:
        return at(inter).step_s

    slower = Link(0.7e9, 1e-4)
    extra = at(slower).parts["dp_total"] - at(local).parts["dp_total"]
    assert 0 < step(slower) - step(local) < 0.5 * extra  # most of the slower wire hides behind the backward
    wire = [collective_s("all_reduce", stage_elements(shape, c) * 4, 8, Link(bw, 1e-3)) for bw in (2e6, 1e6)]
    assert step(Link(1e6, 1e-3)) - step(Link(2e6, 1e-3)) == pytest.approx(wire[1] - wire[0])


def test_candidates_divide_heads_layers_world_and_batch() -> None:
    got = list(candidates(GPT, H100, 64, seq=1000))
    assert got and all(16 % c.tp == 0 and 8 % c.pp == 0 and c.tp * c.cp * c.pp * c.dp == 16 and 64 % c.dp == 0
                       and (64 // c.dp) % c.micro == 0 and c.tp * c.cp <= 8 and 1000 % (2 * c.cp) == 0 for c in got)
    assert {c.recompute for c in got} == {"none", "selective", "full"} and any(c.v == 2 for c in got)
    assert {c.zero for c in got} == {0, 1, 2, 3} and all((c.zero == 0) == (c.dp * c.cp == 1) for c in got)
    assert {c.cp for c in got} == {1, 2, 4} and {c.cp for c in candidates(GPT, H100, 64)} == {1}  # 8 ∤ 1000 / 2


def test_the_lazy_ranking_is_the_exhaustive_one() -> None:
    """`fastest` replays a layout only while it may still rank: its order is every layout predicted and sorted, and
    each bound it orders by is at most the step."""
    node = preset("dgx-h100", 1)
    job = Job(compose_config(["model=gpt-tiny"]), GPT, 16, 1024)
    layouts = list(candidates(GPT, node, 16, 1024))
    full = [predict(GPT, c, node, 16, 1024) for c in layouts]
    assert [p.step_s for p in fastest(job, node, layouts)] == sorted(p.step_s for p in full)
    assert all(predict(GPT, c, node, 16, 1024, replay=False).step_s <= p.step_s for c, p in zip(layouts, full))
    assert len(layouts) > 100 and any(c.pp > 1 for c in layouts) and any(c.cp > 1 for c in layouts)


def test_the_memory_filter_is_hybrid_memorys_estimate() -> None:
    cfg = compose_config(["model=gpt-tiny"])
    job = Job(cfg, shape_of(cfg.model, 512), 32, 256)
    c = Candidate(2, 2, 4, micro=2, recompute="selective")
    cluster = preset("dgx-h100", 2)
    got = peak_memory(job, c, cluster, lambda k: lambda ctx: build_chunks(k, 512, ctx))
    mine = configured(job, c, cluster)
    layout = Layout.create(16, tp=2, pp=2, dp=4, ranks_per_node=8)
    stages = meta_stages(layout, lambda ctx: build_chunks(mine, 512, ctx))
    assert got == max(e.total for e in stage_estimates(mine, layout, stages, "cuda"))


def test_a_diagnose_reports_links_and_node_size_are_read(tmp_path: Path) -> None:
    report = tmp_path / "d.json"
    report.write_text(json.dumps({"nodes": {"ranks_per_node": 4},
                                  "bandwidth": {"summary": {"intra": {"median": 120.0}, "inter": {"median": 9.5}}}}))
    c = from_diagnose(report, H100)
    assert (c.per_node, c.intra.busbw, c.inter.busbw) == (4, 120e9, 9.5e9)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(PlanError, match="not a hybrid-diagnose --json report"):
        from_diagnose(tmp_path / "bad.json", H100)
    assert link_of("25").busbw == 25e9
    with pytest.raises(PlanError, match="unknown link"):
        link_of("carrier-pigeon")


def test_published_rows_of_both_sources_are_predicted_within_20_percent() -> None:
    got = plan_published.run(plan_published.parse_args(["--quick"]), out=lambda _: None)
    assert [g["row"] for g in got["megatron"]] == ["1.7B", "39B"] and [g["row"] for g in got["dgxc"]] == ["8B-8"]
    assert all(abs(g["ratio"] - 1) <= 0.2 for g in got["megatron"] + got["dgxc"]), got


def test_the_command_line_ranks_layouts_and_prints_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model=gpt-tiny", "--cluster", "dgx-a100", "--batch", "8", "--seq", "256", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "the fastest that fit" in out and "run the first: torchrun --nproc_per_node 8 -m hybrid.train" in out
    assert main(["model=gpt-tiny", "--batch", "8", "--seq", "256", "--top", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    steps = [p["step_s"] for p in doc["plans"]]
    assert len(steps) == 2 and steps == sorted(steps) and all(p["fits"] for p in doc["plans"])
    assert doc["command"].endswith("train.precision=bf16_params")


@pytest.mark.parametrize("argv,needle", [
    (["model=gpt-tiny", "--gpu", "tpu-v9"], "unknown GPU 'tpu-v9'"),
    (["model=gpt-tiny", "--cluster", "cray-1"], "unknown cluster 'cray-1'"),
    (["model=gpt-tiny", "--nodes", "0"], "--nodes must be >= 1"),
    (["model=gpt-tiny", "--batch", "0"], "must be >= 1"),
    (["model=gpt-tiny", "--frobnicate"], "unknown flag --frobnicate"),
    (["model=gpt-1b", "--gpu", "a100-40gb", "--per-node", "1", "--batch", "1", "--seq", "262144"],
     "no layout of"),
])
def test_bad_input_is_one_line_and_exit_2(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hybrid: error:") and needle in err[0], err


def test_the_measured_check_runs_layouts_and_ranks_them(capsys: pytest.CaptureFixture[str]) -> None:
    """plan_cpu at tiny sizes: every layout measured and predicted (no claim on the figures at this size)."""
    got = plan_cpu.run(plan_cpu.parse_args(["--quick"]))
    assert len(got["measured"]) == len(got["predicted"]) == 2 and min(got["measured"] + got["predicted"]) > 0
    assert -1.0 <= got["spearman"] <= 1.0 and -1.0 <= got["repeat_spearman"] <= 1.0
    assert "repeat round to round" in capsys.readouterr().out
    assert plan_cpu.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert plan_cpu.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert plan_cpu.parse_layout("tp2pp2dp2 v2 mb1 full zero1") == Candidate(2, 2, 2, 1, v=2, recompute="full")
    assert plan_cpu.parse_layout("tp1pp1dp8 mb2 none zero0 int8").dp_exchange == "int8"
    for bad in (["--layouts", "tp3pp1dp1 mb1 none zero0"], ["--nodes", "3"], ["--nodes", "2", "--inter-gbs", "0"]):
        with pytest.raises(SystemExit):  # tp·pp·dp ≠ world; nodes not dividing the world; no link speed
            plan_cpu.parse_args(["--quick", *bad])
    assert "--nodes must divide --world" in capsys.readouterr().err


def test_the_dp_exchange_follows_the_links() -> None:
    """Across a slow inter-node link two hops beat the flat ring, int8 across beats both; inside one node, or with
    one DP rank a node, only the flat ring is offered. Each choice is a valid command line's overrides."""
    slow = replace(preset("dgx-a100", 4), inter=link_of("eth-100g"))
    timed = {e.method: e.seconds for e in exchange.options(8, 4, 0, 1e8, slow)}  # 2 DP ranks a node, 4 nodes
    assert timed["int8"] < timed["hierarchical"] < timed["flat"]
    assert [e.method for e in exchange.options(8, 4, 1, 1e8, slow)] == ["flat", "int8"]  # ZeRO: the encoded two hops
    assert [e.method for e in exchange.options(2, 4, 0, 1e8, slow)] == ["flat"]  # inside one node
    assert [e.method for e in exchange.options(4, 8, 0, 1e8, slow)] == ["flat"]  # one DP rank a node
    assert exchange.best(8, 4, 0, 1e8, slow, lossy=False).method == "hierarchical"
    assert exchange.overrides("int8", 0) == ["compression=hierarchical", "compression.inner=int8"]
    cfg = compose_config(["model=gpt-tiny"])
    job = Job(cfg, shape_of(cfg.model, 512), 64, 128)
    for method in ("hierarchical", "int8"):
        c = Candidate(4, 1, 8, micro=1, zero=0, dp_exchange=method)
        validate(configured(job, c, slow), 32)  # hybrid.train would run it


def test_a_plan_every_layout_of_which_hybrid_train_refuses_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    """Not "does not fit" but the refusal itself: an optimizer warmup longer than the run, which every layout has."""
    assert main(["model=gpt-tiny", "optim.warmup_steps=1000", "train.steps=10", "--batch", "8", "--seq", "128"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hybrid.train refuses every layout tried" in err[0] and "warmup" in err[0], err

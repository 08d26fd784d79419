"""Every bad input of the command line is one `hybrid: error:` line, exit status 2, no traceback, and nothing
written: a table of command lines (CASES on one process, RANKED on two torchrun ranks), each row one bad input
and a piece of its one line. To cover a new bad input, add a row.

Each row is checked once, in this process, the way its refusal is found: the composition of the command line
(`hybrid.overrides.check`: Hydra's own errors, keys the schema lacks), then `hybrid.validation.validate` for the
row's world, as `hybrid.train.run` calls it. Every RANKED row and the CASES in CHECKED go through the check before
launch (below: its `main`, which composes and validates so for the world the launch starts, and also shows the
one line, the status and nothing written); the other CASES through hybrid.tools.check's `refusal` (the message
`hybrid.train` would refuse them with on one process). The edge that turns such a ConfigError into the line,
the status and nothing written (`hybrid.cli.exit_on_error` → `fail`) is one mechanism for all of them, so it
runs for real for one row of each way a refusal is reached (FORKED, RANKED_FORKED): the real entry point
`hybrid.train.main` in a forked child (hybrid.testing.cli_runs: a real process, without seconds of imports each)
working in an empty folder that must stay empty. Rows refused only after validation (the tokenizer folders on
the file system, wandb's key) must be in FORKED. One case also runs as a fresh `python -m hybrid.train`, the
reference the fork must match.

Before launch: `python -m hybrid.tools.check` (what launch/local.sh, multinode.sh and slurm.sbatch run in one
process before torchrun) gives the same one line, once and without a `[rankN]` prefix, for every RANKED case
and the CASES in CHECKED (its `main` called in this process, in an empty folder that must stay empty); each
launch script, with a stand-in torchrun on PATH, runs the real check process, stops there with that line and
exit 2, and never starts torchrun. A good command line passes the check and reaches torchrun, through
multinode.sh (one more real check process; the passing branch is launch/precheck.sh's, which all three
source: local.sh's way on past a passing check is tests/unit/test_cli_scripts.py's
test_local_sh_picks_the_launcher, slurm.sbatch's on to srun and torchrun tests/e2e/test_slurm_signal.py's).
"""
from __future__ import annotations

import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
from test_nonfinite import frozen_gc, load_what_runs_load

import hybrid.tools.check
import hybrid.train
from hybrid.testing.cli_runs import CliRun, run_forked
from hybrid.tools.check import refusal

WANDB_NEEDS = "a wandb API key" if find_spec("wandb") else "the wandb package"
"""What online mode without a key is refused for: the key, or first the package where wandb is not installed."""

ROOT = Path(__file__).resolve().parents[2]

B = ["model=gpt-tiny", "data.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=4",
     "logging.wandb.mode=disabled", "logging.progress=false"]

CASES: list[tuple[str, list[str], str]] = [  # (id, overrides after B, a piece of the one error line): one process
    ("beta1", ["optim.beta1=1.5"], "optim.beta1 must be in [0, 1)"),
    ("beta2", ["optim.beta2=1"], "optim.beta2 must be in [0, 1)"),
    ("eps", ["optim.eps=-1"], "optim.eps must be > 0"),
    ("weight-decay", ["optim.weight_decay=-0.1"], "optim.weight_decay must be >= 0"),
    ("min-lr-ratio", ["optim.min_lr_ratio=-3"], "optim.min_lr_ratio must be in [0, 1]"),
    ("lr-inf", ["train.lr=inf"], "train.lr must be a finite number > 0"),
    ("lr-nan", ["train.lr=nan"], "train.lr must be a finite number > 0"),
    ("steps-0", ["train.steps=0"], "train.steps must be >= 1"),
    ("steps-negative", ["train.steps=-3"], "train.steps must be >= 1"),
    ("warmup-longer-than-run", ["optim.warmup_steps=500", "train.steps=20"],
     "optim.warmup_steps=500 is longer than the run (train.steps=20)"),
    ("warmup-negative", ["optim.warmup_steps=-1"], "optim.warmup_steps must be >= 0"),
    ("on-nonfinite", ["train.on_nonfinite=ignore"], "train.on_nonfinite='ignore' is not one of stop, skip, rewind"),
    ("max-skipped-steps", ["train.on_nonfinite=skip", "train.max_skipped_steps=0"],
     "train.max_skipped_steps must be >= 1"),
    ("rewind-without-checkpoints", ["train.on_nonfinite=rewind"], "train.on_nonfinite=rewind goes back to the "
     "newest checkpoint: save some with checkpoint.every=N"),
    ("init-std", ["model.init_std=-1"], "model.init_std must be a finite number > 0"),
    ("norm-eps", ["model.norm_eps=-1"], "model.norm_eps must be a finite number > 0"),
    ("ffn-negative", ["model.ffn_hidden=-8"], "model.ffn_hidden must be >= 1"),
    ("ffn-zero", ["model.ffn_hidden=0"], "model.ffn_hidden must be >= 1"),
    ("kv-heads-zero", ["model.n_kv_heads=0"], "model.n_kv_heads must be >= 1"),
    ("unknown-key", ["+train.foo=1"], "unknown key 'train.foo'"),
    ("block-size", ["compression=int8", "compression.block_size=1000000000"],
     "compression.block_size=1000000000 exceeds one DP rank's chunk of a bucket"),
    ("warmup-covers-run", ["compression=sign", "compression.warmup_steps=5", "train.steps=5"],
     "compression.warmup_steps=5 is not shorter than the run (train.steps=5)"),
    ("onebit-no-warmup", ["compression=onebit_adam", "compression.warmup_steps=0"],
     "compression=onebit_adam needs compression.warmup_steps >= 1"),
    ("onebit-refresh-negative", ["compression=onebit_adam", "compression.var_refresh_every=-1"],
     "compression.var_refresh_every must be >= 0"),
    ("warmup-method", ["compression=zeroone_adam", "compression.warmup_method=int8"],
     "compression.warmup_method=int8 does not apply to compression=zeroone_adam (its warm-up is exact)"),
    ("topk-fraction", ["compression=topk", "compression.fraction=1.5"], "compression.fraction must be in (0, 1]"),
    ("powersgd-lookup-rows", ["compression=powersgd", "compression.lookup_rows=maybe"],
     "compression.lookup_rows=maybe Value 'maybe' is not a valid bool"),
    ("powersgd-factor-dtype", ["compression=powersgd", "compression.factor_dtype=fp8"],
     "compression.factor_dtype must be one of fp32, bf16 (what PowerSGD's factors travel in), got 'fp8'"),
    ("powersgd-target-error", ["compression=powersgd", "compression.target_error=2"],
     "compression.target_error must be in [0, 1) (0: a fixed rank), got 2"),
    ("dgc-momentum", ["compression=dgc", "compression.dgc_momentum=1"], "compression.dgc_momentum must be in [0, 1)"),
    ("dgc-warmup-covers-run", ["compression=dgc", "compression.sparsity_warmup_steps=5", "train.steps=5"],
     "compression.sparsity_warmup_steps=5 is not shorter than the run (train.steps=5)"),
    ("measure-every", ["compression=sign", "compression.measure_every=0"], "compression.measure_every must be >= 1"),
    ("unknown-schedule", ["compression=sign", "compression.schedule=sometimes"],
     "compression.schedule='sometimes' is not one of fixed, auto"),
    ("stages-without-auto", ["compression=sign", "compression.stages=[int8]"],
     "compression.stages needs compression.schedule=auto"),
    ("unknown-stage", ["compression=sign", "compression.schedule=auto", "compression.stages=[zip]"],
     "compression.stages=['zip'] may hold only"),
    ("auto-nothing-to-switch-to", ["compression.schedule=auto"], "compression.schedule=auto switches from exact"),
    ("settle-window-covers-run", ["compression=sign", "compression.schedule=auto", "compression.settle_window=5",
                                  "train.steps=10"], "compression.settle_window=5 leaves no step to compress"),
    ("exact-params", ["compression=sign", "compression.exact_params=[norms]"],
     "compression.exact_params=['norms'] may hold only vectors, embeddings"),
    ("block-layout", ["compression=sign", "compression.block_layout=columns"],
     "compression.block_layout must be one of auto, rows, got 'columns'"),
    ("scale-not-a-block-codec", ["compression=topk", "compression.scale=factored"],
     "compression.scale=factored applies to the gradient's block codecs int8, int4, sign"),
    ("llama-seq-len", ["model=llama-tiny", "data.seq_len=4096"], "exceeds model.max_seq_len"),
    ("run-name-escapes", ["run_name=../../x"], "run_name='../../x' must be one folder name"),
    ("tokenizer-empty", ["data.tokenizer={empty}"], "holds no tokenizer"),
    ("tokenizer-garbled", ["data.tokenizer={garbled}"], "cannot be loaded"),
    ("timeout-zero", ["parallel.timeout_s=0"], "parallel.timeout_s must be > 0"),
    ("train-timeout-negative", ["parallel.train_timeout_s=-1"], "parallel.train_timeout_s must be >= 0"),
    ("straggler-threshold", ["health.straggler_threshold=0"], "health.straggler_threshold must be a finite number > 0"),
    ("health-every", ["health.divergence_every=-1"], "health.straggler_every, divergence_every, comm_checks and "
     "comm_warmup must be >= 0"),
    ("comm-slowdown", ["health.comm_slowdown=1"], "health.comm_slowdown must be a finite number > 1"),
    ("comm-min-share", ["health.comm_min_share=1.5"], "health.comm_min_share must be in [0, 1)"),
    ("comm-baseline", ["health.comm_baseline=0"], "health.comm_baseline must be >= 1"),
    ("comm-action", ["health.comm_action=page"], "health.comm_action='page' is not one of warn, stop"),
    ("comm-preflight-missing", ["health.comm_preflight=/nonexistent/preflight.json"],
     "health.comm_preflight: /nonexistent/preflight.json is not a `hybrid-commbench --preflight --save` result"),
    ("recompute", ["train.recompute=some"], "train.recompute='some' is not one of none, selective, full"),
    ("bf16-params-onebit", ["train.precision=bf16_params", "compression=onebit_adam"],
     "train.precision=bf16_params keeps fp32 main weights that compression=onebit_adam's optimizer does not"),
    ("adamw-kernels", ["optim.implementation=triton"], "optim.implementation='triton' is not one of fused, foreach"),
    ("overlap-without-zero", ["parallel.overlap_param_gather=true"], "parallel.overlap_param_gather=true overlaps "
     "the distributed optimizer's parameter all-gather: it needs parallel.zero=1 or 2"),
    ("zero-4", ["parallel.zero=4"], "parallel.zero must be 0 (off), 1 (the distributed optimizer: Adam's moments "
     "sharded over DP), 2 (gradients sharded too) or 3 (parameters too), got 4"),
    ("zero-group", ["parallel.zero=3", "parallel.zero_group=3"], "parallel.zero_group=3 must be dp, node or a number "
     "of ranks dividing dp="),
    ("zero-group-no-zero", ["parallel.zero_group=1"], "parallel.zero_group=1 shards ZeRO's state "
     "inside groups: it needs parallel.zero=1, 2 or 3"),
    ("qwz-zero2", ["parallel.zero=2", "parallel.zero_param_codec=int8"], "parallel.zero_param_codec=int8 encodes "
     "ZeRO-3's parameter all-gather: it needs parallel.zero=3"),
    ("qwz-codec", ["parallel.zero=3", "parallel.zero_param_codec=fp4"], "parallel.zero_param_codec=fp4 is not one "
     "of none, int8"),
    ("hpz-zero2", ["parallel.zero=2", "parallel.zero_hpz=true"], "parallel.zero_hpz=true keeps a node's copy of "
     "ZeRO-3's gathered parameters: it needs parallel.zero=3"),
    ("hpz-one-node", ["parallel.zero=3", "parallel.zero_hpz=true"], "parallel.zero_hpz=true needs a ZeRO shard group "
     "across nodes with several of its ranks on each; here each has 1 rank(s), 1 on a node"),
    ("qgz-feedback", ["parallel.zero=2", "compression=int4", "parallel.zero_grad_feedback=true"],
     "parallel.zero_grad_feedback=true feeds back what qgZ's between-node hop loses: it needs compression=int8|int4 "
     "under a ZeRO stage whose shard group spans nodes"),
    ("zero3-compile", ["parallel.zero=3", "train.compile=true"], "parallel.zero=3 gathers and frees each block's "
     "parameters from hooks around it, which a compiled block cannot run"),
    ("zero3-overlap", ["parallel.zero=3", "parallel.overlap_param_gather=true"], "it needs parallel.zero=1 or 2 "
     "(zero=3 gathers each block before its use, prefetching the next)"),
    ("zero-codec", ["parallel.zero=2", "compression=powersgd"], "parallel.zero=2 reduce-scatters the gradients, "
     "which compression=powersgd cannot do (it needs each bucket whole): use compression=none|fp16|bf16|int8"),
    ("zero-warmup", ["parallel.zero=1", "compression=bf16", "compression.warmup_steps=2"],
     "needs schedule=fixed and warmup_steps=0"),
    ("wandb-online-no-key", ["logging.wandb.mode=online"], f"logging.wandb.mode=online needs {WANDB_NEEDS}"),
    ("optim-name", ["optim.name=lamb"], "optim.name='lamb' is not one of adamw, sgd"),
    ("sgd-nesterov", ["optim=sgd", "optim.momentum=0", "optim.nesterov=true"],
     "optim.nesterov=true needs optim.momentum > 0"),
    ("sync-mode", ["sync.mode=async"], "sync.mode='async' is not one of dp, diloco, gossip, ps"),
    ("tp-overlap-mode", ["parallel.tp_overlap=async"], "parallel.tp_overlap='async' is not one of none, bulk, chunked"),
    ("sync-dp-inner-steps", ["sync.inner_steps=5"], "apply to sync=diloco or sync=local_sgd, not to synchronous DP"),
]
RANKED: list[tuple[str, list[str], str]] = [  # the same, as rank 0 and rank 1 of two torchrun ranks see them
    ("tp-heads", ["parallel=tp2", "model.n_heads=3", "model.hidden=192"],
     "model.n_heads=3 is not divisible by parallel.tp=2"),
    ("tp-kv-heads", ["parallel=tp2", "model=llama-tiny", "model.n_kv_heads=1"],
     "model.n_kv_heads=1 is not divisible by parallel.tp=2"),
    ("tp-ffn", ["parallel=tp2", "model.ffn_hidden=1001"], "model.ffn_hidden=1001 is not divisible by parallel.tp=2"),
    ("pp-interleaved", ["parallel=pp2", "train.micro_batch_size=4", "parallel.schedule=interleaved",
                        "parallel.virtual_stages=2", "train.global_batch_size=12"],
     "interleaved schedule needs microbatches (3) divisible by pp=2"),
    ("pp-stage-layers", ["parallel=pp2", "parallel.stage_layers=[3,2]"], "summing to model.n_layers=4"),
    ("pp-stage-layers-word", ["parallel=pp2", "parallel.stage_layers=balanced"],
     "parallel.stage_layers must be auto or a list of layer counts"),
    ("cp-seq-len", ["parallel.cp=2", "data.seq_len=66"],
     "parallel.cp=2 cuts each sequence into 2·cp = 4 chunks: data.seq_len=66 is not divisible by 4"),
    ("cp-a2a-heads", ["parallel.cp=2", "parallel.cp_comm=a2a", "model.n_heads=3", "model.hidden=96"],
     "parallel.cp_comm=a2a spreads each TP rank's 3 attention heads over parallel.cp=2: not divisible"),
    ("tp-overlap-chunked-without-sp", ["parallel=tp2", "parallel.tp_overlap=chunked"],
     "parallel.tp_overlap=chunked pipelines sequence parallelism's all-gathers and reduce-scatters with the GEMMs: "
     "set parallel.sequence_parallel=true"),
    ("tp-overlap-chunks-seq", ["parallel=tp2", "parallel.sequence_parallel=true", "parallel.tp_overlap=chunked",
                               "parallel.tp_overlap_chunks=6", "data.seq_len=64"],
     "parallel.tp_overlap_chunks=6 does not divide the 64 tokens of each sequence a rank works on"),
    ("tp-overlap-chunks-tp", ["parallel=tp2", "parallel.sequence_parallel=true", "parallel.tp_overlap=chunked",
                              "parallel.tp_overlap_chunks=3"],
     "parallel.tp_overlap_chunks=3 must be a multiple of parallel.tp=2"),
    ("cp-across-nodes", ["parallel.cp=2", "parallel.ranks_per_node=1"],
     "CP group of 2 ranks would span nodes of 1 ranks; CP's every-layer K/V exchange needs the fast intra-node "
     "links (set parallel.allow_cp_across_nodes=true to force it)"),
    ("cp-sync-mode", ["parallel.cp=2", "sync=diloco"],
     "parallel.cp=2 averages gradients over CP and DP together: it runs with sync.mode=dp"),
    ("zb-compiled", ["parallel=pp2", "parallel.schedule=zb1p", "train.compile=true"],
     "train.compile=true makes a compiled graph's backward one node that cannot be split"),
    ("zbv-unequal-parts", ["parallel=pp2", "parallel.schedule=zbv", "parallel.virtual_stages=2", "model.n_layers=6"],
     "parallel.schedule=zbv needs equal parts: model.n_layers=6 is not divisible by pp·virtual_stages = 4"),
    ("zbv-one-chunk", ["parallel=pp2", "parallel.schedule=zbv"],
     "parallel.schedule=zbv needs parallel.virtual_stages >= 2"),
    ("pp-unknown-schedule", ["parallel=pp2", "parallel.schedule=zb2"],
     "parallel.schedule='zb2' is not one of gpipe, 1f1b, interleaved, zb1p, zbv"),
    ("zb-memory", ["parallel=pp2", "parallel.schedule=zb1p", "parallel.zb_memory=2GiB"],
     "parallel.zb_memory='2GiB' is not one of 1f1b, none"),
    ("compression-rank", ["compression=powersgd", "compression.rank=0"], "compression.rank must be > 0, got 0"),
    ("sync-inner-steps", ["sync=diloco", "sync.inner_steps=0"], "sync.inner_steps must be >= 1, got 0"),
    ("sync-fragments", ["sync=diloco", "sync.inner_steps=4", "sync.fragments=5"],
     "sync.fragments must be between 1 and sync.inner_steps=4, got 5"),
    ("sync-momentum", ["sync=diloco", "sync.outer_momentum=1"], "sync.outer_momentum must be in [0, 1), got 1"),
    ("sync-outer", ["sync=diloco", "sync.outer=adam"], "sync.outer='adam' is not one of auto, nesterov, average"),
    ("sync-outer-average-pinned", ["sync=diloco", "sync.outer=average", "sync.outer_lr=0.5"],
     "sync.outer=average is lr 1 with no momentum"),
    ("sync-outer-switch-cos", ["sync=diloco", "sync.outer_switch_cos=2"], "sync.outer_switch_cos must be in [-1, 1]"),
    ("sync-outer-switch-window", ["sync=diloco", "sync.outer_switch_window=0"],
     "sync.outer_switch_window must be >= 1 and sync.outer_switch_left >= 0 (outer rounds), got 0 and 20"),
    ("sync-auto-h-elsewhere", ["sync=gossip", "sync.inner_steps=null"],
     "sync.inner_steps=null (H from train.steps) applies to sync=diloco or sync=local_sgd"),
    ("sync-sharded-optimizer", ["sync=local_sgd", "parallel.zero=1"],
     "sync.mode=diloco cannot run with parallel.zero=1"),
    ("sync-hierarchical", ["sync=diloco", "compression=hierarchical", "compression.inner=int8"],
     "(use sync.scope=inter)"),
    ("sync-inter-one-node", ["sync=diloco", "sync.scope=inter"],
     "sync.scope=inter needs DP replicas on more than one node"),
    ("sync-overlap", ["sync=diloco", "sync.inner_steps=4", "sync.overlap_steps=4"],
     "sync.overlap_steps must be in [0, sync.inner_steps=4)"),
    ("sync-overlap-mix", ["sync=diloco", "sync.overlap_mix=0.5"], "0 unless sync.overlap_steps > 0; got 0.5"),
    ("sync-overlap-serial-hook", ["sync=diloco", "sync.overlap_steps=1", "compression=torch_powersgd"],
     "sync.overlap_steps cannot run with compression=torch_powersgd"),
    ("sync-overlap-gossip", ["sync=gossip", "sync.overlap_steps=1"],
     "sync.overlap_steps and sync.overlap_mix apply to sync=diloco or sync=local_sgd"),
    ("gossip-topology", ["sync=gossip", "sync.topology=torus"],
     "sync.topology='torus' is not one of ring, exponential, one_peer, complete"),
    ("gossip-compression", ["sync=gossip", "compression=int8"], "sync=gossip exchanges fp32 parameters"),
    ("ps-keys-elsewhere", ["sync=diloco", "sync.servers=2"], "apply to sync=ps (the parameter server)"),
    ("ps-staleness-sync", ["sync=ps", "sync.max_staleness=2"], "needs sync.asynchronous=true"),
    ("ps-servers", ["sync=ps", "sync.servers=3"], "sync.servers=3 is more than the DP ranks that host them (dp=2)"),
    ("ps-staleness", ["sync=ps_async", "sync.max_staleness=-1"], "sync.max_staleness must be >= 0, got -1"),
    ("ps-bf16-params", ["sync=ps", "train.precision=bf16_params"], "sync=ps keeps fp32 parameters on the servers"),
    ("ps-skip", ["sync=ps", "train.on_nonfinite=skip"], "train.on_nonfinite=skip is not available with it"),
    ("sgd-sharded-optimizer", ["optim=sgd", "parallel.zero=1"],
     "optim.name=sgd cannot run with parallel.zero=1 or compression=onebit_adam"),
]

CHECKED = ["steps-0", "warmup-longer-than-run", "on-nonfinite", "max-skipped-steps", "rewind-without-checkpoints",
           "llama-seq-len", "tokenizer-garbled", "unknown-key"]
"""CASES checked through the check before launch instead of `refusal` (RANKED all are: the world matters there)."""

FORKED = ["unknown-key", "eps", "rewind-without-checkpoints", "topk-fraction", "sync-mode", "tokenizer-empty",
          "tokenizer-garbled", "wandb-online-no-key"]
"""CASES run for real through `hybrid.train.main`, one per way a refusal is reached: the pre-check's unknown key
(hybrid.overrides), validate's own rule, its checkpoint rule, the compression package's check, the sync modes'
check, the data's tokenizer folders (the file system, after validate), wandb's key (the start-up check). These
are the rows the in-process check leaves out: their refusal may need the whole run's start."""
RANKED_FORKED = ["tp-heads"]
"""RANKED run for real as rank 0 and rank 1: the `[rankN]` prefix is the same for every message."""


def rows(table: list[tuple[str, list[str], str]], ids: list[str], forked: bool) -> list[tuple[str, list[str], str]]:
    """The rows of `table` whose id is (`forked`) or is not in `ids`."""
    return [row for row in table if (row[0] in ids) == forked]


@pytest.fixture(scope="module", autouse=True)
def warm() -> None:
    """What the forked runs and the check would load (transformers for the tokenizer rows, the trainer's
    modules), loaded here once (test_nonfinite's `load_what_runs_load`)."""
    load_what_runs_load()


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Prepared inputs outside the runs' working folders: an empty and a garbled tokenizer folder."""
    root = tmp_path_factory.mktemp("inputs")
    (root / "empty").mkdir()
    (root / "garbled").mkdir()
    (root / "garbled" / "tokenizer.json").write_text("{not json")
    return {"empty": str(root / "empty"), "garbled": str(root / "garbled")}


def assert_refused(r: CliRun, needle: str, cwd: Path) -> None:
    assert r.code == 2, (r.code, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(r.error_lines()) == 1 and needle in r.error_lines()[0], r.stderr[-3000:]
    assert list(cwd.iterdir()) == [], sorted(p.name for p in cwd.iterdir())  # nothing written


def test_every_forked_row_is_a_row() -> None:
    ids = [c[0] for c in CASES + RANKED]
    assert len(set(ids)) == len(ids) and set(FORKED) <= {c[0] for c in CASES}, FORKED
    assert set(RANKED_FORKED) <= {c[0] for c in RANKED} and set(CHECKED) <= {c[0] for c in CASES}
    checked = {c[0] for c in IN_PROCESS + rows(CASES, FORKED, forked=True) + LAUNCH_CASES}
    assert checked == {*ids, "check-world-zero", "check-world-layout"}, checked  # no row left out


IN_PROCESS = [row for row in rows(CASES, FORKED, forked=False) if row[0] not in CHECKED]
"""The CASES neither forked nor checked before launch: their message through `refusal`, on one process."""


@pytest.mark.parametrize(("overrides", "needle"), [c[1:] for c in IN_PROCESS], ids=[c[0] for c in IN_PROCESS])
def test_bad_input_is_refused_with_its_one_line(overrides: list[str], needle: str, folders: dict[str, str]) -> None:
    """A row of IN_PROCESS, in this process (hybrid.tools.check's `refusal`: composed and validated as
    hybrid.train does on one process). A row refused only later belongs in FORKED."""
    message = refusal([*B, *(o.format(**folders) for o in overrides)])
    assert message is not None and needle in message and "\n" not in message, message


@pytest.mark.parametrize(("overrides", "needle"), [c[1:] for c in rows(CASES, FORKED, forked=True)],
                         ids=[c[0] for c in rows(CASES, FORKED, forked=True)])
def test_bad_input_is_one_line_exit_2_nothing_written(overrides: list[str], needle: str, folders: dict[str, str],
                                                      tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A FORKED row through the real entry point. HOME is a fresh folder without a netrc or wandb settings (no
    wandb key), holding the default data cache (~/.cache/hybrid): a row refused before the data step (all but
    the data's own tokenizer rows; wandb's key among them) never starts building it."""
    argv = [*B, *(o.format(**folders) for o in overrides)]
    home = tmp_path_factory.mktemp("home")
    env = {"OMP_NUM_THREADS": "1", "HOME": str(home), "WANDB_API_KEY": "", "HYBRID_CACHE": ""}
    with frozen_gc():
        r = run_forked(hybrid.train.main, argv, tmp_path, env)
    assert_refused(r, needle, tmp_path)
    if not any(o.startswith("data.tokenizer=") for o in overrides):
        assert not (home / ".cache" / "hybrid").exists(), sorted(str(p) for p in home.rglob("*"))


@pytest.mark.parametrize(("overrides", "needle"), [c[1:] for c in rows(RANKED, RANKED_FORKED, forked=True)],
                         ids=[c[0] for c in rows(RANKED, RANKED_FORKED, forked=True)])
def test_bad_input_is_one_line_on_every_rank(overrides: list[str], needle: str, tmp_path: Path) -> None:
    """Checks made before the process group exists run alike on every rank: each forked child gets torchrun's
    RANK/WORLD_SIZE (no MASTER_ADDR: nothing to wait for) and must print its own `[rankN]` line.
    (tests/e2e/test_torchrun.py runs the real torchrun for a bad layout and a bad override.)"""
    for rank in (0, 1):
        env = {"OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2"}
        with frozen_gc():
            r = run_forked(hybrid.train.main, [*B, *overrides], tmp_path, env)
        assert_refused(r, needle, tmp_path)
        assert r.error_lines()[0].startswith(f"[rank{rank}] hybrid: error: "), r.error_lines()


def test_the_fork_runs_as_a_fresh_process_does(tmp_path: Path) -> None:
    (tmp_path / "fork").mkdir()
    (tmp_path / "fresh").mkdir()
    argv = [*B, "optim.eps=-1"]
    with frozen_gc():
        forked = run_forked(hybrid.train.main, argv, tmp_path / "fork")
    fresh = subprocess.run([sys.executable, "-m", "hybrid.train", *argv], cwd=tmp_path / "fresh", text=True,
                           capture_output=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert (forked.code, forked.error_lines()) == (fresh.returncode, [ln for ln in fresh.stderr.splitlines()
                                                                      if "hybrid: error:" in ln])
    assert_refused(forked, "optim.eps must be > 0", tmp_path / "fork")


LAUNCH_CASES = [(c[0], ["--world", "2", *c[1]], c[2]) for c in RANKED] + [c for c in CASES if c[0] in CHECKED] + [
    ("check-world-zero", ["--world", "0"], "--world needs a positive whole number, got 0"),
    ("check-world-layout", ["--world", "3", "parallel=tp2"], "does not divide world size 3")]


def run_check(argv: list[str], cwd: Path, capsys: pytest.CaptureFixture[str],
              monkeypatch: pytest.MonkeyPatch) -> CliRun:
    """`python -m hybrid.tools.check *argv` in this process, working in `cwd`: its `main`, one process without
    torchrun's variables, as the launch scripts run it (they run the real process, test below)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    code = hybrid.tools.check.main(argv)
    out = capsys.readouterr()
    return CliRun(code, out.out, out.err)


@pytest.mark.parametrize(("argv", "needle"), [c[1:] for c in LAUNCH_CASES], ids=[c[0] for c in LAUNCH_CASES])
def test_the_check_before_launch_says_it_once(argv: list[str], needle: str, folders: dict[str, str], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    args = [a.format(**folders) for a in argv]
    split = 2 if args[0] == "--world" else 0
    r = run_check([*args[:split], *B, *args[split:]], tmp_path, capsys, monkeypatch)
    assert_refused(r, needle, tmp_path)
    assert r.error_lines()[0].startswith("hybrid: error: "), r.error_lines()  # one process: no rank prefix


def test_the_check_before_launch_reads_every_job_of_a_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A `-m` sweep: the second value of a key is composed and validated too (hybrid.overrides.sweep_jobs)."""
    r = run_check(["--world", "2", "-m", *B, "train.steps=4,0"], tmp_path, capsys, monkeypatch)
    assert_refused(r, "train.steps must be >= 1", tmp_path)
    r = run_check(["--world", "2", *B, "-m", "train.steps=4,0"], tmp_path, capsys, monkeypatch)
    assert_refused(r, "is not a command line hybrid.train parses", tmp_path)  # Hydra's flags go before the overrides


def stand_in_torchrun(tmp: Path) -> tuple[dict[str, str], Path]:
    """PATH with a `torchrun` that only records that it ran (and a Slurm host list); the marker file."""
    bin_dir, marker = tmp / "bin", tmp / "torchrun-ran"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(f'#!/bin/sh\necho "$@" > {marker}\n')
    (bin_dir / "srun").write_text('#!/bin/sh\nshift\nshift\nexec "$@"\n')  # drop --kill-on-bad-exit, --cpus
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node-a\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "7",
           "SLURM_NNODES": "1", "SLURM_GPUS_ON_NODE": "2", "SLURM_JOB_NODELIST": "node-a", "SLURM_CPUS_PER_TASK": "2",
           "SLURM_SUBMIT_DIR": str(ROOT), "MAX_RESTARTS": "0"}
    env.pop("HYBRID_MODULE", None)
    return env, marker


SCRIPTS = {"local.sh": ["2"], "multinode.sh": ["--nnodes", "1", "--nproc", "2", "--endpoint", "127.0.0.1:1"],
           "slurm.sbatch": []}
GOOD_THROUGH = "multinode.sh"
"""The script a good command line also goes through (the module docstring says why one is enough)."""


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_launch_script_stops_bad_input_before_torchrun(script: str, tmp_path: Path) -> None:
    name, overrides, needle = RANKED[0]
    env, marker = stand_in_torchrun(tmp_path)
    (tmp_path / "work").mkdir()
    p = subprocess.run(["bash", str(ROOT / "launch" / script), *SCRIPTS[script], *B, *overrides], text=True,
                       capture_output=True, timeout=120, env=env, cwd=tmp_path / "work")
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("hybrid: error: ") and needle in lines[0], p.stderr[-3000:]
    assert not marker.exists() and list((tmp_path / "work").iterdir()) == []  # no rank started, nothing written
    if script != GOOD_THROUGH:
        return
    good = subprocess.run(["bash", str(ROOT / "launch" / script), *SCRIPTS[script], *B], text=True,
                          capture_output=True, timeout=120, env=env, cwd=tmp_path / "work")
    assert good.returncode == 0 and marker.exists(), good.stderr[-3000:]  # a good command line reaches torchrun

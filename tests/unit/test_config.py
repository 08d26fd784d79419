"""Config: every file in configs/ composes and validates; bad input is one line and exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybrid.config import CONFIG_DIR, ConfigError, compose_config, config_dir
from hybrid.testing.cli_runs import CliRun, run_forked
from hybrid.tools.check import refusal
from hybrid.validation import validate

ROOT = Path(__file__).resolve().parents[2]
GROUPS = ["model", "parallel", "data", "optim", "compression"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONFIG_DIR) / group).glob("*.yaml"))


def test_the_config_folder_is_the_packaged_one_else_the_checkouts(tmp_path: Path) -> None:
    """A wheel's `hybrid/configs` wins; a source tree or an editable install reads `configs/` beside the package."""
    assert Path(CONFIG_DIR) == ROOT / "configs" and not (ROOT / "hybrid" / "configs").exists()
    package = tmp_path / "site" / "hybrid"
    (package / "configs").mkdir(parents=True)
    assert config_dir(package) == str(tmp_path / "site" / "configs")  # an empty leftover folder is not the wheel's
    (package / "configs" / "config.yaml").write_text("defaults: []\n")
    assert config_dir(package) == str(package / "configs")


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_config_file_composes(group: str, option: str) -> None:
    overrides = [f"{group}={option}"]
    if group == "data" and option == "local":
        overrides.append(f"data.path={ROOT / 'pyproject.toml'}")
    if group == "compression" and option == "hierarchical":  # the file leaves the inner method to the user
        overrides.append("compression.inner=int8")
    cfg = compose_config(overrides)
    expected = option.split("-")[0] if group == "compression" else option  # hierarchical-<inner>
    assert cfg[group].get("name", cfg[group].get("method")) == expected
    world = cfg.parallel.tp * cfg.parallel.pp * (cfg.parallel.dp or 1)
    if group == "model":  # each model composes with the layouts it is meant for
        cfg = compose_config(overrides + ["parallel=tp2pp4", "train.global_batch_size=64"])
        world = 8
    validate(cfg, world)


IDENTITY = ("name", "method")  # a group file's own name: set even where it equals the schema's default


def restated(yaml: object, schema: object, where: str) -> list[str]:
    """The keys of a raw YAML mapping whose value equals the schema's default (nested mappings walked)."""
    out = []
    for key, value in yaml.items():  # type: ignore[attr-defined]
        default = schema.get(key, "<not in the schema>")  # type: ignore[attr-defined]
        if isinstance(value, dict) and isinstance(default, dict):
            out += restated(value, default, f"{where}{key}.")
        elif value == default and key not in IDENTITY:
            out.append(f"{where}{key}: {value!r}")
    return out


@pytest.mark.parametrize("path", sorted(p.relative_to(Path(CONFIG_DIR)).as_posix()
                                        for p in (Path(CONFIG_DIR)).rglob("*.yaml") if p.parent.name != "model"))
def test_no_config_file_restates_a_schema_default(path: str) -> None:
    """The dataclasses of hybrid/config.py are the one source of defaults: a YAML value equal to the default
    would hide a later change of it (model files define models and may spell out every field)."""
    from omegaconf import OmegaConf

    from hybrid.config import Config

    schema = OmegaConf.to_container(OmegaConf.structured(Config), resolve=False)
    raw = OmegaConf.to_container(OmegaConf.load(Path(CONFIG_DIR) / path), resolve=False)
    group = path.split("/")[0] if "/" in path else None
    raw = {k: v for k, v in raw.items() if k not in ("defaults", "hydra")} if group is None else raw
    assert restated(raw, schema if group is None else schema[group], "" if group is None else f"{group}.") == []


def test_the_schema_alone_gives_the_default_train_checkpoint_and_logging() -> None:
    from omegaconf import OmegaConf

    from hybrid.config import Config

    cfg = OmegaConf.to_container(compose_config([]), resolve=False)
    schema = OmegaConf.to_container(OmegaConf.structured(Config), resolve=False)
    for key in ("run_name", "train", "checkpoint", "logging", "optim"):
        assert cfg[key] == schema[key], key
    assert (cfg["train"]["lr"], cfg["train"]["eval_every"], cfg["train"]["eval_batches"]) == (3e-3, 25, 2)


def test_derived_dp_and_microbatches() -> None:
    cfg = compose_config(["parallel=tp2", "train.global_batch_size=64", "train.micro_batch_size=4"])
    layout = validate(cfg, 8)
    assert (layout.tp, layout.pp, layout.dp) == (2, 1, 4)


@pytest.mark.parametrize("overrides,world,needle", [
    (["parallel=tp2pp2"], 6, "does not divide world size 6"),
    (["model.n_heads=6", "model.hidden=384", "parallel=tp4pp2"], 8, "n_heads=6 is not divisible by parallel.tp=4"),
    (["model=llama-tiny", "parallel=tp4pp2"], 8, "n_kv_heads=2 is not divisible by parallel.tp=4"),
    (["model.ffn_hidden=1022", "parallel=tp4pp2"], 8, "ffn_hidden=1022 is not divisible"),
    (["train.steps=-1"], 1, "train.steps must be >= 1"),
    (["train.global_batch_size=30"], 4, "not a multiple of micro_batch_size"),
    (["data.seq_len=4096"], 1, "exceeds model.max_seq_len"),
    (["model.n_layers=2", "parallel=pp4"], 4, "fewer than pp"),
    (["parallel=pp2", "parallel.virtual_stages=2"], 2, "virtual_stages=2 needs schedule=interleaved"),
    (["parallel=pp2", "parallel.schedule=interleaved", "parallel.virtual_stages=2", "train.micro_batch_size=4",
      "train.global_batch_size=12"], 2, r"microbatches \(3\) divisible by pp=2"),
    (["parallel.schedule=interleaved", "parallel.virtual_stages=2"], 1, "interleaved schedule needs pp >= 2"),
    (["parallel=pp2", "parallel.schedule=interleaved"], 2, "interleaved needs parallel.virtual_stages >= 2"),
    (["parallel=pp2", "parallel.schedule=zigzag"], 2, "parallel.schedule='zigzag' is not one of"),
    (["parallel=pp2", "parallel.stage_layers=[1,2]"], 2, r"summing to model.n_layers=4"),
    (["parallel=pp2", "parallel.virtual_stages=2", "parallel.schedule=interleaved", "parallel.stage_layers=[1,3]"],
     2, r"must list 4 layer counts"),
    (["parallel=pp4", "parallel.stage_layers=[2,0,1,1]"], 4, "only the first and last part may be empty"),
    (["model.n_layers=4", "parallel=pp2", "parallel.virtual_stages=3", "parallel.schedule=interleaved"], 2,
     "fewer than pp"),
    (["parallel.sequence_parallel=true", "parallel=tp2", "data.seq_len=127"], 2,
     "data.seq_len=127 divisible by parallel.tp=2"),
    (["checkpoint.every=-1"], 1, "checkpoint.every must be >= 0"),
    (["checkpoint.keep=-2"], 1, "checkpoint.keep must be >= 0"),
    (["checkpoint.save_on_signal=[SIGKILL]"], 1, "save_on_signal: .SIGKILL. is not a signal a process can catch"),
    (["checkpoint.resume=''"], 1, "checkpoint.resume must be none, auto or a checkpoint path"),
    (["train.steps=10", "profile.steps=[5,12]"], 1, r"profile.steps=\[5, 12\] must be \[\] or \[first, last\]"),
    (["profile.steps=[3,2]"], 1, "1 <= first <= last"),
    (["profile.steps=[2]"], 1, "must be"),
])
def test_validate_rejects(overrides: list[str], world: int, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        validate(compose_config(overrides), world)


def run_train(*args: str, cwd: Path = ROOT) -> CliRun:
    """`python -m hybrid.train *args` as a forked child of this process (hybrid.testing.cli_runs)."""
    import hybrid.train

    return run_forked(hybrid.train.main, list(args), cwd, {"OMP_NUM_THREADS": "1"})


BAD_INPUT = [
    (["model=nope"], "Could not find 'model/nope'"),
    (["train.foo=1"], "Could not override 'train.foo'"),
    (["train.steps=abc"], "could not be converted to Integer"),
    (["train.steps=-5"], "train.steps must be >= 1"),
    (["model.hidden=250"], "hidden=250 is not divisible by model.n_heads=4"),
    (["data.path=/nonexistent/corpus.txt"], "does not exist"),
    (["compression=nope"], "Could not find 'compression/nope'"),
    (["data=local"], "data.path is required by data=local"),
    (["train.steps=4", "profile.steps=[3,9]"], "profile.steps=[3, 9] must be"),
]
FORKED = ["model=nope", "train.steps=abc", "model.hidden=250", "data.path=/nonexistent/corpus.txt"]
"""BAD_INPUT rows (by their first override) also run through the real entry point: Hydra's group option and
value errors (the pre-check), validate's rule, a path on the file system; the edge is the same for the rest."""


@pytest.mark.parametrize("args,needle", BAD_INPUT)
def test_bad_input_is_refused_with_its_line(args: list[str], needle: str) -> None:
    """Each row in this process (hybrid.tools.check's `refusal`: composed and validated as hybrid.train does)."""
    message = refusal([*args, "logging.wandb.mode=disabled"])
    assert message is not None and needle in message and "\n" not in message, message


@pytest.mark.parametrize("args,needle", [row for row in BAD_INPUT if row[0][0] in FORKED])
def test_bad_input_is_one_line_and_exit_2(args: list[str], needle: str, tmp_path: Path) -> None:
    r = run_train(*args, f"logging.dir={tmp_path}", "logging.wandb.mode=disabled", cwd=tmp_path)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.code == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("hybrid: error:"), r.stderr
    assert needle in lines[0]


def test_cfg_job_prints_the_composed_config() -> None:
    r = run_train("--cfg", "job", "model=llama-tiny", "train.steps=7")
    assert r.code == 0, r.stderr
    assert "family: llama" in r.stdout and "steps: 7" in r.stdout


@pytest.mark.parametrize("overrides,needle", [
    (["compression.method=zip"], r"compression.method='zip' is not one of"),
    (["compression=powersgd", "compression.rank=0"], r"compression.rank must be > 0, got 0"),
    (["compression=powersgd", "compression.rank=-2"], r"compression.rank must be > 0, got -2"),
    (["compression=topk", "compression.fraction=0"], r"compression.fraction must be in \(0, 1\] .*, got 0"),
    (["compression=topk", "compression.fraction=1.5"], r"compression.fraction must be in \(0, 1\] .*, got 1.5"),
    (["compression=int8", "compression.block_size=0"], r"compression.block_size must be > 0, got 0"),
    (["compression=sign", "compression.warmup_steps=-1"], r"compression.warmup_steps must be >= 0"),
    (["compression=powersgd", "compression.min_compression_rate=0"], r"compression.min_compression_rate must be > 0"),
    (["compression=hierarchical"], r"compression=hierarchical needs compression.inner"),
    (["compression=hierarchical", "compression.inner=hierarchical"], r"compression.inner .*got 'hierarchical'"),
    (["compression=hierarchical", "compression.inner=torch_fp16"], r"compression.inner .*got 'torch_fp16'"),
    (["compression=torch_powersgd", "compression.warmup_steps=1"], r"compression.warmup_steps >= 2"),
    (["compression=sign", "compression.warmup_share=1"], r"compression.warmup_share must be in \[0, 1\), got 1"),
    (["compression=powersgd", "compression.target_error=1.2"], r"compression.target_error must be in \[0, 1\)"),
    (["compression=powersgd", "compression.rank_window=0"], r"compression.rank_window must be >= 1, got 0"),
    (["compression=powersgd", "compression.rank=8", "compression.max_rank=4"], r"compression.max_rank must be >= "),
    (["compression=powersgd", "compression.min_ratio=0.5"], r"compression.min_ratio must be >= 1"),
    (["compression=zeroone_adam", "compression.var_freeze_step=-1"], r"compression.var_freeze_step must be >= 0"),
    (["compression=onebit_adam", "compression.var_refresh_every=-2"], r"compression.var_refresh_every must be >= 0 "),
    (["compression=zeroone_adam", "compression.var_update_scaler=-1"], r"compression.var_update_scaler must be >= 0"),
    (["compression=zeroone_adam", "compression.local_step_scaler=-1"], r"compression.local_step_scaler must be >= 0"),
    (["compression=zeroone_adam", "compression.local_step_clipper=0"], r"compression.local_step_clipper must be >= 1"),
    (["compression=zeroone_adam", "compression.schedule=auto"], r"compression=zeroone_adam refreshes .* its own"),
])
def test_validate_rejects_bad_compression(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        validate(compose_config(overrides), 1)


def test_compression_knobs_that_are_fine() -> None:
    """The boundaries of the checks above are accepted (fraction 1, rank 1, torch_powersgd without
    error feedback needs no warm-up), and make_hook applies the same check."""
    from hybrid.compression import CompressionError
    from hybrid.compression.hooks import make_hook
    from hybrid.config import CompressionConfig

    for overrides in (["compression=topk", "compression.fraction=1"], ["compression=powersgd", "compression.rank=1"],
                      ["compression=torch_powersgd", "compression.warmup_steps=0", "compression.error_feedback=false"],
                      ["compression=hierarchical", "compression.inner=int8"]):
        validate(compose_config(overrides), 1)
    with pytest.raises(CompressionError, match="compression.inner"):  # the package's own error; validate translates
        make_hook(CompressionConfig(method="hierarchical"), None)

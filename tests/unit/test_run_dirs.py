"""Where a run's files go: the default run name follows the real layout, and a sweep job's folders.

The naming rule is checked against the group files themselves: composing `parallel=dp` with another
group file's layout values must name the run after that file, as choosing the file does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hybrid.checkpoint import run_root
from hybrid.config import CONFIG_DIR, ConfigError, ParallelConfig, compose_config, derived_label
from hybrid.train import use_job_folder

GROUPS = sorted(p.stem for p in (Path(CONFIG_DIR) / "parallel").glob("*.yaml"))
LAYOUT = ("tp", "pp", "dp", "virtual_stages")


def group_values(name: str) -> dict[str, object]:
    """The layout values the group file `parallel/<name>.yaml` gives (schema defaults filled in)."""
    merged = OmegaConf.merge(OmegaConf.structured(ParallelConfig), OmegaConf.load(Path(CONFIG_DIR) / "parallel" /
                                                                                 f"{name}.yaml"))
    return {k: merged[k] for k in LAYOUT}


def as_overrides(values: dict[str, object]) -> list[str]:
    return [f"parallel.{k}={'null' if v is None else v}" for k, v in values.items()]


@pytest.mark.parametrize("group", GROUPS)
def test_a_group_file_names_the_run_and_its_values_alone_give_the_same_name(group: str) -> None:
    cfg = compose_config([f"parallel={group}"])
    assert cfg.run_name == f"{cfg.model.name}-{group}"
    values = group_values(group)
    assert derived_label(values["tp"], values["pp"], values["virtual_stages"], values["dp"]) == group
    again = compose_config(["parallel=dp", *as_overrides(values)])  # another file, these values
    assert again.run_name == cfg.run_name


def test_changed_layout_values_rename_the_run_and_other_parallel_keys_do_not() -> None:
    assert compose_config(["parallel=dp", "parallel.tp=4"]).run_name == compose_config(["parallel=tp4"]).run_name
    cfg = compose_config(["parallel=tp2pp2", "parallel.schedule=interleaved", "parallel.virtual_stages=2"])
    assert cfg.run_name == f"gpt-tiny-tp{cfg.parallel.tp}pp{cfg.parallel.pp}v{cfg.parallel.virtual_stages}"
    same = compose_config(["parallel=tp2", "parallel.sequence_parallel=true", "parallel.bucket_mb=1",
                           "parallel.schedule=gpipe"])
    assert same.run_name == compose_config(["parallel=tp2"]).run_name


def test_a_label_without_a_group_file_and_an_explicit_run_name_are_kept() -> None:
    assert compose_config(["parallel.name=mine", "parallel.tp=2"]).run_name == "gpt-tiny-mine"
    cfg = compose_config(["model=llama-tiny", "parallel=tp2", "run_name=gpt-tiny-dp"])
    assert cfg.run_name == "gpt-tiny-dp"


def test_logging_dir_and_checkpoints_follow_the_run_name() -> None:
    for overrides in ([], ["parallel=dp", "parallel.pp=2"], ["run_name=exp1"]):
        cfg = compose_config(overrides)
        assert cfg.logging.dir == f"runs/{cfg.run_name}"
        assert run_root(cfg) == Path(cfg.checkpoint.dir) / cfg.run_name
    # continuing a run under another tp/pp: its run_name finds its checkpoints again
    assert run_root(compose_config(["parallel=tp2", "run_name=gpt-tiny-dp"])) == run_root(compose_config([]))


def test_a_sweep_job_writes_everything_into_its_folder() -> None:
    cfg = compose_config(["train.lr=1e-3"])
    use_job_folder(cfg, "multirun/x/3", ["train.lr=1e-3"])
    assert cfg.logging.dir == "multirun/x/3"
    assert cfg.profile.dir == "multirun/x/3/profile"  # follows logging.dir
    assert run_root(cfg) == Path("multirun/x/3/checkpoints") / cfg.run_name


@pytest.mark.parametrize("override", ["logging.dir=/tmp/a", "checkpoint.dir=/tmp/b", "++logging.dir=c"])
def test_a_fixed_folder_in_a_sweep_is_bad_input(override: str) -> None:
    with pytest.raises(ConfigError, match=r"each job writes into its own folder \(multirun/x/0\).*hydra.sweep.dir"):
        use_job_folder(compose_config([]), "multirun/x/0", ["train.lr=1e-3", override])


def test_the_sweep_folder_has_no_timestamp() -> None:
    """Every rank of a job must name the same folder: nothing in it may depend on when a rank started."""
    hydra = OmegaConf.to_container(OmegaConf.load(Path(CONFIG_DIR) / "config.yaml").hydra, resolve=False)
    folders = [hydra["run"]["dir"], hydra["sweep"]["dir"], hydra["sweep"]["subdir"]]
    assert all("${now:" not in f for f in folders), folders

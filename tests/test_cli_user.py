"""The first hour of a new user (issue 36): defaults that run, messages that point at the cause,
commands that read a training config, and the shipped example configs."""

from __future__ import annotations

import contextlib
import os
import subprocess
import io
import sys
from pathlib import Path
from unittest import mock

import pytest
import yaml

from cli_helpers import FAST, ultrascale
from ultrascale import cli, launch
from ultrascale.config import (
    ConfigError, build_config, known_keys, layout_keys, layout_sections, suggest_key,
)
from ultrascale.config_keys import MEANINGS
from ultrascale.layout import Layout

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def run_cli(*argv: str) -> tuple[int, str, str]:
    """The command in this process; `train` must not start anything."""
    out, err = io.StringIO(), io.StringIO()

    def refuse(*_a, **_k):
        raise AssertionError("a process was started")

    with mock.patch.object(launch, "spawn_local", refuse), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_a_one_rank_run_writes_its_config_layout_and_log(tmp_path):
    # (`ultrascale train --set training.steps=5` with the defaults runs in test_readme.py.)
    proc = ultrascale("train", *FAST, "--set", "parallel.dp=1", "--set", "training.steps=2",
                      "--set", "training.warmup_steps=null", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    run = next((tmp_path / "runs").iterdir())
    assert "warmup_steps: 0" in (run / "config.yaml").read_text()  # a tenth of 2 steps
    assert yaml.safe_load((run / "layout.yaml").read_text())["world_size"] == 1
    assert "rank 0 of 1" in (run / "rank_logs" / "rank_0.log").read_text()


def test_warmup_defaults_to_a_tenth_of_the_steps_and_an_explicit_one_is_kept():
    assert build_config({}, ["training.steps=200"]).training.warmup_steps == 20
    assert build_config({}, ["training.steps=5"]).training.warmup_steps == 0
    assert build_config({}, ["training.steps=1000000"]).training.warmup_steps == 1000
    assert build_config({}, ["training.warmup_steps=3"]).training.warmup_steps == 3
    with pytest.raises(ConfigError, match="leave it out"):
        build_config({}, ["training.steps=5", "training.warmup_steps=20"])


def test_dp_auto_divides_the_world_size():
    assert build_config({}, ["parallel.dp=auto", "parallel.tp=2"], world_size=4).parallel.dp == 2
    with pytest.raises(ConfigError, match="not divisible by tp x pp x cp"):
        build_config({}, ["parallel.dp=auto", "parallel.tp=4"], world_size=6)
    with pytest.raises(ConfigError, match="Give parallel.dp a number"):
        build_config({}, ["parallel.dp=auto"])


@pytest.mark.slow
def test_dp_auto_under_torchrun_with_four_processes_and_tp2_gives_dp2(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=4", "-m", "ultrascale.cli"]
    proc = ultrascale("train", *FAST, "--set", "training.steps=2", "--set", "parallel.dp=auto",
                      "--set", "parallel.tp=2", "--set", "logging.run_dir=run", cwd=tmp_path,
                      launcher=torchrun, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    layout = yaml.safe_load((tmp_path / "run" / "layout.yaml").read_text())
    assert layout["mesh"] == {"pp": 1, "dp": 2, "cp": 1, "tp": 2}
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["parallel"]["dp"] == 2
    first = [line for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][0]
    assert '"tokens": 128' in first  # dp 2 x micro-batch 2 x 32 tokens


def test_zero_with_nothing_to_shard_gets_a_note():
    code, out, _ = run_cli("train", "--dry-run", "--set", "parallel.dp=1", "--set",
                           "parallel.zero=1")
    assert code == 0 and "note: parallel.zero=1 with dp=1: there is nothing to shard" in out
    # ZeRO shards over dp x cp: cp ranks alone are a group to shard over.
    code, out, _ = run_cli("train", "--dry-run", "--set", "parallel.dp=1", "--set",
                           "parallel.cp=2", "--set", "parallel.zero=3")
    assert code == 0 and "nothing to shard" not in out, out


def test_set_without_equals_is_explained():
    code, _, err = run_cli("train", "--set", "training.steps", "10")
    assert code == 2
    assert "--set 'training.steps' has no '='" in err
    assert "did you mean --set training.steps=10?" in err
    assert "Config file" not in err


@pytest.mark.parametrize("typo,meant", [
    ("trainin.steps", "training.steps"), ("parallel.tensor_parallel", "parallel.tp"),
    ("training.lrr", "training.lr"), ("paralel.zero", "parallel.zero"),
    ("training.zero", "parallel.zero"), ("learning_rate", "training.lr"),
    ("training.gradient_accumulation_steps", "training.grad_accum_steps"),
])
def test_did_you_mean_matches_the_section_then_the_key(typo, meant):
    assert suggest_key(typo) == meant
    with pytest.raises(ConfigError, match=f"Did you mean `{meant}`"):
        build_config({}, [f"{typo}=1"])


def test_config_keys_lists_every_key_with_its_default_and_meaning():
    assert set(MEANINGS) == set(known_keys())
    assert [k for k, meaning in MEANINGS.items() if not meaning] == [], \
        "a key declared without its meaning: key(default, meaning, ...) in config.py"
    code, out, _ = run_cli("config", "keys")
    assert code == 0
    listed = {line.split()[0]: line for line in out.splitlines()}
    assert set(listed) == set(known_keys())
    assert listed["training.lr"].split()[1] == "0.003"
    assert "peak learning rate" in listed["training.lr"]
    code, out, _ = run_cli("config", "keys", "launch")
    launch = {k for k in known_keys() if k.startswith("launch.")}
    assert code == 0 and {line.split()[0] for line in out.splitlines()} == launch
    assert "launch.memory_check" in launch
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "training.warmup_steps" in help_text and "parallel.dp" in help_text


def test_a_layout_field_is_fed_by_one_declared_key():
    """Every Layout field is some key's `layout=` role, once; the config's layout and a layout's
    sections are inverses; the memory command has a flag for each."""
    from dataclasses import fields

    roles = [k.layout for k in layout_keys()]
    assert sorted(roles) == sorted(f.name for f in fields(Layout)), "a Layout field no key feeds"
    lay = Layout(dp=2, tp=2, zero=1, mbs=2, grad_accum=3, seq_len=64, recompute="selective",
                 dtype="fp32", cp_mode="all_gather", optimizer="muon")
    cfg = build_config(layout_sections(lay))
    assert cfg.layout() == lay and cfg.training.micro_batch_size == 2
    flags = cli.build_parser()._subparsers._group_actions[0].choices["memory"].format_help()
    assert all(f"--{name.replace('_', '-')}" in flags for name in roles)


def test_version():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and out.getvalue().startswith("ultrascale ")


def test_plan_keeps_an_existing_plan_yaml_and_says_where_it_wrote(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["plan", "--preset", "tiny", "--gpus", "2", "--global-batch-tokens", "8K",
            "--seq-len", "256", "--search-tp", "1", "--search-pp", "1"]
    code, out, err = run_cli(*args)
    assert code == 0, err
    assert "written to plan.yaml" in out
    first = (tmp_path / "plan.yaml").read_text()
    (tmp_path / "plan.yaml").write_text("# mine\n" + first)
    code, out, _ = run_cli(*args)
    assert "written to plan-2.yaml (plan.yaml exists and is kept; --force overwrites it)" in out
    assert (tmp_path / "plan.yaml").read_text().startswith("# mine")
    code, out, _ = run_cli(*args, "--force")
    assert "written to plan.yaml" in out and (tmp_path / "plan.yaml").read_text() == first


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_dry_runs_and_has_a_memory_estimate(config):
    code, out, err = run_cli("train", str(config), "--dry-run")
    assert code == 0, err
    for needle in ("layout: dp", "global batch:", "memory: ", "ranks: ", "dry run: nothing started"):
        assert needle in out, out
    code, out, err = run_cli("memory", str(config), "--json")
    assert code == 0, err
    cfg = build_config(yaml.safe_load(config.read_text()))
    import json
    assert json.loads(out)["layout"]["dp"] == cfg.parallel.dp
    code, out, err = run_cli("plan", "--config", str(config), "--json")
    assert code == 0, err


def test_the_tiny_config_is_the_default_run():
    tiny = build_config(yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text()))
    default = build_config({})
    assert tiny.model == default.model and tiny.parallel == default.parallel
    assert tiny.training.model_dump() == default.training.model_dump()


def test_the_slurm_example_starts_the_ranks_its_config_needs():
    script = (ROOT / "configs" / "llama3-70b.sbatch").read_text()
    cfg = build_config(yaml.safe_load((ROOT / "configs" / "llama3-70b.yaml").read_text()))
    nodes = int(next(x for x in script.splitlines() if "--nodes=" in x).split("=")[1])
    per_node = int(script.split("--nproc-per-node")[1].split()[0])
    assert nodes * per_node == cfg.parallel.world_size
    assert "configs/llama3-70b.yaml" in script


def test_rank_coordinates_follow_the_device_mesh():
    import torch

    from ultrascale.distributed.mesh import atomic_dims

    cfg = build_config({}, ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2"])
    assert tuple(d for d, _ in atomic_dims(cfg)) == launch.MESH_ORDER
    # init_device_mesh lays ranks out as arange(world).view(mesh shape)
    grid = torch.arange(8).view(2, 2, 1, 2)
    for rank, coord in enumerate(launch.rank_coordinates(cfg)):
        assert grid[coord["pp"], coord["dp"], coord["cp"], coord["tp"]].item() == rank


def test_the_installed_ultrascale_command_runs(tmp_path):
    """The console script pip installs (`[project.scripts]`), not `python -m`: it starts, and a
    two-step run on one process trains and writes its metrics."""
    script = Path(sys.executable).parent / "ultrascale"
    assert script.is_file(), f"no {script}: install the package (pip install -e .)"
    version = subprocess.run([str(script), "--version"], capture_output=True, text=True,
                             timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("ultrascale "), version.stderr
    run = subprocess.run([str(script), "train", "--set", "parallel.dp=1", "--set",
                          "training.steps=2", "--set", f"logging.run_dir={tmp_path}", *FAST[4:]],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2

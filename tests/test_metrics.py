"""MFU's peak rates: one table (devices.py) for the planner and the training metrics."""

import torch

from ultrascale.devices import device_peak_flops
from ultrascale.planner.hardware import PROFILES
from ultrascale.train.metrics import peak_flops


def test_gpu_names_map_to_the_planner_profiles():
    assert device_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == PROFILES["h100"].peak("bf16")
    assert device_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert device_peak_flops("NVIDIA H200", "bf16") == PROFILES["h200"].peak("bf16")
    assert device_peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert device_peak_flops("NVIDIA L4", "fp8") == 242e12  # a GPU with a peak but no profile


def test_unknown_devices_have_no_peak_and_so_no_mfu():
    assert device_peak_flops("Tesla T4", "bf16") is None
    assert device_peak_flops("NVIDIA A100-SXM4-80GB", "fp8") is None  # no fp8 on an A100
    assert peak_flops(torch.device("cpu"), "fp32") is None


# A stand-in for the wandb package (not a requirement): each call a JSON line in $FAKE_WANDB_LOG.
FAKE_WANDB = '''
import json, os
def _note(call, **kw):
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
        f.write(json.dumps({"call": call, "pid": os.getpid(), **kw}) + "\\n")
class _Run:
    def log(self, data, step=None):
        _note("log", data=data, step=step)
    def finish(self):
        _note("finish")
def init(project, name, dir, id, resume, config):
    _note("init", project=project, name=name, dir=dir, id=id, resume=resume,
          steps=config["training"]["steps"])
    return _Run()
'''


def test_wandb_gets_rank_0s_metrics_and_a_resume_goes_on_in_the_same_run(tmp_path):
    """`logging.wandb=true` on 2 ranks: one `wandb.init` (rank 0's) named after the run folder,
    every logged step's scalars at their step, `finish` at the end; the resumed run (same folder)
    inits the same id. Without the package, refused before launch with the fix."""
    import json

    from cli_helpers import FAST, ultrascale

    (tmp_path / "fake" / "wandb").mkdir(parents=True)
    (tmp_path / "fake" / "wandb" / "__init__.py").write_text(FAKE_WANDB)
    log, run = tmp_path / "calls.jsonl", tmp_path / "run"
    env = {"FAKE_WANDB_LOG": str(log), "PYTHONPATH": str(tmp_path / "fake")}
    args = ["train", *FAST, "--set", "parallel.dp=2", "--set", "logging.every=2", "--set",
            "logging.wandb=true", "--set", "logging.wandb_project=proj", "--set",
            f"logging.run_dir={run}", "--set", "checkpoint.every=2"]
    first = ultrascale(*args, "--set", "training.steps=4", env=env)
    assert first.returncode == 0, first.stderr
    second = ultrascale(*args, "--set", "training.steps=6", "--set", "checkpoint.resume=auto",
                        env=env)
    assert second.returncode == 0, second.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    inits = [c for c in calls if c["call"] == "init"]
    run_id = (run / "wandb_id").read_text().strip()
    assert [(c["project"], c["name"], c["dir"], c["id"], c["resume"], c["steps"]) for c in inits] \
        == [("proj", "run", str(run), run_id, "allow", 4), ("proj", "run", str(run), run_id,
                                                            "allow", 6)]
    assert {c["pid"] for c in calls} == {c["pid"] for c in inits}  # rank 0 alone calls wandb
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [(c["step"], c["data"]["loss"]) for c in calls if c["call"] == "log"]
    assert logged == [(m["step"], m["loss"]) for m in metrics] and len(logged) >= 4
    assert [c["call"] for c in calls].count("finish") == 2
    assert all("step" not in c["data"] and all(isinstance(v, (int, float)) for v in
                                               c["data"].values())
               for c in calls if c["call"] == "log")
    missing = ultrascale(*args, "--set", f"logging.run_dir={tmp_path / 'other'}", "--dry-run")
    assert "would be refused on this machine: logging.wandb=true needs the wandb package: pip " \
        "install wandb" in missing.stdout


def test_a_failing_wandb_init_says_what_to_do(tmp_path, monkeypatch):
    import sys
    import types

    import pytest

    from ultrascale.train.metrics import MetricsWriter, WandbRun

    def init(**kwargs):
        raise ConnectionError("no network")

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    with pytest.raises(RuntimeError, match="no network.*WANDB_MODE=offline"):
        MetricsWriter(None, None, WandbRun(tmp_path / "run", "proj", {}))

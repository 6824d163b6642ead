"""Sweeps: grid expansion, Slurm scripts, collecting metrics into one CSV and a heatmap, and one real
local sweep of dp layouts through `ultrascale train`."""

from __future__ import annotations

import csv
import json

import pytest
import yaml

from cli_helpers import ultrascale

from ultrascale.planner.sweep import load_grid, main as sweep_main, read_metrics, sweep

BASE = {"model": {"preset": "tiny"}, "device": "cpu",
        "training": {"steps": 3, "seq_len": 32, "warmup_steps": 1},
        "logging": {"every": 1}}


def _grid(tmp_path, **extra) -> str:
    spec = {"base": BASE, "out": str(tmp_path / "out"),
            "grid": {"parallel.dp": [1, 2], "training.micro_batch_size": [1, 2, 4],
                     "training.grad_accum_steps": [1, 2]}}
    spec.update(extra)
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(path)


def test_grid_expands_and_keeps_the_global_batch(tmp_path):
    grid = load_grid(_grid(tmp_path))
    assert len(grid.runs) == 12
    assert grid.axes == ("parallel.dp", "training.micro_batch_size")
    fixed = load_grid(_grid(tmp_path, global_batch_size=4, layouts=["dp=2,mbs=1,acc=2"]))
    assert all(r.global_batch_size == 4 for r in fixed.runs)
    assert {r.name for r in fixed.runs} >= {"dp1-micro_batch_size2-grad_accum_steps2",
                                            "dp2-micro_batch_size2-grad_accum_steps1"}
    assert any(r.values == {"parallel.dp": 2, "training.micro_batch_size": 1,
                            "training.grad_accum_steps": 2} for r in fixed.runs)


@pytest.mark.parametrize("spec, words", [
    ({"grid": {"parallel.dp": 2}}, "must list its values"),
    ({"grid": {"parallel.tp": [3]}}, "does not divide"),
    ({"grid": {"parallel.dp": [1]}, "global_batch_size": 1000}, "no run"),
    ({"grids": {}}, "unknown keys"),
])
def test_bad_grids_are_refused(tmp_path, spec, words, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"base": BASE, **spec}))
    assert sweep_main([str(path)]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_slurm_scripts_then_collect(tmp_path):
    """The collection is `ultrascale sweep GRID --collect` run with requirements.txt's packages
    alone: its rank agreement once needed scipy, a test requirement (issue 50)."""
    path = _grid(tmp_path, mode="slurm", global_batch_size=4, predict="h100",
                 slurm={"gpus_per_node": 8, "partition": "gpu", "time": "00:10:00"})
    grid = sweep(path, log=lambda *a: None)
    scripts = sorted((tmp_path / "out" / "slurm").glob("*.sbatch"))
    assert len(scripts) == len(grid.runs) == 4
    text = scripts[0].read_text()
    assert "#SBATCH --partition=gpu" in text and "srun torchrun" in text
    assert "--set parallel.dp=" in text and "logging.metrics_file=" in text
    # Pretend three jobs ran and logged metrics and the fourth ran out of memory.
    ok, oom = grid.runs[0], grid.runs[3]
    for run, scale in zip(grid.runs[:3], (1.0, 2.0, 3.0)):
        (tmp_path / "out" / run.name).mkdir(parents=True, exist_ok=True)
        (tmp_path / "out" / run.name / "metrics.jsonl").write_text("\n".join(json.dumps(
            {"step": s, "loss": 5.0 - s, "step_time_s": t * scale,
             "tokens_per_s": 4096 / (t * scale), "mfu": None})
            for s, t in [(1, 9.0), (2, 0.5), (3, 0.7)]))
    (tmp_path / "out" / oom.name).mkdir(parents=True, exist_ok=True)
    (tmp_path / "out" / oom.name / "slurm-1.out").write_text("torch.OutOfMemoryError: CUDA out "
                                                             "of memory. Tried to allocate")
    proc = ultrascale("sweep", path, "--collect", runtime_only=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Spearman rank correlation" in proc.stdout
    rows = list(csv.DictReader(open(tmp_path / "out" / "results.csv")))
    status = {r["name"]: r for r in rows}
    assert status[ok.name]["status"] == "ok"
    assert float(status[ok.name]["step_time_s"]) == pytest.approx(0.6)  # first step left out
    assert status[oom.name]["status"] == "oom"


def test_read_metrics_of_a_single_step(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 2.0, "step_time_s": 0.25,
                                "tokens_per_s": 100.0, "mfu": 0.1}) + "\n")
    m = read_metrics(path)
    assert m["step_time_s"] == 0.25 and m["mfu"] == 0.1 and m["final_loss"] == 2.0
    assert read_metrics(tmp_path / "missing.jsonl") == {}


@pytest.mark.slow
def test_local_sweep_of_dp_layouts_runs_train_and_collects(tmp_path):
    path = _grid(tmp_path, global_batch_size=2, predict="h100", repeats=2,
                 grid={"parallel.dp": [1, 2], "training.micro_batch_size": [1],
                       "training.grad_accum_steps": [1, 2]})
    lines = []
    grid = sweep(path, log=lines.append)
    assert [r.status for r in grid.runs] == ["ok", "ok"], [r.error for r in grid.runs]
    started = [x.split("] ")[1].split(" (")[0] for x in lines if x.startswith("[")]
    names = [r.name for r in grid.runs]
    assert started == names + names[::-1]  # the second round in reverse
    rows = list(csv.DictReader(open(tmp_path / "out" / "results.csv")))
    assert {int(r["parallel.dp"]) for r in rows} == {1, 2}
    for r in rows:
        assert float(r["tokens_per_s"]) > 0 and float(r["predicted_step_time_s"]) > 0
        assert int(r["steps_logged"]) == 3
        each = [float(t) for t in r["step_time_s_each"].split(";")]
        assert len(each) == 2 and float(r["step_time_s"]) == pytest.approx(min(each), abs=1e-4)
        assert all((tmp_path / "out" / r["name"] / f"r{k}" / "metrics.jsonl").is_file()
                   for k in (1, 2))
    assert (tmp_path / "out" / "heatmap.png").stat().st_size > 1000
    done = [x for x in lines if x.strip().startswith("ok, ")]
    assert len(done) == 4 and all("tokens/s per device" in x for x in done)  # as the heatmap


def test_a_repeat_goes_to_its_own_folder_in_reverse_order(tmp_path):
    path = _grid(tmp_path, mode="slurm", global_batch_size=4)
    first = sweep(path, log=lambda *a: None)
    again = sweep(path, log=lambda *a: None, out=str(tmp_path / "again"), reverse=True)
    assert [r.name for r in again.runs] == [r.name for r in reversed(first.runs)]
    assert len(list((tmp_path / "again" / "slurm").glob("*.sbatch"))) == len(first.runs)
    assert (tmp_path / "out" / "slurm").is_dir()  # the first sweep's folder is left as it was


def test_repeats_alternate_the_order_and_keep_each_layouts_fastest_run(tmp_path):
    path = _grid(tmp_path, mode="slurm", global_batch_size=4, repeats=3)
    grid = sweep(path, log=lambda *a: None)
    names = [r.name for r in grid.runs]
    scripts = sorted(p.name for p in (tmp_path / "out" / "slurm").glob("*.sbatch"))
    assert scripts == sorted(f"{n}-r{k}.sbatch" for n in names for k in (1, 2, 3))
    # Rounds alternate: forward, reversed, forward (submit_all.sh lists them in that order).
    submitted = [line.split("/")[-1][:-len(".sbatch")]
                 for line in (tmp_path / "out" / "slurm" / "submit_all.sh").read_text().splitlines()
                 if line.startswith("sbatch")]
    assert submitted == ([f"{n}-r1" for n in names] + [f"{n}-r2" for n in reversed(names)]
                         + [f"{n}-r3" for n in names])
    # Each repeat has its own folder; the first layout ran three times (the second one slowed by
    # another job), the second layout ran once and failed twice.
    first, second = grid.runs[0], grid.runs[1]
    for run, k, times in [(first, 1, [9, 0.5, 0.7]), (first, 2, [9, 0.9, 1.1]),
                          (first, 3, [9, 0.6, 0.6]), (second, 2, [9, 2.0, 2.0])]:
        folder = tmp_path / "out" / run.name / f"r{k}"
        folder.mkdir(parents=True)
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(
            {"step": s, "loss": 1.0, "step_time_s": t, "tokens_per_s": 100 / t, "mfu": None})
            for s, t in enumerate(times, 1)))
    for k in (1, 3):
        folder = tmp_path / "out" / second.name / f"r{k}"
        folder.mkdir(parents=True)
        (folder / "slurm-1.out").write_text("RuntimeError: connection reset by peer")
    assert sweep_main([path, "--collect"]) == 0
    rows = {r["name"]: r for r in csv.DictReader(open(tmp_path / "out" / "results.csv"))}
    assert float(rows[first.name]["step_time_s"]) == pytest.approx(0.6)  # the fastest repeat
    assert rows[first.name]["step_time_s_each"] == "0.6000;1.0000;0.6000"
    assert rows[second.name]["status"] == "ok"
    assert rows[second.name]["step_time_s_each"] == ";2.0000;"
    assert {rows[r.name]["status"] for r in grid.runs[2:]} == {"pending"}
    # --repeats on the command line overrides the grid's; a repeat count below 1 is refused.
    assert len(sweep(path, log=lambda *a: None, out=str(tmp_path / "once"), repeats=1).runs) == 4
    assert len(list((tmp_path / "once" / "slurm").glob("*.sbatch"))) == 4
    with pytest.raises(ValueError, match="repeats"):
        load_grid(_grid(tmp_path, repeats=0))


def test_a_layouts_sweep_shows_every_run_in_the_heatmap(tmp_path):
    """Three layouts that name different keys (none names both of the default axes): each gets a
    cell of its own, placed by the values its config really has; a failed run's cell says how it
    failed and a position no run had is not a failure. Throughput is per device throughout."""
    layouts = ["dp=2,mbs=2", "tp=2", "pp=2,mbs=4", "dp=2,zero=1"]
    base = {**BASE, "parallel": {"dp": 1}}  # (training.micro_batch_size stays at its default, 8)
    path = _grid(tmp_path, mode="slurm", grid=None, layouts=layouts, base=base)
    grid = sweep(path, log=lambda *a: None)
    assert [r.settings for r in grid.runs] == [
        {"parallel.dp": 2, "training.micro_batch_size": 2, "parallel.tp": 1, "parallel.pp": 1,
         "parallel.zero": 0},
        {"parallel.dp": 1, "training.micro_batch_size": 8, "parallel.tp": 2, "parallel.pp": 1,
         "parallel.zero": 0},
        {"parallel.dp": 1, "training.micro_batch_size": 4, "parallel.tp": 1, "parallel.pp": 2,
         "parallel.zero": 0},
        {"parallel.dp": 2, "training.micro_batch_size": 8, "parallel.tp": 1, "parallel.pp": 1,
         "parallel.zero": 1}]
    ok, oom, ok2, pending = grid.runs
    for run, tps in [(ok, 800.0), (ok2, 300.0)]:
        (tmp_path / "out" / run.name).mkdir(parents=True)
        (tmp_path / "out" / run.name / "metrics.jsonl").write_text("\n".join(json.dumps(
            {"step": s, "loss": 1.0, "step_time_s": 0.1, "tokens_per_s": tps, "mfu": None})
            for s in (1, 2)))
    (tmp_path / "out" / oom.name).mkdir(parents=True)
    (tmp_path / "out" / oom.name / "slurm-1.out").write_text("torch.OutOfMemoryError: CUDA out "
                                                             "of memory.")
    lines = []
    sweep(path, collect_only=True, log=lines.append)
    assert any("tokens/s per device" in x for x in lines)
    data = json.loads((tmp_path / "out" / "heatmap.json").read_text())
    assert data["x"] == "parallel.dp" and data["unit"] == "tokens/s per device"
    assert data["y"][0] == "training.micro_batch_size"  # then every other key that varies
    assert set(data["y"]) == {"training.micro_batch_size", "parallel.tp", "parallel.pp",
                              "parallel.zero"}
    placed = {run["name"]: (c["row"], c["col"]) for c in data["cells"] for run in c["runs"]}
    assert set(placed) == {r.name for r in grid.runs}  # every run is in the heatmap...
    assert len(set(placed.values())) == 4  # ...in a cell of its own
    by_name = {run["name"]: (c, run) for c in data["cells"] for run in c["runs"]}
    assert by_name[ok.name][0]["tokens_per_s_per_device"] == pytest.approx(800.0 / 2)  # dp=2
    assert by_name[ok2.name][0]["tokens_per_s_per_device"] == pytest.approx(300.0 / 2)  # pp=2
    assert by_name[oom.name][0]["status"] == "oom"
    assert by_name[pending.name][0]["status"] == "pending"
    for name, (cell, _) in by_name.items():  # the cell is where the run's settings say
        run = next(r for r in grid.runs if r.name == name)
        assert data["xs"][cell["col"]] == run.settings["parallel.dp"]
        assert data["ys"][cell["row"]] == [run.settings[k] for k in data["y"]]
    assert len(data["xs"]) * len(data["ys"]) > len(data["cells"])  # the rest: "not in sweep"
    assert (tmp_path / "out" / "heatmap.png").stat().st_size > 1000
    # The table says the same: every swept key filled in with the value the run had.
    rows = {r["name"]: r for r in csv.DictReader(open(tmp_path / "out" / "results.csv"))}
    assert rows[oom.name]["parallel.dp"] == "1" and rows[oom.name]["parallel.tp"] == "2"
    from ultrascale.planner.sweep_report import csv_heatmap

    again = csv_heatmap(tmp_path / "out" / "results.csv")
    assert {run["name"] for c in again["cells"] for run in c["runs"]} == set(placed)
    assert len(again["cells"]) == 4


def test_heatmap_axes_must_be_swept_keys(tmp_path):
    with pytest.raises(ValueError, match="heatmap axes"):
        load_grid(_grid(tmp_path, heatmap={"x": "parallel.dp", "y": "parallel.tp"}))

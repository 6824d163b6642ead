"""`ultrascale ui`'s JSON API answers what the command line answers (the API runs the CLI's own
parsers and functions), its refusals, the Runs view's files, and the PNG pictures of the CLI."""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import pytest

from ui_server import get, query, serve
from ultrascale.cli import main as cli

# A recorded sweep of 30 layouts (benchmarks/README.md): a results.csv without heatmap.json.
RECORDED = (Path(__file__).parent.parent / "benchmarks" / "data" / "planner_sweep_cpu_4ranks_xeon"
            / "results.csv")

# A step as the trainer logs it (train/trainer.py; the values of a tiny CPU run on dp=2).
STEP = {"step": 1, "loss": 5.47, "grad_norm": 4.88, "lr": 0.00015, "tokens": 1024,
        "step_time_s": 0.0745, "tokens_per_s": 13741.6, "mfu": None,
        "memory": {"params_bytes": 3281408, "grads_bytes": 3281408, "optimizer_bytes": 6562968,
                   "peak_allocated_bytes": None, "activations_peak_bytes": None},
        "comm": {"all_reduce/dp": {"calls": 1, "bytes": 3281408, "time_s": 0.0076},
                 "all_reduce/world": {"calls": 2, "bytes": 16, "time_s": 0.0008}}}


def steps(first: int, last: int) -> str:
    return "".join(json.dumps({**STEP, "step": s, "loss": 5.5 - 0.1 * s}) + "\n"
                   for s in range(first, last + 1))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    (root / "run-a").mkdir()
    (root / "run-a" / "metrics.jsonl").write_text(steps(1, 3))
    (root / "sweep-b").mkdir()
    shutil.copy(RECORDED, root / "sweep-b" / "results.csv")
    with serve(root) as (base, seconds):
        print(f"`ultrascale ui` answered its first request {seconds:.2f} s after it started")
        yield base, root


def _argv(params: dict) -> list[str]:
    """The command line of the same flags, written independently of the server's translation."""
    argv = []
    for key, value in params.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value == "true" else [flag, str(value)]
    return argv


def _cli_json(capsys, command: str, params: dict, *extra: str) -> tuple[int, dict | str]:
    code = cli([command, *_argv(params), "--json", *extra])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else err.strip())


def _random_memory(rng: random.Random) -> dict:
    p = {"preset": rng.choice(["tiny", "llama3-1b", "llama3-8b", "llama3-70b"]),
         "dp": rng.choice([1, 2, 4, 8, 16]), "tp": rng.choice([1, 2, 4, 8]),
         "pp": rng.choice([1, 2, 4]), "cp": rng.choice([1, 1, 2]), "zero": rng.randint(0, 3),
         "mbs": rng.choice([1, 2, 4]), "grad_accum": rng.choice([1, 4, 8]),
         "seq_len": rng.choice([1024, 4096, 8192]),
         "recompute": rng.choice(["none", "selective", "full"]),
         "dtype": rng.choice(["bf16", "bf16", "fp32", "fp8"])}
    if rng.random() < 0.3:
        p["sequence_parallel"] = "true"
    if rng.random() < 0.6:
        p["gpu"] = rng.choice(["h100", "h200", "a100"])
    if p["pp"] > 1 and rng.random() < 0.5:
        p["pp_schedule"] = rng.choice(["afab", "interleaved"])
    return p


def test_memory_api_equals_the_cli_json_for_20_random_layouts(server, capsys):
    base, _ = server
    rng = random.Random(33)
    same, refused = 0, 0
    for _ in range(200):
        params = _random_memory(rng)
        code, expected = _cli_json(capsys, "memory", params)
        status, body = get(f"{base}/api/memory?{query(params)}")
        if code == 0:
            assert status == 200 and body == expected, params
            same += 1
        else:  # the same refusal, word for word
            assert status == 400 and expected == f"ultrascale memory: {body['error']}", params
            refused += 1
        if same == 20:
            break
    assert same == 20 and refused > 0
    print(f"memory: 20 answers equal, {refused} refusals equal")


def _random_plan(rng: random.Random, search: bool) -> dict:
    p = {"preset": rng.choice(["llama3-1b", "llama3-8b", "llama3-70b"]),
         "gpu": rng.choice(["h100", "h200", "a100", "b200"]),
         "seq_len": rng.choice([2048, 4096, 8192]),
         "global_batch_tokens": rng.choice(["512K", "1M", "4M"]),
         "dtype": rng.choice(["bf16", "bf16", "fp8"])}
    if search:
        p.update(gpus=rng.choice([8, 16]), top=3, search_zero="0,1",
                 search_recompute="none,selective")
    else:
        dp, tp, pp = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4])
        p["layout"] = (f"dp={dp},tp={tp},pp={pp},zero={rng.randint(0, 1)},"
                       f"mbs={rng.choice([1, 2, 4])},acc={rng.choice([1, 4, 16])}")
    return p


def test_plan_api_equals_the_cli_json_for_20_random_layouts(server, capsys):
    """15 given layouts (`--layout`) and 5 searches; the API writes no config (`config` null), so
    the CLI is asked for none either."""
    base, _ = server
    rng = random.Random(27)
    same = refused = 0
    for i in range(200):
        params = _random_plan(rng, search=same % 4 == 3)
        code, expected = _cli_json(capsys, "plan", params, "--config-out", "-")
        status, body = get(f"{base}/api/plan?{query(params)}")
        if code in (0, 1):  # (1: no layout fits; the object says why)
            assert status == 200 and body == expected, params
            same += 1
        else:
            assert status == 400 and expected == f"ultrascale plan: {body['error']}", params
            refused += 1
        if same == 20:
            break
    assert same == 20
    print(f"plan: 20 answers equal, {refused} refusals equal")


@pytest.mark.parametrize("path, words", [
    ("/api/memory?preset=llama3-8b&dpp=2", "unknown parameter 'dpp'"),
    ("/api/memory?preset=llama3-8b&recompute=some", "invalid choice: 'some'"),
    ("/api/memory?preset=llama3-8b&sequence_parallel=maybe", "give true or false"),
    ("/api/memory?preset=llama3-8b&tp=3", "tp"),
    ("/api/memory?preset=llama3-8b&plot=x.png", "draws no file"),
    ("/api/plan?preset=llama3-8b&gpus=8&config_out=plan.yaml", "writes no file"),
    ("/api/plan?preset=llama3-8b", "give --gpus N"),
    ("/api/run?path=/etc", "not under the folders this server shows"),
    ("/api/config?preset=llama3-8b&gpus=8", "give the layout"),
    ("/api/config?preset=llama3-8b&gpus=8&layout=dp=4,tp=3", "tp"),
])
def test_bad_requests_are_refused_with_the_reason(server, path, words):
    base, _ = server
    status, body = get(base + path)
    assert status == 400 and words in body["error"], body


def test_only_local_host_names_are_answered(server):
    """Listening on localhost, the server answers only loopback Host headers: a page of another
    site cannot read it through DNS rebinding."""
    base, _ = server
    assert base.startswith("http://127.0.0.1:")
    assert get(base + "/api/options", {"Host": "evil.example"})[0] == 400
    assert get(base + "/api/options", {"Host": "localhost"})[0] == 200
    port = int(base.rsplit(":", 1)[1])
    listening = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    local = {row[1] for row in listening if row[3] == "0A" and int(row[1].split(":")[1], 16) == port}
    assert local == {f"0100007F:{port:04X}"}  # 127.0.0.1 only


def test_runs_are_listed_and_read_as_they_grow(server):
    base, root = server
    status, body = get(f"{base}/api/runs")
    assert status == 200 and sorted(r["kind"] for r in body["runs"]) == ["run", "sweep"]
    path = next(r["path"] for r in body["runs"] if r["kind"] == "run")
    status, first = get(f"{base}/api/run?{query({'path': path})}")
    assert status == 200 and first["steps"] == [1, 2, 3] and first["next"] == 3
    assert [p[0] for p in first["series"]["loss"]["loss"]] == [1, 2, 3]
    assert first["series"]["mfu"] == {}  # null on a CPU: no point, not a zero
    assert set(first["series"]["memory"]) == {"params", "grads", "optimizer"}
    assert first["series"]["comm"]["all_reduce/dp"][0] == [1, 3281408]
    # The trainer appends a step and is half-way through the next line: only the whole one comes.
    with open(root / "run-a" / "metrics.jsonl", "a") as fh:
        fh.write(steps(4, 4) + '{"step": 5, "lo')
    status, more = get(f"{base}/api/run?{query({'path': path, 'after': first['next']})}")
    assert more["steps"] == [4] and more["next"] == 4 and not more["reset"]


def test_a_recorded_sweep_without_heatmap_json_shows_every_run(server):
    base, root = server
    status, data = get(f"{base}/api/sweep?{query({'path': root / 'sweep-b'})}")
    assert status == 200 and data["unit"] == "tokens/s per device"
    names = [run["name"] for c in data["cells"] for run in c["runs"]]
    assert len(names) == len(set(names)) == 30 == len(data["cells"])


def test_memory_plot_and_run_plot_write_pngs(tmp_path, capsys):
    png = tmp_path / "memory.png"
    assert cli(["memory", "--preset", "llama3-8b", "--dp", "8", "--zero", "1", "--gpu", "h100",
                "--plot", str(png), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["total"] > 0 and f"picture: {png}" in err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(steps(1, 10))
    assert cli(["plot", str(run)]) == 0
    assert (run / "curves.png").stat().st_size > 20_000
    (tmp_path / "sweep").mkdir()
    shutil.copy(RECORDED, tmp_path / "sweep" / "results.csv")
    assert cli(["plot", str(tmp_path / "sweep"), "--out", str(tmp_path / "heat.png")]) == 0
    assert (tmp_path / "heat.png").stat().st_size > 20_000
    assert cli(["plot", str(tmp_path / "nothing-here")]) == 2
    assert "neither a run's metrics.jsonl nor a sweep's results.csv" in capsys.readouterr().err


def test_plot_draws_the_validation_loss_and_the_lr_and_overlays_two_runs(tmp_path, capsys,
                                                                         monkeypatch):
    """Issue 50, item 5: eval_loss and lr were in the metrics but in no picture; no view put two
    runs in the same charts."""
    from ultrascale.ui import pictures
    from ultrascale.ui import runs as run_files

    for name, scale in (("adamw", 1.0), ("muon", 0.9)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(
            {**STEP, "step": s, "loss": scale * (5.5 - 0.1 * s), "lr": 1e-3 * s,
             **({"eval_loss": scale * 5.0} if s % 5 == 0 else {})}) + "\n" for s in range(1, 11)))
    records, _ = run_files.read_records(tmp_path / "adamw")
    one = run_files.series(records)
    assert [p[0] for p in one["loss"]["eval loss"]] == [5, 10]
    assert one["lr"]["lr"][-1] == [10, 1e-2]
    drawn = {}
    real = pictures.draw_run
    monkeypatch.setattr(pictures, "draw_run", lambda data, path, title="": drawn.update(
        data=data) or real(data, path, title))
    monkeypatch.chdir(tmp_path)
    assert cli(["plot", str(tmp_path / "adamw"), str(tmp_path / "muon")]) == 0
    assert "picture: compare.png" in capsys.readouterr().out
    assert (tmp_path / "compare.png").stat().st_size > 20_000
    assert set(drawn["data"]) == {"adamw", "muon"}
    both = run_files.overlay({k: run_files.series(v) for k, v in drawn["data"].items()})
    assert {"adamw: loss", "adamw: eval loss", "muon: loss", "muon: eval loss"} <= set(
        both["loss"]) and set(both["lr"]) == {"adamw: lr", "muon: lr"}


def test_pictures_without_matplotlib_are_refused_clearly(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (import matplotlib now fails)
    assert cli(["memory", "--preset", "tiny", "--plot", str(tmp_path / "m.png")]) == 2
    assert "needs matplotlib: pip install matplotlib" in capsys.readouterr().err

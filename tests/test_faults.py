"""Faults at scale, the parts one process can check (issue 49): each rank's record of its last
collectives and the diagnosis of a hang from them, the global batch kept when dp changes, the
next attempt after a failure, the fault drill, the message of a rank out of GPU memory, and
checkpoint.every_minutes agreed by every rank. The multi-process runs are in test_faults_cli.py."""

from __future__ import annotations

import json

import pytest
import torch

from distributed import run_ranks
from ultrascale import elastic
from ultrascale.config import ConfigError, build_config
from ultrascale.distributed.recorder import Recorder, diagnose, diagnose_dir, read_record
from ultrascale.launch import rank_coordinates
from ultrascale.rank_guard import describe_exception
from ultrascale.train.oom import DeviceOutOfMemory, OutOfMemoryWatch, oom_message

DP2 = {"0": [0, 1], "1": [0, 1]}


def recorder(tmp_path, rank: int, peers: dict) -> Recorder:
    return Recorder(tmp_path, rank, peers)


def test_the_record_keeps_each_views_count_and_the_last_transfers(tmp_path):
    rec = recorder(tmp_path, 3, {"dp": [1, 3], "tp": [2, 3]})
    for i in range(40):  # more than the ring keeps: the counts stay exact
        rec.returned(rec.enter("all_reduce", "dp", 1024 * i))
    rec.returned(rec.enter("all_gather", "tp", 64))
    open_slot = rec.enter("reduce_scatter", "dp", 2048)
    back = read_record(tmp_path, 3)
    assert back.rank == 3 and back.counts == {"dp": 41, "tp": 1}
    assert back.peers == {"dp": [1, 3], "tp": [2, 3]}
    assert len(back.entries) == 32 and back.entries[-1].seq == 41
    waiting = back.waiting()
    assert (waiting.kind, waiting.view, waiting.seq, waiting.bytes) == ("reduce_scatter", "dp",
                                                                         41, 2048)
    rec.returned(open_slot)
    assert read_record(tmp_path, 3).waiting() is None
    assert read_record(tmp_path, 5) is None  # a rank without a record


def test_a_hang_names_the_rank_that_never_entered_the_collective(tmp_path):
    # dp=2 x tp=2: ranks 0 and 2 wait in their 7th all-reduce on dp; rank 2's partner (rank 3)
    # made only 6; rank 1, rank 0's partner, entered the 7th and waits too.
    groups = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    for rank, made in ((0, 7), (1, 7), (2, 7), (3, 6)):
        rec = recorder(tmp_path, rank, {"dp": groups[rank], "tp": [rank - rank % 2,
                                                                    rank - rank % 2 + 1]})
        for i in range(made):
            slot = rec.enter("all_reduce", "dp", 4 * 2**20)
            if i < 6:
                rec.returned(slot)
    lines = diagnose_dir(tmp_path, 4)
    assert lines[0].startswith("rank 3 never entered all_reduce on dp #7 (4.0 MiB), which rank 1 "
                               "waits in since"), lines
    assert "rank 3: its last was all_reduce on dp #6" in lines[1]
    assert any(line.startswith("ranks 0, 2 wait in all_reduce on dp #7") and "every rank of the "
               "group" in line for line in lines), lines


def test_the_diagnosis_tells_a_disordered_collective_and_a_silent_rank(tmp_path):
    a, b = recorder(tmp_path, 0, {"dp": [0, 1]}), recorder(tmp_path, 1, {"dp": [0, 1]})
    a.returned(a.enter("all_reduce", "dp", 8))
    a.enter("all_gather", "dp", 8)  # rank 0 waits in #2 ...
    b.returned(b.enter("all_reduce", "dp", 8))
    b.returned(b.enter("broadcast", "dp", 8))  # ... which rank 1 made as another kind
    lines = diagnose({0: read_record(tmp_path, 0), 1: read_record(tmp_path, 1)})
    assert "rank 1 entered it and returned: the ranks disagree on the order" in lines[0], lines
    lines = diagnose({0: read_record(tmp_path, 0), 1: None})
    assert lines[0].startswith("rank 1 never entered all_gather on dp #2") and \
        "left no record" in lines[1], lines
    # NCCL: a collective returns once queued, so no rank waits in one; the count behind tells.
    for rank, made in ((0, 5), (1, 4)):
        rec = recorder(tmp_path / "nccl", rank, {"dp": [0, 1]})
        for _ in range(made):
            rec.returned(rec.enter("all_reduce", "dp", 2**20))
        rec.returned(rec.enter("send", "pp", 64, peer=1 - rank))  # p2p: counted apart
    lines = diagnose_dir(tmp_path / "nccl", 2)
    assert lines[0] == "rank 1 never entered all_reduce on dp #5 (1.0 MiB), which rank 0 entered"
    assert lines[1].startswith("  rank 1: its last was send on pp #1"), lines


def test_global_batch_size_sets_the_accumulation_and_refuses_what_does_not_divide():
    cfg = build_config({"parallel": {"dp": "auto"},
                        "training": {"global_batch_size": 16, "micro_batch_size": 2}},
                       world_size=4)
    assert (cfg.parallel.dp, cfg.training.grad_accum_steps, cfg.global_batch_size) == (4, 2, 16)
    again = build_config(cfg.model_dump(mode="json"))  # config.yaml reads back
    assert again.training.grad_accum_steps == 2
    with pytest.raises(ConfigError, match="not a multiple of micro_batch_size x dp = 2 x 3"):
        build_config({"parallel": {"dp": 3},
                      "training": {"global_batch_size": 16, "micro_batch_size": 2}})
    with pytest.raises(ConfigError, match="grad_accum_steps=3 and training.global_batch_size=16 "
                                          "disagree"):
        build_config({"training": {"global_batch_size": 16, "micro_batch_size": 2,
                                   "grad_accum_steps": 3}})


def test_the_next_attempt_resumes_and_drops_the_lost_replicas(tmp_path):
    ck = tmp_path / "ck" / "step_00000002"
    ck.mkdir(parents=True)
    (ck / "meta.json").write_text("{}")
    cfg = build_config({"parallel": {"dp": 4, "tp": 2}, "model": {"preset": "tiny"},
                        "training": {"micro_batch_size": 2},
                        "checkpoint": {"dir": str(tmp_path / "ck")},
                        "logging": {"run_dir": str(tmp_path)},
                        "launch": {"min_dp": 2}})
    coords = rank_coordinates(cfg)
    same = elastic.next_attempt(cfg, elastic.Failure("rank 1 killed", [1]), coords)
    assert same.checkpoint.resume == "auto" and same.parallel.dp == 4
    # Ranks 4 and 5 are the two tp ranks of dp replica 2: one replica goes, and dp=3 does not
    # divide the global batch of 8 x ... = 8 sequences: dp=2, grad_accum 2.
    nxt = elastic.next_attempt(cfg, elastic.Failure("lost", [4, 5], lost=[4, 5]), coords)
    assert (nxt.parallel.dp, nxt.training.grad_accum_steps, nxt.global_batch_size) == (2, 2, 8)
    line = elastic.log_restart(cfg, 1, elastic.Failure("lost", [4, 5], lost=[4, 5]), nxt)
    assert elastic.read_restarts(tmp_path) == [line] and line["dp"] == 2
    assert elastic.surviving_devices(["0", "1", "2", "3", "4", "5", "6", "7"], [4, 5], 4) == \
        ["0", "1", "2", "3"]
    with pytest.raises(ConfigError, match="no dp from 1 down to launch.min_dp=2"):
        elastic.next_attempt(cfg, elastic.Failure("lost", [0, 2, 4], lost=[0, 2, 4]), coords)
    unset = build_config({**cfg.model_dump(mode="json"), "launch": {"min_dp": None}})
    with pytest.raises(ConfigError, match="set launch.min_dp"):
        elastic.next_attempt(unset, elastic.Failure("lost", [4], lost=[4]), coords)


def test_the_fault_drill_fires_once_and_refuses_a_bad_spec(monkeypatch):
    monkeypatch.setenv(elastic.DRILL_ENV, "lose:rank=2,3:step=4")
    drill = elastic.FaultDrill.from_env()
    assert (drill.action, drill.ranks, drill.step) == ("lose", (2, 3), 4)
    drill.strike(3, 2)  # another step: nothing
    drill.strike(4, 1)  # another rank: nothing
    with pytest.raises(elastic.DeviceLost) as lost:
        drill.strike(4, 3)
    assert describe_exception(lost.value)["kind"] == "device_lost"
    monkeypatch.setenv(elastic.RESTART_COUNT_ENV, "1")
    assert elastic.FaultDrill.from_env() is None  # a restart is not struck again
    monkeypatch.setenv(elastic.RESTART_COUNT_ENV, "0")
    monkeypatch.setenv(elastic.DRILL_ENV, "explode:rank=1")
    with pytest.raises(ConfigError, match="ACTION one of kill, stall, lose"):
        elastic.FaultDrill.from_env()


def test_a_torchrun_attempt_logs_its_restart_or_its_new_world(tmp_path, monkeypatch):
    ck = tmp_path / "checkpoints" / "step_00000004"
    ck.mkdir(parents=True)
    (ck / "meta.json").write_text("{}")
    monkeypatch.setattr(elastic, "load_meta", lambda path: {"world_size": 1})
    cfg = build_config({"parallel": {"dp": 2}, "logging": {"run_dir": str(tmp_path)},
                        "checkpoint": {"dir": str(tmp_path / "checkpoints"), "resume": "auto"}})
    (tmp_path / "rank_logs").mkdir()
    (tmp_path / "rank_logs" / "rank_3.failure.json").write_text(json.dumps(
        {"rank": 3, "type": "RuntimeError", "message": "boom"}))
    monkeypatch.setenv(elastic.RESTART_COUNT_ENV, "1")
    line = elastic.log_torchrun_attempt(cfg)
    assert line["cause"] == ("rank 3: RuntimeError: boom; the world changed from 1 to 2 rank(s) "
                             "(torch's agent re-formed it: a node left or joined)")
    assert not list((tmp_path / "rank_logs").glob("*.failure.json"))  # consumed
    monkeypatch.setenv(elastic.RESTART_COUNT_ENV, "0")
    monkeypatch.setattr(elastic, "load_meta", lambda path: {"world_size": 2})
    assert elastic.log_torchrun_attempt(cfg) is None  # the same world, no failure: no line
    assert [r["restart"] for r in elastic.read_restarts(tmp_path)] == [1]


def test_torchrun_restarts_over_the_shared_store_are_refused(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(ConfigError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        elastic.check_torchrun_restarts()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # what that setting gives
    elastic.check_torchrun_restarts()
    # The local launcher's keys do nothing under torchrun: said at start.
    cfg = build_config({"launch": {"max_restarts": 2}})
    assert elastic.notes(cfg, launched=False) == []
    assert "--max-restarts N and --nnodes MIN:MAX" in elastic.notes(cfg, launched=True)[0]


def test_out_of_memory_sets_the_allocators_peak_beside_the_estimate(tmp_path):
    cfg = build_config({"model": {"preset": "tiny"}, "logging": {"run_dir": str(tmp_path)}})
    gib = 2**30
    text = oom_message(3, "CUDA out of memory. Tried to allocate 2.00 GiB",
                       {"params": 2 * gib, "grads": 2 * gib, "optimizer": 8 * gib,
                        "activations": 40 * gib, "comm_buffers": gib, "other": gib,
                        "total": 54 * gib, "reserved": 60 * gib},
                       {"params_bytes": 2 * gib, "grads_bytes": 2 * gib,
                        "optimizer_bytes": 8 * gib}, 75 * gib, 78 * gib, 80 * gib,
                       tmp_path / "memory" / "rank_3_oom.pickle")
    lines = text.splitlines()
    assert lines[0] == ("rank 3 ran out of GPU memory (CUDA out of memory. Tried to allocate 2.00 "
                        "GiB). The allocator's peak: 75.00 GiB allocated, 78.00 GiB reserved, of "
                        "the device's 80.00 GiB.")
    assert lines[4].split() == ["optimizer", "8.00", "GiB", "8.00", "GiB"]
    assert lines[5].split() == ["activations", "40.00", "GiB", "-"]
    assert lines[8].split()[:5] == ["total", "54.00", "GiB", "75.00", "GiB"]
    assert "rank_3_oom.pickle (open it in https://pytorch.org/memory_viz)" in lines[-1]
    # The watch turns CUDA's error into that message (here without a GPU: no snapshot, the
    # estimate from the config), and the launcher's record keeps the table.
    watch = OutOfMemoryWatch(cfg, 0)
    with pytest.raises(DeviceOutOfMemory) as err:
        with watch.watching():
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
    record = describe_exception(err.value)
    assert record["kind"] == "out_of_memory" and record["message"].startswith("rank 0 ran out")
    assert [x.split()[0] for x in record["detail"][1:9]] == [
        "params", "grads", "optimizer", "activations", "comm_buffers", "other", "total",
        "reserved"]
    assert "none recorded (allocations are recorded on CUDA ranks only)" in record["detail"][-1]


def _timed_saves(rate: float) -> list[int]:
    """Rank r's clock runs 1 + rate x r times as fast (and it starts later): returns the steps it
    saved after."""
    from ultrascale.distributed import comm
    from ultrascale.distributed.mesh import init_parallel
    from ultrascale.train import save_timer

    cfg = build_config({"parallel": {"dp": 2}, "device": "cpu"})
    ctx = init_parallel(cfg, timeout_s=60)
    comm.set_context(ctx)
    now = [100.0]
    speed = 1.0 + rate * ctx.rank
    save_timer.time = type("Clock", (), {"monotonic": staticmethod(lambda: now[0] * speed)})
    timer = save_timer.SaveTimer(1.0, ctx)  # a save each minute
    saved = []
    with comm.counting() as traffic:
        for step in range(1, 9):
            now[0] += 25.0  # a step takes 25 s
            if timer.due():
                saved.append(step)
                timer.saved()
    assert traffic.counters[("broadcast", "world")].calls == 8
    return saved


def test_every_minutes_saves_at_the_same_step_on_every_rank():
    # Rank 1's clock runs 30% fast: alone it would save after steps 2 and 5; rank 0's decides.
    saves = run_ranks(2, _timed_saves, 0.3)
    assert saves[0] == saves[1] == [3, 6], saves

"""Pipeline schedules as data and their simulator: validity, bubble formulas, peak memory."""

from collections import Counter

import pytest

from ultrascale.parallel.pipeline.schedules import (
    SCHEDULE_NAMES, Action, PipelineDeadlock, add_communication, build_schedule, check_program,
    dependencies, peer_of, stage_of, validate_schedule,
)
from ultrascale.parallel.pipeline.simulator import simulate, simulate_program


def _cases():
    """(name, pp, m, v) for every schedule, pp in 2 and 4, m in pp and 2pp+1 where allowed."""
    for name in SCHEDULE_NAMES:
        for p in (2, 4):
            for m in (p, 2 * p + 1):
                v = 2 if name == "interleaved" else 1
                if name == "interleaved" and m % p:
                    continue
                yield name, p, m, v
    yield "interleaved", 2, 4, 2
    yield "interleaved", 4, 8, 2


CASES = list(_cases())


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_every_rank_runs_one_forward_and_one_backward_per_microbatch_and_chunk(name, p, m, v):
    programs = build_schedule(name, p, m, v)
    assert len(programs) == p
    for prog in programs:
        counts = Counter((a.kind, a.microbatch, a.chunk) for a in prog)
        assert all(n == 1 for n in counts.values())
        for mb in range(m):
            for c in range(v):
                assert counts[("F", mb, c)] == 1
                split = counts[("I", mb, c)] == 1 and counts[("W", mb, c)] == 1
                assert (counts[("B", mb, c)] == 1) != split
        expected = m * v * (3 if name == "zero_bubble" else 2)
        assert len(prog) == expected
    check_program(programs, p, m, v)


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_simulated_timeline_honours_every_dependency(name, p, m, v):
    t_comm = 0.25
    res = simulate(name, p, m, v, t_comm=t_comm)
    end = {(r, a): e for r, a, _, e in res.timeline}
    assert len(end) == sum(len(prog) for prog in build_schedule(name, p, m, v))
    last_end = [0.0] * p
    for r, a, start, stop in sorted(res.timeline, key=lambda x: x[2]):
        assert start >= last_end[r] - 1e-12  # one action at a time per rank, in program order
        last_end[r] = stop
        for q, dep in dependencies(r, a, p, v):
            if (q, dep) in end:
                assert start >= end[(q, dep)] + (t_comm if q != r else 0.0) - 1e-12
    assert res.total_time == pytest.approx(max(last_end))


@pytest.mark.parametrize("name", ["afab", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 2), (2, 5), (4, 4), (4, 9), (4, 16), (8, 3)])
def test_bubble_is_p_minus_1_over_m(name, p, m):
    res = simulate(name, p, m, t_f=1.0, t_b=2.0)
    assert res.bubble_fraction == pytest.approx((p - 1) / m)
    assert res.ideal_time == pytest.approx(m * 3.0)
    assert res.busy_time == pytest.approx([m * 3.0] * p)
    assert res.idle_time == pytest.approx([res.total_time - m * 3.0] * p)


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 2), (2, 6, 3), (4, 4, 2), (4, 8, 2),
                                   (4, 12, 4), (8, 16, 2)])
def test_interleaved_bubble_is_p_minus_1_over_v_m(p, m, v):
    res = simulate("interleaved", p, m, v, t_f=1.0, t_b=2.0)
    assert res.bubble_fraction == pytest.approx((p - 1) / (v * m))
    assert res.bubble_fraction < simulate("1f1b", p, m).bubble_fraction


@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (4, 4), (4, 9), (8, 17)])
def test_zero_bubble_beats_1f1b_at_the_same_peak_memory(p, m):
    zb, ref = simulate("zero_bubble", p, m), simulate("1f1b", p, m)
    assert zb.bubble_fraction < ref.bubble_fraction
    # ZB-H1 with I = W = t_f: the bubble shrinks to a third of 1F1B's.
    assert zb.bubble_fraction == pytest.approx(ref.bubble_fraction / 3)
    assert max(zb.peak_in_flight) == max(ref.peak_in_flight) == min(p, m)


@pytest.mark.parametrize("p,m", [(2, 1), (2, 2), (2, 5), (4, 2), (4, 4), (4, 9)])
def test_peak_in_flight_on_first_stage(p, m):
    assert simulate("afab", p, m).peak_in_flight[0] == m
    one = simulate("1f1b", p, m)
    assert one.peak_in_flight[0] == min(p, m)
    # Later 1F1B stages hold fewer: rank r keeps p - r micro-batches.
    assert one.peak_in_flight == [float(min(p - r, m)) for r in range(p)]


def test_interleaved_peak_counts_chunks_and_stage_equivalents():
    p, m, v = 4, 8, 2
    res = simulate("interleaved", p, m, v)
    assert res.peak_in_flight == [c / v for c in res.peak_in_flight_chunks]
    # Megatron's figure for the first rank: p * (1 + (p-1)/(p*v)) stage-equivalents.
    assert res.peak_in_flight[0] == pytest.approx(p + (p - 1) / v)
    assert res.peak_in_flight_chunks[0] == 2 * (p - 1) + (v - 1) * p + 1


def test_comm_time_lengthens_the_step_only_across_ranks():
    p, m, c = 4, 8, 0.5
    # AFAB streams each phase, so only the first crossing of each of the p-1 links shows, once
    # going forward and once coming back.
    base, slow = simulate("afab", p, m), simulate("afab", p, m, t_comm=c)
    assert slow.total_time == pytest.approx(base.total_time + 2 * (p - 1) * c)
    # 1F1B pays that too, and more: its steady state waits on a round trip for each backward.
    base, slow = simulate("1f1b", p, m), simulate("1f1b", p, m, t_comm=c)
    assert slow.total_time > base.total_time + 2 * (p - 1) * c
    one_rank = simulate("1f1b", 1, 4, t_comm=10.0)
    assert one_rank.total_time == pytest.approx(12.0) and one_rank.bubble_fraction == 0.0


def test_split_backward_times_add_up():
    res = simulate("zero_bubble", 2, 4, t_f=1.0, t_b=3.0, t_w=1.0)
    assert res.busy_time == pytest.approx([4 * 4.0] * 2)
    durations = {a.kind: e - s for _, a, s, e in res.timeline}
    assert durations == pytest.approx({"F": 1.0, "I": 2.0, "W": 1.0})
    with pytest.raises(ValueError, match="t_w <= t_b"):
        simulate("zero_bubble", 2, 4, t_b=1.0, t_w=2.0)


def test_deadlock_is_detected_and_explained():
    # Rank 1 wants micro-batch 1 first, but rank 0 only forwards it after the backward of
    # micro-batch 0, which rank 1 runs after micro-batch 1: a cycle.
    programs = [
        [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
        [Action("F", 1), Action("F", 0), Action("B", 0), Action("B", 1)],
    ]
    with pytest.raises(PipelineDeadlock, match=r"rank 0 at B0 waits for B0 on rank 1"):
        simulate_program(programs, 2, 2)
    with pytest.raises(PipelineDeadlock, match=r"rank 1 at F1 waits for F1 on rank 0"):
        check_program(programs, 2, 2)


@pytest.mark.parametrize("programs,message", [
    ([[Action("F", 0)], [Action("F", 0), Action("B", 0)]], "needs exactly one backward"),
    ([[Action("B", 0), Action("F", 0)], [Action("F", 0), Action("B", 0)]], "before its forward"),
    ([[Action("F", 0), Action("W", 0), Action("I", 0)], [Action("F", 0), Action("B", 0)]],
     "W0 comes before I0"),
    ([[Action("F", 0), Action("F", 0), Action("B", 0)], [Action("F", 0), Action("B", 0)]],
     "appears twice"),
    ([[Action("F", 0), Action("B", 0)], [Action("F", 0), Action("B", 0)],
      [Action("F", 0), Action("B", 0)]], "one program per pipeline rank"),
])
def test_malformed_programs_are_refused(programs, message):
    with pytest.raises(ValueError, match=message):
        check_program(programs, 2, 1)


@pytest.mark.parametrize("args,message", [
    (("gpipe", 2, 4, 1), "Unknown pipeline schedule 'gpipe'.*afab, 1f1b"),
    (("1f1b", 2, 0, 1), "num_microbatches=0 must be a positive integer"),
    (("1f1b", 0, 4, 1), "pp=0 must be a positive integer"),
    (("1f1b", 2, 4, 2), "only applies to the 'interleaved' schedule.*pp_virtual_stages=1"),
    (("zero_bubble", 2, 4, 2), "only applies to the 'interleaved' schedule"),
    (("interleaved", 2, 5, 2), "multiple of pp=2. Use 4 or 6 micro-batches"),
    (("interleaved", 4, 3, 2), "multiple of pp=4. Use 4 micro-batches"),
    (("interleaved", 2, 4, 1), "needs pp_virtual_stages >= 2"),
    (("interleaved", 1, 4, 2), "needs pp >= 2"),
])
def test_invalid_sizes_are_refused_with_a_fix(args, message):
    with pytest.raises(ValueError, match=message):
        validate_schedule(*args)
    with pytest.raises(ValueError, match=message):
        build_schedule(*args)


def test_virtual_stages_must_fit_the_layers():
    validate_schedule("interleaved", 2, 4, 2, num_layers=4)
    with pytest.raises(ValueError, match="6 layers do not fit 4 pipeline ranks x 2 virtual"):
        validate_schedule("interleaved", 4, 4, 2, num_layers=6)


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_explicit_communication_pairs_every_send_with_a_receive(name, p, m, v):
    compute = build_schedule(name, p, m, v)
    programs = add_communication(compute, p, v)
    assert [[a for a in prog if a.is_compute] for prog in programs] == compute
    sends, recvs = Counter(), Counter()
    for r, prog in enumerate(programs):
        for idx, a in enumerate(prog):
            if a.is_compute:
                continue
            q, c = peer_of(r, a, p)
            assert q != r
            direction = a.kind[-1]
            if a.kind.startswith("SEND"):
                sends[(r, q, direction, a.microbatch, stage_of(r, a.chunk, p))] += 1
                producer = prog[idx - 1]  # a send follows the compute that makes its tensor
                assert producer.is_compute and producer.microbatch == a.microbatch
            else:
                recvs[(q, r, direction, a.microbatch, stage_of(q, c, p))] += 1
    assert sends == recvs and set(sends.values()) == {1}
    # One activation and one gradient per micro-batch cross each of the p*v - 1 stage boundaries.
    assert sum(sends.values()) == 2 * m * (p * v - 1)

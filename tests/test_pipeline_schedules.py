"""Pipeline schedules as data and their simulator: validity, bubble formulas, peak memory."""

from collections import Counter

import pytest

from ultrascale.parallel.pipeline.schedules import (
    SCHEDULE_NAMES, Action, PipelineDeadlock, add_communication, build_schedule, check_program,
    dependencies, owner_of, peer_of, placement_of, stage_of, validate_schedule,
)
from ultrascale.parallel.pipeline.simulator import simulate, simulate_program


def _cases():
    """(name, pp, m, v) for every schedule, pp in 2 and 4, m in pp and 2pp+1 where allowed
    (dualpipev: 2pp and 2pp+1)."""
    for name in SCHEDULE_NAMES:
        for p in (2, 4):
            for m in ((2 * p, 2 * p + 1) if name == "dualpipev" else (p, 2 * p + 1)):
                v = 2 if name in ("interleaved", "dualpipev") else 1
                if name == "interleaved" and m % p:
                    continue
                yield name, p, m, v
    yield "interleaved", 2, 4, 2
    yield "interleaved", 4, 8, 2
    yield "dualpipev", 3, 10, 2
    yield "dualpipev", 1, 3, 2  # one rank holds the whole V (the executor's one-process tests)


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
        if name != "dualpipev":  # which backwards dualpipev splits depends on the rank
            assert len(prog) == m * v * (3 if name == "zero_bubble" else 2)
    check_program(programs, p, m, v, placement_of(name))


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
        for q, dep in dependencies(r, a, p, v, placement_of(name)):
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


@pytest.mark.parametrize("p,m", [(2, 2), (3, 4), (4, 9), (8, 24)])
@pytest.mark.parametrize("t_f,t_b,t_w", [(1.0, 2.0, 1.0), (1.0, 2.0, 0.5), (2.0, 2.0, 1.0),
                                         (1.0, 3.0, 0.25), (0.5, 1.0, 0.5)])
def test_zero_bubble_bubble_is_zb_h1(p, m, t_f, t_b, t_w):
    """The zero-bubble paper's ZB-H1 (its B the input gradient, I here): (p-1)(F + I - W), or
    (p-1)(F + B - 2W) with B = I + W the whole backward (DualPipe's table), on every rank, where
    a W pass is no longer than a forward or an I pass (each fills the gap it is scheduled in;
    beyond that the simulator's bubble is larger)."""
    res = simulate("zero_bubble", p, m, t_f=t_f, t_b=t_b, t_w=t_w)
    bubble = (p - 1) * (t_f + t_b - 2 * t_w)
    assert res.total_time - res.ideal_time == pytest.approx(bubble)
    assert res.idle_time == pytest.approx([bubble] * p)
    longer_w = simulate("zero_bubble", p, m, t_f=1.0, t_b=2.5, t_w=1.2)  # W > I and W > F
    assert longer_w.total_time - longer_w.ideal_time > (p - 1) * (1.0 + 2.5 - 2.4)


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
    where = placement_of(name)
    compute = build_schedule(name, p, m, v)
    programs = add_communication(compute, p, v, where)
    assert [[a for a in prog if a.is_compute] for prog in programs] == compute
    sends, recvs = Counter(), Counter()
    for r, prog in enumerate(programs):
        computed: list[Action] = []  # the compute so far: a send follows the one making it
        for a in prog:
            if a.is_compute:
                computed.append(a)
                continue
            q, c = peer_of(r, a, p, where)
            assert q != r
            direction = a.kind[-1]
            if a.kind.startswith("SEND"):
                sends[(r, q, direction, a.microbatch, stage_of(r, a.chunk, p, where))] += 1
                # After a pair both sends follow: the producer is among the last two.
                assert any(b.microbatch == a.microbatch and b.chunk == a.chunk
                           and (b.kind == "F") == (direction == "F") for b in computed[-2:])
            else:
                recvs[(q, r, direction, a.microbatch, stage_of(q, c, p, where))] += 1
    assert sends == recvs and set(sends.values()) <= {1}
    # One activation and one gradient per micro-batch cross each stage boundary between ranks:
    # p*v - 1 of them, less dualpipev's turn on the last rank.
    crossings = sum(owner_of(s, p, where)[0] != owner_of(s + 1, p, where)[0]
                    for s in range(p * v - 1))
    assert crossings == p * v - 1 - (where == "v")
    assert sum(sends.values()) == 2 * m * crossings


# -- DualPipeV --------------------------------------------------------------------------------


@pytest.mark.parametrize("p,m", [(2, 4), (2, 7), (3, 6), (4, 8), (4, 11), (8, 16)])
def test_dualpipev_is_torch_schedule_dualpipev(p, m):
    """The same compute order as torch.distributed.pipelining's ScheduleDualPipeV (its action
    lists, built without processes): kinds, micro-batches, stages and the overlapped pairs."""
    from torch.distributed.pipelining import schedules as theirs

    kind = {theirs.FORWARD: "F", theirs.FULL_BACKWARD: "B", theirs.BACKWARD_INPUT: "I",
            theirs.BACKWARD_WEIGHT: "W"}
    sched = object.__new__(theirs.ScheduleDualPipeV)  # only the pure list builder is used
    sched.pp_group_size, sched._n_microbatches = p, m
    ours = build_schedule("dualpipev", p, m, 2)
    for r in range(p):
        expected = []
        for a in sched._calculate_single_rank_operations(r):
            pair = a.computation_type == theirs.OVERLAP_F_B
            for i, b in enumerate(a.sub_actions if pair else [a]):
                expected.append((kind[b.computation_type], b.microbatch_index, b.stage_index,
                                 pair and i == 0))
        assert [(a.kind, a.microbatch, stage_of(r, a.chunk, p, "v"), a.paired)
                for a in ours[r]] == expected


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("extra", [0, 3, 2])
@pytest.mark.parametrize("t_f", [1.0, 0.5])
def test_dualpipev_bubble_is_the_published_formula(p, extra, t_f):
    """DualPipe's README: bubble (PP/2 - 1)(F&B + B - 3W) with PP = 2p stages and the times of
    one chunk. The formula is derived, as the zero-bubble paper's ZB1P row (PP-1)(F+B-2W) is,
    for F = I = W (a backward twice a forward, half of it weight gradients); with those times the
    simulator's idle time equals it on every rank, pairs taking F&B = F + B."""
    m = 2 * p + extra * p
    res = simulate("dualpipev", p, m, 2, t_f=t_f, t_b=2 * t_f, t_w=t_f)
    f, b, w = t_f / 2, t_f, t_f / 2  # one chunk: half a rank's layers
    bubble = (2 * p / 2 - 1) * ((f + b) + b - 3 * w)
    assert res.total_time - res.ideal_time == pytest.approx(bubble)
    assert res.idle_time == pytest.approx([bubble] * p)
    zb = simulate("zero_bubble", p, m, t_f=t_f, t_b=2 * t_f, t_w=t_f)
    assert zb.total_time - zb.ideal_time == pytest.approx((p - 1) * (t_f + 2 * t_f - 2 * t_f))
    # At these times, on the same ranks: ZB1P's bubble, a third of 1F1B's (DualPipe gains where
    # F&B < F + B, the overlap hiding communication: `t_pair`, below).
    assert bubble == pytest.approx(zb.total_time - zb.ideal_time)
    one = simulate("1f1b", p, m, t_f=t_f, t_b=2 * t_f)
    assert bubble == pytest.approx((one.total_time - one.ideal_time) / 3)


def test_dualpipev_pairs_hide_the_all_to_alls_by_hand():
    """theory/dualpipev.py's F&B = S + max(C, A), through the simulator, on pp2 with m = 4.

    One chunk: F = 1 (0.3 of it the expert all-to-alls), B = 2 (0.5 of them), W = 1, no pipeline
    transfer. A pair's A = 0.8 hides under its C = 3 - 0.8 = 2.2: F&B = 2.2 (a whole stage's
    pair, what the theory hands the simulator, twice that: 4.4). By hand: each rank runs 2m = 8
    forwards and 8 backwards, 8 x (1 + 2) = 24, of which its 3 pairs (F3&B1c1, F2c1&B0,
    F3c1&B1 on rank 0) hide 3 x 0.8 = 2.4: 21.6 busy; DualPipe's bubble (PP/2 - 1)(F&B + B - 3W)
    with PP = 4 adds 1 x (2.2 + 2 - 3) = 1.2: 22.8. Without the overlap (F&B = 3) 26."""
    from ultrascale.theory.dualpipev import dualpipev_time, hidden_in_pair, pair_time

    forward, backward = {"matmul": 1.4, "ep_comm": 0.6}, {"matmul": 3.0, "ep_comm": 1.0}
    assert pair_time(forward, backward) == pytest.approx(4.4)
    res = simulate("dualpipev", 2, 4, 2, t_f=2.0, t_b=4.0, t_pair=4.4)
    assert res.busy_time == pytest.approx([21.6, 21.6])
    assert res.total_time == pytest.approx(22.8)
    assert dualpipev_time(2, 4, 2.0, 4.0, 4.4) == pytest.approx(22.8)  # the theory's grid
    assert simulate("dualpipev", 2, 4, 2, t_f=2.0, t_b=4.0).total_time == pytest.approx(26.0)
    # Transfers stay in series; all-to-alls beyond the compute show (A = 4 > C = 2: S + A).
    assert pair_time({"matmul": 1.0, "pp_p2p": 0.5, "ep_comm": 3.0},
                     {"matmul": 1.0, "pp_p2p": 0.5, "ep_comm": 1.0}) == pytest.approx(5.0)
    # No all-to-all: the pair is the sum, exactly, and the step today's to the bit.
    dense = ({"matmul": 1.3, "pp_p2p": 0.1}, {"matmul": 2.9, "pp_p2p": 0.1})
    assert hidden_in_pair(*dense) == 0.0
    assert pair_time(*dense) == sum(dense[0].values()) + sum(dense[1].values())
    t_f, t_b = sum(dense[0].values()), sum(dense[1].values())
    assert dualpipev_time(4, 13, t_f, t_b, pair_time(*dense)) == dualpipev_time(4, 13, t_f, t_b)
    assert simulate("dualpipev", 3, 7, 2, t_f=t_f, t_b=t_b, t_pair=t_f + t_b) == \
        simulate("dualpipev", 3, 7, 2, t_f=t_f, t_b=t_b)


@pytest.mark.parametrize("p,m", [(4, 13), (8, 40), (3, 7)])
def test_dualpipev_time_with_overlap_is_the_simulators(p, m):
    """The theory's step time against the simulation of the same times (extended in m past
    2p + 1): on its grids (backward / forward on `RATIO_STEP`'s, pair / (t_f + t_b) on
    `PAIR_STEP`'s) the simulation itself; between them, linear interpolation of the total, which
    grows with both, stays between the simulations at the cell's corners."""
    from ultrascale.theory.dualpipev import PAIR_STEP, dualpipev_time
    from ultrascale.theory.pipeline import RATIO_STEP

    t_f = 0.9
    for t_b, q in ((4 * RATIO_STEP * t_f, 12 * PAIR_STEP), (3 * RATIO_STEP * t_f, 15 * PAIR_STEP)):
        sim = simulate("dualpipev", p, m, 2, t_f=t_f, t_b=t_b, t_pair=q * (t_f + t_b))
        assert dualpipev_time(p, m, t_f, t_b, q * (t_f + t_b)) == pytest.approx(sim.total_time,
                                                                                  rel=1e-9)
    t_b, q = 2.3, 0.8  # ratio 2.56 in [2.5, 3], q in [0.75, 0.8125]
    corners = [simulate("dualpipev", p, m, 2, t_f=t_f, t_b=r * t_f,
                        t_pair=c * t_f * (1 + r)).total_time for r in (2.5, 3.0)
               for c in (0.75, 0.8125)]
    assert min(corners) <= dualpipev_time(p, m, t_f, t_b, q * (t_f + t_b)) <= max(corners)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 9), (8, 16)])
def test_dualpipev_holds_pp_plus_one_chunks(p, m):
    """The README's activation column: PP + 1 chunk activations per device (PP = 2p stages)."""
    assert simulate("dualpipev", p, m, 2).peak_in_flight_chunks == [2 * p + 1] * p


def test_dualpipev_places_the_v_and_turns_on_the_last_rank():
    assert [stage_of(r, c, 4, "v") for r in range(4) for c in (0, 1)] == [0, 7, 1, 6, 2, 5, 3, 4]
    assert [owner_of(s, 4, "v") for s in range(8)] == [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1),
                                                      (2, 1), (1, 1), (0, 1)]
    programs = add_communication(build_schedule("dualpipev", 4, 8, 2), 4, 2, "v")
    # The last rank hands stage 3's output to its own stage 4: no transfer names that boundary.
    assert not any(a.kind in ("SEND_F", "RECV_B") and a.chunk == 0 for a in programs[3])
    # A pair receives both inputs before it and sends both outputs after.
    prog = programs[1]
    k = next(i for i, a in enumerate(prog) if a.paired)
    before, after = prog[k - 2:k], prog[k + 2:k + 4]
    assert [a.kind for a in before] == ["RECV_F", "RECV_B"]
    assert [a.kind for a in after] == ["SEND_F", "SEND_B"]


def test_a_pair_needs_a_backward_after_it_and_both_inputs():
    f = Action("F", 0, paired=True)
    assert f == Action("F", 0) and str(f) == "F0&"
    with pytest.raises(ValueError, match="must be the backward"):
        check_program([[f, Action("F", 1), Action("B", 0), Action("B", 1)]], 1, 2)
    with pytest.raises(ValueError, match="Only a forward pairs"):
        Action("B", 0, paired=True)
    # On two ranks: rank 0 pairs F1 with B0, but B0 needs rank 1's B0, which needs F1 from
    # rank 0 first (rank 1 runs F1 before B0): the pair waits on itself.
    programs = [[Action("F", 0), Action("F", 1, paired=True), Action("B", 0), Action("B", 1)],
                [Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)]]
    with pytest.raises(PipelineDeadlock, match=r"rank 0 at F1&B0 waits for B0 on rank 1"):
        check_program(programs, 2, 2)
    programs[1] = [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)]
    check_program(programs, 2, 2)


@pytest.mark.parametrize("args,message", [
    (("dualpipev", 2, 4, 1), "two chunks per rank.*pp_virtual_stages=2"),
    (("dualpipev", 2, 3, 2), "at least 2 x pp = 4 micro-batches"),
    (("dualpipev", 4, 7, 2), "at least 2 x pp = 8 micro-batches.*Use 8 or more"),
])
def test_dualpipev_sizes_are_refused_with_a_fix(args, message):
    with pytest.raises(ValueError, match=message):
        build_schedule(*args)


def test_dualpipev_layouts_are_refused_before_launch():
    from ultrascale.layout import Layout
    from ultrascale.rules import schedule_violations

    def reasons(**kw):
        return [v.reason for v in schedule_violations(Layout(pp_schedule="dualpipev", **kw), 8)]

    assert reasons(pp=2, pp_virtual_stages=2, grad_accum=4) == []
    assert any("needs pp >= 2" in r for r in reasons(pp=1, pp_virtual_stages=2, grad_accum=4))
    assert any("two chunks per rank" in r for r in reasons(pp=2, grad_accum=4))
    assert any("at least 2 x pp = 8" in r for r in reasons(pp=4, pp_virtual_stages=2,
                                                           grad_accum=6))


@pytest.mark.parametrize("p,m", [(2, 4), (2, 7), (4, 8), (4, 13), (8, 16)])
def test_dualpipev_theory_holds_what_the_simulator_replays(p, m):
    """theory/dualpipev.py: the chunks held at the peak are the simulator's (2pp + 1, in
    whole-stage units half that), both ends on rank 0, and its step time the simulator's."""
    from ultrascale.theory.dualpipev import DualPipeV, dualpipev_time, held_states

    sched = DualPipeV("dualpipev")
    sim = simulate("dualpipev", p, m, 2, t_f=1.0, t_b=2.5)
    assert [sched.in_flight(p, m, 2, r) for r in range(p)] == sim.peak_in_flight
    for r in range(p):  # the closed forms against the replay of each rank's program
        states, second = held_states(p, m, r)
        assert max(w + d for w, d, _ in states) == max(w for w, _, _ in states) == 2 * p + 1
        assert any(s[:2] == (2 * p + 1, 0) for s in states)
        assert second == sched.edge_in_flight(p, m, 2, r, 0) == r + 1
        assert max(e for _, _, e in states) == r + 1  # before their backward, at most as many
    assert [sched.ends(r, p) for r in range(p)] == [(True, True)] + [(False, False)] * (p - 1)
    assert dualpipev_time(p, m, 2.0, 5.0) == pytest.approx(2.0 * sim.total_time)


def test_the_estimator_describes_a_dualpipev_rank():
    """The memory estimate of a dualpipev layout: rank 0 holds the embedding and the head, and
    (2pp + 1) / 2 stages' worth of activations, against 1F1B's pp on its first rank."""
    from ultrascale.config import ModelConfig
    from ultrascale.layout import Layout
    from ultrascale.memory.estimator import estimate

    model = ModelConfig(preset="tiny", tie_embeddings=False)
    v_shape = estimate(model, Layout(pp=2, pp_schedule="dualpipev", pp_virtual_stages=2,
                                     grad_accum=4, dtype="fp32"))
    one = estimate(model, Layout(pp=2, grad_accum=4, dtype="fp32"))
    assert v_shape.stage == 0 and "embedding, output head and loss" in v_shape.rank_desc
    assert v_shape.activations > one.activations

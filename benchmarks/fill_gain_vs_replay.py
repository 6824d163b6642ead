"""The planner's closed form for a pipeline whose ranks carry unequal work, against the simulator
replaying every rank with its own stage times.

`theory/pipeline.placement` costs the busiest rank and subtracts what the lighter ranks gain in
the fill and drain (`Schedule.fill_gain_share` of pp x busiest minus the sum over ranks) from the
schedule run at the busiest rank's pace. Here, for seeded loads (each rank's forward drawn from 1
to 2, its backward twice that, on 4 and 8 ranks with 2pp and 4pp micro-batches), the closed form
over the replay (`pipeline.shared_pipeline_time` with a core per rank: the plain schedule), and
the uniform schedule at the busiest pace (what the planner costed before) over it. A model of the
simulator, not of a machine: it runs anywhere in seconds.

    python benchmarks/fill_gain_vs_replay.py [--loads 150] [--seed 0]
"""

from __future__ import annotations

import argparse
import random

from ultrascale.layout import Layout
from ultrascale.theory.dualpipev import dualpipev_time
from ultrascale.theory.pipeline import pipeline_time, shared_pipeline_time
from ultrascale.theory.terms import schedule_of

SCHEDULES = (("1f1b", 1), ("dualpipev", 2), ("zero_bubble", 1), ("interleaved", 2))


def errors(schedule: str, v: int, loads: int, seed: int, share: float) -> list[tuple[float, float]]:
    """(closed form / replay - 1, uniform / replay - 1) for each seeded load."""
    rng = random.Random(seed)
    out = []
    for _ in range(loads):
        pp = rng.choice([4, 8])
        m = rng.choice([2 * pp, 4 * pp])
        f = tuple(round(rng.uniform(1, 2), 2) for _ in range(pp))
        b = tuple(2 * w for w in f)
        per_chunk = (lambda x: tuple((w / 2, w / 2) for w in x)) if v == 2 else (lambda x: x)
        replay = shared_pipeline_time(schedule, pp, m, v, per_chunk(f), per_chunk(b),
                                      cores=pp, threads=1)
        t = max(f)
        uniform = (dualpipev_time(pp, m, t, 2 * t) if schedule == "dualpipev"
                   else pipeline_time(schedule, pp, m, v, t, 2 * t))
        closed = max(m * 3 * t, uniform - share * (pp * 3 * t - 3 * sum(f)))
        out.append((closed / replay - 1, uniform / replay - 1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"{args.loads} seeded loads (seed {args.seed}); error = time / replay - 1")
    print("| schedule | fill_gain_share | closed form: min, max | all the slack: min, max "
          "| uniform at the busiest pace: min, max |")
    print("| --- | --- | --- | --- | --- |")
    for schedule, v in SCHEDULES:
        share = schedule_of(Layout(pp=4, pp_virtual_stages=v, pp_schedule=schedule)
                            ).fill_gain_share
        ours = errors(schedule, v, args.loads, args.seed, share)
        whole = errors(schedule, v, args.loads, args.seed, 1.0)
        closed, uniform = [e for e, _ in ours], [u for _, u in ours]
        print(f"| {schedule} | {share} | {min(closed):+.1%}, {max(closed):+.1%} | "
              f"{min(e for e, _ in whole):+.1%}, {max(e for e, _ in whole):+.1%} | "
              f"{min(uniform):+.1%}, {max(uniform):+.1%} |")


if __name__ == "__main__":
    main()

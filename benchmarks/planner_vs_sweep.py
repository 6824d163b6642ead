"""The planner against a sweep measured on this machine (`ultrascale sweep`).

    ultrascale calibrate --ranks 4                                   # the profile (local)
    ultrascale sweep benchmarks/sweep_cpu_4ranks.yaml                # the measurements
    python benchmarks/planner_vs_sweep.py                            # this comparison
    python benchmarks/planner_vs_sweep.py --csv A/results.csv --csv B/results.csv --json out.json
    python benchmarks/planner_vs_sweep.py --csv sweeps/r6/results.csv   # a sweep with --repeats 6

The recorded comparisons (benchmarks/planner_notes.md, "On a CPU machine: calibrate and sweep"):

    D=benchmarks/data/planner_sweep_cpu_4ranks_xeon        # one sweep with --repeats 6
    python benchmarks/planner_vs_sweep.py --profile $D/local.yaml --csv $D/results.csv \
        [--markdown] [--across median] [--best-of 1 --best-of 3]
    python benchmarks/planner_vs_sweep.py --profile $D/local_2.yaml --csv $D/results_2.csv \
        [--without-cache-model]                             # the second sweep, with the cache model
    D=benchmarks/data/planner_sweep_cpu_4ranks             # ten sweeps on another machine
    python benchmarks/planner_vs_sweep.py --profile $D/local.yaml \
        $(for f in $(ls -v $D/sweep*.csv); do echo --csv $f; done) [--markdown] [--across median]

For every layout of the grid that ran: the measured step time (the sweep's median over the steps
after the first; with several --csv, repeats of the sweep, or one sweep run with `--repeats`, the
lowest of those medians: on a machine shared with other jobs, the least disturbed run of each
layout; `--across median` takes their median instead), the cost model's prediction on the profile
(`planner.cost.predict`), and their ranks. Figures: Spearman rank correlation of predicted
and measured step times, median relative error, and the planner's first choice: `planner.plan`
searching the same dimensions as the grid (its dp/tp/pp, ZeRO stages and micro-batch sizes, at the
grid's global batch, sequence length and dtype; no recompute, 1F1B), walking down its ranking to the
first layout the engine runs (`parallel.check_supported`), whose
measured step time is set against the best measured (the gap; target <= 10%). With several
sweeps, also how well they agree with each other (Spearman of each pair over the layouts both
ran): the ceiling for any prediction of a single sweep.

The code is the package's: `ultrascale.planner.sweep_compare`.
"""

import sys

from ultrascale.planner.sweep_compare import main

if __name__ == "__main__":
    sys.exit(main(description=__doc__))

"""The planner's step time for our own runtime against our own measured runs, held out from any
fit: the GPU suite's one-GPU runs on an H200 (benchmarks/gpu/results/) on the `h200` profile, and
the out-of-sample CPU sweeps (benchmarks/data/planner_sweep_cpu_4ranks_*) on their machines'
calibrated profiles.

    python benchmarks/planner_vs_ours.py            # docs/planner.md's "On our own runtime"
    python benchmarks/planner_vs_ours.py --json

Reads recorded runs only (no timing): it can run anywhere. The code is the package's:
`ultrascale.planner.ours_check`.
"""

import sys

from ultrascale.planner.ours_check import main

if __name__ == "__main__":
    sys.exit(main(description=__doc__))

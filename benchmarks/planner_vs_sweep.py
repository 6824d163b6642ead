"""The planner against a sweep measured on this machine (`ultrascale sweep`).

Its code, options and recorded comparisons:
`ultrascale.planner.sweep_compare` (the same command as
`python -m ultrascale.planner.sweep_compare`);
`python benchmarks/planner_vs_sweep.py --help` prints them.
"""

import sys

from ultrascale.planner import sweep_compare

if __name__ == "__main__":
    sys.exit(sweep_compare.main(description=sweep_compare.__doc__))

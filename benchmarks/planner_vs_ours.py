"""The planner's step time for our own runtime against our own measured runs, held out from any fit.

Its code, options and recorded comparison:
`ultrascale.planner.ours_check` (the same command as
`python -m ultrascale.planner.ours_check`);
`python benchmarks/planner_vs_ours.py --help` prints them.
"""

import sys

from ultrascale.planner import ours_check

if __name__ == "__main__":
    sys.exit(ours_check.main(description=ours_check.__doc__))

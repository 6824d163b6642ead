"""The memory estimator against the engine's own step on fake tensors (`ultrascale memory
--measure`) over a grid of layouts on five models.

Its code, options and recorded comparison:
`ultrascale.memory.measure_grid` (the same command as
`python -m ultrascale.memory.measure_grid`);
`python benchmarks/memory_vs_measure.py --help` prints them.
"""

import sys

from ultrascale.memory import measure_grid

if __name__ == "__main__":
    sys.exit(measure_grid.main(description=measure_grid.__doc__))

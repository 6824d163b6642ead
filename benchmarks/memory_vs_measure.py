"""The memory estimator against the engine's own step on fake tensors (`ultrascale memory
--measure`) over a grid of layouts on llama3-8b, llama3-70b, mixtral-8x7b, qwen3-30b-a3b and
deepseek-v3: every dimension and its modes, dtypes, recompute, Muon.

    python benchmarks/memory_vs_measure.py --smoke          # two rows on two-layer models
    python benchmarks/memory_vs_measure.py                  # the grid, into the results file
    python benchmarks/memory_vs_measure.py --table          # docs/memory.md's table from it

The measured figures are bytes, not timings: the grid can run on a loaded machine (rows already
in the results file are skipped, so an interrupted run resumes). The code is the package's:
`ultrascale.memory.measure_grid`.
"""

import sys

from ultrascale.memory.measure_grid import main

if __name__ == "__main__":
    sys.exit(main(description=__doc__))

"""The planner against the playbook's published H100 runs (benchmarks/data/playbook_bench_1b_3b.csv).

    python benchmarks/planner_vs_playbook.py            # figures per (model, nodes) cell
    python benchmarks/planner_vs_playbook.py --fit      # refit the H100 constants first (26 s)
    python benchmarks/planner_vs_playbook.py --fit --objective least-squares   # every run alike
    python benchmarks/planner_vs_playbook.py --sensitivity   # the worst cell, each constant moved
    python benchmarks/planner_vs_playbook.py --json out.json
    python benchmarks/planner_vs_playbook.py --fit --fit-on 1.34G   # hold the 3.57G runs out
    python benchmarks/planner_vs_playbook.py --per-micro-batch     # time per micro-batch by layout
    python benchmarks/planner_vs_playbook.py --per-layer-split     # micro-batch 1: fixed + per layer
    python benchmarks/planner_vs_playbook.py --fabric              # the bus bandwidths each job measured
    python benchmarks/planner_vs_playbook.py --per-run-fabric      # each run on its job's bandwidths
    python benchmarks/planner_vs_playbook.py --one-state h100-playbook   # one profile for every run
    python benchmarks/planner_vs_playbook.py --fit --set dp_overlap=1    # refit with one field changed
    python benchmarks/planner_vs_playbook.py --cell 1.34G:64             # one cell, run by run
    python benchmarks/planner_vs_playbook.py --fit --runtime nanotron-balanced  # nanotron's pp split

The cluster ran in two states, and every job measured which before it trained: its node's
all-reduce ran with NVLink SHARP (~458 GB/s bus bandwidth; profile `h100-playbook-nvls`) or
without it (~425 GB/s; profile `h100-playbook`, whose tensor-parallel ring steps wait ~0.27 ms
each). Each run is predicted on the profile of its own job's state, as a planner is used on a
cluster calibrated the day it runs (`--one-state NAME` predicts every run on one profile instead).
Rows used: status Success, dp x tp x pp = 8 x nodes, global batch 256 x 4096 tokens, and for
pp > 1 only runs after nanotron's pipeline-engine fix (after_pp_fix). Repeated layouts keep
their best run.

For each (model, nodes) cell: median relative error of predicted tokens/s/GPU and Spearman rank
correlation of predicted and measured (each run on its state's profile); then the planner, on
the profile of the state in which the cell's best measured layout ran, searching only the
dimensions those runs explored (their tp, pp and micro-batch values, ZeRO 0/1, sequence parallel,
1F1B, no recompute, keeping what fits by the memory estimator with nanotron's runtime): its rank
of the best measured layout, and the measured throughput of its highest-ranked layout measured in
that state as a fraction of the best measured (the MFU ratio: same model, same FLOPs per token);
and the same ratio for its first choice itself where that layout was measured in that state.

The code is the package's (`ultrascale.planner.playbook`: the runs and figures; `planner.fit`:
the fit, also `python -m ultrascale.planner.fit`, with held-out checks; `planner.playbook_report`:
this report).
"""

import sys

from ultrascale.planner.playbook_report import main

if __name__ == "__main__":
    sys.exit(main(description=__doc__))

"""The theory wing: what each parallel dimension costs a rank, in bytes and in seconds.

One torch-free file per dimension (`block`, `ends`, `recompute`, `tensor`, `context`,
`pipeline`, `expert`, `data`, `precision`, `optimizer`), each with a `TERM` (`term.Term`); the
memory estimate (`memory.estimator`) and the step time (`planner.cost`) are folds over the list
in `terms.py`. `shape.py` is the one description of sizes they share, `rates.py` what the
hardware charges, `implementation.py` the implementations described (ours, nanotron's).
"""

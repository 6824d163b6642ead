"""Parallel strategies, each a small module that transforms the plain model.

- `support.check_supported(cfg)`: refuses unimplemented combinations before any process starts;
- `apply.parallelize(model, ctx, cfg)`: applies the strategies (precision, recompute, tensor
  parallel, context parallel, expert parallel, pipeline split, data parallel / ZeRO) and returns
  the `Runtime` the trainer drives;
- one module per strategy: `precision`, `data`, `zero`, `zero3`, `tensor`, `context`, `expert`,
  `pipeline/`, `recompute`.

This package file imports nothing: the memory estimator and the planner import the torch-free
`ultrascale.parallel.pipeline.simulator` through it. Import the names from their modules
(`from ultrascale.parallel.apply import parallelize`).
"""

"""Parallel strategies, each a small module that transforms the plain model.

- `support.check_supported(cfg)`: refuses unimplemented combinations before any process starts;
- `apply.parallelize(model, ctx, cfg)`: applies the strategies (precision, recompute, tensor
  parallel, context parallel, expert parallel, pipeline split, data parallel / ZeRO) and returns
  the `Runtime` the trainer drives;
- one module per strategy: `precision`, `data`, `zero`, `zero3`, `tensor`, `context`, `expert`,
  `pipeline/`, `recompute`.

The names are loaded on first use (PEP 562), so that importing a torch-free piece such as
`ultrascale.parallel.pipeline.simulator` (the memory estimator, the planner) does not import torch.
"""

from __future__ import annotations

import importlib

_LAZY = {"check_supported": "support", "parallelize": "apply"}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

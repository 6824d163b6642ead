"""Regional compilation (`training.compile`): each transformer block's forward goes through
`torch.compile`, as torchtitan compiles per block rather than the whole model.

`compile_blocks(model)` rebases every block of `model.layers` onto a subclass of its own class
(`Block`, full recompute's `CheckpointedBlock`, whatever a strategy made of it) whose forward
calls the compiled forward of that class. The block keeps its parameters, names and children, and
its module hooks stay outside the compiled code: ZeRO-3 gathers and frees a block in its hooks,
around the compiled forward. Blocks of one class share one compiled function; with PyTorch's
inlining of nn modules, layers of one shape share one graph (their parameters are its inputs).
Collectives inside a block (tensor parallel's autograd functions, which count their bytes through
`distributed/comm.py`) are not traced: dynamo breaks the graph around them and runs them eagerly.

It runs after every strategy that changes blocks (tensor, context, expert parallel, the pipeline
split) and before the data-parallel owner hooks the blocks. `training.compile_cache` names
inductor's cache folder (TORCHINDUCTOR_CACHE_DIR, process-wide, as torch reads it).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ultrascale.parallel.seams import rebase

_COMPILED: dict[type, type] = {}  # a block class -> its compiled-forward subclass


def compiled_class(cls: type) -> type:
    """The subclass of `cls` whose forward is `torch.compile(cls.forward)` (made once per class)."""
    if cls not in _COMPILED:
        if issubclass(cls, tuple(_COMPILED.values())):
            return cls  # already compiled
        run = torch.compile(cls.forward, dynamic=False)

        def forward(self, *args, **kwargs):
            return run(self, *args, **kwargs)

        _COMPILED[cls] = type(f"Compiled{cls.__name__}", (cls,), {
            "forward": forward, "__module__": __name__,
            "__doc__": f"{cls.__name__} with its forward compiled (regional compilation)."})
    return _COMPILED[cls]


def compile_blocks(model: nn.Module, cache_dir: str | None = None) -> int:
    """Rebase every block of `model.layers` onto its compiled-forward subclass; returns how many."""
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(cache_dir)
    for key, block in model.layers.items():
        model.layers[key] = rebase(block, compiled_class(type(block)))
    return len(model.layers)

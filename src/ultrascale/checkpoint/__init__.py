"""Checkpoints that a crash can never half-write (store.py: written to a temporary folder, then
renamed); Hugging Face folders in and out (hf.py); the whole model from a checkpoint of any layout
(gather.py); `ultrascale export` and `generate` (command.py).

The store's names are loaded on first use (PEP 562), so that registering the commands (the CLI
does at start) imports no torch."""

from __future__ import annotations

import importlib

_LAZY = {"CheckpointMeta": "store", "find_latest": "store", "load_checkpoint": "store",
         "save_checkpoint": "store"}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

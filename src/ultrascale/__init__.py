"""ultrascale: train LLMs with 5D parallelism, and know the layout before the run.

The Python API (docs/api.md): `load` a checkpoint or a Hugging Face folder as a plain module,
its `tokenizer`, `generate` text; `memory` and `plan` as functions."""

from ultrascale.api import generate, load, memory, plan, tokenizer

__all__ = ["generate", "load", "memory", "plan", "tokenizer"]

"""ultrascale: train LLMs with 5D parallelism, and know the layout before the run.

The Python API (docs/api.md): `load` a checkpoint or a Hugging Face folder as a plain module,
its `tokenizer`, `generate` text; `estimate_memory` and `plan` as functions."""

from ultrascale.api import estimate_memory, generate, load, plan, tokenizer

__all__ = ["estimate_memory", "generate", "load", "plan", "tokenizer"]

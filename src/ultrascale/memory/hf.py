"""A ModelConfig from a Hugging Face `config.json` (Llama, Mistral, Qwen, Mixtral-style MoE, ...),
for the estimator and the planner: any decoder's shape, read by `hf_arch.model_keys` without the
training engine's limits (the trainer reads the same file strictly, through `model.hf_config`)."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from ultrascale import hf_arch
from ultrascale.config import ConfigError, ModelConfig


def from_hf_config(path: str | Path) -> ModelConfig:
    """Read the shape keys of a Hugging Face decoder config; raise ConfigError if unusable."""
    try:
        keys = hf_arch.model_keys(path, strict=False)
    except hf_arch.HFConfigError as exc:
        raise ConfigError(str(exc)) from None
    try:
        return ModelConfig(**keys)
    except ValidationError as err:
        inner = [str((e.get("ctx") or {}).get("error") or e["msg"]) for e in err.errors()]
        raise ConfigError(f"{str(hf_arch.config_path(path))!r}: {' '.join(inner)}") from None

"""The one validated configuration tree: YAML file plus `--set section.key=value` overrides.

Every structural rule (tp divides the heads, pp divides the layers, ...) is checked here, before any
process starts, and reported as a `ConfigError` that names the key, the value and the fix. The rules
themselves live in the rules package, which the estimator, the planner and the engine ask too.

Here: the tree's root (`Config`, the rules that span sections, `Config.layout()`), what the
declarations say (`known_keys`, `layout_keys`, ...), and loading (YAML, overrides, errors). The
sections are declared in config_model.py (the model) and config_sections.py (parallel, training,
precision, data, checkpoint, logging, launch); every section is importable from here too.

How to add a key: declare it once, in its section, as `name: type = key(default, meaning, ...)`
(config_fields.py). The annotation is its type and the pydantic constraints (ge=, gt=, ...) its
bounds; `meaning` is the line `ultrascale config keys` and `ultrascale train --help` print;
`layout="..."` names the `Layout` field it feeds where it changes memory or time (add that field to
layout.py: `Config.layout()`, the `memory`/`plan` flag of that name and the layout string then
follow); `aliases=(...)` are other trainers' names for it. Then give it a row in
docs/configuration.md (tests/test_docs.py checks every key is there); a rule on its value goes in
the rules package (src/ultrascale/rules/).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, ValidationInfo, model_validator

from ultrascale import config_fields, devices, hf_arch
from ultrascale.config_fields import ConfigError, Section, key
from ultrascale.config_model import ModelConfig, RopeScaling
from ultrascale.config_sections import (CheckpointConfig, DataConfig, LaunchConfig, LoggingConfig,
                                        ParallelConfig, PrecisionConfig, TrainingConfig,
                                        default_warmup)
from ultrascale.layout import Layout
from ultrascale.rules import (accumulation_for, fp8_expert_violations,
                              fp8_swiglu_violations, layout_violations, precision_violations,
                              training_violations)

# The sections and the error are this module's names too (`from ultrascale.config import ...`).
__all__ = [
    "CheckpointConfig", "Config", "ConfigError", "DataConfig", "LaunchConfig", "LoggingConfig",
    "ModelConfig", "ParallelConfig", "PrecisionConfig", "RopeScaling", "TrainingConfig",
    "build_config", "default_warmup", "known_keys", "layout_keys", "layout_sections",
    "load_config", "parse_override", "suggest_key",
]


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    device: Literal["auto", "cpu", "cuda"] = key("auto", "auto (CUDA when present, else CPU), cpu "
                                                         "or cuda")
    launch: LaunchConfig = Field(default_factory=LaunchConfig)

    @model_validator(mode="before")
    @classmethod
    def _auto_dtype(cls, data: Any, info: ValidationInfo) -> Any:
        """`precision.dtype: auto` becomes the one dtype the run computes in (devices.resolve_dtype:
        bf16 on CUDA and on CPUs with bf16 instructions, fp32 otherwise), once, here: config.yaml,
        the ranks, the checkpoints' meta.json and every estimate see the same. CUDA is the
        validation context's `cuda` where given (the planner and a Slurm sweep predict GPUs from
        a login node), else what `device` means on this machine."""
        if not isinstance(data, dict):
            return data
        precision = data.get("precision")
        if isinstance(precision, PrecisionConfig):
            precision = precision.model_dump()
        precision = precision if precision is not None else {}
        if not isinstance(precision, dict) or precision.get("dtype", "auto") != "auto":
            return data
        cuda = (info.context or {}).get("cuda")
        if cuda is None:
            device = data.get("device", "auto")
            cuda = devices.uses_cuda(device) if device in ("auto", "cpu", "cuda") else False
        return {**data, "precision": {**precision, "dtype": devices.resolve_dtype("auto", cuda)}}

    @model_validator(mode="before")
    @classmethod
    def _vocab_from_tokenizer(cls, data: Any) -> Any:
        """model.vocab_size follows a Hugging Face tokenizer unless it is given (or the model
        comes from a Hugging Face config, whose vocabulary the weights have)."""
        if not isinstance(data, dict):
            return data
        model, section = data.get("model") or {}, data.get("data") or {}
        if not isinstance(model, dict) or not isinstance(section, dict):
            return data
        if model.get("vocab_size") or model.get("from_hf") or model.get("hf_config"):
            return data
        size = hf_arch.tokenizer_vocab_size(str(section.get("tokenizer", "byte")))
        return {**data, "model": {**model, "vocab_size": size}} if size else data

    @model_validator(mode="after")
    def _grad_accum_from_global_batch(self) -> "Config":
        """training.global_batch_size fixes the batch: grad_accum_steps follows dp."""
        t = self.training
        if t.global_batch_size is not None:
            given = t.grad_accum_steps if "grad_accum_steps" in t.model_fields_set else None
            t.grad_accum_steps, broken = accumulation_for(t.global_batch_size, t.micro_batch_size,
                                                          self.parallel.dp, given)
            if broken:
                raise ConfigError(broken.message)
        return self

    @model_validator(mode="after")
    def _check_layout(self) -> "Config":
        t, d = self.training, self.data
        if d.val_source is not None and d.val_fraction:
            raise ConfigError(f"data.val_source={d.val_source!r} and data.val_fraction="
                              f"{d.val_fraction} both give a validation split. Keep one.")
        if t.eval_every and d.val_source is None and not d.val_fraction:
            raise ConfigError(f"training.eval_every={t.eval_every} but there is no validation "
                              "split: set data.val_source (a file or folder) or data.val_fraction "
                              "(e.g. 0.05), or training.eval_every=0.")
        broken = layout_violations(self.model, self.layout(), self.parallel.pp_layers) \
            + precision_violations(self.precision) \
            + fp8_expert_violations(self.model, self.precision) \
            + fp8_swiglu_violations(self.precision, self.training) \
            + training_violations(self.training)
        if broken:
            raise ConfigError(broken[0].message)
        if t.warmup_steps > t.steps:
            raise ConfigError(
                f"training.warmup_steps={t.warmup_steps} exceeds training.steps={t.steps}: "
                "the learning rate would never reach its peak. Lower warmup_steps, or leave it "
                f"out (the default is a tenth of the steps: {default_warmup(t.steps)})."
            )
        return self

    def layout(self) -> Layout:
        """This run's layout as the estimator and the planner see it: every knob that changes
        memory or time (the keys declared with `layout=`), the dtype concrete."""
        return Layout(**{k.layout: getattr(getattr(self, k.section), k.attr)
                         for k in layout_keys()})

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step: micro_batch_size x grad_accum_steps x dp."""
        t = self.training
        return t.micro_batch_size * t.grad_accum_steps * self.parallel.dp

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# ---------------------------------------------------------------------------------------------
# What the declarations say (config_fields.py reads them).


def known_keys() -> list[str]:
    """Every key of the tree, dotted (`training.lr`, ..., `device`), in declaration order."""
    return [k.name for k in config_fields.declared(Config)]


@functools.cache
def layout_keys() -> tuple[config_fields.Key, ...]:
    """The keys that feed a `Layout` field (declared with `layout=`), in declaration order."""
    return tuple(k for k in config_fields.declared(Config) if k.layout)


def layout_sections(layout: Layout) -> dict:
    """The nested config sections that run `layout` with `ultrascale train`."""
    out: dict = {}
    for k in layout_keys():
        out.setdefault(k.section, {})[k.attr] = getattr(layout, k.layout)
    return out


def suggest_key(loc: str) -> str | None:
    """The key meant by an unknown `loc` (config_fields.suggest_key)."""
    return config_fields.suggest_key(Config, loc)


# ---------------------------------------------------------------------------------------------
# Loading: YAML + overrides, with errors turned into one readable paragraph each.


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r} has no '=': an override is one word, "
                          f"section.key=value: --set {item}=VALUE (e.g. --set training.lr=1e-3).")
    name, raw = item.split("=", 1)
    if not name.strip():
        raise ConfigError(f"--set {item!r} names no key: write --set section.key=value.")
    return name.strip().split("."), yaml.safe_load(raw) if raw.strip() else None


def build_config(data: dict | None = None, overrides: list[str] = (),
                 world_size: int | None = None, cuda: bool | None = None) -> Config:
    """Validate a nested dict plus `section.key=value` overrides into a Config, or raise ConfigError.

    world_size: the launcher's (WORLD_SIZE, or the local GPUs), which `parallel.dp: auto` divides.
    cuda: whether the run computes on CUDA, which `precision.dtype: auto` follows (None: what the
    config's `device` means on this machine).
    """
    data = json.loads(json.dumps(data or {}))  # a deep copy we may edit
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: `{part}` is not a section.")
        node[path[-1]] = value
    try:
        return Config.model_validate(data, context={"world_size": world_size, "cuda": cuda})
    except ValidationError as err:
        raise ConfigError(config_fields.explain(Config, err)) from None


def load_config(path: str | Path | None = None, overrides: list[str] = (),
                world_size: int | None = None, cuda: bool | None = None) -> Config:
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"Config file {str(path)!r} does not exist. Give the path of a YAML "
                              "file, or no file to train the default tiny model.")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"Config file {str(path)!r} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"Config file {str(path)!r} must hold a mapping of sections.")
    return build_config(data, overrides, world_size, cuda)

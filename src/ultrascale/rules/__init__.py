"""Layout rules, once: what must divide what, and what our engine runs today.

Config validation (config.py), the memory estimator, the planner's search and the engine's
pre-launch check (`parallel.support.check_supported`) all ask these functions instead of keeping
rules of their own (the pipeline executor's `validate_schedule` still guards its direct callers
with the same schedule rules). Each returns the rules a model or layout breaks, as `Violation`s
(key, value, reason, fix; violation.py), in a fixed order: callers raise the first (or all) in
their own error type. One module per subject:

- shape.py, `model_violations(model)`: the model's own shape (heads divide the width, ...);
  `expert_violations` checks a mixture of experts' own keys;
- layout.py, `layout_violations(model, layout)`: a layout against a model, whoever runs it (tp
  divides the heads and the MLP, the pipeline stages split the layers, cp and sequence parallel
  split the sequence, ep divides dp and the experts, dp_shard divides dp);
  `value_violations(layout)`: values a `Layout` can hold but no run can take (what the config's
  types already refuse);
- pipeline.py, `schedule_violations(layout, num_layers)`: what each pipeline schedule needs; and
  the one convention for stages that do not divide the layers: `layers_per_stage` (the first
  stages take the smaller shares), `split_layers` (the engine's ranges);
- precision.py, `precision_violations(precision)`: fp16 and FP8; `fp8_pays`;
  `fp8_expert_violations(model, precision)`: the routed experts in FP8;
  `fp8_swiglu_violations(precision, training)`: the FP8-cached SwiGLU against the Triton one;
- engine.py, `engine_violations(model, layout)`: what ultrascale's engine does not run yet
  (`ENGINE_GAPS`: empty today, every layout the rules accept runs).

Every public name is importable from `ultrascale.rules` itself. `model` is anything with
`ModelConfig`'s field names, `layout` anything with `Layout`'s: no torch, no pydantic, no import of
the config, so that every part of the package can ask.
"""

from __future__ import annotations

from ultrascale.rules.engine import ENGINE_GAPS, engine_violations, training_violations
from ultrascale.rules.layout import (CP_MODES, RECOMPUTE, ZERO3_GATHER, ZERO_STAGES,
                                     accumulation_for, context_violations,
                                     expert_parallel_violations, layout_violations,
                                     sequence_violations, value_violations,
                                     zero3_gathers_per_step)
from ultrascale.rules.pipeline import (SCHEDULES, layers_per_stage, pipeline_split_violations,
                                       schedule_violations, split_layers)
from ultrascale.rules.precision import (FP8_FILTERS, FP8_RECIPES, fp8_expert_violations,
                                        fp8_pays, fp8_swiglu_violations, precision_violations)
from ultrascale.rules.shape import (expert_violations, kv_heads_split,
                                    latent_attention_violations, model_violations,
                                    router_group_violations)
from ultrascale.rules.violation import Violation, divisors

__all__ = [
    "CP_MODES", "ENGINE_GAPS", "FP8_FILTERS", "FP8_RECIPES", "RECOMPUTE", "SCHEDULES",
    "ZERO3_GATHER", "ZERO_STAGES", "Violation", "accumulation_for", "context_violations",
    "divisors", "engine_violations", "expert_parallel_violations",
    "expert_violations", "fp8_expert_violations", "fp8_pays", "fp8_swiglu_violations", "kv_heads_split", "latent_attention_violations",
    "layers_per_stage", "layout_violations", "model_violations", "pipeline_split_violations",
    "precision_violations", "router_group_violations", "schedule_violations",
    "sequence_violations", "split_layers", "training_violations", "value_violations",
    "zero3_gathers_per_step",
]

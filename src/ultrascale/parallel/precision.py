"""Mixed precision (`precision.*`), the first step of `parallelize` (docs/precision.md).

`apply_precision(model, cfg.precision, device)` puts the model's parameters in the compute dtype
and returns the run's `Precision`:

- fp32: nothing changes.
- bf16 / fp16: every parameter is held in that dtype on the device, so the whole forward and
  backward compute in it (no autocast). What the playbook keeps in fp32 stays fp32: RMSNorm's
  statistics, the softmax inside attention (the SDPA kernels accumulate in fp32), the loss
  (`ops.cross_entropy` upcasts the logits), the loss and gradient-norm reductions (fp64), the
  gradient accumulation (`precision.grad_accum_dtype`: the data-parallel owner adds each fresh
  low-precision gradient into an fp32 buffer), and the weights the optimizer updates: the
  data-parallel owner keeps fp32 master weights (ZeRO shards them) and refreshes the module's
  low-precision copies from them after each step (`replicated.py`, `zero.py`).
- fp16 adds dynamic loss scaling (`LossScaler`): the loss is multiplied by the scale; the
  gradient norm's all-reduce over the world, which every rank computes anyway, tells every rank
  at once whether any gradient overflowed; then the step is skipped and the scale halved, else
  the gradients are unscaled (with the clipping coefficient) and after `loss_scale_window` clean
  steps the scale doubles.
- fp8: parameters and activations in bf16, and every linear layer of the blocks (with
  `fp8_filter=auto`, those `rules.fp8_pays` finds large enough to gain) multiplies in FP8
  (`Fp8Matmul`, swapped into `Linear.matmul`): e4m3 forward, `fp8_backward` gradients, scales by
  `fp8_recipe`, fp32 accumulation (parallel/fp8.py). The embedding, the output head, attention
  and the norms stay bf16, and so do the routed experts unless `fp8_experts` (their grouped GEMM,
  `GroupedExperts.matmul`, swapped for `Fp8GroupedMatmul`: the same recipe, expert by expert).
  `fp8_cache_activations` keeps each FP8 matmul's input for backward as its forward quantised it
  (parallel/fp8.py), and swaps every SwiGLU's `act` (the dense MLPs', the shared and the routed
  experts') for `Fp8CachedSwiGLU`, which keeps gate and up in e4m3 and recomputes the rest. `fp8_emulate` runs the exact reference instead of the device's scaled
  matmul; a recipe the device cannot run natively is refused without it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from ultrascale.config import ConfigError, PrecisionConfig
from ultrascale.models.grouped_gemm import GroupedMatmul
from ultrascale.models import ops
from ultrascale.models.llama import FeedForward, Linear, LinearMatmul, SwiGLUActivation
from ultrascale.models.moe import GroupedExperts
from ultrascale.parallel.fp8 import (
    BLOCK, Fp8Recipe, cached_swiglu, fp8_forward, fp8_grad_input, fp8_grad_weight,
    fp8_grouped_mm, fp8_linear, keep_input, kept_input,
)
from ultrascale.parallel.runtime import RuntimePart
from ultrascale.rules import FP8_RECIPES, fp8_pays, precision_violations

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                "fp8": torch.bfloat16}  # fp8: parameters and activations in bf16


class Fp8Matmul(LinearMatmul):
    """A linear layer's three matmuls in FP8 (parallel/fp8.py), by `recipe`."""

    def __init__(self, recipe: Fp8Recipe):
        super().__init__()
        self.recipe = recipe

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, weight, self.recipe)

    def grad_input(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        g = grad.reshape(-1, grad.shape[-1])
        return fp8_grad_input(g, weight, self.recipe).view(*grad.shape[:-1], -1)

    def grad_weight(self, grad2d: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
        # A dequantised cached input stays fp32 (q x scale exactly): quantised again as it is.
        x2d = x2d if x2d.dtype == torch.float32 else x2d.to(grad2d.dtype)
        return fp8_grad_weight(grad2d, x2d, self.recipe)

    def keep_input(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return keep_input(x, self.recipe)

    def kept_input(self, kept: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return kept_input(kept, self.recipe)

    def extra_repr(self) -> str:
        r = self.recipe
        how = "native" if r.native else "emulated"
        cache = ", inputs kept in e4m3" if r.cache else ""
        return f"{r.name}, e4m3 forward, {r.backward} backward, {how}{cache}"


class Fp8GroupedMatmul(GroupedMatmul):
    """The routed experts' grouped GEMM in FP8, expert by expert (parallel/fp8.py), by `recipe`
    (`precision.fp8_experts`)."""

    def __init__(self, recipe: Fp8Recipe):
        super().__init__()
        self.recipe = recipe

    def forward(self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
                impl: str = "grouped") -> torch.Tensor:
        return fp8_grouped_mm(x, weight, counts, self.recipe)

    def extra_repr(self) -> str:
        return Fp8Matmul.extra_repr(self)


class Fp8CachedSwiGLU(SwiGLUActivation):
    """The SwiGLU activation (`ops.swiglu`, the same forward bit for bit) keeping gate and up for
    backward in e4m3 with 1 x 128 tile scales, silu(gate) and the product recomputed from them in
    backward (`precision.fp8_cache_activations`; DeepSeek-V3's cached SwiGLU input, parallel/
    fp8.py). `weight` [rows]: the routing weight of each row, applied inside the product."""

    # Its backward already recomputes the product from what it keeps: selective recomputation
    # leaves it unwrapped (a checkpoint would keep gate and up in the compute dtype instead).
    recomputes_product = True

    def forward(self, gate: torch.Tensor, up: torch.Tensor,
                weight: torch.Tensor | None = None) -> torch.Tensor:
        return cached_swiglu(gate, up, weight, ops.swiglu)

    def extra_repr(self) -> str:
        return "gate and up kept in e4m3, 1 x 128 tiles"


class LossScaler(RuntimePart):
    """fp16's dynamic loss scale, a part of the runtime. Every rank holds the same state: it
    changes only on what the world-wide gradient norm says (`update`), which the scaler reads on
    the host every step (the one host sync of an fp16 step)."""

    def __init__(self, init: float, window: int, factor: float = 2.0):
        self.scale, self.window, self.factor = float(init), window, factor
        self.clean_steps = 0  # steps without overflow since the scale last changed
        self.skipped_steps = 0  # steps skipped for an overflow, over the run
        self.used = self.scale  # the scale of the last step's loss

    # -- as a runtime part --------------------------------------------------------------------
    def scale_loss(self, loss_scale: float) -> float:
        self.used = self.scale
        return loss_scale * self.scale

    def grad_factor(self) -> float:
        return self.scale

    def skip_update(self, norm: torch.Tensor) -> bool:
        return not bool(torch.isfinite(norm))

    def after_step(self, skipped: bool) -> None:
        self.update(skipped)

    def metrics(self) -> dict:
        return {"loss_scale": self.used, "skipped_steps": self.skipped_steps}

    def checkpoint_state(self) -> dict:
        return {"loss_scaler": self.state()}

    def load_checkpoint_state(self, meta: dict) -> None:
        if meta.get("loss_scaler"):  # else a fresh scale (an fp16 run resumed from bf16/fp32)
            self.load_state(meta["loss_scaler"])

    # -- the scale ----------------------------------------------------------------------------

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale /= self.factor
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps == self.window:
            self.scale *= self.factor
            self.clean_steps = 0

    def state(self) -> dict[str, float | int]:
        """For checkpoints (meta.json's `loss_scaler`, the same on every rank): a resumed run
        continues with the same scale, and doubles it when this one would have."""
        return {"scale": self.scale, "clean_steps": self.clean_steps,
                "skipped_steps": self.skipped_steps}

    def load_state(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])


@dataclass
class Precision:
    """What `apply_precision` did: the resolved compute dtype, the loss scaler (fp16) and the FP8
    recipe (fp8)."""

    dtype: str  # fp32, bf16, fp16 or fp8
    param_dtype: torch.dtype
    grad_accum_dtype: torch.dtype
    scaler: LossScaler | None = None
    fp8: Fp8Recipe | None = None


# -- FP8 on this device ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _native_runs(device_key: str, recipe: str) -> bool:
    """Whether this device's scaled matmul runs `recipe`: a small linear layer forward and
    backward through it, checked against the reference (so that a kernel that runs but reads the
    scales in another layout counts as missing)."""
    device = torch.device(device_key)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2 * BLOCK, 2 * BLOCK, generator=gen).to(device, torch.bfloat16)
    w = torch.randn(BLOCK, 2 * BLOCK, generator=gen).to(device, torch.bfloat16)
    g = torch.randn(2 * BLOCK, BLOCK, generator=gen).to(device, torch.bfloat16)
    outs = []
    for native in (True, False):
        r = Fp8Recipe(recipe, native=native)
        try:
            outs.append((fp8_forward(x, w, r), fp8_grad_input(g, w, r),
                         fp8_grad_weight(g, x, r)))
        except (RuntimeError, ValueError, NotImplementedError, TypeError, AttributeError):
            return False
    return all(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=1e-2 * b.float().abs().max())
               for a, b in zip(*outs))


def native_fp8_recipes(device: torch.device) -> tuple[str, ...]:
    """The FP8 recipes this device's scaled matmul runs (checked once per device)."""
    if not hasattr(torch, "float8_e4m3fn"):
        return ()
    key = f"cuda:{device.index or 0}" if device.type == "cuda" else device.type
    return tuple(r for r in FP8_RECIPES if _native_runs(key, r))


def fp8_recipe(precision: PrecisionConfig, device: torch.device) -> Fp8Recipe:
    """The recipe a run uses on `device`: native, emulated (asked), or refused."""
    cache = precision.fp8_cache_activations
    if precision.fp8_emulate:
        return Fp8Recipe(precision.fp8_recipe, precision.fp8_backward, native=False, cache=cache)
    native = native_fp8_recipes(device)
    broken = precision_violations(precision, native, device=_device_name(device))
    if broken:
        raise ConfigError(broken[0].message)
    return Fp8Recipe(precision.fp8_recipe, precision.fp8_backward, native=True, cache=cache)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "this CPU"


# -- the step of parallelize ----------------------------------------------------------------------


def apply_precision(model: nn.Module, precision: PrecisionConfig,
                    device: torch.device) -> Precision:
    """Put `model` (in place) in the compute dtype of `precision` on `device`; FP8 swaps the
    matmuls of every linear layer in the blocks (`Linear.matmul`)."""
    dtype = precision.dtype  # concrete: `auto` was resolved when the config was validated
    broken = precision_violations(precision)
    if broken:
        raise ConfigError(broken[0].message)
    param_dtype = TORCH_DTYPES[dtype]
    with torch.no_grad():  # parameters only: a buffer (an MoE's expert bias) stays fp32
        for p in model.parameters():
            p.data = p.data.to(param_dtype)
    fp8 = fp8_recipe(precision, device) if dtype == "fp8" else None
    if fp8 is not None:
        _swap_fp8_children(model, precision, fp8)
    scaler = None
    if dtype == "fp16":
        scaler = LossScaler(precision.loss_scale_init, precision.loss_scale_window)
    accum = torch.float32 if precision.grad_accum_dtype == "fp32" else torch.bfloat16
    return Precision(dtype, param_dtype, accum, scaler, fp8)


def _swap_fp8_children(model: nn.Module, precision: PrecisionConfig, fp8: Fp8Recipe) -> None:
    """FP8's parameterless children in the blocks (the MTP modules' too): each linear's matmul
    (those `fp8_filter` takes), the routed experts' grouped GEMM (`fp8_experts`), and with the
    cache every SwiGLU activation."""
    blocks = [model.layers] + ([model.mtp] if model.mtp is not None else [])
    for module in (m for part in blocks for m in part.modules()):  # MTP's projection too
        if isinstance(module, Linear) and (precision.fp8_filter == "all" or fp8_pays(
                module.in_features, module.out_features, precision.fp8_recipe)):
            module.matmul = Fp8Matmul(fp8)
        if isinstance(module, GroupedExperts) and precision.fp8_experts:
            module.matmul = Fp8GroupedMatmul(fp8)
        if isinstance(module, (FeedForward, GroupedExperts)) and fp8.cache \
                and type(module.act) is SwiGLUActivation:
            module.act = Fp8CachedSwiGLU()

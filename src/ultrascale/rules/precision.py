"""Precision (parallel/precision.py runs it; docs/precision.md): fp16 needs loss scaling, an FP8
recipe must be known (and run by the device, or emulated), and which linear layers FP8 speeds up."""

from __future__ import annotations

from typing import Optional, Sequence

from ultrascale.rules.violation import Violation

FP8_RECIPES = ("tensorwise", "rowwise", "blockwise")
FP8_FILTERS = ("all", "auto")
FP8_ONLY_KEYS = ("fp8_cache_activations", "fp8_experts")  # meaningless without precision.dtype=fp8
# The scaled matmul wants 16-byte rows of FP8 (a multiple of 16 along every dim it reads);
# block-wise scales want whole 1 x 128 and 128 x 128 tiles along each expert's contraction dims.
FP8_ALIGN = {"tensorwise": 16, "rowwise": 16, "blockwise": 128}


def fp8_pays(in_features: int, out_features: int, recipe: str) -> bool:
    """Whether FP8 is expected to speed up a linear layer x [tokens, in] @ W [out, in].T
    (`precision.fp8_filter=auto`; full, unsplit sizes): the contraction K = in_features and the
    output width N = out_features both multiples of 16 (the scaled matmul's alignment), and above
    torchao's thresholds, which it measured on H100s (torchao/float8 README; its auto filters):
    row-wise (and block-wise, the same per-tile work) needs K > 2048, N > 1024 and not both
    K <= 4096 and N <= 2048; tensor-wise needs K > 1024 or N > 4096. Below them the quantisation
    passes cost as much as the FP8 matmul saves."""
    k, n = in_features, out_features
    if k % 16 or n % 16:
        return False
    if recipe == "tensorwise":
        return k > 1024 or n > 4096
    return k > 2048 and n > 1024 and not (k <= 4096 and n <= 2048)


def precision_violations(precision, native_fp8: Optional[Sequence[str]] = None,
                         device: str = "this device") -> list[Violation]:
    """What no run can take in `precision` (anything with PrecisionConfig's field names): fp16
    without loss scaling, an unknown FP8 recipe; with `native_fp8` (the recipes the device's
    scaled matmul runs, parallel/precision.py `native_fp8_recipes`), an FP8 recipe the device
    lacks unless the exact reference is asked for (`fp8_emulate`)."""
    out = []
    if precision.dtype == "fp16" and precision.loss_scaling == "none":
        out.append(Violation(
            "precision.loss_scaling", "none",
            "fp16 without loss scaling loses every gradient below 6e-8 (fp16's smallest "
            "subnormal) and most below 6e-5 to underflow",
            "Set precision.loss_scaling=dynamic, or use precision.dtype=bf16 (fp32's range: no "
            "scaling needed)"))
    if precision.dtype != "fp8":
        for name in FP8_ONLY_KEYS:
            if getattr(precision, name, False):
                out.append(Violation(
                    f"precision.{name}", True,
                    f"precision.{name}=true acts on FP8 matmuls, and precision.dtype="
                    f"{precision.dtype!r} has none",
                    f"Set precision.dtype=fp8, or precision.{name}=false"))
        return out
    recipe = precision.fp8_recipe
    if recipe not in FP8_RECIPES:
        out.append(Violation("precision.fp8_recipe", recipe,
                             f"precision.fp8_recipe={recipe!r} is not an FP8 recipe",
                             f"Choose one of {', '.join(FP8_RECIPES)}"))
    elif native_fp8 is not None and recipe not in native_fp8 and not precision.fp8_emulate:
        have = (f"it runs {', '.join(native_fp8)}" if native_fp8 else
                "it has no FP8 scaled matmul at all")
        out.append(Violation(
            "precision.fp8_recipe", recipe,
            f"The scaled matmul of {device} does not run the {recipe} FP8 recipe ({have})",
            "Set precision.fp8_emulate=true to run the exact reference instead (quantise, "
            "dequantise, fp32 matmul: the same numbers, not the speed)"
            + (f", or choose precision.fp8_recipe among {', '.join(native_fp8)}"
               if native_fp8 else "")))
    return out


def fp8_expert_violations(model, precision) -> list[Violation]:
    """`precision.fp8_experts` (models/moe.py's grouped GEMMs through parallel/precision.py's
    `Fp8GroupedMatmul`): a model with routed experts, whose widths (hidden_size and the experts'
    moe_ffn_hidden_size, each a contraction dim of one of the three GEMMs) the recipe tiles whole:
    multiples of 16 (the scaled matmul's alignment), of 128 for block-wise scales (DeepSeek-V3's
    tiles; a partial tile at an expert's edge would be padding its kernels do not take).
    `precision`: the config's section, or a `Layout` (which names no recipe: the least tile,
    tensor-wise's and row-wise's)."""
    recipe = getattr(precision, "fp8_recipe", "tensorwise")
    if precision.dtype != "fp8" or not getattr(precision, "fp8_experts", False):
        return []
    if not model.num_experts:
        return [Violation("precision.fp8_experts", True,
                          "precision.fp8_experts=true but the model has no routed experts",
                          "Set precision.fp8_experts=false (the dense linears already run in "
                          "FP8 under precision.dtype=fp8)")]
    align = FP8_ALIGN.get(recipe, 16)
    widths = {"model.hidden_size": model.hidden_size,
              "model.moe_ffn_hidden_size": model.moe_ffn_hidden_size or model.ffn_hidden_size}
    out = []
    for name, width in widths.items():
        if width % align:
            fits = [r for r, a in FP8_ALIGN.items() if width % a == 0 and all(
                w % a == 0 for w in widths.values())]
            out.append(Violation(
                name, width,
                f"precision.fp8_experts=true with precision.fp8_recipe="
                f"{recipe!r} needs the experts' widths in whole tiles of {align}, "
                f"and {name}={width} is not a multiple of {align}",
                (f"Choose precision.fp8_recipe among {', '.join(fits)}, or " if fits else
                 "Choose widths that are multiples of 16, or ")
                + "set precision.fp8_experts=false (the experts then stay bf16)"))
    return out


def fp8_swiglu_violations(precision, training) -> list[Violation]:
    """Who computes the MLPs' SwiGLU. `precision.fp8_cache_activations` (under fp8) swaps every
    SwiGLU activation for one that keeps gate and up in e4m3 and recomputes the product in
    backward (parallel/precision.py `Fp8CachedSwiGLU`); `training.kernels=triton` asks for the
    Triton SwiGLU, which keeps them in bf16. Asked for both, one request would be silently
    dropped: refused. `training.kernels=auto` has the precedence: the cache's SwiGLU, Triton for
    the norms and rotary (parallel/kernels.py swaps only the reference activation)."""
    if not (precision.dtype == "fp8" and getattr(precision, "fp8_cache_activations", False)
            and getattr(training, "kernels", "auto") == "triton"):
        return []
    return [Violation(
        "training.kernels", "triton",
        "training.kernels=triton asks for the Triton SwiGLU kernel, which keeps gate and up in "
        "bf16 for backward, and precision.fp8_cache_activations=true for the SwiGLU that keeps "
        "them in e4m3 (DeepSeek-V3's cached SwiGLU input): one MLP activation cannot be both",
        "Set training.kernels=auto (the FP8-cached SwiGLU, the Triton norms and rotary on CUDA), "
        "or precision.fp8_cache_activations=false to keep the Triton SwiGLU")]

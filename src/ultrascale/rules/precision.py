"""Precision (parallel/precision.py runs it; docs/precision.md): fp16 needs loss scaling, an FP8
recipe must be known (and run by the device, or emulated), and which linear layers FP8 speeds up."""

from __future__ import annotations

from typing import Optional, Sequence

from ultrascale.rules.violation import Violation

FP8_RECIPES = ("tensorwise", "rowwise", "blockwise")
FP8_FILTERS = ("all", "auto")


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

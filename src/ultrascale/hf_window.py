"""Sliding windows in Hugging Face configs: Mistral's over every layer, Qwen's (with
`use_sliding_window`) over the layers its `layer_types` name, or `max_window_layers` (the layers
from that index on): read into `model.sliding_window` and `model.sliding_window_layers`, and
written back. Torch-free, as hf_arch.py which maps them."""

from __future__ import annotations


def sliding(hf: dict) -> int | None:
    """Mistral's window, or Qwen's where use_sliding_window turns it on (on the layers
    `window_layers` lists): None where no layer slides."""
    window, kinds = _window_kinds(hf)
    if window is None or (kinds is not None and "sliding_attention" not in kinds):
        return None
    return window


def window_layers(hf: dict) -> list[int] | None:
    """The layers a Qwen config slides its window over (`layer_types`, or `max_window_layers`:
    the layers from that index on), where some layers attend fully; None: all alike."""
    window, kinds = _window_kinds(hf)
    if window is None or kinds is None or len(set(kinds)) == 1:
        return None
    return [i for i, k in enumerate(kinds) if k == "sliding_attention"]


def _window_kinds(hf: dict) -> tuple[int | None, list[str] | None]:
    """(the window, each layer's kind: sliding_attention or full_attention, None if not said)."""
    if "use_sliding_window" in hf and not hf["use_sliding_window"]:
        return None, None
    kinds = hf.get("layer_types")
    if kinds is None and "max_window_layers" in hf and "use_sliding_window" in hf:
        first = hf["max_window_layers"]
        kinds = ["full_attention" if i < first else "sliding_attention"
                 for i in range(hf.get("num_hidden_layers", 0))]
    return hf.get("sliding_window"), kinds


def qwen_window(m) -> dict:
    """A Qwen config's window keys: the layers that slide (`layer_types`, and where they are the
    last ones, `max_window_layers`, the first of them, for transformers before 5), or none."""
    if m.sliding_window is None:
        return {"use_sliding_window": False, "sliding_window": None}
    layers = range(m.num_layers) if m.sliding_window_layers is None else m.sliding_window_layers
    kinds = ["sliding_attention" if i in layers else "full_attention"
             for i in range(m.num_layers)]
    out = {"use_sliding_window": True, "sliding_window": m.sliding_window, "layer_types": kinds}
    first = kinds.index("sliding_attention") if "sliding_attention" in kinds else m.num_layers
    if all(k == "sliding_attention" for k in kinds[first:]):
        out["max_window_layers"] = first
    return out

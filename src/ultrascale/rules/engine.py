"""What ultrascale's engine runs today, beyond the layout rules: the pipeline schedules' conditions,
then each gap. Each gap is one function; a feature that lands deletes its entry from ENGINE_GAPS
(and turns the test of its refusal into a parity test)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from ultrascale.rules.pipeline import schedule_violations
from ultrascale.rules.violation import Violation


def _sliding_window(model, lay) -> Optional[Violation]:
    """A window shorter than the sequence runs on one process, under tp, pp, recompute, compile
    and Ulysses (each rank attends over whole sequences); ring and all-gather attention's block
    plans and multi-head latent attention do not take it yet."""
    window = getattr(model, "sliding_window", None)
    if window is None or window >= lay.seq_len:
        return None
    if getattr(model, "attention", "mha") == "mla":
        return Violation("model.sliding_window", window,
                         "multi-head latent attention over a sliding window is not implemented",
                         "leave model.sliding_window unset for attention: mla", gap=True)
    if lay.cp > 1 and lay.cp_mode != "ulysses":
        return Violation("parallel.cp_mode", lay.cp_mode,
                         f"{lay.cp_mode} context parallelism over a sliding window "
                         f"(model.sliding_window={window} < training.seq_len={lay.seq_len}) is "
                         "not implemented",
                         "set parallel.cp_mode=ulysses (each rank attends over whole "
                         f"sequences), or training.seq_len <= {window}", gap=True)
    return None


ENGINE_GAPS: tuple[Callable[[Any, Any], Optional[Violation]], ...] = (_sliding_window,)


def training_violations(training) -> list[Violation]:
    """Training settings the engine does not run together yet (anything with TrainingConfig's
    field names): none today; a gap between training keys lands here, as ENGINE_GAPS' do."""
    return []


def engine_violations(model, layout) -> list[Violation]:
    """Why ultrascale's engine would refuse a layout that the layout rules accept: the first
    schedule rule it breaks (with pp > 1), then each gap of `ENGINE_GAPS`."""
    out = schedule_violations(layout, model.num_layers)[:1] if layout.pp > 1 else []
    return out + [v for gap in ENGINE_GAPS if (v := gap(model, layout)) is not None]

"""What ultrascale's engine runs today, beyond the layout rules: the pipeline schedules' conditions,
then each gap. Each gap is one function; a feature that lands deletes its entry from ENGINE_GAPS
(and turns the test of its refusal into a parity test)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from ultrascale.rules.pipeline import schedule_violations
from ultrascale.rules.violation import Violation


def _sliding_window(model, lay) -> Optional[Violation]:
    """A window shorter than the sequence runs on one process and under every layout (ring and
    all-gather cp cut their block plans to it, Ulysses attends over whole sequences); multi-head
    latent attention does not take it yet."""
    window = getattr(model, "sliding_window", None)
    if window is None or window >= lay.seq_len:
        return None
    if getattr(model, "attention", "mha") == "mla":
        return Violation("model.sliding_window", window,
                         "multi-head latent attention over a sliding window is not implemented",
                         "leave model.sliding_window unset for attention: mla", gap=True)
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

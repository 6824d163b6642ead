"""What ultrascale's engine runs today, beyond the layout rules: the pipeline schedules' conditions,
then each gap. Each gap is one function; a feature that lands deletes its entry from ENGINE_GAPS
(and turns the test of its refusal into a parity test)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from ultrascale.rules.pipeline import schedule_violations
from ultrascale.rules.violation import Violation


# Every feature the layout rules accept runs today (the last gap, multi-head latent attention over
# a sliding window, landed with ring and all-gather attention over one).
ENGINE_GAPS: tuple[Callable[[Any, Any], Optional[Violation]], ...] = ()


def training_violations(training) -> list[Violation]:
    """Training settings the engine does not run together yet (anything with TrainingConfig's
    field names): none today; a gap between training keys lands here, as ENGINE_GAPS' do."""
    return []


def engine_violations(model, layout) -> list[Violation]:
    """Why ultrascale's engine would refuse a layout that the layout rules accept: the first
    schedule rule it breaks (with pp > 1), then each gap of `ENGINE_GAPS`."""
    out = schedule_violations(layout, model.num_layers)[:1] if layout.pp > 1 else []
    return out + [v for gap in ENGINE_GAPS if (v := gap(model, layout)) is not None]

"""What every rule returns: a `Violation` (the key at fault, its value, why, and the fix), and the
divisors its fixes suggest."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Violation:
    """One broken rule: the config key at fault, its value, why it cannot be, and what to do."""

    key: str
    value: Any
    reason: str
    fix: str = ""  # empty where the reason already says what to do
    gap: bool = False  # a gap in our engine (ENGINE_GAPS), not a rule of the layout

    @property
    def message(self) -> str:
        """One paragraph, as ConfigError shows it: the reason, then the fix."""
        if self.gap:
            return f"{self.reason}; {_sentence(self.fix)}"
        return _sentence(self.reason) + (" " + _sentence(self.fix) if self.fix else "")

    def line(self) -> str:
        """`key=value: why.`, one line of the engine's refusal (`check_supported`)."""
        return f"{self.key}={self.value!r}: {self.message.rstrip('.')}."


def _sentence(text: str) -> str:
    return text if text.endswith(".") else text + "."


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]

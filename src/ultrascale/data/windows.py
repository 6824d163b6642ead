"""What a sample is once packed, and how samples become a micro-batch's inputs and targets.

A `Window` is one sample: seq_len + 1 tokens (inputs and next-token targets), where documents
begin inside it, and which tokens are trained on. `micro_batch` stacks windows into inputs,
targets (IGNORE where a target does not count) and the documents' starts, which attention and the
rotary positions follow (models/documents.py). Text (data/dataset.py) and chat data
(data/chat.py) both make windows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

IGNORE = -100  # a target that counts nothing (models/ops.py's IGNORE)
NO_BEGINS = np.zeros(0, dtype=np.int64)


@dataclass
class Window:
    """One sample: tokens [seq_len + 1] (inputs and next-token targets), where documents begin
    inside it (indices 1..seq_len: the token at that index starts one; empty without document
    masking), and which tokens are trained on as targets (None: all, else bool [seq_len + 1])."""

    tokens: np.ndarray
    begins: np.ndarray = field(default_factory=lambda: NO_BEGINS)
    counted: np.ndarray | None = None


def starts_from_begins(seq_len: int, begins: np.ndarray) -> np.ndarray:
    """[seq_len] index of each token's document's first token, given where documents begin."""
    first = np.zeros(seq_len, dtype=bool)
    first[0] = True
    first[begins[begins < seq_len]] = True
    return np.maximum.accumulate(np.where(first, np.arange(seq_len), 0))


def micro_batch(windows: list[Window]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(inputs, targets, starts) [b, seq_len] of some samples: targets IGNORE where they do not
    count (not trained on, or across a document boundary); starts (`starts_from_begins`) where
    some sample holds a document boundary, else None (one document each: plain causal)."""
    tokens = np.stack([w.tokens for w in windows]).astype(np.int64)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].copy()
    seq_len = inputs.shape[1]
    for row, w in enumerate(windows):
        if w.counted is not None:
            targets[row, ~w.counted[1:]] = IGNORE
        targets[row, w.begins - 1] = IGNORE  # the last token of a document predicts nothing
    if not any((w.begins < seq_len).any() for w in windows):
        return inputs, targets, None
    return inputs, targets, np.stack([starts_from_begins(seq_len, w.begins) for w in windows])

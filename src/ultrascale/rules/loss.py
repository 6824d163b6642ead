"""The chunked loss's chunks (`training.chunked_loss`), one rule for the engine that runs it
(models/ops.py `linear_cross_entropy`) and the estimator that counts its bytes (theory/ends.py)."""

from __future__ import annotations

LOSS_CHUNKS = 8  # chunks of the chunked loss (torchtitan's ChunkedLossWrapper takes 8 too)


def loss_chunk_tokens(tokens: int) -> int:
    """Tokens per chunk: a few large chunks (at most LOSS_CHUNKS), a power of two of at least 256
    tokens. Each chunk adds a pass over the fp32 weight-gradient sum (vocabulary x hidden) and
    re-reads the head weight, so many small chunks cost more time than the memory they save: at
    8192 tokens and a 128k vocabulary, 8 chunks hold 0.5 GB of fp32 logits at a time where the
    plain head holds 4.2 GB."""
    per_chunk = -(-tokens // LOSS_CHUNKS)
    return min(tokens, max(256, 1 << (per_chunk - 1).bit_length()))

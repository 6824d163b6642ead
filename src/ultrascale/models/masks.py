"""Attention masks: a boolean mask as the additive one kernels take, and a causal sliding
window's (`model.sliding_window`), made once per shape so that every layer's kernel takes, and
keeps for its backward, the same tensor. (Document masks, which depend on the data, are made
once per micro-batch: models/documents.py.)"""

from __future__ import annotations

import functools

import torch
from torch._guards import detect_fake_mode


@functools.lru_cache(maxsize=16)
def sequence_offsets(batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """The variable-length layout of a batch of whole sequences: [0, seq, 2 seq, ...] (int32)."""
    return torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=device)


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = attend) as the additive one kernels take: 0 or -inf (SDPA converts
    a boolean one so too, in every call)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf"))


def in_window(index: torch.Tensor, window: int) -> torch.Tensor:
    """[s, s] bool: key j is within query i's window, i - window < j (causality apart)."""
    return index[None, :] > index[:, None] - window


@functools.lru_cache(maxsize=16)
def _window_mask_cached(seq: int, window: int, dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor:
    i = torch.arange(seq, device=device)
    return additive((i[None, :] <= i[:, None]) & in_window(i, window), dtype)


@torch.compiler.disable  # one tensor for every layer and micro-batch of this shape
def window_mask(seq: int, window: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive [1, 1, seq, seq] mask of a causal sliding window (0 where query i sees key j:
    i - window < j <= i; -inf elsewhere), made once per shape: every layer's kernel takes and
    keeps the same tensor. Under fake tensors (`memory --measure`) made anew, never cached."""
    if detect_fake_mode() is not None:
        return _window_mask_cached.__wrapped__(seq, window, dtype, torch.device(device))[None, None]
    return _window_mask_cached(seq, window, dtype, torch.device(device))[None, None]

"""Document boundaries inside packed sequences (`data.document_mask`).

A packed sequence holds several documents one after another. With document masking a token
attends only to the earlier tokens of its own document, and its rotary position counts from its
document's first token. Both follow from one tensor that travels with the micro-batch:
`starts[b, i]`, the index in sequence b of the first token of token i's document. So query i sees
key j exactly when starts[b, i] <= j <= i (`mask`), and its rotary position is i - starts[b, i]
(`rotary_positions`).

`starts` always covers the whole sequence, also on a context-parallel rank that holds two chunks
of it: every rank can then tell which of another rank's keys its queries see without asking.
The CPU copy (`host`) is what plans are made from (which blocks of a ring meet, the cumulative
lengths of the variable-length kernel), so that no plan waits for a device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ultrascale.models.masks import additive, in_window


@dataclass(eq=False)
class Documents:
    """Where the documents of a micro-batch's sequences begin (see the module docstring)."""

    starts: torch.Tensor  # [b, S] int64 on the compute device
    host: torch.Tensor  # the same, on the CPU
    # FlashAttention's variable-length layout of the flattened batch: the offsets at which each
    # document begins and the total [documents + 1] (int32, device), and the longest document.
    cu_seqlens: torch.Tensor
    max_len: int
    # On a CPU the mask of whole sequences [b, 1, S, S], made once per micro-batch: every layer's
    # attention takes (and saves for its backward) this one tensor. None elsewhere (CUDA's
    # variable-length kernel needs none).
    whole_mask: torch.Tensor | None = None
    cache: dict = field(default_factory=dict, repr=False)  # plans made from `host`, by their key

    @classmethod
    def of(cls, starts: torch.Tensor | np.ndarray, device: torch.device | str = "cpu"
           ) -> "Documents":
        """From the starts [b, S] of every token's document (on any device; copied to both)."""
        host = torch.as_tensor(starts, dtype=torch.int64).cpu()
        check_starts(host)
        b, s = host.shape
        index = torch.arange(s)
        begins = (host == index).nonzero()  # (sequence, index) of each document's first token
        flat = torch.cat([begins[:, 0] * s + begins[:, 1], torch.tensor([b * s])])
        lengths = flat.diff()
        docs = cls(host.to(device), host, flat.to(torch.int32).to(device),
                   int(lengths.max()) if len(lengths) else 0)
        if torch.device(device).type == "cpu":
            docs.whole_mask = docs.mask(index, index).unsqueeze(1)
        return docs

    def additive_mask(self, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
        """The whole sequences' mask [b, 1, S, S] as attention kernels add it to the scores (0
        where a query sees a key, -inf elsewhere) in `dtype`: made once per micro-batch and
        dtype, so every layer's kernel takes, and keeps for its backward, this one tensor (a
        boolean mask is converted by each call, and each layer would keep its own). `window`: a
        query also sees only keys i - window < j <= i (a sliding window)."""
        key = ("additive_mask", dtype, window)
        if key not in self.cache:
            self.cache[key] = _additive_mask(self, dtype, window)
        return self.cache[key]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.host.shape)

    def rotary_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """The rotary positions [b, s] of the tokens at sequence indices `positions` [s]: their
        distance from their document's first token."""
        return positions[None, :] - self.starts[:, positions]

    def mask(self, q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        """[b, sq, sk] bool, True where the query at sequence index q_index[i] sees the key at
        k_index[j]: the same document, not later."""
        q, k = q_index[None, :, None], k_index[None, None, :]
        return (k <= q) & (k >= self.starts[:, q_index][:, :, None])


def check_starts(starts: torch.Tensor) -> None:
    """Refuse starts that are not a packing: each token's document starts at or before it, where
    a document starts its tokens follow it, and the first token starts one."""
    if starts.dim() != 2:
        raise ValueError(f"document starts must be [batch, seq], got {tuple(starts.shape)}")
    index = torch.arange(starts.shape[1])
    prev = torch.cat([torch.zeros_like(starts[:, :1]), starts[:, :-1]], dim=1)
    ok = (starts <= index) & (starts >= 0) & ((starts == prev) | (starts == index))
    if starts.numel() and not (bool(ok.all()) and bool((starts[:, 0] == 0).all())):
        raise ValueError("document starts must give each token the index of its document's first "
                         "token (non-decreasing, each document contiguous, the first at 0)")


@torch.compiler.disable  # made once, eagerly, whichever compiled block asks first
def _additive_mask(docs: Documents, dtype: torch.dtype, window: int | None = None
                   ) -> torch.Tensor:
    allowed = docs.whole_mask
    index = torch.arange(docs.shape[1], device=docs.starts.device)
    if allowed is None:
        allowed = docs.mask(index, index).unsqueeze(1)
    if window is not None:
        allowed = allowed & in_window(index, window)
    return additive(allowed, dtype)

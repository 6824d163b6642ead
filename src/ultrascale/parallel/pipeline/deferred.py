"""Deferred weight gradients: a backward split into I (input gradients, on the pipeline's critical
path) and W (weight gradients, run later in the schedule's bubbles), for zero_bubble and dualpipev.

`defer_weight_grads(model, store)` swaps every `Linear.matmul` (the parameterless child that holds
a linear layer's three matmuls, FP8's included) for a `DeferredMatmul` wrapping it. Within an I
pass (`store.capturing(key)`) the layers' weight-gradient work is recorded under `key` instead of
run; `store.flush(key)` (the W pass) runs it. Two callers record work:

- a plain linear (and tensor parallel's row-parallel matmul, which calls the layer's matmul on its
  weight shard): `DeferredMatmul.forward` is an autograd function that hands autograd a detached
  weight, so nothing reaches the parameter in I; its backward computes the input gradient and
  records (input, output gradient);
- tensor parallel's column-parallel matmuls (q/k/v, gate/up: parallel/tensor_layers.py), which
  compute their weight gradients in their own backward, offer that work through
  `LinearMatmul.defer_weight_grads`; under sequence parallel it includes gathering the input's
  sequence shards again, which therefore moves from I to W (the same bytes, later).

W feeds each gradient in through autograd (a backward from the weight tensor itself), so that it
accumulates like any other and the parameters' post-accumulate hooks (data parallel's bucketed
reduction) fire when the gradient is really there; a weight that reaches the matmul through a
graph (a replicated kv projection's rows, summed over tp) gets that graph's backward then too.
Norms, the embedding, the head and the experts are small or not linears: their gradients come in I.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Iterable, NamedTuple

import torch
from torch import nn

from ultrascale.memory.measure import track_held
from ultrascale.models.llama import Linear, LinearMatmul

# The work of a W pass: pairs (weight tensor, its gradient), computed one at a time.
WeightGrads = Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]]


class Deferred(NamedTuple):
    """One layer's recorded weight-gradient work."""

    weights: tuple[torch.Tensor, ...]  # what the gradients go into
    # the layer's input (under sequence parallel, this rank's shard), or what its matmul keeps of
    # it (`LinearMatmul.keep_input`: FP8's cache, the 8-bit copy and its scales)
    inputs: torch.Tensor | tuple[torch.Tensor, ...]
    grad_out: torch.Tensor | tuple[torch.Tensor, ...]  # its output gradient(s)
    compute: WeightGrads
    held: list  # the memory meter's handles on the kept tensors, if a meter runs


class WeightGradStore:
    """Weight-gradient work recorded during an I pass, keyed by (micro-batch, chunk), run in W."""

    def __init__(self) -> None:
        self._key = None
        self._pending: dict[object, list[Deferred]] = defaultdict(list)
        self._thread = threading.local()  # dualpipev's paired backward runs in a helper thread

    @property
    def split_next(self) -> bool:
        """Whether the backward of the forward running now (in this thread) will be split into I
        and W (the executor says, per action: dualpipev splits only some). A forward whose
        backward is a full B builds plain autograd, whose weight gradients need no nested
        backward."""
        return getattr(self._thread, "split_next", True)

    @split_next.setter
    def split_next(self, value: bool) -> None:
        self._thread.split_next = value

    @contextmanager
    def forward_for(self, split: bool):
        """Within this block, forwards are run for a backward that is (or is not) split."""
        before, self.split_next = self.split_next, split
        try:
            yield
        finally:
            self.split_next = before

    @contextmanager
    def capturing(self, key):
        """Within this block, deferred matmuls store their weight gradient under `key`."""
        self._key = key
        try:
            yield
        finally:
            self._key = None

    @property
    def active(self) -> bool:
        return self._key is not None

    def record(self, weights: tuple[torch.Tensor, ...],
               inputs: torch.Tensor | tuple[torch.Tensor, ...],
               grad_out: torch.Tensor | tuple[torch.Tensor, ...], compute: WeightGrads) -> bool:
        """Keep the work for the W pass of the current key; False outside an I pass (the caller
        then computes it at once)."""
        if self._key is None:
            return False
        outs = grad_out if isinstance(grad_out, tuple) else (grad_out,)
        ins = inputs if isinstance(inputs, tuple) else (inputs,)
        # A memory meter, when one runs, counts the kept tensors until W has used them.
        self._pending[self._key].append(Deferred(weights, inputs, grad_out, compute,
                                                 track_held(*ins, *outs)))
        return True

    def flush(self, key) -> None:
        """Run the weight-gradient work of `key`, one layer at a time and within a layer one
        weight at a time (only one weight gradient is ever held extra)."""
        work = self._pending.pop(key, [])
        while work:
            grads = iter(work.pop().compute())
            while True:
                with torch.no_grad():  # as in a backward: the gradients need no graph
                    pair = next(grads, None)
                if pair is None:
                    break
                torch.autograd.backward(pair[0], pair[1].to(pair[0].dtype))

    def __len__(self) -> int:
        return sum(len(v) for v in self._pending.values())


def _linear_weight_grad(matmul: LinearMatmul, inputs: torch.Tensor,
                        grad_out: torch.Tensor) -> torch.Tensor:
    # In the dtype of the backward, as autograd's own linear would (FP8: the layer's recipe).
    return matmul.grad_weight(grad_out.reshape(-1, grad_out.shape[-1]),
                              inputs.reshape(-1, inputs.shape[-1]))


class _WeightRef:
    """The weight, handed to the autograd function as a plain object: as a tensor argument it
    would get an autograd edge (and its hooks would fire, gradient-less, in I)."""

    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor):
        self.weight = weight


class _DeferredLinearFn(torch.autograd.Function):
    """y = x W^T with W given detached; the weight gradient goes to the store (or, outside an I
    pass, into the weight at once)."""

    @staticmethod
    def forward(ctx, x, detached_weight, ref, matmul):
        # What the weight gradient needs of x, as the layer keeps it (FP8's cache: 8 bits).
        ctx.save_for_backward(detached_weight, *matmul.inner.keep_input(x))
        ctx.weight, ctx.matmul = ref.weight, matmul
        return matmul.inner(x, detached_weight)  # the layer's own (FP8: its recipe)

    @staticmethod
    def backward(ctx, grad_out):
        w, *kept = ctx.saved_tensors
        inner, weight = ctx.matmul.inner, ctx.weight
        grad_in = inner.grad_input(grad_out, w)

        def weight_grads():
            yield weight, _linear_weight_grad(inner, inner.kept_input(tuple(kept)), grad_out)

        inputs = kept[0] if len(kept) == 1 else tuple(kept)
        if not ctx.matmul.store.record((weight,), inputs, grad_out, weight_grads):
            # A full backward (B, outside an I pass): no reason to defer. The gradient enters
            # through autograd as W's would (a nested backward from the weight), so that its
            # accumulation and hooks are the same whichever pass computes it.
            for w_, g in weight_grads():
                torch.autograd.backward(w_, g.to(w_.dtype))
        return grad_in, None, None, None


class DeferredMatmul(LinearMatmul):
    """A linear layer's matmuls (`inner`, the layer's own: plain or FP8) with the weight gradient
    left to the W pass. Parameterless, like what it wraps: swapping it renames nothing."""

    def __init__(self, inner: LinearMatmul, store: WeightGradStore):
        super().__init__()
        self.inner = inner
        self.store = store

    @property
    def may_defer(self) -> bool:  # asked in the forward: will its backward be split?
        return self.store.split_next

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not (x.requires_grad and weight.requires_grad and self.store.split_next):
            # No input gradient to split from, no weight gradient, or a full backward ahead:
            # plain autograd.
            return self.inner(x, weight)
        return _DeferredLinearFn.apply(x, weight.detach(), _WeightRef(weight), self)

    def grad_input(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.inner.grad_input(grad, weight)

    def grad_weight(self, grad2d: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
        return self.inner.grad_weight(grad2d, x2d)

    def keep_input(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.inner.keep_input(x)

    def kept_input(self, kept: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.inner.kept_input(kept)

    def defer_weight_grads(self, weights, inputs, grad_out, compute: WeightGrads) -> bool:
        return self.store.record(tuple(weights), inputs, grad_out, compute)


def defer_weight_grads(module: nn.Module, store: WeightGradStore) -> int:
    """Swap the matmul of every `Linear` under `module` for a DeferredMatmul; returns how many."""
    swapped = 0
    for child in module.modules():
        if isinstance(child, Linear) and not isinstance(child.matmul, DeferredMatmul):
            child.matmul = DeferredMatmul(child.matmul, store)
            swapped += 1
    return swapped

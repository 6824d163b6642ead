"""ZeRO-3: parameters sharded too, gathered one block at a time around its forward and backward.

A *unit* (one bucket) is a block: each entry of `model.layers`, the embedding, and the head (final
norm + output projection); with tied embeddings the embedding and the head share a weight, so they
form one unit. Between uses a unit holds only this rank's shard; its flat parameter keeps its
shape but its storage is resized to zero bytes (the parameters stay views of it, so autograd's
saved tensors see the data again once it is re-gathered).

    forward   pre-hook: gather the unit (waiting for a prefetch if one is in flight) and prefetch
              the next unit; post-hook: free it, and hook its output's gradient
    backward  output-gradient hook: gather the unit again, prefetch the previous one; when every
              gradient of the unit is in: free the parameters, reduce-scatter the gradients
    step      AdamW on the shards only; nothing is gathered until the next forward

The head (and a tied embedding) is used outside a module call (`F.linear(norm(x), head_weight())`),
so it is freed by the root module's post-forward hook, or, for a pipeline stage whose root forward
is not called, at the end of the step (a stage may run several backwards in a row). Traffic per
step: 2 psi all-gather + psi reduce-scatter.
Micro-batch forwards and backwards may interleave (1F1B): each hook gathers whatever is freed.
"""

from __future__ import annotations

import torch
from torch import nn

from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.parallel.buckets import Bucket, make_bucket
from ultrascale.parallel.zero import ShardedDataParallel


def plan_units(module: nn.Module, named: list[tuple[str, nn.Parameter]]) -> list[list]:
    """Group parameters by block, in forward order: [embed], layer..., [head]; a tied embedding
    joins the head, and the merged unit goes first (the embedding runs first)."""
    layers: dict[str, list] = {}
    embed, head = [], []
    for n, p in named:
        parts = n.split(".")
        if parts[0] == "layers" and len(parts) > 2:
            layers.setdefault(parts[1], []).append((n, p))
        elif parts[0] == "embed":
            embed.append((n, p))
        else:
            head.append((n, p))
    tied = getattr(module, "output", None) is None and getattr(module, "norm", None) is not None
    units = []
    if tied:
        units.append(embed + head)
    elif embed:
        units.append(embed)
    units += list(layers.values())
    if head and not tied:
        units.append(head)
    return [u for u in units if u]


class FullyShardedDataParallel(ShardedDataParallel):
    def __init__(self, module: nn.Module, ctx: ParallelContext, **kwargs):
        super().__init__(module, ctx, stage=3, **kwargs)
        self._state = {b.index: "full" for b in self.buckets}
        self._root_ran = False  # this step, the root module's forward ran (not a pipeline stage)
        self._gathering: dict[int, tuple] = {}  # index -> (work, source tensor kept alive)
        for b in self.buckets:
            self._free(b)
        self._hook_modules()

    def _plan(self, bucket_mb: float) -> list[Bucket]:
        # The unit of gathering is the block; bucket_mb does not apply.
        return [make_bucket(i, u, self.n_shard, self.accum_dtype)
                for i, u in enumerate(plan_units(self.module, self.named))]

    def _master(self, local: torch.Tensor) -> torch.Tensor:
        return local.to(torch.float32, copy=True)  # persistent: the flat parameter is freed

    # -- gather / free ------------------------------------------------------------------------
    def _start_gather(self, b: Bucket) -> None:
        if self._state[b.index] != "free":
            return
        flat = b.flat_param
        flat.untyped_storage().resize_(b.padded * flat.element_size())
        src = b.shard.to(flat.dtype, copy=True)
        work = comm.all_gather(flat, src, self.shard_dim, async_op=True, tag="param_gather")
        self._gathering[b.index] = (work, src)
        self._state[b.index] = "gathering"

    def gather(self, b: Bucket) -> None:
        self._start_gather(b)
        if self._state[b.index] == "gathering":
            self._gathering.pop(b.index)[0].wait()
            self._state[b.index] = "full"

    def _free(self, b: Bucket) -> None:
        if self._state[b.index] == "gathering":
            self.gather(b)
        if self._state[b.index] == "full":
            b.flat_param.untyped_storage().resize_(0)
            self._state[b.index] = "free"

    def _prefetch(self, b: Bucket | None) -> None:
        if b is not None:
            self._start_gather(b)

    # -- hooks --------------------------------------------------------------------------------
    def _hook_modules(self) -> None:
        """Hook each block; prefetch follows the forward order (embed, layers, head) and its
        reverse in backward."""
        m = self.module
        owner = {id(p): b for b in self.buckets for p in b.params}
        layers = [(mod, owner[id(next(mod.parameters()))])
                  for mod in (m.layers.values() if getattr(m, "layers", None) is not None else ())]
        embed, norm = getattr(m, "embed", None), getattr(m, "norm", None)
        embed_unit = owner[id(embed.weight)] if embed is not None else None
        head_unit = owner[id(norm.weight)] if norm is not None else None
        chain = [embed_unit] + [u for _, u in layers] + [head_unit]
        self._head_index = head_unit.index if head_unit is not None else None
        mods = [embed] + [mod for mod, _ in layers] + [norm]
        self._bwd_next = {}  # a tied unit's backward starts at the head: the last entry wins
        for i, (mod, u) in enumerate(zip(mods, chain)):
            if u is None:
                continue
            fwd_next = next((v for v in chain[i + 1:] if v is not None), None)
            self._bwd_next[u.index] = next((v for v in reversed(chain[:i]) if v is not None), None)
            # Layers and an untied embedding are freed after their forward; a tied embedding
            # is kept for the head, and the head is freed by the root module's post-hook.
            free_after = 0 < i < len(chain) - 1 or (i == 0 and u is not head_unit)
            mod.register_forward_pre_hook(self._pre_forward(u, fwd_next if i < len(chain) - 1
                                                            else None))
            mod.register_forward_hook(self._post_forward(u, free_after))
        m.register_forward_hook(self._root_post_forward)

    def _pre_forward(self, b: Bucket, prefetch: Bucket | None):
        def hook(module, args):
            self.gather(b)
            self._prefetch(prefetch)
        return hook

    def _post_forward(self, b: Bucket, free_after: bool):
        def hook(module, args, out):
            if free_after:
                self._free(b)
                self._hook_output(out, b)
        return hook

    def _root_post_forward(self, module, args, out):
        """The head (and a tied embedding) ran outside module calls: free it now; its backward,
        which comes first, gathers it again."""
        self._root_ran = True
        held = [b for b in self.buckets if self._state[b.index] != "free"]
        for b in held:
            self._free(b)
        if held:
            self._hook_output(out, held[-1])

    def _hook_output(self, out, b: Bucket) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: self._pre_backward(b))

    def _pre_backward(self, b: Bucket) -> None:
        self.gather(b)
        self._prefetch(self._bwd_next.get(b.index))

    def _backward_done(self, b: Bucket) -> None:
        # The head of a pipeline's last stage has no regather hook (no root forward ran to free
        # it and hook the logits): it stays gathered until finish(), or a later micro-batch's
        # backward (all-forward-all-backward) would find its weights freed.
        if b.index == self._head_index and not self._root_ran:
            return
        self._free(b)

    # -- step and state -----------------------------------------------------------------------
    def finish(self) -> None:
        super().finish()
        for b in self.buckets:  # a unit left gathered by a partial schedule, or a stage's head
            self._free(b)
        self._root_ran = False

    def _publish_params(self) -> None:
        """Nothing to gather after the step: each unit is gathered by its next forward."""
        for b in self.buckets:
            self._free(b)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        for b in self.buckets:
            self.gather(b)
        state = {n: t.detach().clone() for n, t in self.module.state_dict().items()}
        for b in self.buckets:
            self._free(b)
        return state

    def param_bytes(self) -> int:
        return sum(b.shard.numel() * b.shard.element_size()
                   + b.flat_param.untyped_storage().nbytes() for b in self.buckets)

"""DeepSeek-V3's recompute policy (`training.recompute: norms_and_mla_up`): the outputs of the
RMSNorms and of MLA's up-projections are not kept for backward; backward recomputes them from
what is kept anyway.

What a layer keeps for backward is whatever autograd saves. Here, while a block's forward runs,
`saved_tensors_hooks` look at each tensor autograd saves: one that a recomputable step made (it
was `mark`ed) is saved as its recipe (the step and its inputs) instead, and its first unpacking
in backward reruns the step under no_grad (once per step, shared by every tensor saved from its
outputs; views of an output are rebuilt with their own strides). The recipes' inputs are
tensors kept anyway, so the saving is the outputs' bytes:

- each RMSNorm (`RMSNorm.kernel` swapped for `RecipeNormKernel`): its own computation runs under
  a checkpoint (only its input, which the layer before keeps, and its weight are saved), and its
  output, which the next linear layer (or the router, the attention projections) saves as its
  input, becomes a recipe;
- MLA's expansion (`LatentAttention.expansion` swapped for `RecipeExpansion`): the queries, keys
  and (zero-padded) values the attention core saves become the recipe of the latents' norms and
  the up-projections, from the down-projections' outputs (which the latents' norms keep);
- under `precision.fp8_cache_activations`, each SwiGLU (FP8's cached one swapped for
  `RecipeCachedSwiGLU`): its product, the down projection's input, becomes the recipe of the
  SwiGLU on its gate and up's 8-bit copies, which it keeps anyway (DeepSeek-V3's 3.3.2: the
  SwiGLU's input cached, its output recomputed in backward).

No matmul of the forward runs twice except the up-projections; the attention core is not
recomputed. (The SwiGLU's rebuilt product differs from the forward's by the 8-bit rounding of
gate and up: the down projection's weight gradient takes it, as DeepSeek-V3's does.) A block is
rebased onto `RecipeBlock`, whose forward holds the hooks; its norms, expansion and SwiGLUs share
its `Recipes`. What is not made by a marked step (the attention output, the experts' rows, the
MLP's products without the FP8 cache) is saved as before.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ultrascale.models import ops
from ultrascale.models.llama import Block, FeedForward, RMSNorm
from ultrascale.models.mla import Expansion, LatentAttention
from ultrascale.models.moe import GroupedExperts
from ultrascale.models.ops import Rope
from ultrascale.parallel.fp8 import cached_swiglu
from ultrascale.parallel.precision import Fp8CachedSwiGLU
from ultrascale.parallel.seams import Checkpointed, rebase
from ultrascale.parallel.flat import storage_key


class _Recipe:
    """A step and its inputs; its outputs, recomputed once on first use."""

    def __init__(self, fn, args: tuple):
        self.fn, self.args = fn, args
        self.outputs: tuple | None = None

    def output(self, index: int) -> torch.Tensor:
        if self.outputs is None:
            with torch.no_grad():
                out = self.fn(*self.args)
            self.outputs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        return self.outputs[index]


class _Packed:
    """A saved tensor as (recipe, output index, its view of that output)."""

    def __init__(self, recipe: _Recipe, index: int, t: torch.Tensor):
        self.recipe, self.index = recipe, index
        self.view = (t.size(), t.stride(), t.storage_offset())

    def unpack(self) -> torch.Tensor:
        out = self.recipe.output(self.index)
        size, stride, offset = self.view
        if (out.size(), out.stride(), out.storage_offset()) == (size, stride, offset):
            return out
        return out.as_strided(size, stride, offset)


def _owns_storage(t: torch.Tensor) -> bool:
    """A tensor whose storage is its own, from its start (a fresh result): every tensor sharing
    that storage is a view of it, which its recipe rebuilds."""
    return t.numel() > 0 and t.storage_offset() == 0 and \
        t.untyped_storage().nbytes() == t.numel() * t.element_size()


class Recipes:
    """The marked outputs of one block's forward, by storage, while it runs. The outputs are
    held until the forward ends, so that no other tensor takes their memory (and their storage's
    address, the key) meanwhile."""

    def __init__(self):
        self.marked: dict[int, tuple[_Recipe, int, torch.Tensor]] = {}
        self.on = False

    def mark(self, outputs, fn, args: tuple) -> None:
        """`outputs` (a tensor or several) of fn(*args): saved as its recipe from now on."""
        if not self.on or not torch.is_grad_enabled():
            return
        recipe = _Recipe(fn, args)
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        for i, t in enumerate(outputs):
            if isinstance(t, torch.Tensor) and _owns_storage(t):
                self.marked[storage_key(t)] = (recipe, i, t)
                # Told to the FP8 linears that read it (parallel/fp8.py `cached_input`): kept as
                # its recipe, it costs nothing, less than an 8-bit copy.
                t.kept_as_recipe = True

    @contextmanager
    def active(self):
        """Within: marked outputs are saved as recipes, the other tensors as the hooks around
        (a memory meter's, if one runs) save them."""
        self.on = True
        outer = _hooks_around()

        def pack(t: torch.Tensor):
            hit = self.marked.get(storage_key(t)) \
                if t.layout == torch.strided else None
            if hit is not None:
                return _Packed(hit[0], hit[1], t)
            return t if outer is None else _Outer(outer[0](t))

        def unpack(p):
            if isinstance(p, _Packed):
                return p.unpack()
            return p if outer is None else outer[1](p.packed)

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield
        finally:
            self.on = False
            self.marked.clear()


def _hooks_around():
    """The saved-tensor hooks active around this point (pack, unpack), or None: what a nested
    pair hands the tensors it does not take. torch keeps only the innermost pair active, and
    tells the pair below through this (private) call; without it, a meter around would not see
    the block's tensors (nothing else changes)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


class _Outer:
    """What the hooks around made of a saved tensor."""

    __slots__ = ("packed",)

    def __init__(self, packed):
        self.packed = packed


class RecipeNormKernel(nn.Module):
    """An RMSNorm's kernel run under a checkpoint, its output marked (parameterless)."""

    def __init__(self, kernel: nn.Module, recipes: Recipes):
        super().__init__()
        self.kernel = Checkpointed(kernel)
        self.recipes = recipes

    @torch.compiler.disable  # marks what the hooks see: never traced
    def forward(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y = self.kernel(x, weight, eps)
        self.recipes.mark(y, self.kernel.wrapped, (x, weight, eps))
        return y


class RecipeExpansion(Expansion):
    """MLA's expansion with its q, k, v marked (parameterless)."""

    def __init__(self, recipes: Recipes):
        super().__init__()
        self.recipes = recipes

    @torch.compiler.disable  # marks what the hooks see: never traced
    def forward(self, expand, *latents):
        out = expand(*latents)
        self.recipes.mark(out, expand, latents)
        return out


class RecipeCachedSwiGLU(Fp8CachedSwiGLU):
    """FP8's cached SwiGLU with its product marked (parameterless)."""

    def __init__(self, recipes: Recipes):
        super().__init__()
        self.recipes = recipes

    @torch.compiler.disable  # marks what the hooks see: never traced
    def forward(self, gate: torch.Tensor, up: torch.Tensor,
                weight: torch.Tensor | None = None) -> torch.Tensor:
        return cached_swiglu(gate, up, weight, ops.swiglu, mark=self.recipes.mark)

    def extra_repr(self) -> str:
        return super().extra_repr() + "; the product kept as its recipe"


class RecipeBlock(Block):
    """A block whose forward saves its marked outputs as recipes (`recipes` set by rebase).
    `training.compile` compiles `block_forward` alone (parallel/compile.py): the hooks are set
    outside the graph, the marking steps run eagerly between its pieces (each is
    `torch.compiler.disable`d), and the tensors a graph saves pass through the hooks as any
    other, so a marked one is kept as its recipe there too."""

    recipes: Recipes

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        with self.recipes.active():
            return self.block_forward(x, rope)

    def block_forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        return Block.forward(self, x, rope)


def apply_norms_and_mla_up(model: nn.Module) -> None:
    """Rebase every block of `model` (the MTP modules' too) onto `RecipeBlock`, its norms'
    kernels, MLA's expansion and FP8's cached SwiGLUs (precision runs first) swapped for the
    marking ones."""
    for _, holder, attr in model.block_slots():
        block = getattr(holder, attr)
        recipes = Recipes()
        for module in block.modules():
            if isinstance(module, RMSNorm):
                module.kernel = RecipeNormKernel(module.kernel, recipes)
            elif isinstance(module, LatentAttention):
                module.expansion = RecipeExpansion(recipes)
            elif isinstance(module, (FeedForward, GroupedExperts)) \
                    and type(module.act) is Fp8CachedSwiGLU:
                module.act = RecipeCachedSwiGLU(recipes)
        setattr(holder, attr, rebase(block, RecipeBlock, recipes=recipes))

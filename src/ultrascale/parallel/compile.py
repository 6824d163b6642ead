"""Regional compilation (`training.compile`): each transformer block's forward goes through
`torch.compile`, as torchtitan compiles per block rather than the whole model.

`compile_blocks(model)` rebases every block of `model.layers` onto a subclass of its own class
(`Block`, whatever a strategy made of it) whose forward calls the compiled forward of that
class (full recompute's `CheckpointedBlock`: its eager checkpoint around the compiled `Block`,
below). The block keeps its parameters, names and children, and
its module hooks stay outside the compiled code: ZeRO-3 gathers and frees a block in its hooks,
around the compiled forward. Blocks of one class share one compiled function; with PyTorch's
inlining of nn modules, layers of one shape share one graph (their parameters are its inputs).
Collectives inside a block (tensor parallel's autograd functions, which count their bytes through
`distributed/comm.py`) are not traced: dynamo breaks the graph around them and runs them eagerly.

A mixture-of-experts block compiles around its data-dependent part: each MoE is rebased onto a
subclass whose `routed` (token sorting, expert parallel's exchanges and split sizes, the grouped
GEMM of groups whose sizes change every step) is `torch.compiler.disable`d. Dynamo breaks the
graph there, so the attention, the norms, the router and the shared experts compile to graphs of
fixed shapes while the routed experts run eagerly.

Under full recomputation a block's forward is a checkpoint of the plain block's; dynamo cannot
trace a checkpoint whose body breaks the graph (an MoE's routed experts, tensor parallel's
collectives, context parallel's core), and falls back to running the whole block eagerly: with
tp2 no graph was compiled at all. So every block keeps its checkpoint eager around the compiled
plain forward (the class `checkpoint_around_compiled` makes), which the checkpoint replays in
backward.

The plain loss (`Llama.criterion`: the head's matmul and the cross-entropy, which upcasts the
logits to fp32 inside) is compiled the same way, as torchtitan compiles its loss apart from the
blocks: inductor fuses the upcast, log-softmax and nll over the bf16 logits, so neither fp32 logits
nor their zero-filled gradient exist in memory. The chunked and the vocabulary-parallel losses
stay eager (they loop over chunks, or call collectives).

It runs after every strategy that changes blocks (tensor, context, expert parallel, the pipeline
split) and before the data-parallel owner hooks the blocks. `training.compile_cache` names
inductor's cache folder (TORCHINDUCTOR_CACHE_DIR, process-wide, as torch reads it).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ultrascale.models.llama import Block, LanguageModelLoss
from ultrascale.models.mla import LatentAttention
from ultrascale.models.moe import MoE
from ultrascale.parallel.recipes import RecipeBlock
from ultrascale.parallel.recompute import CheckpointedBlock
from ultrascale.parallel.seams import rebase

_COMPILED: dict[type, type] = {}  # a block class -> its compiled-forward subclass
_EAGER: dict[str, dict[type, type]] = {}  # method -> (class -> its subclass leaving it eager)
_COMPILED_INSIDE: dict[str, type] = {}  # checkpointing classes around a compiled forward


def compiled_class(cls: type) -> type:
    """The subclass of `cls` whose forward is `torch.compile(cls.forward)` (made once per class)."""
    if cls not in _COMPILED:
        if issubclass(cls, tuple(_COMPILED.values())):
            return cls  # already compiled
        run = torch.compile(cls.forward, dynamic=False)

        def forward(self, *args, **kwargs):
            return run(self, *args, **kwargs)

        _COMPILED[cls] = type(f"Compiled{cls.__name__}", (cls,), {
            "forward": forward, "__module__": __name__,
            "__doc__": f"{cls.__name__} with its forward compiled (regional compilation)."})
    return _COMPILED[cls]


def _eager_method_class(cls: type, method: str, prefix: str, doc: str) -> type:
    """The subclass of `cls` whose `method` dynamo never traces (made once per class and method)."""
    made = _EAGER.setdefault(method, {})
    if cls not in made:
        if issubclass(cls, tuple(made.values())):
            return cls
        made[cls] = type(f"{prefix}{cls.__name__}", (cls,), {
            method: torch.compiler.disable(getattr(cls, method)), "__module__": __name__,
            "__doc__": f"{cls.__name__} {doc}"})
    return made[cls]


def eager_routed_class(cls: type) -> type:
    """The subclass of an MoE class whose `routed` dynamo never traces."""
    return _eager_method_class(cls, "routed", "EagerRouted",
                               "whose routed experts run eagerly in a compiled block.")


def eager_forward_class(cls: type) -> type:
    """The subclass of a module class whose forward dynamo never traces."""
    return _eager_method_class(cls, "forward", "Eager", "run eagerly in a compiled block.")


def checkpoint_around_compiled(cls: type) -> type:
    """A subclass of a checkpointing block class whose checkpoint (eager) runs the compiled
    forward of the plain block: its MRO puts the compiled `Block` right after `cls`."""
    name = f"{cls.__name__}AroundCompiled"
    if name not in _COMPILED_INSIDE:
        _COMPILED_INSIDE[name] = type(name, (cls, compiled_class(Block)), {
            "__module__": __name__,
            "__doc__": f"{cls.__name__} checkpointing the compiled forward of the plain block."})
    return _COMPILED_INSIDE[name]


def _compile_recipe_block(block: RecipeBlock) -> RecipeBlock:
    """DeepSeek's policy under compile: the block's graphs run inside its hooks, and MLA's
    attention core eagerly, so that the core keeps the very q, k, v the expansion marked (a graph
    would save its own layout of them, which no recipe describes)."""
    for module in block.modules():
        if isinstance(module, LatentAttention):
            module.inner = rebase(module.inner, eager_forward_class(type(module.inner)))
    return rebase(block, compiled_recipe_class(type(block)))


def compiled_recipe_class(cls: type) -> type:
    """The subclass of a `RecipeBlock` class whose `block_forward` (the plain block's, inside its
    saved-tensor hooks) is compiled (made once per class)."""
    if cls not in _COMPILED:
        run = torch.compile(cls.block_forward, dynamic=False)

        def block_forward(self, x, rope):
            return run(self, x, rope)

        _COMPILED[cls] = type(f"Compiled{cls.__name__}", (cls,), {
            "block_forward": block_forward, "__module__": __name__,
            "__doc__": f"{cls.__name__} compiled inside its recipes' hooks."})
    return _COMPILED[cls]


def compile_blocks(model: nn.Module, cache_dir: str | None = None) -> int:
    """Rebase every block of `model` (the MTP modules' too) onto its compiled-forward subclass (an
    MoE inside it onto its eager-routed one first), and the plain loss onto its own; returns how
    many blocks."""
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(cache_dir)
    slots = model.block_slots()  # the layers and the MTP modules' blocks
    for _, holder, attr in slots:
        block = getattr(holder, attr)
        if isinstance(block.mlp, MoE):
            block.mlp = rebase(block.mlp, eager_routed_class(type(block.mlp)))
        if isinstance(block, CheckpointedBlock):
            setattr(holder, attr, rebase(block, checkpoint_around_compiled(type(block))))
            continue
        if isinstance(block, RecipeBlock):
            setattr(holder, attr, _compile_recipe_block(block))
            continue
        setattr(holder, attr, rebase(block, compiled_class(type(block))))
    if type(getattr(model, "criterion", None)) is LanguageModelLoss:
        model.criterion = rebase(model.criterion, compiled_class(LanguageModelLoss))
    return len(slots)

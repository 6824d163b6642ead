"""How a strategy changes a module of the plain model without patching it.

- `rebase(module, Subclass, **attrs)`: a new instance of a subclass that overrides some methods,
  holding the very same parameters, buffers and children (so every parameter name, the optimizer
  state and the name-seeded initialisation are unchanged). Tensor parallel rebases attention and
  feed-forward onto classes that override `project` and `out`; full recomputation rebases blocks.
- `Checkpointed(child)`: a parameterless child run again in backward instead of saving its
  activations (selective recomputation swaps `inner` and `act` for it).
- `inner_of(module)`: the attention core behind such wrappers, for a strategy that swaps the core;
  `replace_inner(module, name, new)` swaps it there, keeping the wrappers.
"""

from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint

_MODULE_STATE = set(vars(nn.Module()))  # what nn.Module.__init__ sets on every instance


def rebase(module: nn.Module, cls: type, **attrs) -> nn.Module:
    """An instance of `cls` (a subclass of the module's class) sharing the module's parameters,
    buffers, children and plain attributes, with `attrs` set on top."""
    if not issubclass(cls, type(module)):
        raise TypeError(f"{cls.__name__} must subclass {type(module).__name__} to take its place")
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    for key, value in vars(module).items():
        if key not in _MODULE_STATE:
            object.__setattr__(new, key, value)
    new._parameters.update(module._parameters)
    new._buffers.update(module._buffers)
    new._non_persistent_buffers_set.update(module._non_persistent_buffers_set)
    new._modules.update(module._modules)
    for key, value in attrs.items():
        setattr(new, key, value)
    return new.train(module.training)


class Checkpointed(nn.Module):
    """Runs a parameterless child under activation checkpointing (non-reentrant): only its inputs
    are saved, and it runs again in backward."""

    def __init__(self, wrapped: nn.Module):
        super().__init__()
        if any(True for _ in wrapped.parameters()):
            raise ValueError("Checkpointed wraps parameterless children only (parameter names "
                             "would change); rebase a module onto a checkpointing subclass instead")
        self.wrapped = wrapped

    def forward(self, *args):
        return checkpoint(self.wrapped, *args, use_reentrant=False)


def inner_of(module: nn.Module) -> nn.Module:
    """The module behind any `Checkpointed` wrappers."""
    while isinstance(module, Checkpointed):
        module = module.wrapped
    return module


def replace_inner(module: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` in place of the child `name` of `module`, or of the module behind its
    `Checkpointed` wrappers (context parallel swaps the attention core under selective
    recomputation's checkpoint, which then reruns the new core). A core's sliding window
    (`CausalAttention.window`) passes to the new one."""
    holder, attr = module, name
    while isinstance(getattr(holder, attr), Checkpointed):
        holder, attr = getattr(holder, attr), "wrapped"
    if getattr(getattr(holder, attr), "window", None) is not None:
        new.window = getattr(holder, attr).window
    setattr(holder, attr, new)

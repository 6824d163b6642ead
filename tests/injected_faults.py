"""Faults injected inside the ranks, to show that a parity check sits below the effect it must
detect (tests/test_injected_faults.py): each makes the parity checks of the layouts it touches
fail.

- `grad_summed_twice`: the data-parallel gradient reduction runs twice (every bucket all-reduced,
  or reduced before its reduce-scatter, once more): each gradient is dp times too large.
- `stage_grads_doubled`: the first pipeline stage's gradients doubled before the reduction.
- `all_to_all_off`: what rank 1 hands to every all-to-all is 1e-3 too large (the expert dispatch
  and combine, Ulysses' exchanges, Muon's).

Each is a monkeypatch of the module attribute the engine calls through (comm.*, Runtime.*), undone
when the case ends.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest

ALL_TO_ALL_ERROR = 1e-3


def _grad_summed_twice(mp: pytest.MonkeyPatch) -> None:
    from ultrascale.distributed import comm

    all_reduce, reduce_scatter = comm.all_reduce, comm.reduce_scatter

    def twice(tensor, dim, *args, tag="", **kwargs):
        if tag == "grad_bucket":
            all_reduce(tensor, dim, tag=tag)
        return all_reduce(tensor, dim, *args, tag=tag, **kwargs)

    def reduced_first(output, input, dim, *args, tag="", **kwargs):
        if tag == "grad_bucket":
            all_reduce(input, dim, tag=tag)
        return reduce_scatter(output, input, dim, *args, tag=tag, **kwargs)

    mp.setattr(comm, "all_reduce", twice)
    mp.setattr(comm, "reduce_scatter", reduced_first)


def _stage_grads_doubled(mp: pytest.MonkeyPatch) -> None:
    import torch

    from ultrascale.parallel.runtime import Runtime

    finish = Runtime.finish_gradients

    def doubled(self):
        if self.ctx.size("pp") > 1 and self.ctx.coord("pp") == 0:
            with torch.no_grad():
                for name, p in self.named_parameters():
                    self.data_parallel.accumulated_grad(name, p).mul_(2.0)
        return finish(self)

    mp.setattr(Runtime, "finish_gradients", doubled)


def _all_to_all_off(mp: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from ultrascale.distributed import comm

    all_to_all = comm.all_to_all

    def off(output, input, dim, *args, **kwargs):
        if dist.get_rank() == 1 and input.is_floating_point():
            input = input * (1.0 + ALL_TO_ALL_ERROR)
        return all_to_all(output, input, dim, *args, **kwargs)

    mp.setattr(comm, "all_to_all", off)


FAULTS = {"grad_summed_twice": _grad_summed_twice, "stage_grads_doubled": _stage_grads_doubled,
          "all_to_all_off": _all_to_all_off}


@contextmanager
def injected(fault: str | None):
    """The named fault in force (None: none) until the block ends."""
    with pytest.MonkeyPatch.context() as mp:
        if fault is not None:
            FAULTS[fault](mp)
        yield

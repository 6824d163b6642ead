"""Two computations on one rank that take turns, each handing over to the other while its own
communication is in flight: DualPipe's overlap of one micro-batch's forward with another's
backward, where each chunk's expert all-to-alls run under the other chunk's compute.

    Turns().run(forward, backward)     # forward in this thread, backward in a helper thread

Exactly one of the two runs at any time (they would only fight over the same cores): `forward`
starts; when the running one reaches `wait(work)` on a launched collective, it hands the turn to
the other and takes it back when that one reaches its own `wait`; once either has finished, the
other runs alone. Which collective each issues, and in what order, is therefore fixed by the code
alone, identical on every rank of the group, as collectives over one process group need (they
match in issue order). Outside `Turns.run`, `wait(work)` is `work.wait()`.

On the CPU, gloo moves the bytes in its own threads while the other chunk computes (tested on
gloo only); torchtitan's DualPipeV overlap for GPUs has the same shape, two threads meeting at
the all-to-alls.

A new thread starts outside the dispatch modes the caller runs under (`memory --measure`'s fake
tensors and allocation tracker, `logging.measure_memory`'s tracker): the helper enters the
caller's before its computation, so both sides allocate, and are counted, alike.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

from torch.utils._python_dispatch import (
    TorchDispatchMode, _get_current_dispatch_mode_stack, _pop_mode, _push_mode)

T = TypeVar("T")

_current = threading.local()  # .turns, .side: the Turns this thread runs under, and its side


class Turns:
    """One pairing of two computations (see the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._turn = 0  # the side that may run: 0 the caller's (first), 1 the helper's
        self._done = [False, False]
        self.handovers = 0  # how often the turn passed while the other still had work

    def run(self, first: Callable[[], T], second: Callable[[], object]) -> T:
        """Run both to completion, taking turns; returns what `first` returned. An exception in
        either is raised here (in `first`, at once: the helper is left to the process's end, as
        its peers are then stuck too)."""
        errors: list[BaseException] = []
        modes = _get_current_dispatch_mode_stack()

        def helper() -> None:
            try:
                with _under(modes):
                    self._side(1, second)
            except BaseException as e:  # raised in the caller after join
                errors.append(e)

        thread = threading.Thread(target=helper, name="overlap-backward", daemon=True)
        thread.start()
        result = self._side(0, first)
        thread.join()
        if errors:
            raise errors[0]
        return result

    def _side(self, me: int, fn: Callable[[], T]) -> T:
        _current.turns, _current.side = self, me
        try:
            with self._cond:
                self._cond.wait_for(lambda: self._turn == me)
            return fn()
        finally:
            _current.turns = None
            with self._cond:
                self._done[me] = True
                self._turn = 1 - me
                self._cond.notify_all()

    def hand_over(self, me: int) -> None:
        """Let the other side run until it hands back (or finishes); at once if it has finished."""
        with self._cond:
            if self._done[1 - me]:
                return
            self.handovers += 1
            self._turn = 1 - me
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._turn == me)


@contextmanager
def _under(modes: list[TorchDispatchMode]) -> Iterator[None]:
    """This thread runs under `modes` (another thread's stack, bottom first) while within. Pushed
    as they are, not entered: entering would run a mode's own set-up (a tracker's reset) again."""
    for mode in modes:
        _push_mode(mode)
    try:
        yield
    finally:
        for mode in reversed(modes):  # fake tensors' mode by its key, the others from the top
            _pop_mode(getattr(mode, "_mode_key", None))


def wait(work) -> None:
    """Wait for a launched collective; under `Turns.run`, the other computation runs meanwhile."""
    turns = getattr(_current, "turns", None)
    if turns is not None:
        turns.hand_over(_current.side)
    work.wait()

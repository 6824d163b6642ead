"""Run a pipeline schedule: this rank's action list, with batched asynchronous point-to-point.

The program comes from `schedules.add_communication`: compute actions (F, B, I, W) with the
transfers next to them. Each run of adjacent transfers is posted as one `comm.batch_p2p` (which
counts the bytes). A receive is waited for only just before the compute that consumes it. A send
is waited for (and its buffer let go) once it has surely arrived: when this rank receives a
message that the peer sent after the compute that consumed ours (`PipelineExecutor.plan` reads it
off the peer's program), else at the end of the step. So a rank blocks only where the schedule's
dependencies make it wait, `schedules.check_program` has proved those acyclic (no deadlock), and
a stage holds about as many sent activations and gradients as it has micro-batches in flight, not
one per micro-batch of the step.

Matching: a backend pairs the sends from rank a to rank b with the receives b posts from a in
order (gloo per tag, NCCL always). b therefore posts its receives from a in the order a sends
them, which it knows because a's program is data: when b needs a message, it first posts any
earlier messages from a that are still unposted (their buffers wait, filled, until used).

Tested on gloo, where the two directions between a pair progress independently. NCCL also runs
the sends and receives of a pair on one stream in posting order, so it additionally needs both
directions interleaved the same way on both sides; that is not checked here yet.

Neighbouring stages on this rank (dualpipev's V turns on the last rank) hand the activation and
its gradient over in memory. A forward the schedule pairs with the next backward (dualpipev) runs
together with it: both inputs are taken first, both outputs posted after; where `overlap_pairs` is
set (a mixture of experts over ep ranks) the backward runs in a helper thread that takes turns
with the forward at each all-to-all (parallel/overlap.py), so each one's exchanges travel while the
other computes.
"""

from __future__ import annotations

from collections import deque
from contextlib import nullcontext
from typing import Callable

import torch

from ultrascale.distributed import comm
from ultrascale.parallel.overlap import Turns
from ultrascale.parallel.pipeline.schedules import (
    SPLIT_BACKWARD, Action, add_communication, build_schedule, check_program, owner_of, peer_of,
    placement_of, stage_of,
)
from ultrascale.parallel.pipeline.stage import StageChunk, WeightGradStore
from ultrascale.parallel.runtime import MicroBatch

# A transfer: ("F" activation | "B" gradient, micro-batch, virtual stage it is addressed to).
Message = tuple[str, int, int]


def message_of(rank: int, action: Action, pp: int, placement: str = "loop") -> Message:
    stage = stage_of(rank, action.chunk, pp, placement)
    if action.kind == "SEND_F":
        return ("F", action.microbatch, stage + 1)
    if action.kind == "SEND_B":
        return ("B", action.microbatch, stage - 1)
    return (action.kind[-1], action.microbatch, stage)  # RECV_F / RECV_B: addressed to us


def p2p_bytes_per_step(pp: int, v: int, m: int, pp_rank: int, activation_bytes: int,
                       placement: str = "loop") -> int:
    """Bytes this rank sends in one step: an activation out of each of its chunks but the last
    stage, a gradient out of each but the first, for every micro-batch; none to a neighbouring
    stage on this rank (dualpipev's turn)."""
    last = pp * v - 1
    outgoing = 0
    for c in range(v):
        stage = stage_of(pp_rank, c, pp, placement)
        outgoing += sum(0 <= other <= last and owner_of(other, pp, placement)[0] != pp_rank
                        for other in (stage - 1, stage + 1))
    return outgoing * m * activation_bytes


class PipelineExecutor:
    def __init__(self, chunks: list[StageChunk], schedule: str, pp: int, pp_rank: int,
                 peers: list[int], hidden_size: int, dtype: torch.dtype,
                 autocast: Callable = nullcontext, weight_store: WeightGradStore | None = None,
                 seq_shards: int = 1, overlap_pairs: bool = False):
        self.chunks, self.schedule, self.pp, self.rank = chunks, schedule, pp, pp_rank
        self.v = len(chunks)
        self.placement = placement_of(schedule)
        self.peers = peers  # global rank of each pipeline index
        self.hidden_size, self.dtype = hidden_size, dtype
        # Under sequence parallel, stages exchange 1/tp of the sequence (each tp rank its shard).
        self.seq_shards = seq_shards
        self.autocast = autocast
        if schedule in SPLIT_BACKWARD and weight_store is None:
            raise ValueError(f"The {schedule} schedule needs a WeightGradStore (the linears' "
                             "matmuls swapped by deferred.defer_weight_grads) to split I from W.")
        self.store = weight_store
        # Paired forward and backward take turns at each all-to-all (a mixture of experts over
        # ep ranks); otherwise they run one after the other.
        self.overlap_pairs = overlap_pairs
        self.handovers = 0  # turns passed between paired chunks over the executor's life (tests)
        self._plans: dict[int, tuple[list[Action], dict[int, list[Message]],
                                     dict[Message, list[Message]]]] = {}

    def plan(self, m: int) -> tuple[list[Action], dict[int, list[Message]],
                                    dict[Message, list[Message]]]:
        """This rank's program for m micro-batches, what each peer sends it (in send order), and
        for a message it receives, which of its own sends have surely arrived once that one has."""
        if m not in self._plans:
            pp, where = self.pp, self.placement
            compute = build_schedule(self.schedule, pp, m, self.v)
            check_program(compute, pp, m, self.v, where)  # complete and deadlock-free, or raise
            programs = add_communication(compute, pp, self.v, where)
            incoming: dict[int, list[Message]] = {}
            for q, prog in enumerate(programs):
                for a in prog:
                    if a.kind.startswith("SEND") and peer_of(q, a, pp, where)[0] == self.rank:
                        incoming.setdefault(q, []).append(message_of(q, a, pp, where))
            self._plans[m] = (programs[self.rank], incoming, self._releases(programs))
        return self._plans[m]

    def _releases(self, programs: list[list[Action]]) -> dict[Message, list[Message]]:
        """For each of our sends, the first message its peer sends us after the compute that
        consumed it: once that message is here, the peer had our send, so waiting on the send
        returns at once and its buffer can go."""
        out: dict[Message, list[Message]] = {}
        pp, where = self.pp, self.placement
        for a in programs[self.rank]:
            if not a.kind.startswith("SEND"):
                continue
            sent = message_of(self.rank, a, pp, where)
            q = peer_of(self.rank, a, pp, where)[0]
            consumers = ("F",) if sent[0] == "F" else ("B", "I")
            prog = programs[q]
            used = next(i for i, b in enumerate(prog)
                        if b.kind in consumers and b.microbatch == sent[1]
                        and stage_of(q, b.chunk, pp, where) == sent[2])
            after = next((b for b in prog[used + 1:] if b.kind.startswith("SEND")
                          and peer_of(q, b, pp, where)[0] == self.rank), None)
            if after is not None:
                out.setdefault(message_of(q, after, pp, where), []).append(sent)
        return out

    def is_local(self, stage: int) -> bool:
        """Whether virtual stage `stage` is one of this rank's chunks."""
        return owner_of(stage, self.pp, self.placement)[0] == self.rank

    def run(self, micro_batches: list[MicroBatch], loss_scale: float,
            backward_context: Callable[[bool], object] = lambda last: nullcontext()
            ) -> torch.Tensor:
        """Forward and backward every micro-batch through this rank's chunks; returns the summed
        token loss of the micro-batches whose last stage is here (zero elsewhere)."""
        program, incoming, releases = self.plan(len(micro_batches))
        b, s = micro_batches[0].tokens.shape
        if s % self.seq_shards:
            raise ValueError(f"sequence length {s} is not divisible by tp={self.seq_shards} "
                             f"(sequence parallel splits it across the tp ranks)")
        step = _Step(self, micro_batches, loss_scale, (b, s // self.seq_shards, self.hidden_size),
                     {q: deque(msgs) for q, msgs in incoming.items()}, releases,
                     {(a.microbatch, a.chunk) for a in program if a.kind == "I"})
        # Data parallel launches its reductions during the backward flagged last: the final B,
        # or with split backwards the final W (the linears' weight gradients arrive in W).
        last_backward = max(i for i, a in enumerate(program) if a.kind in ("B", "W"))
        pending: list[Action] = []
        i = 0
        while i < len(program):
            action = program[i]
            i += 1
            if not action.is_compute:
                pending.append(action)
                continue
            step.post(pending)
            pending = []
            if action.kind == "F" and not action.paired:
                step.forward(action)
                continue
            if action.paired:  # add_communication put its backward right after it
                backward, i = program[i], i + 1
            with backward_context(i - 1 == last_backward):
                if action.paired:
                    step.together(action, backward)
                elif action.kind == "W":
                    self.store.flush((action.microbatch, action.chunk))
                else:
                    step.backward(action)
        step.post(pending)
        return step.finish()


class _Step:
    """The state of one training step on one rank."""

    def __init__(self, ex: PipelineExecutor, micro_batches, loss_scale: float,
                 shape: tuple[int, int, int], incoming: dict[int, deque],
                 releases: dict[Message, list[Message]], split: set[tuple[int, int]]):
        self.ex, self.micro_batches, self.loss_scale, self.shape = ex, micro_batches, loss_scale, shape
        self.incoming, self.releases = incoming, releases
        self.split = split  # (micro-batch, chunk) whose backward is split into I and W
        self.received: dict[Message, tuple[torch.Tensor, comm.CountedWork | None]] = {}
        self.outbox: dict[Message, torch.Tensor] = {}
        # Hand-overs between this rank's own neighbouring stages: message -> tensor.
        self.local: dict[Message, torch.Tensor] = {}
        # Sends in flight, kept alive until waited: message -> (tensor, work).
        self.sent: dict[Message, tuple[torch.Tensor, comm.CountedWork]] = {}
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.loss_sum = torch.zeros((), dtype=torch.float64,
                                    device=micro_batches[0].tokens.device)

    def post(self, actions: list[Action]) -> None:
        """Launch these transfers (and any earlier receives they must follow) as one batch."""
        if not actions:
            return
        ex = self.ex
        ops, receives, sent_msgs = [], [], []
        for a in actions:
            msg = message_of(ex.rank, a, ex.pp, ex.placement)
            peer = peer_of(ex.rank, a, ex.pp, ex.placement)[0]
            if a.kind.startswith("SEND"):
                ops.append(("send", self.outbox.pop(msg), ex.peers[peer]))
                sent_msgs.append(msg)
                continue
            queue = self.incoming[peer]
            while msg not in self.received:
                nxt = queue.popleft()
                buf = torch.empty(self.shape, dtype=ex.dtype, device=self.loss_sum.device)
                self.received[nxt] = (buf, None)
                receives.append((nxt, len(ops)))
                ops.append(("recv", buf, ex.peers[peer]))
                sent_msgs.append(None)
        works = comm.batch_p2p(ops, dim="pp", tag="pipeline")
        for msg, idx in receives:
            self.received[msg] = (ops[idx][1], works[idx])
        for (kind, tensor, _), work, msg in zip(ops, works, sent_msgs):
            if kind == "send":
                self.sent[msg] = (tensor, work)

    def take(self, msg: Message) -> torch.Tensor:
        """The tensor addressed to us as `msg`: handed over by our own other chunk, or received
        (waited for here)."""
        if msg in self.local:
            return self.local.pop(msg)
        buf, work = self.received.pop(msg)
        work.wait()
        # The peer sent this after using some of our sends: those have arrived, let them go.
        # (gloo reports a send complete only once waited for; without this every activation and
        # gradient sent would be held until the end of the step.)
        for done in self.releases.get(msg, ()):
            sent = self.sent.pop(done, None)
            if sent is not None:
                sent[1].wait()
        return buf

    def give(self, msg: Message, tensor: torch.Tensor) -> None:
        """Address `tensor` to stage msg[2]: kept for our own chunk there, else queued to send."""
        if self.ex.is_local(msg[2]):
            self.local[msg] = tensor
        else:
            self.outbox[msg] = tensor.contiguous()

    def forward(self, a: Action) -> None:
        chunk = self.ex.chunks[a.chunk]
        mb = self.micro_batches[a.microbatch]
        if chunk.is_first:
            x = mb.tokens
        else:
            x = self.take(("F", a.microbatch, chunk.stage)).requires_grad_()
        store = self.ex.store
        split = (a.microbatch, a.chunk) in self.split
        with self.ex.autocast(), (store.forward_for(split) if store is not None else nullcontext()):
            y = chunk(x, mb.positions, mb.targets if chunk.is_last else None, mb.documents,
                      mb.future if chunk.is_last else None)
        if chunk.is_last:  # y is the summed token loss
            self.loss_sum += y.detach().double()
            y = y * self.loss_scale
        else:
            self._check(y, "activation", chunk.stage)
            self.give(("F", a.microbatch, chunk.stage + 1), y.detach())
        self.saved[(a.microbatch, a.chunk)] = (x, y)

    def backward(self, a: Action) -> None:
        chunk = self.ex.chunks[a.chunk]
        x, y = self.saved.pop((a.microbatch, a.chunk))
        grad = None if chunk.is_last else self.take(("B", a.microbatch, chunk.stage))
        store = self.ex.store
        capture = (store.capturing((a.microbatch, a.chunk)) if a.kind == "I"
                   else nullcontext())
        # Full recomputation runs the forward again inside this backward: it must take the
        # branch the forward took (split or not), or the tensors it saves differ.
        again = store.forward_for(a.kind == "I") if store is not None else nullcontext()
        with capture, again:
            torch.autograd.backward(y, grad)
        if not chunk.is_first:
            self._check(x.grad, "gradient", chunk.stage)
            self.give(("B", a.microbatch, chunk.stage - 1), x.grad)

    def together(self, f: Action, b: Action) -> None:
        """A forward and a backward of two other chunks or micro-batches, paired by the schedule
        (their inputs are in, their outputs go out after both)."""
        if not self.ex.overlap_pairs:
            self.forward(f)
            self.backward(b)
            return
        turns = Turns()
        # The backward's gradient is taken here, before the helper thread starts: the receive
        # bookkeeping is this thread's.
        if not self.ex.chunks[b.chunk].is_last:
            msg = ("B", b.microbatch, self.ex.chunks[b.chunk].stage)
            self.local[msg] = self.take(msg)
        turns.run(lambda: self.forward(f), lambda: self.backward(b))
        self.ex.handovers += turns.handovers

    def _check(self, t: torch.Tensor, what: str, stage: int) -> None:
        # The receiver allocates its buffer from (shape, dtype) alone: refuse anything else rather
        # than let a transfer of the wrong size hang or garble.
        if tuple(t.shape) != self.shape or t.dtype != self.ex.dtype:
            raise RuntimeError(f"pipeline stage {stage} would send a {what} of shape "
                               f"{tuple(t.shape)} {t.dtype}; the peer expects {self.shape} "
                               f"{self.ex.dtype}.")

    def finish(self) -> torch.Tensor:
        for _, work in self.sent.values():
            work.wait()
        leftovers = [m for m in self.received] + list(self.outbox) + list(self.saved) \
            + list(self.local)
        if leftovers or any(q for q in self.incoming.values()):
            raise RuntimeError(f"pipeline step ended with unused transfers or activations: "
                               f"{leftovers[:5]}")
        if self.ex.store is not None and len(self.ex.store):
            raise RuntimeError("pipeline step ended with weight gradients never computed (an I "
                               "without its W)")
        return self.loss_sum

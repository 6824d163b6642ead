"""The model's ends: the embedding on the first stage, the final norm, output head and loss on the
last (models/llama.py `embed_tokens`, `head`, the criterion).

Bytes, per micro-batch: the token ids; the final norm's input and output, the loss's fp32
probabilities (chunked: the gradients it made) and targets, and while the loss runs its logits
(chunked: one chunk's). Seconds: the head's GEMM
(vocabulary-parallel over tp, never in fp8) and the cross-entropy's memory traffic. (A tied
embedding's gradient exchange between the two stages is a gradient sum: `data.py`.)
Torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ultrascale.layout import Layout
from ultrascale.rules.loss import loss_chunk_tokens
from ultrascale.theory.rates import cast_time, gemm_time, memory_time
from ultrascale.theory.shape import ModelShape, Shape
from ultrascale.theory.term import Bytes, Carried, Pass, Seconds, Stage, Step, Term

if TYPE_CHECKING:
    from ultrascale.planner.hardware import Hardware

CE_BYTES_PER_LOGIT = 16  # fp32 logits written, read for softmax, read/written again in backward


def stage_bytes(stage: Stage) -> Bytes | None:
    if not stage.impl.count_extras or not (stage.embedding or stage.head):
        return None  # (the playbook's formula counts only the layers)
    out = Bytes()
    x, rules, tp = stage.shape, stage.impl.rules, stage.layout.tp
    a, tok = x.act, x.b * x.s
    res = tok * x.h // (x.tp if x.sp else 1)
    if stage.embedding:
        # int64 ids; a vocabulary-parallel embedding also keeps its out-of-shard mask (bool).
        out.edge["token ids"] = tok * (8 + (tp > 1))
    if stage.head:
        # Final norm as in a block; the loss keeps fp32 probabilities (log-softmax or softmax)
        # per micro-batch until its backward, and while it runs the logits in the compute
        # dtype and, if narrower, their fp32 copy.
        final = stage.norm  # as in a block, outside any recomputed layer
        if x.sp and rules.sp_head_gathered and not rules.sp_saves_gathered:
            final += (tok * x.h - res) * a  # the head keeps the gathered output
        out.edge["final norm"] = final
        kept, running = loss_kept(x, stage.layout), loss_running(x, stage.layout, rules)
        out.edge[kept[0]] = kept[1]
        # int64, kept by the loss for its backward; a vocabulary-parallel loss keeps the
        # targets' shard indices and which of them fall in its shard (bool).
        out.edge["targets"] = tok * (8 + (tp > 1))
        out.transient[running[0]] = running[1]
        # The head runs as F.linear on its weight (tied or not), never deferred to a W pass.
    return out


def loss_kept(x: Shape, lay: Layout) -> tuple[str, int]:
    """(part, bytes) one loss keeps per micro-batch until its backward: the fp32 probabilities;
    chunked (`training.chunked_loss`), the gradients its forward already made, of the hidden
    states (their dtype) and of this rank's head rows (fp32)."""
    if lay.chunked_loss:
        return "loss gradients (chunked)", x.b * x.s * x.h * x.act + x.vocab * x.h * 4
    return "loss probabilities (fp32)", loss_probabilities(x)


def loss_running(x: Shape, lay: Layout, rules) -> tuple[str, int]:
    """(part, bytes) while one loss runs. Whole: its logits in the compute dtype and, if
    narrower, their fp32 copy; ours without tp peaks in its backward (`loss_backward_grads`),
    the vocabulary-parallel loss turns its kept softmax into the gradient in place. Chunked
    (models/ops.py `linear_cross_entropy`): one chunk's logits, their fp32 copy and their
    gradient cast back, beside the product of that gradient with the chunk's hidden states
    (the head rows' size, compute dtype) added into the fp32 weight gradient; its backward
    scales the two kept gradients into new tensors (the head's in fp32, then cast)."""
    a, tok = x.act, x.b * x.s
    if lay.chunked_loss:
        chunk = loss_chunk_tokens(tok) * x.vocab
        forward = chunk * (a + (4 + a if a < 4 else 0)) + x.vocab * x.h * a
        backward = tok * x.h * a + x.vocab * x.h * (4 + a)
        return "loss chunk", max(forward, backward)
    forward = a + (4 if a < 4 else 0)
    backward = 8 if rules.loss_backward_grads and lay.tp == 1 else 0
    return "logits", tok * x.vocab * max(forward, backward)


def loss_probabilities(x: Shape) -> int:
    """Bytes of the fp32 probabilities one loss keeps per micro-batch until its backward."""
    return x.b * x.s * x.vocab * 4


def head_forward(m: ModelShape, hw: "Hardware", sh: Shape) -> float:
    """The output head's forward GEMM, vocabulary-parallel over tp, in the storage dtype (never
    fp8)."""
    return gemm_time(hw, sh.tokens, m.vocab_size / sh.tp, sh.h, sh.store)


def loss_traffic(m: ModelShape, hw: "Hardware", sh: Shape) -> float:
    """The cross-entropy's memory traffic, forward plus backward; in a low-precision run, the
    cast of its logits to fp32 and of their gradient back (`rates.cast_time`)."""
    logits = sh.tokens * m.vocab_size / sh.tp
    return memory_time(hw, logits * CE_BYTES_PER_LOGIT) + cast_time(hw, logits, sh.store)


def seconds(step: Step) -> Seconds:
    """On the rank with the output head: its GEMM forward, twice that backward, and the loss's
    traffic, half in each pass."""
    head_f, ce = step.head_f, step.ce
    return Seconds(head=Pass({"matmul": head_f, "elementwise": ce / 2},
                             {"matmul": 2 * head_f, "elementwise": ce / 2}),
                   carried={"head": Carried(forward=head_f, backward=2 * head_f, comm=ce)})


TERM = Term("ends", stage_bytes=stage_bytes, seconds=seconds)

"""Multi-token prediction (models/mtp.py, DeepSeek-V3): what its modules hold and cost, on the
stage with the output head (under pp they sit on the last stage).

Each of the `mtp_layers` modules normalizes the embedded tokens k ahead (enorm) and the previous
depth's hidden state (hnorm), projects the two concatenated (eh_proj, 2h -> h, replicated over
tp), runs one block of the model's kind (an MoE layer for an MoE model whose dense layers come
first) and the model's output head and loss once more after its own final norm. Its parameters
are the model's (`params.py`, counted on the head's stage with the copy of the embedding an
untied model's last stage keeps). Bytes: per micro-batch, what a module saves (its block's parts
as the layers', under the layout's recompute; its norms, which no recompute policy reaches; the
projection's input; its final norm; the loss's fp32 probabilities; the tokens and the targets of
every depth).
Seconds: per micro-batch on the head's rank, the block, the projection, the head and the loss
again, and the block's expert all-to-alls. Torch-free.
"""

from __future__ import annotations

from ultrascale.params import mtp_moe
from ultrascale.theory.block import norm_bytes
from ultrascale.theory.ends import loss_kept
from ultrascale.theory.expert import ep_layer_comm, moe_share
from ultrascale.theory.precision import CACHED_BYTES
from ultrascale.theory.rates import gemm_time
from ultrascale.theory.term import Bytes, Carried, Pass, Seconds, Stage, Step, Term


def stage_bytes(stage: Stage) -> Bytes | None:
    depth = getattr(stage.model, "mtp_layers", 0)
    if not depth or not stage.head or not stage.impl.count_extras:
        return None
    kind = stage.kinds["moe" if mtp_moe(stage.model) and "moe" in stage.kinds else "dense"]
    x, rules = kind.shape, stage.impl.rules
    a, tok, tp = x.act, x.b * x.s, stage.layout.tp
    res = tok * x.h // x.sp_div
    upcast = rules.norm_upcast and a < 4
    # A norm whose output only the concatenation reads: its input (the embedding's output for
    # enorm; for hnorm the hidden state the final norm keeps already, unless upcast copies it),
    # unfused its normalized copy, an fp32 rms per token.
    own = res * (rules.norm_saves_normalized * a) + tok * 4 // x.sp_div
    enorm = res * (4 if upcast else a) + own
    hnorm = (res * 4 if upcast else 0) + own
    out = Bytes()
    for part, v in kind.parts.items():
        out.edge[f"MTP {part}"] = depth * v
    # The projection's input, the two norms' outputs concatenated (FP8's cache: in e4m3).
    proj_b = CACHED_BYTES if x.dtype == "fp8" and stage.layout.fp8_cache else a
    out.edge["MTP norms and projection input"] = depth * (enorm + hnorm + 2 * res * proj_b)
    # Its own final norm before the head (freed by the backward before its block's).
    out.edge["MTP final norm"] = depth * norm_bytes(x, rules)
    kept, size = loss_kept(x, stage.layout)
    out.edge[f"MTP {kept}"] = depth * size
    # int64 tokens each depth embeds, and the targets of every depth (one tensor).
    out.edge["MTP tokens and targets"] = 2 * depth * tok * (8 + (tp > 1))
    return out


def seconds(step: Step) -> Seconds | None:
    """Per micro-batch on the head's rank: each module's block (the model's average block's
    times; an MoE block's all-to-alls), its projection, the head and the loss once more."""
    m, sh, layer = step.model, step.sh, step.layer
    depth = getattr(m, "mtp_layers", 0)
    if not depth:
        return None
    proj = gemm_time(step.hw, sh.tokens, sh.h, 2 * sh.h, sh.dtype)
    mm_f = layer["matmul_f"] + proj + step.head_f
    fwd = {"matmul": depth * mm_f, "attention": depth * layer["attention_f"],
           "elementwise": depth * (layer["elementwise_f"] + step.ce / 2)}
    bwd = {"matmul": depth * (layer["matmul_b"] + 2 * proj + 2 * step.head_f),
           "attention": depth * layer["attention_b"],
           "elementwise": depth * (layer["elementwise_b"] + step.ce / 2)}
    if layer.get("recompute"):
        bwd["recompute"] = depth * layer["recompute"]
    comm = 0.0
    if mtp_moe(m) and step.lay.ep > 1 and moe_share(m):
        comm = depth * ep_layer_comm(m, step.lay, step.hw, sh) / moe_share(m)
        fwd["ep_comm"] = bwd["ep_comm"] = comm / 2
    return Seconds(head=Pass(fwd, bwd),
                   carried={"head": Carried(forward=sum(fwd.values()) - comm / 2,
                                            backward=sum(bwd.values()) - comm / 2, comm=comm)})


TERM = Term("mtp", stage_bytes=stage_bytes, seconds=seconds)

"""Multi-head latent attention (models/mla.py, DeepSeek-V2/V3): what it saves and what it costs.

Per layer, with n heads (n / tp on a rank), dq `q_lora_rank` (0: one query projection), dc
`kv_lora_rank`, dr, dn, dv the rotary, nope and value head dims, and dqk = dn + dr: every
attention core takes values of their own width (`models/ops.py`; context parallel's ring and
all-gather send them packed beside the keys, Ulysses as they are):

- the down-projections (h -> dq, h -> dc + dr) run replicated over tp, on this rank's tokens
  under sequence parallel; their latents enter the tensor-parallel region (gathered along the
  sequence under sequence parallel), where the latents' RMSNorms and the up-projections
  (dq -> n (dn + dr), dc -> n (dn + dv)) hold this rank's heads; the output projection
  (n dv -> h) is row-parallel;
- the core runs q, k of n x dqk and v of n x dv per token: the scores 2 n s' dqk FLOPs a query
  over its s' keys, the values 2 n s' dv; backward recomputes the scores and runs dP = dO V^T
  (dv), dV (dv), dQ and dK (dqk). It keeps q, k, v and its output (n x dv), which the output
  projection reads as it is. (On a GPU a width the memory-efficient kernel's alignment refuses,
  not a multiple of 8 in half precision, is padded as a whole, `ops.one_width`; DeepSeek's
  widths are multiples of 8 and this file does not count that case; on a CPU the fused kernel
  computes at max(dqk, dv), which this file, counting a GPU's FLOPs, does not count either.)
- `training.recompute: norms_and_mla_up` (parallel/recipes.py) keeps of the expansion only the
  latents (the latent norms run under a checkpoint) and recomputes q, k and v from them in
  backward: the up-projections' GEMMs and the norms run once more.

`MLA` answers the attention's hooks (`attention.Attention`); `TERM` adds the seconds the
norms_and_mla_up policy spends rebuilding (the recompute term knows the built-in modes only).
The parameters are the model's (`params.py`). Torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ultrascale.theory.attention import Attention, mean_visible_keys
from ultrascale.theory.implementation import TensorRules
from ultrascale.theory.rates import gemm_time, memory_time
from ultrascale.theory.shape import ModelShape, Shape
from ultrascale.theory.term import Carried, Pass, Seconds, Step, Term

if TYPE_CHECKING:
    from ultrascale.planner.hardware import Hardware

POLICY = "norms_and_mla_up"  # DeepSeek-V3's recompute policy (training.recompute)


def dims(m: ModelShape) -> tuple[int, int, int, int, int, int]:
    """(dq, dc, dr, dn, dv, w) of model `m`."""
    dr, dn, dv = m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim
    return m.q_lora_rank or 0, m.kv_lora_rank, dr, dn, dv, max(dn + dr, dv)


def core_widths(m: ModelShape) -> tuple[int, int]:
    """(query-key, value) head widths the attention core computes and keeps: their own."""
    _, _, dr, dn, dv, _ = dims(m)
    return dn + dr, dv


def latent_norm(tok: int, d: int, a: int, rules: TensorRules) -> int:
    """Bytes one latent RMSNorm and the up-projection after it keep (`block.norm_bytes`'s rule
    for a latent of width d, which no other tensor keeps): its input (an fp32 copy under
    autocast), unfused the normalized latent, an fp32 rms per token, its output."""
    norm = tok * d * (4 if rules.norm_upcast and a < 4 else a) + tok * 4
    if rules.norm_saves_normalized:
        norm += tok * d * a
    return norm + tok * d * a


class MLA(Attention):
    """Multi-head latent attention (`model.attention: mla`)."""

    name = "mla"

    def applies(self, m: ModelShape) -> bool:
        return getattr(m, "attention", "mha") == "mla"

    # --- bytes -------------------------------------------------------------------------------

    def saved(self, x: Shape, recompute: str, rules: TensorRules) -> dict[str, int]:
        """Bytes one layer's attention saves for backward, one micro-batch (recompute none,
        selective or norms_and_mla_up; full is the block's), by part. Its "attention norm"
        replaces the block's: the down-projections read the norm's output on this rank's tokens
        (never a gathered copy), and under norms_and_mla_up the norm keeps only its input."""
        dq, dc, dr, dn, dv, w = dims(x.model)
        a, tok, n = x.act, x.b * x.s, x.heads
        res = tok * x.h // x.sp_div
        out: dict[str, int] = {}
        if recompute == POLICY:
            out["attention norm"] = res * a
            # The latent norms' checkpoints keep the latents: the query latent, and the whole
            # key-value projection output (its latent a view of it).
            out["MLA latents"] = tok * (dq + dc + dr) * a
        else:
            norm = res * (4 if rules.norm_upcast and a < 4 else a) + tok * 4 // x.sp_div
            if rules.norm_saves_normalized:
                norm += res * a
            out["attention norm"] = norm + res * a
            # Under autocast the latent norm keeps an fp32 copy of the key-value latent alone;
            # otherwise the latent, a view, keeps the projection output (dc + dr) alive.
            kv = latent_norm(tok, dc, a, rules) + (tok * dr * a if a == 4 or not rules.norm_upcast
                                                   else 0)
            out["MLA latents"] = (latent_norm(tok, dq, a, rules) if dq else 0) + kv
        if rules.rotary_saves_input:
            out["rotary"] = tok * (n + 1) * dr * a
        dk, dw = core_widths(x.model)
        if recompute != POLICY:
            out["q, k, v"] = tok * n * (2 * dk + dw) * a
        if recompute != "selective":
            core = tok * n * dw * a + x.b * n * x.s * 4  # output and fp32 logsumexp
            if rules.attention == "eager":
                core += x.b * n * x.s * x.s_kv * a
            out["attention core"] = core
        if _output_copied(x, recompute, rules):
            out["output projection input"] = tok * n * dv * a
        return out

    def deferred(self, x: Shape) -> tuple[int, int]:
        """(inputs, output gradients) of its linears for a deferred weight-gradient pass: the
        norm output (shared by the down-projections), the normalized latents, the attention
        output; the gradients of the two latents, of q, of k and v, of the output."""
        dq, dc, dr, dn, dv, w = dims(x.model)
        tok, n = x.b * x.s, x.heads
        inputs = tok * (x.h // x.sp_div + dq + dc + n * dv)
        grads = tok * (dq + dc + dr + n * (dn + dr) + n * (dn + dv) + x.h)
        return inputs, grads

    def fp8_inputs(self, x: Shape, recompute: str, rules: TensorRules,
                   norm_rebuilt: bool) -> tuple[int, int]:
        """Its linears' inputs (`Attention.fp8_inputs`): the norm output read by the
        down-projections and the normalized latents read by the up-projections (recipes under
        norms_and_mla_up: nothing kept), kept by linears alone; and the attention output, kept
        by the core too unless it reaches the output projection as a copy (`_output_copied`).
        Its projections are plain linears under tp too."""
        dq, dc, dr, dn, dv, w = dims(x.model)
        tok = x.b * x.s
        out = tok * x.heads * dv
        alone, anyway = (out, 0) if _output_copied(x, recompute, rules) else (0, out)
        if recompute == POLICY:
            return alone, anyway
        return tok * (x.h // x.sp_div + dq + dc) + alone, anyway

    def kv_elements(self, x: Shape) -> float:
        """K (or V) elements per token on this rank: the mean of the two widths (context
        parallel moves and accumulates K and V together)."""
        return x.heads * sum(core_widths(x.model)) / 2

    def q_elements(self, x: Shape) -> int:
        return x.heads * core_widths(x.model)[0]

    def k_elements(self, x: Shape) -> int:
        """Every query head has its own key (the nope part its own, the rotary part shared but
        expanded to each head before the core), of the query-key width."""
        return x.heads * core_widths(x.model)[0]

    def v_elements(self, x: Shape) -> int:
        return x.heads * core_widths(x.model)[1]

    def out_elements(self, x: Shape) -> int:
        return x.heads * core_widths(x.model)[1]

    def kv_heads(self, x: Shape) -> int:
        return x.heads

    # --- seconds -----------------------------------------------------------------------------

    def kv_width(self, sh: Shape) -> float:
        """Keys (or values) per token as the core sees them, the whole model's: n x the mean of
        the two widths (what moving K and V costs, halved)."""
        return sh.model.num_heads * sum(core_widths(sh.model)) / 2

    def down_gemms(self, hw: "Hardware", sh: Shape) -> float:
        """The down-projections, replicated over tp (on this rank's tokens under sp)."""
        dq, dc, dr = dims(sh.model)[:3]
        return gemm_time(hw, sh.tokens / sh.sp_div, dq + dc + dr, sh.h, sh.dtype) if dq else \
            gemm_time(hw, sh.tokens / sh.sp_div, dc + dr, sh.h, sh.dtype)

    def up_gemms(self, hw: "Hardware", sh: Shape) -> float:
        """The up-projections of this rank's heads (what norms_and_mla_up runs again)."""
        dq, dc, dr, dn, dv, _ = dims(sh.model)
        n, T = sh.model.num_heads / sh.tp, sh.tokens
        return (gemm_time(hw, T, n * (dn + dr), dq or sh.h, sh.dtype)
                + gemm_time(hw, T, n * (dn + dv), dc, sh.dtype))

    def forward_gemms(self, hw: "Hardware", sh: Shape) -> float:
        dv = dims(sh.model)[4]
        out = gemm_time(hw, sh.tokens, sh.h, sh.model.num_heads * dv / sh.tp, sh.dtype)
        return self.down_gemms(hw, sh) + self.up_gemms(hw, sh) + out

    def column_gemm(self, hw: "Hardware", sh: Shape) -> float:
        return self.up_gemms(hw, sh)

    def core_time(self, hw: "Hardware", sh: Shape) -> float:
        """Causal attention forward over half the score matrix: QK^T at the query-key width,
        PV at the value width (`core_widths`)."""
        dk, dw = core_widths(sh.model)
        return self._core_products(hw, sh, dk + dw)

    def core_backward_time(self, hw: "Hardware", sh: Shape) -> float:
        """The scores again and dQ, dK at the query-key width, dP and dV at the value width."""
        dk, dw = core_widths(sh.model)
        return self._core_products(hw, sh, 3 * dk + 2 * dw)

    def _core_products(self, hw: "Hardware", sh: Shape, widths: int) -> float:
        """Products of (T x the keys a query sees: half the sequence, or its sliding window's)
        scores by heads x `widths` (the widths of each product summed), at the attention
        rate."""
        heads = sh.model.num_heads / sh.tp
        keys = mean_visible_keys(sh.model, sh.layout.seq_len)
        attn_flops = 2 * sh.tokens * keys * heads * widths
        return attn_flops / hw.attention_rate(sh.store)

    def elementwise_width(self, sh: Shape) -> float:
        """Per token, forward: the latent norms (read, write), rotary on the rotary parts, the
        concatenations of q and k and the copy of v (a write each, read by the core)."""
        dq, dc, dr, dn, dv, w = dims(sh.model)
        n = sh.model.num_heads / sh.tp
        return 2 * (dq + dc) + 2 * (n + 1) * dr + n * (2 * (dn + dr) + dv)

    def quantised_width(self, sh: Shape) -> float:
        """FP8 quantises the normalized latents and the attention output (besides the block's
        norm outputs)."""
        dq, dc, _, _, dv, _ = dims(sh.model)
        return dq + dc + sh.model.num_heads * dv / sh.tp


def _output_copied(x: Shape, recompute: str, rules: TensorRules) -> bool:
    """Whether the output projection's input is a tensor of its own, not the core's output
    (which the core keeps anyway without recomputation): under selective recompute (the core's
    output is not kept), where Ulysses sends it back (`Shape.output_copy`) or the implementation
    copies it."""
    return recompute == "selective" or x.output_copy or rules.attention_output_copy


def rebuild_time(step: Step) -> float:
    """What norms_and_mla_up runs again per layer in backward: the up-projections and the
    latent norms (with the rest of the expansion's elementwise work), and the block's two
    RMSNorms (read h, write h each)."""
    sh, hw = step.sh, step.hw
    expansion = step.attention.elementwise_width(sh) * sh.tokens * sh.act
    norms = 2 * 2 * sh.tokens * sh.h / sh.sp_div * sh.act
    return step.attention.up_gemms(hw, sh) + memory_time(hw, expansion + norms, dtype=sh.store)


def seconds(step: Step) -> Seconds | None:
    if step.lay.recompute != POLICY or not isinstance(step.attention, MLA):
        return None
    rebuilt = rebuild_time(step)
    return Seconds(layer=Pass(backward={"recompute": rebuilt}),
                   carried={"layer": Carried(backward=rebuilt)})


TERM = Term("mla", seconds=seconds)

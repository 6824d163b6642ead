"""The attention of a transformer block: what it saves for backward and what it costs.

`Attention` is the interface an attention's theory answers; `GQA` answers it for
`models.llama.Attention` (multi-head attention with grouped key/value heads, rotary positions,
flash/SDPA core). The block (`block.py`) asks the model's attention for its part of a layer, and
context and tensor parallelism ask it for the widths they move. Another kind of attention (e.g.
multi-head latent attention) is one more file with a subclass whose `applies(model)` says which
models it describes, listed before `GQA` in `terms.ATTENTIONS`. Its parameter counts are the
model's (`params.py`). Torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ultrascale.theory.implementation import TensorRules
from ultrascale.theory.rates import gemm_time
from ultrascale.theory.shape import ModelShape, Shape

if TYPE_CHECKING:
    from ultrascale.planner.hardware import Hardware


class Attention:
    """The hooks an attention's theory answers (GQA's answers are the defaults)."""

    name = "attention"

    def applies(self, m: ModelShape) -> bool:
        """Whether this theory describes the attention of model `m`."""
        return True

    # --- bytes -------------------------------------------------------------------------------

    def saved(self, x: Shape, recompute: str, rules: TensorRules) -> dict[str, int]:
        """Bytes saved for backward by one layer's attention (after its norm), one micro-batch,
        under recompute none or selective (full keeps only the layer input: `block.py`).

        Rotary keeps cos/sin (s x head_dim each; counted per forward when the layers share them)
        and, for some kernels, the unrotated q and k. SDPA's inputs q, k, v are kept by the
        attention (or, with selective recompute, by the checkpoint that reruns it). Context
        parallel keeps this rank's share: its tokens (ring, all-gather) or, for Ulysses, the whole
        sequence's for 1/cp of the heads, as many bytes. The output projection keeps its input;
        without recompute it is the attention output itself unless the implementation copies it
        (a transpose that is not a view)."""
        a = x.act
        tok = x.b * x.s
        q, kv = tok * x.heads * x.head_dim, tok * x.kv
        out: dict[str, int] = {}
        rot = 0 if rules.rotary_tables_shared else rotary_tables(x)
        if rules.rotary_saves_input:
            rot += (q + kv) * a
        if rot:
            out["rotary"] = rot
        attn_kv = tok * x.attn_kv if x.attn_kv and recompute != "selective" else kv
        if recompute != "selective" and rules.kv_expanded_off_flash and _expands_kv(x):
            attn_kv = q  # the memory-efficient kernel keeps k, v expanded to every query head
        out["q, k, v"] = (q + 2 * attn_kv) * a
        if x.model is not None and x.model.qk_norm:
            out["q, k norms"] = qk_norm_saved(x, rules)
        if recompute == "none":
            core = q * a + x.b * x.heads * x.s * 4  # output and fp32 logsumexp
            if rules.attention == "eager":
                core += x.b * x.heads * x.s * x.s_kv * a  # softmax probabilities
            out["attention core"] = core
        if recompute != "none" or rules.attention_output_copy or x.output_copy:
            out["output projection input"] = q * a
        return out

    def backward_workspace(self, x: Shape) -> int:
        """Bytes its backward makes at once beside what it saved: with q/k norms (Qwen3), the
        query norm's, as ours' RMSNorm over the residual (`block.norm_backward_workspace`):
        five fp32 tensors, of the queries' width."""
        if x.model is None or not x.model.qk_norm:
            return 0
        return 5 * 4 * x.b * x.s * x.heads * x.head_dim

    def deferred(self, x: Shape) -> tuple[int, int]:
        """(inputs, output gradients), elements, that the attention's linears keep for a deferred
        weight-gradient pass: the norm output (one tensor shared by q, k and v) and the attention
        output; the gradients of q, k, v and of the output projection."""
        tok = x.b * x.s
        q, kv = tok * x.heads * x.head_dim, tok * x.kv
        return tok * x.h + q, q + 2 * kv + tok * x.h

    def fp8_inputs(self, x: Shape, recompute: str, rules: TensorRules,
                   norm_rebuilt: bool) -> tuple[int, int]:
        """(kept by its linears alone, kept anyway), elements: the inputs its FP8 linears would
        keep as 8-bit copies under `precision.fp8_cache_activations` (theory/precision.py). The
        norm output, unless tensor parallel's column matmul (which keeps its own input) or the
        recompute policy (`norm_rebuilt`: a recipe, nothing kept) takes it; the attention
        output, which without recomputation the core keeps too unless the implementation copies
        it."""
        tok = x.b * x.s
        q = tok * x.heads * x.head_dim
        norm = 0 if x.tp > 1 or norm_rebuilt else tok * x.h
        if recompute == "none" and not (rules.attention_output_copy or x.output_copy):
            return norm, q
        return norm + q, 0

    def kv_elements(self, x: Shape) -> int:
        """Key (or value) elements per token on this rank (what context parallel moves)."""
        return x.kv

    def q_elements(self, x: Shape) -> int:
        """Query elements per token on this rank (what context parallel's dq holds, and what
        Ulysses sends of the queries)."""
        return x.heads * x.head_dim

    # What the attention core takes and gives, per token on this rank: what context parallel
    # moves (`context.cp_layer_transfers`). Keys and values each at their own width, and the
    # output at the values' (an attention whose values are narrower than its keys, MLA, moves
    # less than heads x head_dim for them).

    def k_elements(self, x: Shape) -> int:
        """Key elements per token on this rank, as the core takes them."""
        return x.kv

    def v_elements(self, x: Shape) -> int:
        """Value elements per token on this rank, as the core takes them."""
        return x.kv

    def out_elements(self, x: Shape) -> int:
        """The core's output elements per token on this rank (its query heads at the values'
        width)."""
        return x.heads * x.head_dim

    def kv_heads(self, x: Shape) -> int:
        """Key/value heads the core takes on this rank (Ulysses replicates them up to a multiple
        of cp where cp does not divide them)."""
        return x.kv // x.head_dim

    # --- seconds -----------------------------------------------------------------------------

    def kv_width(self, sh: Shape) -> int:
        """Width of the key (or value) projection of the whole model (the step time divides it
        by tp)."""
        return sh.model.num_kv_heads * sh.model.head_dim

    def forward_gemms(self, hw: "Hardware", sh: Shape) -> float:
        """The q, k, v and output projections of one layer, forward."""
        T, h, tp = sh.tokens, sh.h, sh.tp
        kv = self.kv_width(sh)
        return (gemm_time(hw, T, (h + 2 * kv) / tp, h, sh.dtype)  # q, k, v
                + gemm_time(hw, T, h, h / tp, sh.dtype))  # output projection

    def column_gemm(self, hw: "Hardware", sh: Shape) -> float:
        """The column-parallel GEMM a tensor-parallel collective may hide under (q, k, v)."""
        return gemm_time(hw, sh.tokens, (sh.h + 2 * self.kv_width(sh)) / sh.tp, sh.h, sh.dtype)

    def core_time(self, hw: "Hardware", sh: Shape) -> float:
        """Causal attention forward: QK^T and PV over half the (T x seq) score matrix, in the
        storage dtype (attention stays in bf16 under fp8), at the kernel's rate for the model's
        head dimension where the profile measured it per head dimension. The backward:
        `core_backward_time`."""
        keys = mean_visible_keys(sh.model, sh.layout.seq_len)
        attn_flops = 2 * 2 * sh.tokens * keys * (sh.h / sh.tp)
        return attn_flops / hw.attention_rate(sh.store, sh.head_dim)

    def core_backward_time(self, hw: "Hardware", sh: Shape) -> float:
        """Causal attention backward: five products of the forward's size (the scores
        recomputed, dP, dV, dQ, dK), 2.5 times `core_time`."""
        return 2.5 * self.core_time(hw, sh)

    def elementwise_width(self, sh: Shape) -> float:
        """Elements per token of the attention's elementwise work (rotary on q and k, and their
        copies), forward."""
        return 2 * (sh.h + self.kv_width(sh)) / sh.tp

    def quantised_width(self, sh: Shape) -> float:
        """Elements per token of the attention's matmul input that FP8 quantises beside the norm
        outputs: the attention output."""
        return sh.h / sh.tp


class GQA(Attention):
    """Multi-head attention with grouped key/value heads (`models.llama.Attention`)."""

    name = "gqa"


def mean_visible_keys(model, seq: int) -> float:
    """`visible_keys` over the model's layers: the window's where it slides over every layer,
    else averaged over the layers it slides over (`sliding_window_layers`) and the others."""
    windowed = visible_keys(seq, getattr(model, "sliding_window", None))
    layers = getattr(model, "sliding_window_layers", None)
    if layers is None:
        return windowed
    share = len(layers) / model.num_layers
    return share * windowed + (1 - share) * visible_keys(seq, None)


def qk_norm_saved(x: Shape, rules: TensorRules) -> int:
    """What the RMSNorms over each query and key head keep (Qwen3's `qk_norm`), as ours' over the
    residual: the input (an fp32 copy of a half-precision one), unfused the normalized x, an fp32
    rms per head and token; recomputed only with the whole layer."""
    a, tok = x.act, x.b * x.s
    elements = tok * (x.heads * x.head_dim + x.kv)
    per = (4 if rules.norm_upcast and a < 4 else a) + (a if rules.norm_saves_normalized else 0)
    return elements * per + tok * (x.heads + x.kv // x.head_dim) * 4


def visible_keys(seq: int, window: int | None) -> float:
    """The keys a causal query sees, on average over a sequence: half of it, or with a sliding
    window w shorter than it, w for every query but the first w - 1 (which see 1..w - 1):
    (w s - w (w - 1) / 2) / s."""
    if window is None or window >= seq:
        return seq * 0.5
    return (window * seq - window * (window - 1) / 2) / seq


def rotary_tables(x: Shape) -> int:
    """Bytes of the rotary cos and sin tables of one forward, in the compute dtype."""
    return 2 * x.s * x.head_dim * x.act


def _expands_kv(x: Shape) -> bool:
    """Whether the layer's attention core expands grouped kv heads for the memory-efficient kernel
    (`ops.attention` on a GPU): the plain core (or Ulysses') where FlashAttention does not apply,
    fp32 or a head_dim that is not a multiple of 8 up to 256."""
    lay = x.layout
    plain = lay is None or lay.cp == 1 or lay.cp_mode == "ulysses"
    grouped = x.kv < x.heads * x.head_dim
    flash = x.act == 2 and x.head_dim % 8 == 0 and x.head_dim <= 256
    return plain and grouped and not flash

"""Multi-head latent attention (DeepSeek-V2/V3) in plain PyTorch: no parallel code lives here.

    x -> compress: the down-projections: the query latent (q_a_proj; without q_lora_rank the
         input itself) and the key-value latent with the rotary key part (kv_a_proj_with_mqa)
      -> expand: the latents' RMSNorms and the up-projections (q_b_proj or q_proj, kv_b_proj)
         into per-head queries, keys and values; rotary embeddings on the rotary parts (one key
         part shared by every head); queries and keys [nope | rope]
      -> inner (the attention core, the same seam as multi-head attention's) on q and k of the
         query-key width and v of its own
      -> out (o_proj)

The core takes values of their own width (`ops.attention`: on CUDA the memory-efficient or cuDNN
kernel; on a CPU, whose fused kernel takes one width, the values are zero-padded for the kernel
alone and every saved tensor keeps its own width), so the attention's output and what backward
keeps are at the value width (128 for DeepSeek-V3, not the query-key 192), and on CUDA its P.V
products run at it too; context parallel's cores keep the two widths (parallel/context.py).
YaRN's softmax correction (mscale_all_dim) scales the queries, so
every core runs with its default 1 / sqrt(query-key width).

Seams: `compress` and `out` are methods tensor parallel overrides (heads split, the
down-projections and the latent norms replicated); `rotary` and `inner` are the parameterless
children multi-head attention has; `expansion` runs `expand` (a recompute policy swaps it). Parameter names follow transformers' DeepseekV3Attention, so
an import maps them one to one. The classes of its linears and norms come from the model
(models/llama.py), so that a precision recipe or a fused kernel reaches them as any other.
"""

from __future__ import annotations

import torch
from torch import nn

from ultrascale.models import ops
from ultrascale.models.ops import Rope


def softmax_scale_factor(cfg) -> float:
    """DeepSeek's YaRN correction of the softmax scale, mscale(factor, mscale_all_dim)^2 (1
    without YaRN or mscale_all_dim)."""
    s = cfg.rope_scaling
    if s is None or s.type != "yarn" or not s.mscale_all_dim:
        return 1.0
    return ops.yarn_mscale(s.factor, s.mscale_all_dim) ** 2


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rotary dimensions laid out in interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's
    checkpoints) as halves (x0, x2, ..., x1, x3, ...), where `rotary` turns pair i (x_i,
    x_i+d/2) by frequency i: the same rotation of each pair, its dimensions permuted alike in
    queries and keys (which leaves their products unchanged)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class Expansion(nn.Module):
    """Parameterless: runs MLA's expansion (the latents' norms, the up-projections, rotary) on
    the latents. DeepSeek-V3's recompute policy swaps it for one whose outputs backward
    recomputes from the latents instead of keeping them (parallel/recompute.py)."""

    def forward(self, expand, *latents):
        return expand(*latents)


class LatentAttention(nn.Module):
    """See the module docstring. `linear(in, out)` and `norm(dim, eps)` make the layers (the
    model's `Linear` and `RMSNorm`); `rotary` and `inner` are its parameterless children."""

    def __init__(self, cfg, linear: type, norm: type, rotary: nn.Module, inner: nn.Module):
        super().__init__()
        h, heads = cfg.hidden_size, cfg.num_heads
        self.nope, self.rope_dim, self.v_dim = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                                cfg.v_head_dim)
        self.qk_dim = self.nope + self.rope_dim
        self.kv_rank = cfg.kv_lora_rank
        self.interleaved = cfg.rope_interleave
        if cfg.q_lora_rank:
            self.q_a_proj = linear(h, cfg.q_lora_rank)
            self.q_a_layernorm = norm(cfg.q_lora_rank, cfg.norm_eps)
            self.q_b_proj = linear(cfg.q_lora_rank, heads * self.qk_dim)
            self.q_proj = None
        else:
            self.q_proj = linear(h, heads * self.qk_dim)
        self.kv_a_proj_with_mqa = linear(h, self.kv_rank + self.rope_dim)
        self.kv_a_layernorm = norm(self.kv_rank, cfg.norm_eps)
        self.kv_b_proj = linear(self.kv_rank, heads * (self.nope + self.v_dim))
        self.o_proj = linear(heads * self.v_dim, h)
        # What the queries are scaled by, so that the core's default 1/sqrt(qk_dim) becomes
        # qk_dim^-1/2 x YaRN's correction.
        self.q_scale = softmax_scale_factor(cfg)
        self.rotary = rotary
        self.inner = inner
        self.expansion = Expansion()

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        q, k, v = self.expansion(self.expand, *self.compress(x), rope)
        return self.out(self.inner(q, k, v, rope.positions, rope.documents))

    def compress(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, s, hidden] -> (what the query up-projection reads: the query latent before its
        norm, or x without q_lora_rank; the key-value latent and the rotary key part [b, s,
        kv_lora_rank + qk_rope_head_dim])."""
        q_in = x if self.q_proj is not None else self.q_a_proj(x)
        return q_in, self.kv_a_proj_with_mqa(x)

    def expand(self, q_in: torch.Tensor, kv: torch.Tensor, rope: Rope
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The latents -> q, k [b, s, heads, qk_dim] and v [b, s, heads, v_dim], ready for the
        core."""
        b, s = kv.shape[:2]
        q = self.q_proj(q_in) if self.q_proj is not None else \
            self.q_b_proj(self.q_a_layernorm(q_in))
        q = q.view(b, s, -1, self.qk_dim)
        latent, k_rot = kv.split([self.kv_rank, self.rope_dim], dim=-1)
        kv_up = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, s, -1, self.nope + self.v_dim)
        q_nope, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        k_nope, v = kv_up.split([self.nope, self.v_dim], dim=-1)
        k_rot = k_rot.unsqueeze(2)  # one rotary key part, shared by every head
        if self.interleaved:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        q_rot, k_rot = self.rotary(q_rot, k_rot, rope)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, -1, q.shape[2], -1)], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        # v a copy, not a view of the up-projection's output: the core keeps it for backward,
        # and a view would keep the nope keys' columns alive with it.
        return q, k, v.contiguous()

    def out(self, attended: torch.Tensor) -> torch.Tensor:
        return self.o_proj(attended.flatten(2))

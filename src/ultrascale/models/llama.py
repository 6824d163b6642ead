"""A Llama-style decoder in plain PyTorch: no parallel code lives here.

Parallel strategies transform this model from the outside (swap or wrap modules). They rely on:
- layers in a `ModuleDict` keyed by their global index, so parameter names stay the same when a
  pipeline stage keeps only some layers;
- attention that infers its local head count from the projection outputs, so tensor parallel can
  shrink the projections without touching this file;
- `forward` that returns logits; the loss is computed by the trainer (`train/loss.py`).
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from ultrascale.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 for stability under bf16 autocast, as Llama does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for the given absolute positions (shape [seq]), "rotate half" convention."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float32) / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)  # [seq, head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.head_dim = hd
        self.rope_theta = cfg.rope_theta
        self.q_proj = nn.Linear(h, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, h, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)
        cos, sin = rotary_cos_sin(positions, self.head_dim, self.rope_theta, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention on [batch, heads, seq, head_dim]; a separate method so that selective
        recomputation and context parallel can replace exactly this part."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=q.shape[1] != k.shape[1])


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_proj(x), self.up_proj(x)))

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up: a method of its own so selective recomputation can replace it."""
        return F.silu(gate) * up


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.num_layers)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size,
                                                                  bias=False)

    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.output is None else self.output.weight

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: [batch, seq] -> logits [batch, seq, vocab]. Each stage-local piece may be absent
        (pipeline parallel keeps only its part), so every step checks what this module holds."""
        x = self.embed(tokens) if self.embed is not None else tokens
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        for layer in self.layers.values():
            x = layer(x, positions)
        if self.norm is None:
            return x
        return F.linear(self.norm(x), self.head_weight())


# ---------------------------------------------------------------------------------------------
# Initialisation that depends only on (seed, parameter name): the same weights whatever the layout.


def _name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_weights(model: Llama, seed: int) -> None:
    """Normal(0, 0.02) for matrices, with the residual-output projections scaled by 1/sqrt(2L) as in
    GPT-2, ones for norms. Each tensor draws from its own generator seeded by its name."""
    std = 0.02
    out_std = std / math.sqrt(2 * model.cfg.num_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            gen = torch.Generator(device="cpu").manual_seed(_name_seed(seed, name))
            s = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * s)


def build_model(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu") -> Llama:
    if cfg.num_experts:
        raise NotImplementedError(
            "model.num_experts > 0 (mixture of experts) is not implemented yet; set "
            "model.num_experts=0 for a dense model.")
    model = Llama(cfg)
    init_weights(model, seed)
    return model.to(device)

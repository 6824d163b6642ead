"""A Llama-style decoder in plain PyTorch: no parallel code lives here.

Parallel strategies transform this model from the outside, through its seams:
- parameterless children that a strategy swaps: `Attention.inner` (the attention core: context
  parallel puts ring attention there, recomputation a checkpoint), `FeedForward.act`,
  `Linear.matmul` (a precision recipe's matmuls: FP8),
  `Llama.criterion` (the loss: tensor parallel puts the vocabulary-parallel one there, the kernels
  step a chunked one), and `RMSNorm.kernel` / `Attention.rotary` (fused kernels, by
  `training.kernels`);
- methods a subclass overrides: `Attention.project` / `out` and `FeedForward.project` / `out`
  (tensor parallel's column- and row-parallel matmuls);
- `shard_units()`: the groups of modules ZeRO-3 gathers together;
- a block's `mlp` is the dense `FeedForward`, or past the first `first_k_dense` layers of a
  mixture of experts the `MoE` of models/moe.py (whose own seams are its dispatcher and balance);
- layers in a `ModuleDict` keyed by their global index, so parameter names stay the same when a
  pipeline stage keeps only some layers, and `embed_tokens` / `run_layers` / `head`, which a
  pipeline stage calls for its part.
Swapping a child or rebasing a module onto a subclass keeps every parameter name, so checkpoints
and the name-seeded initialisation stay valid. The primitive math is in `models/ops.py`.
"""

from __future__ import annotations

import hashlib
import math
from typing import Iterable

import torch
from torch import nn

from ultrascale.config import ModelConfig
from ultrascale.models import ops
from ultrascale.models.documents import Documents
from ultrascale.models.mla import LatentAttention
from ultrascale.models.moe import MoE
from ultrascale.models.mtp import MTPLayer, MultiTokenPrediction
from ultrascale.models.ops import Rope


class LinearMatmul(nn.Module):
    """Parameterless: the three matmuls of a bias-free linear layer, `ops.linear` and its two
    gradients. A precision recipe swaps it (FP8, parallel/precision.py); strategies that run a
    layer's matmuls themselves (tensor parallel's fused column/row matmuls, zero bubble's deferred
    weight gradient) call `grad_input` / `grad_weight` of the layer's child."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, weight)

    def grad_input(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return ops.linear_grad_input(grad, weight)

    def grad_weight(self, grad2d: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
        return ops.linear_grad_weight(grad2d, x2d)

    def keep_input(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What a caller that keeps the input for the weight gradient itself (zero bubble's
        deferred matmul) keeps of x: x (FP8's cache: its 8-bit copy and scales)."""
        return (x,)

    def kept_input(self, kept: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The input for `grad_weight` from what `keep_input` kept."""
        return kept[0]

    # Whether `defer_weight_grads` may take the weight gradients (zero bubble's DeferredMatmul):
    # a caller that computes them itself then keeps the weights out of autograd's graph.
    may_defer = False

    def defer_weight_grads(self, weights, inputs, grad_out, compute) -> bool:
        """A caller that computes the weight gradients itself (tensor parallel's column matmuls)
        offers that work (`compute()` yields (weight, gradient) pairs) here first: True means it
        was taken for later (zero bubble's W pass), False (this plain matmul) compute it now."""
        return False


class Linear(nn.Linear):
    """A linear layer whose matmul is its `matmul` child (`ops.linear`); bias-free unless asked
    (Qwen2's q, k, v)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.matmul = LinearMatmul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.weight)
        return y if self.bias is None else y + self.bias


class RMSNormKernel(nn.Module):
    """Parameterless: the RMSNorm math (`training.kernels` may swap in a fused kernel)."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return ops.rms_norm(x, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.kernel = RMSNormKernel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.eps)


class Rotary(nn.Module):
    """Parameterless: rotates q and k by the positions' angles (`training.kernels` may swap in a
    fused kernel)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, rope: Rope
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.rotary(q, rope), ops.rotary(k, rope)


class CausalAttention(nn.Module):
    """The attention core, parameterless: causal softmax attention of q over k, v
    ([batch, seq, heads, head_dim]) at the given sequence indices, within each document when the
    micro-batch has `documents` (models/documents.py). `backend`: the SDPA kernel
    (`ops.SDPA_BACKENDS`; None: `ops.attention_backend`'s rule). `kernels`: the device type whose
    kernel choices it makes (`ops.attention`), None for its tensors' own. `window`: the model's
    sliding window (`model.sliding_window`; None: the whole causal past)."""

    kernels: str | None = None

    def __init__(self, backend: str | None = None, window: int | None = None):
        super().__init__()
        self.backend, self.window = backend, window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        # One process sees the whole sequence in order: causal by index is causal by position.
        return ops.attention(q, k, v, causal=True, documents=documents, backend=self.backend,
                             kernels=self.kernels, window=self.window)

    def extra_repr(self) -> str:
        shown = [f"backend={self.backend}"] if self.backend else []
        return ", ".join(shown + ([f"window={self.window}"] if self.window else []))


class Attention(nn.Module):
    """project (q, k, v) -> q/k norms (Qwen3) -> rotary -> inner (the attention core) -> out
    (output projection)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        h, hd, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.head_dim = hd
        self.q_proj = Linear(h, cfg.num_heads * hd, bias)
        self.k_proj = Linear(h, cfg.num_kv_heads * hd, bias)
        self.v_proj = Linear(h, cfg.num_kv_heads * hd, bias)
        self.o_proj = Linear(cfg.num_heads * hd, h)
        # Per-head RMSNorm of queries and keys (over head_dim, one weight shared by the heads).
        self.q_norm = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None
        self.rotary = Rotary()
        self.inner = CausalAttention(window=cfg.window_of(layer))

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        q, k, v = self.project(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, rope)
        return self.out(self.inner(q, k, v, rope.positions, rope.documents))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [b, s, hidden] -> q, k, v [b, s, heads, head_dim]."""
        return tuple(self._heads(proj(x)) for proj in (self.q_proj, self.k_proj, self.v_proj))

    def out(self, attended: torch.Tensor) -> torch.Tensor:
        return self.o_proj(attended.flatten(2))

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(t.shape[0], t.shape[1], -1, self.head_dim)


class SwiGLUActivation(nn.Module):
    """silu(gate) * up, times a per-row weight when given (the routed experts' routing weights:
    `ops.swiglu`), parameterless (selective recomputation wraps it, fused kernels and FP8 swap
    it; each takes the weight)."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor,
                weight: torch.Tensor | None = None) -> torch.Tensor:
        return ops.swiglu(gate, up, weight)


class FeedForward(nn.Module):
    """The gated MLP: project (the input projections) -> act -> out (the output projection).

    `in_projections` / `out_projection` name the linears, so that tensor parallel can split any
    feed-forward of this shape (column-parallel in, row-parallel out) without knowing its names."""

    in_projections = ("gate_proj", "up_proj")
    out_projection = "down_proj"

    def __init__(self, hidden_size: int, ffn_hidden_size: int):
        super().__init__()
        self.gate_proj = Linear(hidden_size, ffn_hidden_size)
        self.up_proj = Linear(hidden_size, ffn_hidden_size)
        self.down_proj = Linear(ffn_hidden_size, hidden_size)
        self.act = SwiGLUActivation()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(*self.project(x)))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name)(x) for name in self.in_projections)

    def out(self, h: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.out_projection)(h)


def make_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    """The feed-forward of layer `layer`: the dense MLP, or (a mixture of experts past its first
    `first_k_dense` layers) the MoE, whose shared experts are one dense MLP as wide as all of
    them."""
    if not cfg.num_experts or layer < cfg.first_k_dense:
        return FeedForward(cfg.hidden_size, cfg.ffn_hidden_size)
    shared = None
    if cfg.shared_experts:
        shared = FeedForward(cfg.hidden_size, cfg.shared_experts * cfg.expert_ffn_hidden_size)
    return MoE(cfg, SwiGLUActivation(), shared)


def make_attention(cfg: ModelConfig, layer: int = 0) -> nn.Module:
    """Multi-head attention, or (model.attention=mla) DeepSeek's multi-head latent attention
    (models/mla.py), made of this file's layers; layer `layer`'s sliding window."""
    if cfg.attention == "mla":
        return LatentAttention(cfg, Linear, RMSNorm, Rotary(),
                               CausalAttention(window=cfg.window_of(layer)))
    return Attention(cfg, layer)


# The attention classes a strategy finds in a block (both have the `rotary` and `inner` seams).
ATTENTION_TYPES = (Attention, LatentAttention)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = make_attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = make_mlp(cfg, layer)

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class LanguageModelLoss(nn.Module):
    """Parameterless: the summed token cross-entropy of the head's logits, over the targets that
    count (a target below 0, the data's IGNORE, counts nothing: a prompt's token, a document's
    last). It takes the head's input and weight rather than logits, so that a replacement may
    never build the full logits (vocabulary-parallel, or chunked)."""

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor,
                targets: torch.Tensor) -> torch.Tensor:
        return ops.cross_entropy(ops.linear(hidden, weight), targets)


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.num_layers)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        self.criterion = LanguageModelLoss()
        # Multi-token prediction (models/mtp.py): depth k's block is of the kind a layer
        # num_layers + k would have (an MoE past first_k_dense).
        self.mtp = None if not cfg.mtp_layers else MultiTokenPrediction(
            [MTPLayer(cfg.hidden_size, cfg.norm_eps, Linear, RMSNorm, Block(cfg, cfg.num_layers + k))
             for k in range(cfg.mtp_layers)])

    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.output is None else self.output.weight

    # -- the pieces of a forward, which a pipeline stage calls for its part -------------------
    def rope(self, positions: torch.Tensor, documents: Documents | None = None) -> Rope:
        """Rotary tables of these positions (within their documents, given `documents`), once
        per forward for every layer; the attention cores read the documents from them."""
        return ops.rotary_tables(positions, self.cfg.rotary_dim, self.cfg.rope_theta,
                                 self.cfg.rope_scaling, documents)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)

    def run_layers(self, x: torch.Tensor, rope: Rope,
                   layer_ids: Iterable[int] | None = None) -> torch.Tensor:
        layers = self.layers.values() if layer_ids is None else \
            (self.layers[str(i)] for i in layer_ids)
        for layer in layers:
            x = layer(x, rope)
        return x

    def head(self, x: torch.Tensor, targets: torch.Tensor | None = None,
             rope: Rope | None = None, future: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm and output head: the summed token loss given targets, else the logits.
        With multi-token prediction, `future` targets (models/mtp.py) and a gradient to take,
        the MTP losses are attached to the main loss (the one returned)."""
        h = self.norm(x)
        if targets is None:
            return ops.linear(h, self.head_weight())
        weight = self.head_weight()
        loss = self.criterion(h, weight, targets)
        if self.mtp is not None and future is not None and torch.is_grad_enabled():
            loss = self.mtp(loss, x, rope, future, self.embed_tokens,
                            lambda hidden, t: self.criterion(hidden, weight, t))
        return loss

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                targets: torch.Tensor | None = None,
                documents: Documents | None = None,
                future: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [batch, seq] -> logits [batch, seq, vocab], or the summed token loss when
        `targets` are given (targets below 0 count nothing; `future`: multi-token prediction's
        targets). A pruned model (no embedding or head) passes hidden states through.
        `documents`: the packed documents' boundaries, which attention does not cross."""
        if positions is None:  # the input's own sequence (token ids are never split)
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed_tokens(tokens) if self.embed is not None else tokens
        rope = self.rope(positions, documents)
        x = self.run_layers(x, rope)
        return x if self.norm is None else self.head(x, targets, rope, future)

    def block_slots(self) -> list[tuple[str, nn.Module, str]]:
        """(parameter prefix, holder, attribute) of every transformer block this model holds:
        the layers, then the MTP modules' blocks. A strategy that rebases blocks replaces
        `getattr(holder, attribute)` (a ModuleDict takes its keys as attributes)."""
        slots = [(f"layers.{key}", self.layers, key) for key in self.layers]
        if self.mtp is not None:
            slots += [(f"mtp.{key}.block", layer, "block") for key, layer in self.mtp.items()]
        return slots

    def shard_units(self) -> list[list[nn.Module]]:
        """Modules whose parameters are gathered together (ZeRO-3), in forward order: the
        embedding, each layer, the head (final norm and the module holding the head weight:
        with tied embeddings that is the embedding, so the two units share a weight), each MTP
        layer (which starts at its enorm and, as the head, is used until the forward ends: its
        final norm runs outside its own call)."""
        units = [[self.embed]] if self.embed is not None else []
        units += [[layer] for layer in self.layers.values()]
        if self.norm is not None:
            units.append([self.norm, self.output if self.output is not None else self.embed])
        if self.mtp is not None:
            units += [[layer.enorm, layer] for layer in self.mtp.values()]
        return units


# ---------------------------------------------------------------------------------------------
# Initialisation that depends only on (seed, parameter name): the same weights whatever the layout.


def _name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_weights(model: Llama, seed: int) -> None:
    """Normal(0, 0.02) for matrices, with the residual-output projections scaled by 1/sqrt(2L) as in
    GPT-2, ones for norms, zeros for biases. Each tensor draws from its own generator seeded by its
    name (the stacked experts of a layer as one tensor, which expert parallel then slices); buffers
    (the experts' bias) start at zero."""
    std = 0.02
    out_std = std / math.sqrt(2 * model.cfg.num_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            if name.endswith(".bias"):
                p.zero_()
                continue
            gen = torch.Generator(device="cpu").manual_seed(_name_seed(seed, name))
            out = name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj"))
            s = out_std if out else std
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * s)


def build_model(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu") -> Llama:
    model = Llama(cfg)
    init_weights(model, seed)
    return model.to(device)

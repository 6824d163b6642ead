"""Which SDPA kernel runs the attention core, chosen by measuring them on the device.

On CUDA, PyTorch's scaled-dot-product attention has three fused kernels: cuDNN's (fastest on
Hopper for training shapes by transformers' and PyTorch's own measurements, but not for every
shape, dtype and driver), FlashAttention-2, and the memory-efficient one. `choose_backend` times
the forward and backward of each candidate at the run's shape (micro-batch, sequence, this rank's
heads and kv heads, head dim, dtype), drops any that fails or disagrees with the others, and
picks the fastest; cuDNN is tried with grouped kv heads as given and with them expanded; with
values of their own head width (multi-head latent attention) only the kernels that take them
(`ops.takes_value_width`: cuDNN and the memory-efficient one, not FlashAttention-2). The
choice is cached in the process and on disk (keyed by GPU, torch, cuDNN and shape), so a run's
ranks and its next runs use the same kernel. `apply_attention_backend` swaps each plain
attention core (`Attention.inner`, a parameterless child) for one that names it; context
parallel's cores are left alone (they run their own blocks). A CPU has one kernel: PyTorch's
fused CPU attention, in fp32 (`ops.attention`).
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import torch
from torch import nn

from ultrascale.models import ops
from ultrascale.models.llama import ATTENTION_TYPES, CausalAttention
from ultrascale.models.mla import LatentAttention
from ultrascale.parallel.seams import Checkpointed

_CHOSEN: dict[str, dict] = {}  # shape key -> probe result, this process


def describe_cpu() -> str:
    return "PyTorch's fused CPU kernel (SDPA), in fp32"


def candidates(grouped: bool, dtype: torch.dtype = torch.bfloat16, head_dim: int = 0,
               v_dim: int = 0) -> list[str]:
    """The kernels worth timing: "+expand" only for grouped kv heads, and for values of a width
    of their own (multi-head latent attention) only the kernels that take it
    (`ops.takes_value_width`: not FlashAttention-2)."""
    return [c for c in ops.SDPA_BACKENDS if (grouped or "+" not in c) and
            (not v_dim or v_dim == head_dim or
             ops.takes_value_width(c.partition("+")[0], dtype, head_dim, v_dim))]


def _cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "ultrascale" / "sdpa_probe.json"


def _read_cache() -> dict:
    try:
        return json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, result: dict) -> None:
    """Best effort, atomic (ranks of one machine may write at once)."""
    try:
        path = _cache_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {**_read_cache(), key: result}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError:
        pass


def _fwd_bwd(q, k, v, backend: str):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = ops.attention(q, k, v, causal=True, backend=backend)
    out.backward(torch.ones_like(out))
    return out.detach(), q.grad


def _time_ms(fn, repeats: int) -> float:
    fn()  # warm-up (and the kernel's own setup)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def probe(device: torch.device, dtype: torch.dtype, batch: int, seq: int, heads: int,
          kv_heads: int, head_dim: int, v_dim: int | None = None, repeats: int = 5) -> dict:
    """{"backend": the fastest that ran and agreed, "ms": {candidate: ms or why not}}; values
    `v_dim` wide (None: head_dim)."""
    g = torch.Generator(device=device).manual_seed(0)
    v_dim = v_dim or head_dim
    q, k, v = (torch.randn(batch, seq, h, d, generator=g, device=device, dtype=dtype)
               for h, d in ((heads, head_dim), (kv_heads, head_dim), (kv_heads, v_dim)))
    results, reference = {}, None
    for cand in candidates(heads != kv_heads, dtype, head_dim, v_dim):
        try:
            out, dq = _fwd_bwd(q, k, v, cand)
            if reference is not None:
                err = max(float((a.float() - b.float()).abs().max() / b.float().abs().max())
                          for a, b in zip((out, dq), reference))
                if err > 2e-2:  # bf16 kernels agree to ~1e-2 of the largest value
                    results[cand] = f"disagrees ({err:.1e} of the largest value)"
                    continue
            reference = reference or (out, dq)
            results[cand] = _time_ms(lambda: _fwd_bwd(q, k, v, cand), repeats)
        except (RuntimeError, ValueError, NotImplementedError) as exc:
            results[cand] = f"refused: {str(exc).splitlines()[0][:120]}"
    timed = {c: ms for c, ms in results.items() if isinstance(ms, float)}
    if not timed:
        raise RuntimeError(f"no SDPA kernel runs attention of this shape on {device}: {results}")
    return {"backend": min(timed, key=timed.get), "ms": results}


def choose_backend(device: torch.device, dtype: torch.dtype, batch: int, seq: int, heads: int,
                   kv_heads: int, head_dim: int, v_dim: int | None = None) -> dict:
    """The probe's result for this shape, from the caches when it has run before."""
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    key = (f"{torch.cuda.get_device_name(device)}|torch {torch.__version__}|cudnn {cudnn}|"
           f"{dtype}|b{batch} s{seq} h{heads} kv{kv_heads} d{head_dim}"
           + (f" dv{v_dim}" if v_dim and v_dim != head_dim else ""))
    if key not in _CHOSEN:
        cached = _read_cache().get(key)
        if cached is None:
            cached = probe(device, dtype, batch, seq, heads, kv_heads, head_dim, v_dim)
            _write_cache(key, cached)
        _CHOSEN[key] = cached
    return _CHOSEN[key]


def _cores(model: nn.Module):
    """(holder, attribute) of every plain attention core, under a checkpoint if there is one."""
    for module in model.modules():
        if isinstance(module, ATTENTION_TYPES):
            holder, name = module, "inner"
            while isinstance(getattr(holder, name), Checkpointed):  # selective recompute
                holder, name = getattr(holder, name), "wrapped"
            if type(getattr(holder, name)) is CausalAttention:
                yield holder, name


def _core_shape(attn: nn.Module) -> tuple[int, int, int, int]:
    """(query heads, kv heads, query-key width, value width) this rank's attention core sees:
    multi-head attention's, or MLA's (a kv head per query head, values of their own width)."""
    if isinstance(attn, LatentAttention):
        heads = attn.kv_b_proj.weight.shape[0] // (attn.nope + attn.v_dim)
        return heads, heads, attn.qk_dim, attn.v_dim
    return (attn.q_proj.weight.shape[0] // attn.head_dim,
            attn.k_proj.weight.shape[0] // attn.head_dim, attn.head_dim, attn.head_dim)


def apply_attention_backend(model: nn.Module, device: torch.device, dtype: torch.dtype,
                            batch: int, seq: int) -> str:
    """Swap every plain attention core for one that runs the kernel measured fastest at this
    rank's shape; returns the run's header line for attention."""
    if device.type != "cuda":
        return describe_cpu()
    cores = list(_cores(model))
    if not cores:
        return "context parallel's own attention (ring, all-gather or Ulysses blocks)"
    attn = next(m for m in model.modules() if isinstance(m, ATTENTION_TYPES))
    result = choose_backend(device, dtype, batch, seq, *_core_shape(attn))
    for holder, name in cores:
        setattr(holder, name, CausalAttention(result["backend"],
                                              window=getattr(holder, name).window))
    timings = ", ".join(f"{c} {ms:.2f} ms" if isinstance(ms, float) else f"{c} {ms}"
                        for c, ms in result["ms"].items())
    return f"SDPA {result['backend']} (measured forward + backward: {timings})"

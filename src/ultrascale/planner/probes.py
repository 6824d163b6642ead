"""The compute probes `ultrascale calibrate` times on every rank at once (calibrate.py runs them):
linear layers' matmuls across sizes and narrow shapes, causal attention at a few head dims, a copy,
a block's host work, its elementwise work at two sizes, the optimizer update (each in fp32 and bf16
where a run's dtype changes it); and how their times become a profile's rates (the efficiency curve,
the in-cache and out-of-cache efficiencies). torch and numpy are imported inside the functions
that use them (the CLI imports calibrate.py to register the subcommand).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ultrascale.planner.hardware import Hardware

DTYPES = ("fp32", "bf16")
# Each timed sample repeats the call for at least this long (a single call of a small kernel mostly
# measures the timer). A compute sample runs on every rank at once, the same number of calls, from
# one barrier to the next: the time it takes all of them (one rank may get ahead of its fair share
# of a core for a while, the slowest cannot). The probes are sampled in rounds, each round going
# once through all of them, and each compute probe keeps its fastest round: other jobs on a shared
# machine only ever slow a round down, and load that comes and goes then weighs on no probe in
# particular.
MIN_SAMPLE_S = 0.1
ROUNDS = 4
MATMUL_SIZES = [64, 128, 192, 256, 384, 512, 768]
QUICK_SIZES = [64, 128, 256, 512]
BLOCK = dict(hidden=512, heads=8, kv_heads=4, ffn=1536, tokens=256)  # a small training block
# The same block's elementwise work at 2048 tokens: its widest activation (12 MiB) is several
# times a core's L2, as the copy probe's 64 MiB are, so it runs out of that cache where BLOCK may
# run in it.
BLOCK_OUT_OF_CACHE = dict(BLOCK, tokens=2048)
UPDATE_NUMEL = 2**22
# AdamW on fp32 reads the parameter, gradient and both moments and writes three back.
ADAMW_MIN_BYTES = 28.0
# Linear layers with a narrow dimension, as a small model's are: (tokens, in, out). Beside the
# square ones they tell a GEMM's size from its smallest dimension (`curves.efficiency_surface`):
# each narrow dimension square and four times wider on the other side, both ways round.
NARROW_GEMMS = [(1024, d, w) for d in (32, 64, 128) for w in (d, 4 * d)] + [
    (1024, 4 * d, d) for d in (32, 64, 128)]
QUICK_NARROW_GEMMS = [(1024, 32, 128), (1024, 128, 128)]
# Causal attention with grouped kv heads (two query heads a kv head) at a few head dimensions:
# the CPU kernel's rate falls with the head dimension (`Hardware.attention_eff_by_head_dim`).
ATTENTION = dict(batch=2, seq=256, heads=8, kv_heads=4)
ATTENTION_HEAD_DIMS = (32, 64, 128)
ATTENTION_REFERENCE_DIM = 64  # the head dimension of `Hardware.attention_eff_by_dtype`


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def core_cache_bytes() -> float | None:
    """A core's own cache, its L2 (bytes), as the C library or Linux's sysfs reports it; None where
    neither says."""
    try:
        size = os.sysconf("SC_LEVEL2_CACHE_SIZE")
        if size > 0:
            return float(size)
    except (AttributeError, ValueError, OSError):
        pass
    path = Path("/sys/devices/system/cpu/cpu0/cache/index2/size")
    try:
        text = path.read_text().strip().upper()
    except OSError:
        return None
    scale = {"K": 2**10, "M": 2**20}.get(text[-1:], 1)
    digits = text.rstrip("KM")
    return float(digits) * scale if digits.isdigit() else None


def cache_efficiencies(eff_small: float, eff_large: float, cache_bytes: float | None,
                       small: dict = BLOCK, large: dict = BLOCK_OUT_OF_CACHE,
                       dtype_bytes: int = 4) -> tuple[float, float | None]:
    """(hbm_eff, cached_eff) from the elementwise probe's efficiency at two sizes. The small probe
    runs wholly in a core's L2, so its efficiency is the in-cache one; the large one runs the share
    `theory.rates.cached_share` gives its working set at that rate and the rest out of the cache, which
    leaves one unknown. Without a cache size, or when the sizes do not tell the rates apart (the
    larger not slower: noise; or a cache that holds most of the large probe too), the large
    probe's figure alone: (eff_large, None). Also where the small probe does not fit in the cache
    (a 512 KiB L2 against its 1.5 MiB): solving two mostly out-of-cache probes for the in-cache
    rate turned their few percent of noise into the answer (no figure, 0.85 and 1.0 in three
    calibrations on a 2-core EPYC within five minutes). `dtype_bytes`: of the probes' tensors (their
    working sets halve in bf16)."""
    from ultrascale.theory.rates import block_working_set

    if not cache_bytes:
        return eff_large, None
    c_small, c_large = (
        min(1.0, cache_bytes / block_working_set(b["tokens"], b["hidden"], b["ffn"], dtype_bytes))
        for b in (small, large))
    if c_small < 1.0 or c_large > 0.9 or eff_large >= eff_small:
        return eff_large, None
    # 1 / eff_large = c_large / eff_small + (1 - c_large) / hbm_eff
    hbm_eff = (1 - c_large) / (1 / eff_large - c_large / eff_small)
    return min(1.0, hbm_eff), min(1.0, eff_small)


def inner_calls(fn) -> int:
    """Calls per sample: enough for MIN_SAMPLE_S (after a warm-up call: allocations, kernels)."""
    fn()
    t0 = time.perf_counter()
    fn()
    return max(1, min(1000, int(MIN_SAMPLE_S / max(time.perf_counter() - t0, 1e-7))))


def sample(fn, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def fit_efficiency_curve(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Fit rate = peak * F / (F + half) to the measured points, in relative (log) error so that the
    small sizes weigh as much as the large ones. Returns (peak, half); (the best rate, 0.0) where
    the rates do not level off. In numpy alone (curves.py): calibrate runs on requirements.txt."""
    from ultrascale.planner.curves import efficiency_curve

    return efficiency_curve(points)


def attention_probe(dtype: str, head_dim: int) -> str:
    """The attention probe's name in `dtype` at `head_dim`."""
    return f"attention/{dtype}/d{head_dim}"


def matmul_probe(dtype: str, tokens: int, d_in: int, d_out: int) -> str:
    """The name of the probe of a linear layer from `d_in` to `d_out` on `tokens` rows (a square
    probe of size n: `matmul/<dtype>/<n>`)."""
    if tokens == d_in == d_out:
        return f"matmul/{dtype}/{tokens}"
    return f"matmul/{dtype}/{tokens}x{d_in}x{d_out}"


def matmul_dims(name: str) -> tuple[int, int, int]:
    """(tokens, in, out) of a matmul probe's name."""
    dims = [int(x) for x in name.split("/")[2].split("x")]
    return (dims[0],) * 3 if len(dims) == 1 else tuple(dims)


def overhead_probe(dtype: str) -> str:
    """The host-work probe's name in `dtype` (fp32's keeps the name older calibrations used)."""
    return "overhead" if dtype == "fp32" else f"overhead/{dtype}"


def elementwise_probe_name(dtype: str, out_of_cache: bool = False) -> str:
    """The elementwise probe's name in `dtype` at BLOCK's size or BLOCK_OUT_OF_CACHE's (fp32's keep
    the names older calibrations used)."""
    name = "elementwise_out_of_cache" if out_of_cache else "elementwise"
    return name if dtype == "fp32" else f"{name}/{dtype}"


def attention_flops(seq: int, heads: int, dim: int, batch: int = 1) -> float:
    """Forward FLOPs of causal attention: QK^T and PV over half the score matrix."""
    return 2 * 2 * batch * seq * seq * heads * dim * 0.5


def block_config(hidden: int, heads: int, kv_heads: int, ffn: int):
    from ultrascale.config import ModelConfig

    return ModelConfig(preset=None, hidden_size=hidden, num_layers=1, num_heads=heads,
                       num_kv_heads=kv_heads, ffn_hidden_size=ffn, vocab_size=16)


def _block(hidden: int, heads: int, kv_heads: int, ffn: int):
    from ultrascale.models.llama import Block

    cfg = block_config(hidden, heads, kv_heads, ffn)
    return cfg, Block(cfg)


def compute_probes(quick: bool = False) -> dict:
    """name -> one call of each compute probe (timed per call):

    - `matmul/<dtype>/<n>`: the three GEMMs of a square linear layer's forward and backward
      (y = x W^T, dx = dy W, dW = dy^T x), without autograd's host work (priced apart);
      `matmul/<dtype>/<tokens>x<in>x<out>` the same for the narrow layers of NARROW_GEMMS;
    - `attention/<dtype>/d<head_dim>`: causal scaled_dot_product_attention (ATTENTION, grouped
      kv heads), forward and backward, in each compute dtype at each of ATTENTION_HEAD_DIMS;
    - `copy`: a 64 MiB copy;
    - `overhead` (fp32), `overhead/bf16`: a transformer block's forward and backward on 4 tokens
      (its host work), with its parameters and input in that dtype;
    - `elementwise`: the elementwise work of a block of training size (BLOCK), forward and
      backward, with the model's own pieces: two RMSNorms (with their casts to fp32 and back in
      bf16), rotary on q and k, silu(gate) * up, two residual adds; `elementwise_out_of_cache`
      the same at 2048 tokens; `elementwise/bf16`, `elementwise_out_of_cache/bf16` both in bf16,
      as a bf16 run's parameters and activations are (a CPU runs them at about fp32's time per
      element, so at a smaller share of the bandwidth per byte);
    - `update`: the runtime's update of UPDATE_NUMEL parameters (`update_call`).
    """
    import torch

    probes = {}
    squares = [(n, n, n) for n in (QUICK_SIZES if quick else MATMUL_SIZES)]
    for dtype in DTYPES:
        for tokens, d_in, d_out in squares + (QUICK_NARROW_GEMMS if quick else NARROW_GEMMS):
            probes[matmul_probe(dtype, tokens, d_in, d_out)] = linear_probe(tokens, d_in, d_out,
                                                                            dtype)
    for dtype in DTYPES:  # a CPU's bf16 attention kernel runs far below its bf16 GEMMs
        for head_dim in ATTENTION_HEAD_DIMS:
            probes[attention_probe(dtype, head_dim)] = attention_call(head_dim, dtype)
    src = torch.empty(16 * 2**20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    probes["copy"] = lambda: dst.copy_(src)
    for dtype in DTYPES:
        probes[overhead_probe(dtype)] = overhead_call(dtype)
    for dtype in DTYPES:
        probes[elementwise_probe_name(dtype)] = elementwise_probe(**BLOCK, dtype=dtype)
        probes[elementwise_probe_name(dtype, out_of_cache=True)] = elementwise_probe(
            **BLOCK_OUT_OF_CACHE, dtype=dtype)
    probes["update"] = update_call()
    return probes


def update_call(impl: str = "fused"):
    """One call: the runtime's update of UPDATE_NUMEL parameters in four tensors, as
    `training.optimizer_impl` runs it (parallel/flat.py: the gradients' fp64-accumulated squared
    norm, AdamW, the clip coefficient 1); the calibration times the default, fused."""
    import torch

    from ultrascale.parallel.flat import GradSqSum, adamw

    params = [torch.nn.Parameter(torch.randn(UPDATE_NUMEL // 4)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = adamw(params, [], 1e-4, (0.9, 0.95), 0.1, impl)
    sq_sum = GradSqSum([1] * len(params), impl, torch.device("cpu"))
    grads = [p.grad for p in params]
    return lambda: (sq_sum(grads), opt.step())


def linear_probe(tokens: int, d_in: int, d_out: int, dtype: str):
    """One call: the three GEMMs of a linear layer from `d_in` to `d_out` on `tokens` rows,
    forward and backward (y = x W^T, dx = dy W, dW = dy^T x)."""
    import torch

    dt = _torch_dtype(dtype)
    x, w, g = (torch.randn(tokens, d_in, dtype=dt), torch.randn(d_out, d_in, dtype=dt),
               torch.randn(tokens, d_out, dtype=dt))
    return lambda: (torch.mm(x, w.t()), torch.mm(g, w), torch.mm(g.t(), x))


def attention_call(head_dim: int, dtype: str):
    """One call: causal attention (ATTENTION, grouped kv heads) at `head_dim`, forward and
    backward."""
    import torch

    from ultrascale.models import ops

    a, dt = ATTENTION, _torch_dtype(dtype)
    q = torch.randn(a["batch"], a["seq"], a["heads"], head_dim, dtype=dt, requires_grad=True)
    k, v = (torch.randn(a["batch"], a["seq"], a["kv_heads"], head_dim, dtype=dt,
                        requires_grad=True) for _ in range(2))
    return lambda: ops.attention(q, k, v, causal=True).sum().backward()


def overhead_call(dtype: str):
    """One call: a small block's forward and backward on 4 tokens, in `dtype` (its host work)."""
    import torch

    from ultrascale.models import ops

    cfg, block = _block(16, 2, 2, 32)
    block = block.to(_torch_dtype(dtype))
    x = torch.randn(1, 4, 16, dtype=_torch_dtype(dtype), requires_grad=True)
    positions = torch.arange(4)
    # The tables each forward, in fp32, as the model makes them (`Transformer.rope`).
    return lambda: block(x, ops.rotary_tables(positions, cfg.head_dim, cfg.rope_theta)
                         ).sum().backward()


def steady_allocator() -> bool:
    """Keep freed memory in the process, as a running trainer's allocator does.

    A fresh process's glibc malloc serves each multi-megabyte temporary (a probe's output, the
    float64 copy of a gradient in the norm) with a new mmap and returns it on free, so every call
    pays page faults; a trainer that has run a step reuses its heap instead. On the 2-core dev
    box the update probe cost 14.4 ns per parameter on one core in a fresh process, 3.5 ns with
    the memory kept, when it ran the per-tensor path; the fused path it runs now takes about 0.6
    of the per-tensor path's time (`benchmarks/update_probe_cpu.py` prints both). Returns whether it applied (False without
    glibc, where nothing changes)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    # 32 MiB is glibc's largest mmap threshold: bigger blocks are mmapped whatever we ask.
    return bool(mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))


def measure_compute(quick: bool = False, barrier=lambda: None, agree=lambda n: n,
                    rounds: int = ROUNDS) -> dict:
    """Seconds per call of each compute probe on this process's threads, every rank computing at
    once: the fastest of the rounds. `barrier` lines the ranks up before and after each sample,
    `agree` gives every rank the same number of calls (the largest any rank asks for)."""
    probes = compute_probes(quick)
    inner = {name: agree(inner_calls(fn)) for name, fn in probes.items()}
    times: dict[str, list[float]] = {name: [] for name in probes}
    for _ in range(rounds):
        for name, fn in probes.items():
            barrier()
            t0 = time.perf_counter()
            for _ in range(inner[name]):
                fn()
            barrier()  # until the slowest rank is done
            times[name].append((time.perf_counter() - t0) / inner[name])
    return {name: min(t) for name, t in times.items()}


def elementwise_probe(hidden: int, heads: int, kv_heads: int, ffn: int, tokens: int,
                      dtype: str = "fp32"):
    """One call: a block's elementwise work, forward and backward, with every parameter and
    activation in `dtype` (as `precision.dtype` holds them: no autocast)."""
    import torch

    from ultrascale.models import ops
    from ultrascale.models.llama import RMSNorm

    hd, dt = hidden // heads, _torch_dtype(dtype)
    norm1, norm2 = RMSNorm(hidden).to(dt), RMSNorm(hidden).to(dt)
    x = torch.randn(1, tokens, hidden, dtype=dt, requires_grad=True)
    q = torch.randn(1, tokens, heads, hd, dtype=dt, requires_grad=True)
    k = torch.randn(1, tokens, kv_heads, hd, dtype=dt, requires_grad=True)
    gate, up = (torch.randn(1, tokens, ffn, dtype=dt, requires_grad=True) for _ in range(2))
    positions = torch.arange(tokens)

    def step():
        rope = ops.rotary_tables(positions, hd, 10000.0)
        r = x + norm1(x)
        out = (norm2(r) + r).sum() + ops.rotary(q, rope).sum()
        out = out + ops.rotary(k, rope).sum() + ops.swiglu(gate, up).sum()
        out.backward()

    return step


def elementwise_efficiency(hw: Hardware, elementwise_s: float, hidden: int, heads: int,
                           kv_heads: int, ffn: int, tokens: int, dtype: str = "fp32") -> float:
    """Fraction of the copy bandwidth that a block's elementwise work in `dtype` reaches (unfused
    kernels: several passes per byte the cost model counts): the bytes the model counts for one
    block in that dtype, forward and backward, at the copy bandwidth, over the measured time of
    that work."""
    from ultrascale.layout import Layout
    from ultrascale.planner.cost import block_times

    cfg = block_config(hidden, heads, kv_heads, ffn)
    lay = Layout(mbs=1, seq_len=tokens, dtype=dtype)
    # At the full copy bandwidth, whatever cache model and dtype efficiencies the profile has.
    parts = block_times(cfg, lay, hw.with_(hbm_eff=1.0, cache_bytes=None, cached_eff=None,
                                           hbm_eff_by_dtype={}, cached_eff_by_dtype={}))
    counted = parts["elementwise_f"] + parts["elementwise_b"]
    return min(1.0, max(0.01, counted / elementwise_s))

"""The device, and the pieces of a step measured alone (run.py starts each as a subprocess):

    python benchmarks/gpu/micro.py env --json OUT          # GPU, versions, bf16 GEMM, copy rate
    python benchmarks/gpu/micro.py optimizer --json OUT    # the optimizer path, both impls
    python benchmarks/gpu/micro.py loss_attention --json OUT

- env: device name, SMs, memory, torch / CUDA / cuDNN versions, an 8192^3 bf16 matmul's
  TFLOP/s and a device-to-device copy's GB/s (read and written), nvidia-smi's clocks and power.
- optimizer: the 1B model's tensors (bf16 parameters, fp32 masters, fp32 gradients): our norm +
  clip + step (`parallel/flat.py`) with `training.optimizer_impl` per_tensor and fused, and torch's
  reference (fp32 parameters, `clip_grad_norm_(foreach=True)`, `AdamW(fused=True)`, a
  `_foreach_copy_` into bf16 copies); ms (CUDA events, median of 5) and the step's peak MiB.
- loss_attention: the head's loss over 8192 tokens and Llama 3's 128256-token vocabulary,
  forward + backward: eager (fp32 upcast of the logits), compiled (`parallel/compile.py`'s
  compiled loss), chunked (8 chunks); and the attention probe (`parallel/attention_backend.py`)
  at the 1B's shape: each SDPA kernel's forward + backward ms, and the one chosen; and
  DeepSeek-V3's MLA core (192-wide queries and keys, 128-wide values, 128 heads, 4,096 tokens):
  each kernel's TFLOP/s and share of the bf16 peak.
`--smoke`: tiny sizes on the CPU (nothing compiled; CPU timers).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

GIB = 2 ** 30


def timed_ms(fn, device: torch.device, repeats: int = 5, warmup: int = 2) -> float:
    """Median milliseconds of fn() (CUDA events on a GPU, wall time on a CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def env(smoke: bool) -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()
           if torch.backends.cudnn.is_available() else None,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        out.update(sms=p.multi_processor_count, memory_gib=round(p.total_memory / GIB, 1),
                   l2_mib=getattr(p, "L2_cache_size", 0) / 2 ** 20)
    n = 512 if smoke else 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    ms = timed_ms(lambda: a @ b, device, repeats=10, warmup=3)
    out["bf16_matmul_tflops"] = 2 * n ** 3 / ms / 1e9
    big = torch.empty(2 ** 20 if smoke else 2 ** 30, dtype=torch.uint8, device=device)
    other = torch.empty_like(big)
    ms = timed_ms(lambda: other.copy_(big), device, repeats=10)
    out["copy_gb_per_s"] = 2 * big.numel() / ms / 1e6
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,"
                            "power.draw,power.limit,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        out["nvidia_smi"] = q.stdout.strip()
    return out


def _model(smoke: bool, device: torch.device):
    """The 1B model (or a tiny one) in bf16 on `device`, its weights drawn there (fast; the
    values do not matter here)."""
    from ultrascale.config import build_config
    from ultrascale.models.llama import Llama

    model_keys = {"preset": "llama3-1b"} if not smoke else {
        "preset": None, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
        "ffn_hidden_size": 128, "vocab_size": 512}
    cfg = build_config({"model": model_keys, "device": device.type}, [])
    with torch.device("meta"):
        model = Llama(cfg.model)
    model = model.to_empty(device=device).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model


def optimizer(smoke: bool) -> dict:
    from ultrascale.distributed import comm
    from ultrascale.distributed.mesh import ParallelContext
    from ultrascale.parallel.flat import clip_coefficient
    from ultrascale.parallel.replicated import Replicated

    device = torch.device("cpu" if smoke else "cuda")
    ctx = ParallelContext.without_mesh(device.type)
    comm.set_context(ctx)
    model = _model(smoke, device)
    g = torch.Generator(device=device).manual_seed(0)
    grads = {n: torch.randn(p.shape, generator=g, device=device, dtype=p.dtype) * 1e-3
             for n, p in model.named_parameters()}
    out = {"parameters": sum(p.numel() for p in model.parameters())}
    for impl in ("per_tensor", "fused"):
        owner = Replicated(model, ctx, impl=impl)
        owner.build_optimizer(3e-4, (0.9, 0.95), 0.1)

        def step():
            sq = owner.local_grad_sq_sum()
            _, coef = clip_coefficient(sq, 1.0, 1.0)
            owner.scale_grads(coef)
            owner.step(3e-4)

        def fresh():  # untimed: the gradients as a backward would hand them over
            for n, p in model.named_parameters():
                p.grad = grads[n]
            owner.finish()

        out[impl] = _timed_step(step, fresh, device)
        del owner, step, fresh  # its masters, gradients and moments: gone before the next
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["torch_reference"] = _torch_reference(model, grads, device)
    return out


def _timed_step(step, fresh, device: torch.device) -> dict:
    times = []
    for i in range(7):
        fresh()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        times.append(timed_ms(step, device, repeats=1, warmup=0))
    out = {"ms": statistics.median(times[2:])}
    if device.type == "cuda":
        out["step_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    return out


def _torch_reference(model, grads: dict, device: torch.device) -> dict:
    """torch's own: fp32 parameters with fused AdamW and foreach clipping, then the bf16 copies."""
    masters = [p.detach().float() for p in model.parameters()]
    groups = [{"params": [m for m in masters if m.dim() >= 2], "weight_decay": 0.1},
              {"params": [m for m in masters if m.dim() < 2], "weight_decay": 0.0}]
    adam = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), fused=True)
    low = list(model.parameters())

    def step():
        torch.nn.utils.clip_grad_norm_(masters, 1.0, foreach=True)
        adam.step()
        with torch.no_grad():
            torch._foreach_copy_(low, masters)

    def fresh():
        for m, (n, _) in zip(masters, model.named_parameters()):
            m.grad = grads[n].float()

    return _timed_step(step, fresh, device)


def loss_attention(smoke: bool) -> dict:
    from ultrascale.models import ops
    from ultrascale.models.llama import LanguageModelLoss
    from ultrascale.parallel.attention_backend import describe_cpu, probe
    from ultrascale.parallel.compile import compiled_class

    device = torch.device("cpu" if smoke else "cuda")
    tokens, hidden, vocab = (256, 32, 1000) if smoke else (8192, 2048, 128256)
    dtype = torch.float32 if smoke else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g, device=device, dtype=dtype)
    w = torch.randn(vocab, hidden, generator=g, device=device, dtype=dtype) * 0.02
    t = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    losses = {"eager": LanguageModelLoss(),
              "chunked": lambda a, b, c: ops.linear_cross_entropy(a, b, c)}
    if not smoke:
        losses["compiled"] = compiled_class(LanguageModelLoss)()
    out = {"shape": {"tokens": tokens, "hidden": hidden, "vocab": vocab, "dtype": str(dtype)}}
    for name, fn in losses.items():
        out[f"loss_{name}"] = _loss_row(fn, h, w, t, device)
    if smoke:
        out["attention"] = {"backend": "cpu", "note": describe_cpu()}
    else:
        out["attention"] = probe(device, torch.bfloat16, 4, 2048, 32, 8, 64)
    out["attention_mla"] = mla_core(smoke, device)
    return out


def mla_core(smoke: bool, device: torch.device) -> dict:
    """DeepSeek-V3's attention core (128 heads, queries and keys 192 wide, values 128, 4,096
    tokens, causal) forward and backward on each SDPA kernel that takes two widths: its TFLOP/s
    and its share of the card's bf16 peak, the figure the planner's `attention_eff` (fitted on
    the playbook's H100 runs, FlashAttention-2 at head widths 64 and 128) is compared with in
    docs/deepseek.md. Smoke: 4 heads of 24 / 16 at 128 tokens on the CPU kernel, fp32."""
    from ultrascale.devices import device_peak_flops
    from ultrascale.parallel.attention_backend import probe

    b, s, n, dqk, dv = (1, 128, 4, 24, 16) if smoke else (1, 4096, 128, 192, 128)
    # Per token and head, s / 2 keys on average (causal): forward 2 s' (dqk + dv), backward
    # 2 s' (3 dqk + 2 dv) (theory/mla.py's count).
    flops = b * s * s * n * (4 * dqk + 3 * dv)
    shape = {"batch": b, "seq": s, "heads": n, "qk_dim": dqk, "v_dim": dv, "flops": flops}
    if smoke:
        from ultrascale.models import ops

        q, k, v = (torch.randn(b, s, n, d, requires_grad=True) for d in (dqk, dqk, dv))
        ms = {"cpu": timed_ms(lambda: ops.attention(q, k, v, causal=True).sum().backward(),
                              device, repeats=3, warmup=1)}
        peak = None
    else:
        ms = probe(device, torch.bfloat16, b, s, n, n, dqk, dv)["ms"]
        peak = device_peak_flops(torch.cuda.get_device_name(device), "bf16")
    rows = {}
    for kernel, t in ms.items():
        if isinstance(t, float):
            rate = flops / (t * 1e-3)
            rows[kernel] = {"ms": t, "tflops": rate / 1e12,
                            "of_bf16_peak": rate / peak if peak else None}
        else:
            rows[kernel] = {"why_not": t}
    return {"shape": shape, "kernels": rows}


def _loss_row(fn, h, w, t, device: torch.device) -> dict:
    def run():
        a, b = h.detach().requires_grad_(), w.detach().requires_grad_()
        fn(a, b, t).backward()

    if device.type == "cuda":
        run()  # compiles, if it will
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    row = {"ms": timed_ms(run, device)}
    if device.type == "cuda":
        row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("env", "optimizer", "loss_attention"))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    result = {"env": env, "optimizer": optimizer, "loss_attention": loss_attention}[args.what](
        args.smoke)
    Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

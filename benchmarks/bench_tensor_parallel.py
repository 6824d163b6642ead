"""Our tensor parallel against PyTorch's DTensor tensor parallel, on the same model and ranks.

    python benchmarks/bench_tensor_parallel.py [--tp 4] [--steps 12] [--json out.json]
    python benchmarks/bench_tensor_parallel.py --smoke       # tp 2, a tiny model: it runs

Both sides start from the same full model (built from the seed, then split), run forward, the
vocabulary-parallel loss and backward of the same batch on the same tp process group, and zero
their gradients; one optimizer-free training step. PyTorch's side is
`torch.distributed.tensor.parallel.parallelize_module` with ColwiseParallel / RowwiseParallel
(and SequenceParallel + PrepareModuleInput with sequence parallel), as torchtitan applies it to
Llama, with `loss_parallel` for the sharded logits. Steps alternate between the two sides (ours,
theirs, ours, ...), after a warm-up, and the figure is the median of the per-pair ratios
ours / theirs (below 1.0: we are faster). The first losses of both sides are printed to show they
compute the same thing.

Runs on the GPU with NCCL when there are at least tp GPUs, else on the CPU with gloo.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from _spawn import slowest, spawn


def model_config(args):
    from ultrascale.config import ModelConfig
    return ModelConfig(preset=None, hidden_size=args.hidden, num_layers=args.layers,
                       num_heads=args.heads, num_kv_heads=args.kv_heads,
                       ffn_hidden_size=args.ffn, vocab_size=args.vocab, tie_embeddings=False)


def plain_linears(model: torch.nn.Module) -> torch.nn.Module:
    """Each of our linear layers (an nn.Linear whose matmul is a child module, the seam precision
    recipes swap) as a plain nn.Linear holding the same parameters: DTensor's parallel styles
    shard every submodule of a layer they apply to, and a parameterless child has no weight."""
    from ultrascale.models.llama import Linear

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                plain = torch.nn.Linear(child.in_features, child.out_features,
                                        bias=child.bias is not None, device=child.weight.device)
                plain.weight = child.weight
                plain.bias = child.bias
                setattr(parent, name, plain)
    return model


def dtensor_model(model, mesh, sp: bool):
    """torchtitan's tensor-parallel plan for Llama, with our module names, on plain nn.Linear
    layers (as torchtitan's model has)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    model = plain_linears(model)
    seq = Shard(1) if sp else Replicate()
    top = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
           "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                     use_local_output=False)}
    if sp:
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for block in model.layers.values():
        plan = {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
                "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(output_layouts=seq),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=seq)}
        if sp:
            plan.update({
                "attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1), None),
                                           desired_input_layouts=(Replicate(), None)),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),))})
        parallelize_module(block, mesh, plan)
    return model


def dtensor_step(model, tokens, targets):
    """Llama.forward, but through the `output` module so its parallel style applies."""
    from torch.distributed.tensor.parallel import loss_parallel
    x = model.embed(tokens)
    rope = model.rope(torch.arange(tokens.shape[1], device=tokens.device))
    for layer in model.layers.values():
        x = layer(x, rope)
    logits = model.output(model.norm(x))
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        (loss / targets.numel()).backward()
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


def rank_main(args) -> dict:
    """One rank (started by `_spawn.spawn`; `init_parallel` sets up its process groups)."""
    from ultrascale.config import build_config
    from ultrascale.distributed import comm
    from ultrascale.distributed.mesh import init_parallel
    from ultrascale.models.llama import build_model
    from ultrascale.parallel.tensor import apply_tensor_parallel

    device = "cuda" if args.cuda else "cpu"
    cfg = build_config({"model": model_config(args).model_dump(),
                        "parallel": {"dp": 1, "tp": args.tp}, "device": device,
                        "precision": {"dtype": "fp32"}}, [])
    ctx = init_parallel(cfg)
    comm.set_context(ctx)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(ctx.device)
    tokens, targets = batch[:, :-1], batch[:, 1:]

    ours = build_model(cfg.model, seed=0, device=ctx.device)
    apply_tensor_parallel(ours, ctx, sequence_parallel=args.sp, overlap=True)
    theirs = dtensor_model(build_model(cfg.model, seed=0, device=ctx.device), ctx.mesh["tp"],
                           args.sp)

    def our_step():
        loss = ours(tokens, targets=targets)  # the vocabulary-parallel loss is the model's
        (loss / targets.numel()).backward()
        return loss

    def their_step():
        return dtensor_step(theirs, tokens, targets)

    def timed(step, model):
        if args.cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        loss = step()
        model.zero_grad(set_to_none=True)
        if args.cuda:
            torch.cuda.synchronize()
        return slowest(time.perf_counter() - t0), float(loss.detach())

    first = (timed(our_step, ours)[1], timed(their_step, theirs)[1])
    for _ in range(args.warmup):
        timed(our_step, ours), timed(their_step, theirs)
    pairs = []
    for i in range(args.steps):
        # Alternate which side goes first so that neither always follows the other.
        if i % 2 == 0:
            a, b = timed(our_step, ours)[0], timed(their_step, theirs)[0]
        else:
            b, a = timed(their_step, theirs)[0], timed(our_step, ours)[0]
        pairs.append((a, b))
    return {"first_loss": first, "pairs": pairs}


def run(args) -> dict:
    out = spawn(args.tp, rank_main, args, timeout=1800, gloo=False)[0]  # all time the same steps
    ratios = [a / b for a, b in out["pairs"]]
    return {"sequence_parallel": args.sp, "first_loss_ours": out["first_loss"][0],
            "first_loss_dtensor": out["first_loss"][1],
            "median_step_s_ours": statistics.median(a for a, _ in out["pairs"]),
            "median_step_s_dtensor": statistics.median(b for _, b in out["pairs"]),
            "median_ratio": statistics.median(ratios),
            # The spread of the per-pair ratios: on a loaded machine it is wide.
            "ratio_quartiles": statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios,
            "pairs": out["pairs"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    p.add_argument("--sp", choices=["both", "on", "off"], default="both")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round: check that it runs")
    args = p.parse_args(argv)
    if args.smoke:
        vars(args).update(tp=2, hidden=64, layers=1, heads=4, kv_heads=2, ffn=128, vocab=256,
                          batch=1, seq=16, steps=1, warmup=0)
    args.cuda = torch.cuda.is_available() and torch.cuda.device_count() >= args.tp
    results = []
    for sp in {"both": (False, True), "on": (True,), "off": (False,)}[args.sp]:
        run_args = argparse.Namespace(**{**vars(args), "sp": sp})
        r = run(run_args)
        results.append(r)
        print(f"tp={args.tp} sequence_parallel={sp}: ours {r['median_step_s_ours'] * 1e3:.1f} ms, "
              f"DTensor {r['median_step_s_dtensor'] * 1e3:.1f} ms, median ratio "
              f"{r['median_ratio']:.3f} (quartiles {r['ratio_quartiles'][0]:.3f}-"
              f"{r['ratio_quartiles'][-1]:.3f}; first loss {r['first_loss_ours']:.6f} vs "
              f"{r['first_loss_dtensor']:.6f})", flush=True)
    summary = {"device": "cuda" if args.cuda else "cpu", "tp": args.tp,
               "model": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads",
                                                       "ffn", "vocab")},
               "batch": args.batch, "seq": args.seq, "steps": args.steps, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

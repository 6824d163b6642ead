"""Rank functions of the mixed-precision tests (module level: spawned ranks import them by
name)."""

from __future__ import annotations

import torch



def run_case(case: tuple[str, dict]) -> dict:
    """One case on this rank: ("train", config) trains and reports as the parity tests do, with
    fp16's skipped steps and loss scales; ("inspect", config) reports the matmul of every linear
    layer after `parallelize`; ("poison", config) overflows one rank's gradient by hand."""
    kind, data = case
    if kind == "train":
        return train_reporting_scales(data)
    if kind == "inspect":
        return inspect_matmuls(data)
    if kind == "poison":
        return poisoned_step(data)
    raise ValueError(kind)


def run_cases(cases: list[tuple[str, dict]]) -> list[dict]:
    return [run_case(c) for c in cases]


def train_reporting_scales(data: dict) -> dict:
    from ultrascale.config import Config
    from ultrascale.train.trainer import train

    result = train(Config.model_validate(data), return_state=True, generate_sample=False)
    return {"losses": result.losses, "grad_norms": result.grad_norms,
            "state": result.final_state, "loss_scales": result.loss_scales,
            "skipped": result.skipped_steps}


def _runtime(data: dict):
    from ultrascale.config import Config
    from ultrascale.distributed import comm
    from ultrascale.distributed.mesh import init_parallel
    from ultrascale.models.llama import build_model
    from ultrascale.parallel.apply import parallelize

    cfg = Config.model_validate(data)
    ctx = init_parallel(cfg)
    comm.set_context(ctx)
    return cfg, ctx, parallelize(build_model(cfg.model, cfg.training.seed), ctx, cfg)


def inspect_matmuls(data: dict) -> dict:
    """The class of each linear layer and of its matmul child, by module name, after every
    strategy has rebased or swapped what it does (tensor parallel, zero bubble's deferral)."""
    from ultrascale.models.llama import Linear

    def kind(matmul) -> str:  # a wrapping matmul (zero bubble's deferral) names what it wraps
        inner = getattr(matmul, "inner", None)
        return type(matmul).__name__ + (f"({kind(inner)})" if inner is not None else "")

    cfg, ctx, rt = _runtime(data)
    out = {name: (type(m).__name__, kind(m.matmul))
           for name, m in rt.module.named_modules() if isinstance(m, Linear)}
    dtypes = {p.dtype for p in rt.module.parameters()}
    return {"linears": out, "param_dtypes": sorted(str(d) for d in dtypes)}


def poisoned_step(data: dict) -> dict:
    """fp16: one micro-batch step where only rank 0's gradient holds an inf (put there by hand
    after the reduction). Every rank must skip the step (the gradient norm's all-reduce tells
    them) and halve the scale; no weight and no optimizer state may change."""
    cfg, ctx, rt = _runtime(data)
    t = cfg.training
    rt.build_optimizer(t.lr, (t.beta1, t.beta2), t.weight_decay)
    before = {n: v.clone() for n, v in rt.data_parallel.master_weights().items()}
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1),
                           generator=gen)
    scale = rt.loss_scale
    rt.forward_backward([(tokens[:, :-1], tokens[:, 1:])], 1.0 / tokens[:, 1:].numel())
    rt.finish_gradients()
    if ctx.rank == 0:
        name, g = next(iter(rt.data_parallel._grads()))
        g.view(-1)[0] = float("inf")
    norm = rt.clip_grad_norm(t.grad_clip)
    stepped = rt.optimizer_step(t.lr)
    after = rt.data_parallel.master_weights()
    unchanged = all(torch.equal(before[n], after[n]) for n in before)
    params_follow = all(torch.equal(p, after[n].to(p.dtype))
                        for n, p in rt.module.named_parameters())
    report = {"stepped": stepped, "norm": norm, "scale_before": scale,
              "scale_after": rt.loss_scale, "skipped": rt.skipped_steps,
              "weights_unchanged": unchanged, "params_follow_masters": params_follow,
              "optimizer_state": sum(len(s) for s in rt.optimizer.state.values())}
    return report


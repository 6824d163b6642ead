"""Shared pieces of the parity tests: a tiny config, the functions the ranks run, and the
comparisons against one process.

Parity means: same seed, same global batch -> the same run, whatever the layout, in fp32:

- per-step losses within 1e-5 relative;
- per-step gradient norms: the first step's within 1e-5 relative, the later steps' within 1e-3
  (`assert_parity`; why below). Adam and clipping hide a gradient wrong by one factor from the
  losses and nearly from the weights; the norm shows it;
- final weights within 1e-5 (looser where a test says why);
- the first step's gradient of every weight, gathered whole, within 1e-5 of the tensor's scale
  (`grad_rank` in the ranks, `assert_gradients_match`), the copies held by several ranks (dp, cp,
  tp after the gather, a tied embedding's first- and last-stage copies) bitwise equal;
- after training, a tied embedding's last-stage copy equal to its first-stage copy, bit for bit
  (`train_rank` returns it).

A module's multi-rank spawn runs every case of one world size in turn (`run_cases`), cached by
`shared`, which also remembers a failure: the first test that needs the spawn fails with the ranks'
traceback, the module's later ones at once with one line.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch

from distributed import run_ranks
from ultrascale.config import build_config

# A model small enough that 8 ranks on two cores finish 10 steps in seconds, with shapes that
# divide by 2 and 4 (heads, kv heads, ffn, layers) so every layout applies.
TINY = {
    "model": {"preset": None, "hidden_size": 64, "num_layers": 4, "num_heads": 4,
              "num_kv_heads": 2, "ffn_hidden_size": 128, "vocab_size": 256,
              "tie_embeddings": True},
    "training": {"steps": 10, "seq_len": 32, "micro_batch_size": 2, "grad_accum_steps": 1,
                 "lr": 3e-3, "warmup_steps": 2, "grad_clip": 1.0},
    "parallel": {"dp": 1},
    "logging": {"progress": False, "sample_tokens": 0},
    "device": "cpu",
    "precision": {"dtype": "fp32"},
}

# The first step's gradient norm: the same gradients summed in another order. Each element is a
# sum over the global batch's 256-2048 tokens whose fp32 reassociation moves it by a few ulps of
# the largest terms (measured: at most 2e-8 relative to the norm, on every layout and under
# ATEN_CPU_CAPABILITY=avx2 and MKL_ENABLE_INSTRUCTIONS=AVX2); 1e-5 is far above that and far below
# any gradient wrong by a factor, a stage or an expert's share.
FIRST_NORM_RTOL = 1e-5
# The later steps' norms are those of weights that already differ: AdamW divides each update by
# sqrt(v) + eps, which turns the round-off of a near-zero gradient element into a visible step,
# so the runs part by up to ~1e-5-1e-4 in the weights after 10 steps, and their norms follow
# (measured at step 10: 1.1e-4 for dp2 x tp2 with ZeRO, 2.6e-5 for ep2 with a capacity, 2e-6 for
# tp2 and cp2, under all three kernel settings above). 1e-3 keeps a margin of ~10 over that; a
# gradient wrong by a factor is caught at step 1, and what only the later steps can show (a
# gradient not cleared between steps, a micro-batch left out) moves the norm by 10% or more.
LATER_NORM_RTOL = 1e-3
# A first-step gradient element against the tensor's largest one: the same 256-2048-term sums
# reassociated (a few ulps, ~1e-7 of the scale; measured 4e-7 across cp, tp, pp and dp).
GRAD_RTOL = 1e-5


def make_config(overrides: list[str] = (), base: dict = TINY):
    return build_config(base, list(overrides))


def _tied_copy(rt, cfg) -> torch.Tensor | None:
    """A last pipeline stage's own copy of the tied embedding (full size), collective over the
    ranks of every stage: None elsewhere and without a second copy."""
    if not (cfg.model.tie_embeddings and cfg.parallel.pp > 1):
        return None
    local = rt.gather_full(rt.data_parallel.full_local_state())
    last = rt.ctx.coord("pp") == cfg.parallel.pp - 1
    return local["embed.weight"].clone() if last else None


def train_rank(config_dict: dict) -> dict:
    """Runs in each rank: train; return the per-step losses and gradient norms, (on every rank)
    the full final weights and, on a tied model's last pipeline stage, its own embedding copy."""
    import ultrascale.train.trainer as trainer
    from ultrascale.config import Config

    cfg = Config.model_validate(config_dict)
    runtimes = []
    real = trainer.parallelize

    def keep(*args, **kwargs):
        runtimes.append(real(*args, **kwargs))
        return runtimes[-1]

    trainer.parallelize = keep  # the runtime, to read the tied copy after training
    try:
        result = trainer.train(cfg, return_state=True, generate_sample=False)
    finally:
        trainer.parallelize = real
    return {"losses": result.losses, "grad_norms": result.grad_norms,
            "state": result.final_state, "tied_copy": _tied_copy(runtimes[0], cfg)}


def global_batch(cfg) -> torch.Tensor:
    """The fixed global batch of `grad_rank`: global_batch_size sequences of seq_len + 1 tokens."""
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, cfg.model.vocab_size, (cfg.global_batch_size, cfg.training.seq_len + 1),
                         generator=gen)


def grad_rank(config_dict: dict) -> dict:
    """Runs in each rank: one forward/backward of `global_batch` (this dp rank's share) and the
    gradient reduction; the gradient of every weight this rank holds, by plain name and full size
    (gathered over tp and ep), and the rank's pipeline stage. ZeRO keeps only shards of the
    reduced gradients: take them before sharding (`without_zero`)."""
    from ultrascale.config import Config
    from ultrascale.distributed import comm
    from ultrascale.distributed.mesh import init_parallel
    from ultrascale.models.llama import build_model
    from ultrascale.parallel.apply import parallelize

    cfg = Config.model_validate(config_dict)
    if cfg.parallel.zero:
        raise ValueError("grad_rank reads whole gradients: take them with parallel.zero=0 "
                         "(parity.without_zero)")
    ctx = init_parallel(cfg)
    comm.set_context(ctx)
    rt = parallelize(build_model(cfg.model, cfg.training.seed), ctx, cfg)
    mine = global_batch(cfg).chunk(cfg.parallel.dp)[ctx.coord("dp")]
    micro = [(s[:, :-1], s[:, 1:]) for s in mine.split(cfg.training.micro_batch_size)]
    rt.forward_backward(micro, 1.0 / (cfg.global_batch_size * cfg.training.seq_len))
    rt.finish_gradients()
    # Where the optimizer will read each gradient: `.grad`, a bucket's view, or under mixed
    # precision the fp32 accumulation buffer.
    grads = rt.gather_full({n: rt.data_parallel.accumulated_grad(n, p).detach().clone()
                            for n, p in rt.named_parameters()})
    return {"grads": grads, "pp_stage": ctx.coord("pp")}


def step_grads_rank(config_dict: dict) -> dict:
    """Runs in each rank: the trainer's first step, without clipping; the gradient its optimizer
    receives for every piece this rank steps (`Runtime.held()`: whole parameters, or under ZeRO
    this rank's flat ranges of the reduced gradient shards, Muon's included), as (name, flat
    start, flat gradient). Layouts without tensor or expert parallel (whose pieces are slices of
    the plain model's tensors: `grad_rank` gathers those)."""
    import ultrascale.train.trainer as trainer
    from ultrascale.config import Config

    cfg = Config.model_validate(config_dict)
    if cfg.parallel.tp > 1 or cfg.parallel.ep > 1:
        raise ValueError("step_grads_rank places flat pieces of whole tensors: use grad_rank "
                         "under tensor or expert parallel")
    assert cfg.training.steps == 1 and cfg.training.grad_clip is None, \
        "one step, unclipped: build the config with step_grads_config"
    pieces: list[tuple[str, int, torch.Tensor]] = []
    runtimes = []
    real = trainer.parallelize

    def capturing(*args, **kwargs):
        rt = real(*args, **kwargs)
        runtimes.append(rt)
        build = rt.build_optimizer

        def build_and_watch(*a, **k):
            out = build(*a, **k)
            opt = rt.data_parallel.optimizer
            step = opt.step

            def watched(*sa, **sk):
                if not pieces:
                    pieces.extend((h.name, h.start, h.value.grad.detach().reshape(-1).clone())
                                  for h in rt.held() if h.value.grad is not None)
                return step(*sa, **sk)

            opt.step = watched
            return out

        rt.build_optimizer = build_and_watch
        return rt

    trainer.parallelize = capturing
    try:
        trainer.train(cfg, generate_sample=False)
    finally:
        trainer.parallelize = real
    return {"pieces": pieces, "pp_stage": runtimes[0].ctx.coord("pp")}


def assemble_step_grads(per_rank: list[dict], like: dict[str, torch.Tensor]) -> dict:
    """The whole gradients from every rank's pieces (`step_grads_rank`), shaped as `like`'s
    tensors: every element covered, and the pieces several ranks hold (replicas, a tied
    embedding's two stages) bitwise equal."""
    flat = {n: torch.full((t.numel(),), float("nan"), dtype=torch.float32) for n, t in like.items()}
    for rank, r in enumerate(per_rank):
        for name, start, g in r["pieces"]:
            dest = flat[name][start:start + g.numel()]
            seen = ~dest.isnan()
            assert torch.equal(dest[seen], g.float()[seen]), \
                f"{name}@{start}: rank {rank}'s piece differs from another rank's"
            dest.copy_(g.float())
    for name, t in flat.items():
        assert not t.isnan().any(), f"{name}: {int(t.isnan().sum())} elements held by no rank"
    return {n: t.view(like[n].shape) for n, t in flat.items()}


def assert_step_grads_match(reference: dict, per_rank: list[dict], rtol: float = GRAD_RTOL,
                            tied_stages: tuple[int, int] | None = None) -> None:
    """`step_grads_rank`'s pieces of every rank, assembled, against one process's (rtol of each
    tensor's scale, as `assert_gradients_match`). `tied_stages`: the first and last pipeline
    stage, which must both step the tied embedding (their copies bitwise equal: assembled)."""
    like = {name: g for name, _, g in reference["pieces"]}
    assert_gradients_match(assemble_step_grads([reference], like),
                           [assemble_step_grads(per_rank, like)], rtol)
    if tied_stages is not None:
        holders = {r["pp_stage"] for r in per_rank
                   if any(name == "embed.weight" for name, _, _ in r["pieces"])}
        assert holders == set(tied_stages), f"tied embedding stepped on stages {holders}"


def step_grads_config(overrides: list[str], base: dict = TINY) -> dict:
    return make_config(list(overrides) + ["training.steps=1", "training.warmup_steps=0",
                                          "training.grad_clip=null"],
                       base=base).model_dump(mode="json")


def without_zero(overrides: list[str]) -> list[str]:
    """The layout with its gradients whole: ZeRO only changes where they are kept."""
    return [o for o in overrides if not o.startswith("parallel.zero=")]


RANK_FUNCTIONS = {"train": train_rank, "grads": grad_rank, "step_grads": step_grads_rank}


def run_cases(cases: list[tuple]) -> list:
    """Runs in each rank: every case in turn, each `(kind, config_dict)` or `(kind, config_dict,
    fault)`: kind "train" (`train_rank`), "grads" (`grad_rank`), or one a module registered in
    RANK_FUNCTIONS; fault, one of tests/injected_faults.py's, injected for that case only."""
    from injected_faults import injected

    out = []
    for kind, data, *fault in cases:
        with injected(fault[0] if fault else None):
            out.append(RANK_FUNCTIONS[kind](data))
    return out


def spawn_cases(world: int, cases: dict[str, tuple], timeout: float = 540.0) -> dict[str, list]:
    """name -> case; runs them all in one spawn of `world` ranks: name -> each rank's result."""
    per_rank = run_ranks(world, run_cases, list(cases.values()), timeout=timeout)
    return {name: [r[i] for r in per_rank] for i, name in enumerate(cases)}


def shared(fn):
    """A cache for a module's shared (multi-rank) run that remembers a failure too: the first test
    that calls it fails with the error, every later one at once, saying where to look."""
    done: dict[tuple, tuple[bool, object]] = {}

    @functools.wraps(fn)
    def cached(*args):
        if args in done:
            ok, value = done[args]
            if ok:
                return value
            pytest.fail(f"{fn.__name__}{args!r} failed in an earlier test of this module (its "
                        f"traceback is there): {value}", pytrace=False)
        try:
            value = fn(*args)
        except Exception as exc:
            lines = str(exc).strip().splitlines()
            done[args] = (False, f"{type(exc).__name__}: {lines[-1] if lines else ''}")
            raise
        done[args] = (True, value)
        return value

    cached.cache_clear = done.clear
    return cached


def run_layout(overrides: list[str]) -> list[dict]:
    cfg = make_config(overrides)
    data = cfg.model_dump(mode="json")
    if cfg.parallel.world_size == 1:
        return [train_rank(data)]
    return run_ranks(cfg.parallel.world_size, train_rank, data, timeout=540.0)


def assert_grad_norms(reference: dict, result: dict, first_rtol: float = FIRST_NORM_RTOL,
                      later_rtol: float = LATER_NORM_RTOL) -> None:
    ref, got = reference["grad_norms"], result["grad_norms"]
    assert len(got) == len(ref)
    for step, (g, r) in enumerate(zip(got, ref), start=1):
        rtol = first_rtol if step == 1 else later_rtol
        assert abs(g - r) <= rtol * abs(r), \
            f"gradient norm of step {step}: {g!r} against {r!r} (rtol {rtol:g})"


def assert_parity(reference: dict, result: dict, rtol: float = 1e-5, atol: float = 1e-5, *,
                  first_norm_rtol: float = FIRST_NORM_RTOL,
                  later_norm_rtol: float = LATER_NORM_RTOL) -> None:
    """Losses (rtol), gradient norms (see above), final weights (rtol, atol), and a tied
    embedding's last-stage copy equal to the first stage's."""
    ref_losses = torch.tensor(reference["losses"], dtype=torch.float64)
    losses = torch.tensor(result["losses"], dtype=torch.float64)
    torch.testing.assert_close(losses, ref_losses, rtol=rtol, atol=0.0)
    if "grad_norms" in reference and "grad_norms" in result:
        assert_grad_norms(reference, result, first_norm_rtol, later_norm_rtol)
    assert reference["state"].keys() == result["state"].keys()
    for name, ref in reference["state"].items():
        torch.testing.assert_close(result["state"][name], ref, rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")
    if result.get("tied_copy") is not None:
        assert torch.equal(result["tied_copy"], result["state"]["embed.weight"]), \
            "the tied embedding's last-stage copy differs from its first-stage copy"


def merge_gradients(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Every rank's gradients by name; copies held by several ranks must be bitwise equal (data,
    context and tensor parallel replicas, a tied embedding's two stages)."""
    got: dict[str, torch.Tensor] = {}
    for rank, r in enumerate(per_rank):
        grads = r["grads"] if "grads" in r else r
        for n, g in grads.items():
            if n in got:
                assert torch.equal(got[n], g), f"{n}: rank {rank}'s copy differs from another's"
            got[n] = g
    return got


def assert_gradients_match(reference: dict, per_rank: list[dict], rtol: float = GRAD_RTOL,
                           tied_stages: tuple[int, int] | None = None) -> None:
    """The first step's gradients of every rank (`grad_rank`'s results) against one process's:
    every weight within `rtol` of its tensor's largest element. `tied_stages`: the first and last
    pipeline stage, which must both hold the tied embedding."""
    ref = reference["grads"] if "grads" in reference else reference
    got = merge_gradients(per_rank)
    assert got.keys() == ref.keys()
    for n, g_ref in ref.items():
        scale = float(g_ref.abs().max())
        torch.testing.assert_close(got[n], g_ref, rtol=rtol, atol=rtol * scale,
                                   msg=lambda m, n=n: f"{n}: {m}")
    if tied_stages is not None:
        holders = {r["pp_stage"] for r in per_rank if "embed.weight" in r["grads"]}
        assert holders == set(tied_stages), f"tied embedding held by stages {holders}"


def assert_resumes_exactly(layout: list[str], checkpoints: Path) -> list[dict]:
    """Train `layout` for 6 steps saving every 3 into `checkpoints`, then resume from step 3 in
    the same layout: the resumed run's losses and final weights equal the uninterrupted run's
    bit for bit. Returns the uninterrupted run's results."""
    layout = layout + ["training.steps=6", f"checkpoint.dir={checkpoints}", "checkpoint.every=3"]
    full = run_layout(layout)
    assert (checkpoints / "step_00000003").is_dir()
    # The run ended at step 6 and wrote it; remove it so resume=auto starts from step 3.
    shutil.rmtree(checkpoints / "step_00000006")
    resumed = run_layout(layout + ["checkpoint.resume=auto"])
    for f, r in zip(full, resumed):
        assert r["losses"] == f["losses"][3:]
        for name, t in f["state"].items():
            assert r["state"][name].equal(t), name
    return full

"""`ultrascale memory ... --measure`: the engine's own step on fake tensors (memory/fake_step.py)
for the pipeline stages that can hold the layout's peak, each in a process of its own (a fake
process group and the engine's caches are per process), two at a time where there are cores.

    measured = measure(config_for(model, layout))
    measured.total, measured.parts, measured.stage, measured.assumptions

Stages measured: the first and the last (with an even split a middle stage holds the first's
layers without the embedding and no more micro-batches in flight); every stage of an uneven
`pp_layers` split.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context

from ultrascale.config import Config, ModelConfig, build_config, layout_sections
from ultrascale.layout import Layout
from ultrascale.memory.fake_step import ASSUMPTIONS, StageMeasure, micro_batches_run

KERNELS = ("cuda", "cpu")
_KERNEL_NOTES = {
    "cuda": "attention as on a GPU (operands in their dtype, flash or memory-efficient with kv "
            "heads expanded); training.kernels=torch (Triton kernels are not run); ring and "
            "all-gather attention's blocks and the grouped GEMM on their CPU paths",
    "cpu": "this machine's CPU code paths (the attention core in fp32 under bf16/fp16)",
}


@dataclass
class Measured:
    stages: list[StageMeasure]
    kernels: str
    assumptions: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def busiest(self) -> StageMeasure:
        return max(self.stages, key=lambda s: s.peak.total)

    @property
    def total(self) -> int:
        return self.busiest.peak.total

    def as_dict(self) -> dict:
        top = self.busiest
        return {"total": top.peak.total, **top.peak.parts, "phase": top.peak.phase, "op": top.peak.op,
                "stage": top.stage, "rank": top.rank, "kernels": self.kernels,
                "stages": [s.as_dict() for s in self.stages],
                "assumptions": list(self.assumptions), "seconds": round(self.seconds, 1)}


def stages_to_measure(cfg: Config) -> list[int]:
    p = cfg.parallel
    if p.pp == 1:
        return [0]
    if p.pp_layers and len(set(p.pp_layers)) > 1:
        return list(range(p.pp))
    return [0, p.pp - 1]


def config_for(model: ModelConfig, layout: Layout, pp_layers=None, base: Config | None = None
               ) -> Config:
    """A training config that runs `layout` on `model` (over `base`'s other keys)."""
    data = base.model_dump(mode="json") if base is not None else {}
    data["model"] = json.loads(json.dumps(model.keys()))
    for section, keys in layout_sections(layout).items():
        data.setdefault(section, {}).update(keys)
    if pp_layers:
        data["parallel"]["pp_layers"] = list(pp_layers)
    data["training"].update(steps=2, warmup_steps=1, compile=False)
    data["device"] = "cpu"
    data.setdefault("logging", {}).update(progress=False, sample_tokens=0)
    return build_config(data)


def _measure_stage(config: dict, stage: int, kernels: str) -> StageMeasure:
    import torch

    from ultrascale.memory.fake_step import measure_rank

    torch.set_num_threads(1)  # nothing computes: the work is Python
    return measure_rank(Config.model_validate(config), stage, kernels)


def measure(cfg: Config, kernels: str = "cuda", stages: list[int] | None = None,
            workers: int | None = None) -> Measured:
    """The measured step of each stage (`stages_to_measure`), in worker processes."""
    return measure_many([cfg], kernels, workers, stages)[0]


def measure_many(cfgs: list[Config], kernels: str = "cuda", workers: int | None = None,
                 stages: list[int] | None = None) -> list[Measured]:
    """`measure` of several configs, their stages spread over the same workers."""
    from ultrascale.parallel.support import check_supported

    for cfg in cfgs:
        check_supported(cfg)  # what `ultrascale train` refuses, refused here the same way
    t0 = time.perf_counter()
    jobs = [(i, s) for i, cfg in enumerate(cfgs)
            for s in (stages_to_measure(cfg) if stages is None else stages)]
    data = [cfg.model_dump(mode="json") for cfg in cfgs]
    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    # A fresh process per stage: the engine caches small tensors (positions, plans), which
    # must not outlive the fake mode that made them.
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"),
                             max_tasks_per_child=1) as pool:
        results = list(pool.map(_measure_stage, [data[i] for i, _ in jobs],
                                [s for _, s in jobs], [kernels] * len(jobs)))
    seconds = time.perf_counter() - t0
    out = []
    for i, cfg in enumerate(cfgs):
        mine = [r for (j, _), r in zip(jobs, results) if j == i]
        out.append(Measured(mine, kernels, _assumptions(cfg, kernels, mine),
                            seconds if len(cfgs) == 1 else sum(r.seconds for r in mine)))
    return out


def _assumptions(cfg: Config, kernels: str, results: list[StageMeasure]) -> list[str]:
    out = [_KERNEL_NOTES[kernels]]
    if cfg.model.num_experts:
        out += ASSUMPTIONS
    m, run = cfg.training.grad_accum_steps, micro_batches_run(cfg)
    if run < m:
        out.append(f"{run} of the {m} micro-batches run (no pipeline: the middle ones repeat "
                   "one another's memory)")
    if cfg.parallel.pp > 1:
        out.append("pipeline stages measured: " + ", ".join(str(r.stage) for r in results))
    stand_ins = {}
    for r in results:
        for kind, n in r.stand_ins.items():
            stand_ins[kind] = stand_ins.get(kind, 0) + n
    if stand_ins:
        out.append("numbers read from tensors are stand-ins (1.0, True, 0: a loss, a gradient "
                   "norm; no allocation depends on them): " +
                   ", ".join(f"{n} {kind}" for kind, n in sorted(stand_ins.items())))
    return out


# -- beside the estimate in the table --------------------------------------------------------------

_ROWS = {"parameters": ("params",), "gradients": ("grads",), "optimizer state": ("optimizer",),
         "activations": ("activations", "temporaries"),
         "communication buffers": ("comm_buffers",), "total (peak)": ("total",)}


def measured_cell(item: str, measured: Measured, scale: int = 2**30) -> str:
    """The measured size in the table's unit (`scale` bytes, GiB by default) for a row of the
    estimate's table (`memory/report.py` rows), or ""."""
    parts = _ROWS.get(item)
    if parts is None:
        return ""
    peak = measured.busiest.peak
    value = peak.total if parts == ("total",) else sum(peak.parts[p] for p in parts)
    return f"{value / scale:,.2f}"


def caption(measured: Measured) -> str:
    top = measured.busiest
    return (f"measured: the engine's step on fake tensors, stage {top.stage} (rank {top.rank}), "
            f"peak in {top.peak.phase}; activations = saved + temporaries; "
            f"{measured.seconds:.0f} s. Assumed: " + "; ".join(measured.assumptions))

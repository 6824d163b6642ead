"""The readable table of a MemoryEstimate (plain text; the command renders it with rich), and the
one way sizes are written for people: GiB from 1 GiB up, MiB (or KiB) below, never "0.00 GiB"."""

from __future__ import annotations

GIB = 2**30
MIB = 2**20
_UNITS = (("GiB", GIB), ("MiB", MIB), ("KiB", 2**10))


def size(n: float) -> str:
    """`1.23 GiB`, `717 MiB`, `8.5 MiB`, `12 KiB`, `0 B`: three significant figures at most."""
    for unit, scale in _UNITS:
        if abs(n) >= scale:
            v = n / scale
            return f"{v:,.2f} {unit}" if unit == "GiB" else f"{v:.{0 if v >= 100 else 1}f} {unit}"
    return f"{n:.0f} B"


def table_unit(est) -> tuple[str, int]:
    """The unit of a whole table: GiB when the peak reaches 1 GiB, else MiB."""
    return ("GiB", GIB) if max(est.total, est.reserved) >= GIB else ("MiB", MIB)


def gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def state_notes(layout=None, zero3_shard_is_master: bool = False) -> dict[str, str]:
    """What the parameters, gradients and optimizer rows hold for this layout (the ZeRO stage, the
    dtypes, the optimizer), as the estimator counts them (docs/memory.md)."""
    if layout is None:
        return {"params": "", "grads": "", "params_experts": "", "grads_experts": "",
                "optimizer_experts": "", "optimizer": "master weights + Adam m, v (Muon: one buffer for the matrices)"}
    zero, shard = layout.zero, (layout.dp_shard or layout.dp) * layout.cp
    split = f" (1/{shard} per rank)" if shard > 1 else ""
    shard_e = max(shard // layout.ep, 1)  # expert weights are replicated over dp / ep ranks

    def experts(stage: int) -> str:  # the routed experts' row under a state ZeRO shards at `stage`
        part = f"1/{layout.ep} of the experts" if layout.ep > 1 else "every expert"
        if zero < stage or shard == 1:
            return part
        return part + (f", ZeRO shard 1/{shard_e}" if shard_e > 1 else
                       ", not sharded by ZeRO (ep spans the dp ranks)")

    per_row = {"params_experts": experts(3), "grads_experts": experts(2),
               "optimizer_experts": experts(1)}
    moments = "Muon's momentum for the matrices, Adam's m, v for the rest" \
        if layout.optimizer == "muon" else "Adam m, v"
    master = layout.master_dtype != layout.dtype
    def sharded(stage: int) -> str:
        return f", ZeRO shard{split}" if zero >= stage and shard > 1 else ""

    if zero >= 3 and zero3_shard_is_master:
        return {**per_row,
                "params": f"{layout.master_dtype}{sharded(3)}: the master weights too; the "
                          f"{layout.dtype} layers exist only while gathered (communication "
                          "buffers)",
                "grads": f"{layout.grad_accum_dtype}{sharded(2)}",
                "optimizer": f"{moments}{sharded(1)}; no separate master copy"}
    return {**per_row, "params": f"{layout.dtype}{sharded(3)}",
            "grads": f"{layout.grad_accum_dtype}{sharded(2)}",
            "optimizer": (f"{layout.master_dtype} master weights + " if master else "")
            + moments + sharded(1)}


def rows(est, layout=None, zero3_shard_is_master: bool = False,
         fmt=gib) -> list[tuple[str, str, str]]:
    """(item, size, note) rows: the five categories, their parts, the phases and the verdict.
    `fmt` writes a size; given the layout, the notes say what each state row holds under its
    ZeRO stage (`zero3_shard_is_master`: the implementation's, theory/implementation.py)."""
    experts = getattr(est, "experts", {}) or {}
    notes = state_notes(layout, zero3_shard_is_master)
    step = getattr(est, "grads_step", est.grads)  # ours makes them during the backward
    if step > est.grads:
        notes["grads"] = "; ".join(filter(None, (
            notes["grads"], f"made during the backward ({fmt(step)} at the optimizer step)")))
    out = []
    for key, label, value in (("params", "parameters", est.params),
                              ("grads", "gradients", est.grads),
                              ("optimizer", "optimizer state", est.optimizer)):
        out.append((label, fmt(value), notes[key]))
        if experts.get(key):  # the routed experts' part of it (E / ep experts, ZeRO over edp)
            out.append(("  of which routed experts", fmt(experts[key]), notes[f"{key}_experts"]))
    out.append(("activations", fmt(est.activations),
                "peak over the pipeline schedule" if est.phase == "forward/backward"
                else f"not held at the peak (forward/backward peak {size(est.activations_peak)})"))
    for name, n in sorted(est.activation_parts.items(), key=lambda kv: -kv[1]):
        if n:
            out.append((f"  {name}", fmt(n), ""))
    out.append(("communication buffers", fmt(est.comm_buffers), ""))
    for name, n in sorted(est.comm_parts.items(), key=lambda kv: -kv[1]):
        if n:
            out.append((f"  {name}", fmt(n), ""))
    if est.other:
        out.append(("workspaces", fmt(est.other), "library workspaces, small caches"))
    for name, n in est.phases.items():
        out.append((f"peak during {name}", fmt(n), "<- binding" if name == est.phase else ""))
    out.append(("total (peak)", fmt(est.total), est.rank_desc))
    if est.reserved != est.total:
        out.append(("reserved (with fragmentation)", fmt(est.reserved),
                    "what the caching allocator holds; the fit verdict uses it"))
    if est.device_memory is not None:
        verdict = "fits" if est.fits else "does NOT fit"
        out.append(("device memory", fmt(est.device_memory), verdict))
    return out


def format_table(est, layout=None, zero3_shard_is_master: bool = False) -> str:
    unit, scale = table_unit(est)
    body = rows(est, layout, zero3_shard_is_master, lambda n: f"{n / scale:,.2f} {unit}")
    w0 = max(len(r[0]) for r in body)
    w1 = max(len(r[1]) for r in body)
    lines = [f"Memory per device, {est.rank_desc} (runtime: {est.runtime})"]
    for item, text, note in body:
        lines.append(f"{item:<{w0}}  {text:>{w1}}  {note}".rstrip())
    return "\n".join(lines)

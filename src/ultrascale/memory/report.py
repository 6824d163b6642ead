"""The readable table of a MemoryEstimate (plain text; the command renders it with rich)."""

from __future__ import annotations

GIB = 2**30


def gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def rows(est) -> list[tuple[str, str, str]]:
    """(item, GiB, note) rows: the five categories, their parts, the phases and the verdict."""
    experts = getattr(est, "experts", {}) or {}
    step = getattr(est, "grads_step", est.grads)
    grads_note = "" if step <= est.grads else \
        f"made during the backward ({gib(step)} at the optimizer step)"
    out = [("parameters", gib(est.params), ""), ("gradients", gib(est.grads), grads_note),
           ("optimizer state", gib(est.optimizer),
            "master weights + Adam m, v (Muon: one buffer for the matrices)")]
    if experts.get("params"):
        # The routed experts' share of the three (E / ep experts here, ZeRO over edp).
        total = experts["params"] + experts["grads"] + experts["optimizer"]
        out.append(("  of which routed experts", gib(total),
                    f"params {gib(experts['params'])}, grads {gib(experts['grads'])}, "
                    f"optimizer {gib(experts['optimizer'])}"))
    out.append(("activations", gib(est.activations),
                "peak over the pipeline schedule" if est.phase == "forward/backward"
                else f"not held at the peak (forward/backward peak {gib(est.activations_peak)})"))
    for name, n in sorted(est.activation_parts.items(), key=lambda kv: -kv[1]):
        if n:
            out.append((f"  {name}", gib(n), ""))
    out.append(("communication buffers", gib(est.comm_buffers), ""))
    for name, n in sorted(est.comm_parts.items(), key=lambda kv: -kv[1]):
        if n:
            out.append((f"  {name}", gib(n), ""))
    if est.other:
        out.append(("workspaces", gib(est.other), "library workspaces, small caches"))
    for name, n in est.phases.items():
        out.append((f"peak during {name}", gib(n), "<- binding" if name == est.phase else ""))
    out.append(("total (peak)", gib(est.total), est.rank_desc))
    if est.reserved != est.total:
        out.append(("reserved (with fragmentation)", gib(est.reserved),
                    "what the caching allocator holds; the fit verdict uses it"))
    if est.device_memory is not None:
        verdict = "fits" if est.fits else "does NOT fit"
        out.append(("device memory", gib(est.device_memory), verdict))
    return out


def format_table(est) -> str:
    body = rows(est)
    w0 = max(len(r[0]) for r in body)
    w1 = max(len(r[1]) for r in body)
    lines = [f"Memory per device, {est.rank_desc} (runtime: {est.runtime})"]
    for item, size, note in body:
        lines.append(f"{item:<{w0}}  {size:>{w1}}  {note}".rstrip())
    return "\n".join(lines)

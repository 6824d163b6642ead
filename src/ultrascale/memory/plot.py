"""`ultrascale memory --plot PNG`: the memory breakdown of a layout and memory against sequence
length, as a PNG (matplotlib, imported only when a picture is drawn). The web app draws the same in
the browser (ui/static/app.js, with the same colours)."""

from __future__ import annotations

from pathlib import Path

GIB = 2**30
# The memory categories of `ultrascale memory --json`, in stacking order, with the page's colours.
CATEGORIES = [("params", "parameters", "#4e79a7"), ("grads", "gradients", "#f28e2b"),
              ("optimizer", "optimizer state", "#59a14f"), ("activations", "activations", "#e15759"),
              ("comm_buffers", "communication buffers", "#b07aa1"),
              ("other", "workspaces", "#9c755f")]


class MissingMatplotlib(ValueError):
    """(A ValueError so that every command's handler prints it as one line.)"""


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise MissingMatplotlib("drawing a PNG needs matplotlib: pip install matplotlib "
                                "(requirements.txt pins it).") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_memory(report: dict, by_seq_len: list[tuple[int, dict]], path: str | Path) -> Path:
    """Left: the layout's memory per device, stacked by category, against the device's memory.
    Right: the same for each sequence length (the playbook's memory-against-length chart)."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.8),
                                      gridspec_kw={"width_ratios": [1, 2.2]})
    _stack(left, ["this layout"], [report])
    _stack(right, [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n, _ in by_seq_len],
           [r for _, r in by_seq_len])
    right.set_xlabel("sequence length")
    for ax in (left, right):
        if report.get("device_memory"):
            ax.axhline(report["device_memory"] / GIB, color="k", ls="--", lw=1)
        ax.set_ylabel("GiB per device")
    verdict = {True: "fits", False: "does NOT fit", None: ""}[report.get("fits")]
    model = report["model"].get("preset") or "model"
    left.set_title(f"{report['total_gib']:.1f} GiB {verdict}".strip(), fontsize=10)
    right.set_title(f"{model}, {_layout_text(report['layout'])}" + (
        "  (dashed: device memory)" if report.get("device_memory") else ""), fontsize=10)
    right.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _stack(ax, labels: list[str], reports: list[dict]) -> None:
    bottom = [0.0] * len(reports)
    for key, name, color in CATEGORIES:
        values = [r[key] / GIB for r in reports]
        if any(values):
            ax.bar(labels, values, bottom=bottom, color=color, label=name, width=0.6)
            bottom = [b + v for b, v in zip(bottom, values)]


def _layout_text(layout: dict) -> str:
    dims = [f"{k}{layout[k]}" for k in ("dp", "tp", "pp", "cp", "ep") if layout.get(k, 1) > 1]
    return " ".join(dims + [f"zero{layout['zero']}", f"mbs{layout['mbs']}",
                            f"recompute {layout['recompute']}", layout["dtype"]])

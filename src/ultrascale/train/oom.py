"""Out of memory on a GPU: what held the memory, written down before the rank ends.

With `launch.oom_snapshot` (on by default) a CUDA rank records its allocations from the start
(torch.cuda.memory._record_memory_history: the last MAX_ENTRIES allocations and frees with their
stacks). When it runs out of memory it writes the snapshot to
`<run>/memory/rank_N_oom.pickle` (drag it into https://pytorch.org/memory_viz) and ends with a
message that sets the allocator's peak beside the estimate, part by part: what
`ultrascale memory` predicted for parameters, gradients, optimizer state, activations and the rest,
what this rank counted in the first three, and the allocator's peak against the device.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from ultrascale.config import Config

MAX_ENTRIES = 100_000
GIB = 2**30
PARTS = ("params", "grads", "optimizer", "activations", "comm_buffers", "other")


class DeviceOutOfMemory(RuntimeError):
    """A rank ran out of GPU memory; the message says where the memory went."""


def start_recording(cfg: Config, device: torch.device) -> bool:
    """Record allocations from now on (CUDA ranks with launch.oom_snapshot)."""
    if device.type != "cuda" or not cfg.launch.oom_snapshot:
        return False
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
    return True


def snapshot_path(cfg: Config, rank: int) -> Path:
    return Path(cfg.logging.run_dir) / "memory" / f"rank_{rank}_oom.pickle"


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f} GiB"


def oom_message(rank: int, first_line: str, estimate: dict | None, counted: dict | None,
                peak_allocated: int, peak_reserved: int, capacity: int | None,
                snapshot: Path | None, no_snapshot: str = "") -> str:
    """The message of a rank out of memory: the allocator's figures, then a table of the
    estimate beside what the rank counted, part by part."""
    lines = [f"rank {rank} ran out of GPU memory ({first_line}). The allocator's peak: "
             f"{_gib(peak_allocated)} allocated, {_gib(peak_reserved)} reserved"
             + (f", of the device's {_gib(capacity)}" if capacity else "") + "."]
    if estimate is not None:
        counted = counted or {}
        lines.append(f"  {'part':<13}{'estimate':>12}{'this rank':>12}")
        for part in PARTS:
            have = counted.get(f"{part}_bytes")
            lines.append(f"  {part:<13}{_gib(estimate.get(part)):>12}{_gib(have):>12}")
        lines.append(f"  {'total':<13}{_gib(estimate.get('total')):>12}"
                     f"{_gib(peak_allocated):>12}  (this rank: the allocator's peak)")
        if estimate.get("reserved"):
            lines.append(f"  {'reserved':<13}{_gib(estimate['reserved']):>12}"
                         f"{_gib(peak_reserved):>12}  (with the allocator's fragmentation)")
    lines.append("Where it went, allocation by allocation: " + (
        f"{snapshot} (open it in https://pytorch.org/memory_viz)" if snapshot else
        no_snapshot or "no snapshot") + ". To fit: "
        "`ultrascale memory` with this layout lists the changes that shrink it (more tp or pp, "
        "a higher ZeRO stage, recompute, a smaller micro-batch).")
    return "\n".join(lines)


def _estimate(cfg: Config) -> dict | None:
    from ultrascale.memory.estimator import LayoutError, estimate

    try:
        return estimate(cfg.model, cfg.layout(), pp_layers=cfg.parallel.pp_layers).to_dict()
    except LayoutError:
        return None


class OutOfMemoryWatch:
    """Around a rank's training: on CUDA's OutOfMemoryError, the snapshot and the message
    (DeviceOutOfMemory). `runtime`, once set, gives the bytes the rank counted."""

    def __init__(self, cfg: Config, rank: int):
        self.cfg, self.rank = cfg, rank
        self.runtime = None
        self.recording = False

    def start(self, device: torch.device) -> None:
        self.recording = start_recording(self.cfg, device)

    @contextmanager
    def watching(self):
        try:
            yield self
        except torch.cuda.OutOfMemoryError as exc:
            raise DeviceOutOfMemory(self.explain(exc)) from exc

    def explain(self, exc: BaseException) -> str:
        snapshot = None
        if self.recording:
            snapshot = snapshot_path(self.cfg, self.rank)
            snapshot.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(snapshot))
        counted = None
        if self.runtime is not None:
            counted = self.runtime.memory_report()
        capacity = None
        if torch.cuda.is_available():
            capacity = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
        reserved = torch.cuda.max_memory_reserved() if torch.cuda.is_available() else 0
        first = (str(exc).strip().splitlines() or ["CUDA out of memory"])[0][:200]
        why = "" if self.recording else (
            "none recorded (allocations are recorded on CUDA ranks only)" if
            self.cfg.launch.oom_snapshot else "none: set launch.oom_snapshot=true to record one")
        return oom_message(self.rank, first, _estimate(self.cfg), counted, peak, reserved,
                           capacity, snapshot, why)

"""Writing checkpoints atomically (optionally in the background) and reading pieces back.

A save: rank 0 makes `<dir>/.step_00000010.tmp/`; every rank copies its pieces (state.py) and RNG
state to host memory and writes `rank_NNNNN.safetensors` there (fsynced) and its SHA-256; once
every rank has written, rank 0 reads the files' headers into the index and the digests into
meta.json, writes meta.json last, renames the folder
to `step_00000010` and prunes the oldest beyond `keep`. A folder without the dot is therefore
always complete, and a crash at any moment leaves the previous checkpoints as they were.

With `checkpoint.async_save` the file is written by a thread while training goes on; at each
later step the ranks agree (one all-reduce of a flag) whether every file is written, and rank 0
then commits as above. A new save first finishes the previous one; the end of training waits for
it.

Tensors go through safetensors and metadata through JSON: nothing is unpickled on load.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from ultrascale.checkpoint.index import (FORMAT, HASH_SUFFIX, META, PREFIX, VALUE,
                                         CheckpointError, build_index, file_sha256, pieces,
                                         rank_file, step_dir, verify_file)
from ultrascale.distributed import comm


@dataclass
class CheckpointMeta:
    step: int
    consumed_samples: int
    world_size: int
    layout: dict
    config: dict
    lr_schedule: dict
    shapes: dict[str, list[int]] = field(default_factory=dict)  # full shape of every parameter
    loss_scaler: dict | None = None  # fp16's dynamic loss scale (parallel/precision.py), else None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- RNG ---------------------------------------------------------------------------------------


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """This process's generators: torch's (and CUDA's) as tensors, Python's and NumPy's as JSON."""
    tensors = {"rng/torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    text = {"python_rng": json.dumps(random.getstate()),
            "numpy_rng": json.dumps([kind, keys.tolist(), pos, has_gauss, gauss])}
    return tensors, text


def restore_rng(tensors: dict[str, torch.Tensor], text: dict[str, str]) -> None:
    if "rng/torch" in tensors:
        torch.set_rng_state(tensors["rng/torch"])
    if "rng/cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng/cuda"])
    if "python_rng" in text:
        version, state, gauss = json.loads(text["python_rng"])
        random.setstate((version, tuple(state), gauss))
    if "numpy_rng" in text:
        kind, keys, pos, has_gauss, gauss = json.loads(text["numpy_rng"])
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


# -- writing -----------------------------------------------------------------------------------


@dataclass
class _Pending:
    meta: CheckpointMeta
    tmp: Path
    final: Path
    thread: threading.Thread | None = None
    error: BaseException | None = None


class CheckpointWriter:
    """Saves of one run. Collective: every rank calls `save`, `poll` (each step) and `close`."""

    def __init__(self, root: Path, keep: int, rank: int, world_size: int,
                 asynchronous: bool = False):
        self.root, self.keep = Path(root), keep
        self.rank, self.world_size = rank, world_size
        self.asynchronous = asynchronous
        self.pending: _Pending | None = None
        self.last: Path | None = None  # the newest committed checkpoint

    def save(self, meta: CheckpointMeta, tensors: dict[str, torch.Tensor]) -> None:
        """Write `tensors` (this rank's pieces) as part of step `meta.step`'s checkpoint."""
        if self.pending is not None:
            self._finish(block=True)
        final = step_dir(self.root, meta.step)
        tmp = self.root / f".{final.name}.tmp"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(f".{PREFIX}*.tmp"):  # left by a killed save
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        comm.barrier()
        # A copy in host memory, so that training may change the live tensors at once.
        payload = {k: t.detach().to("cpu", copy=True).contiguous() for k, t in tensors.items()}
        rng, text = rng_state()
        payload.update(rng)
        pending = _Pending(meta, tmp, final)
        path = tmp / rank_file(self.rank)
        self.pending = pending
        if self.asynchronous:
            pending.thread = threading.Thread(target=self._write, args=(pending, path, payload,
                                                                        text), daemon=True)
            pending.thread.start()
        else:
            self._write(pending, path, payload, text)
            self._finish(block=True)

    @staticmethod
    def _write(pending: _Pending, path: Path, payload: dict, text: dict) -> None:
        try:
            save_file(payload, str(path), metadata=text)
            _fsync(path)
            # Its digest, read back from the page cache, for rank 0 to put in meta.json: a resume
            # or an export then refuses a file changed after the save (index.verify_file).
            digest = path.with_name(path.name + HASH_SUFFIX)
            digest.write_text(file_sha256(path))
            _fsync(digest)
        except BaseException as exc:  # noqa: BLE001  (reported by every rank at the next poll)
            pending.error = exc

    def poll(self) -> None:
        """Commit the pending save if every rank has written its file (call once per step)."""
        if self.pending is not None:
            self._finish(block=False)

    def close(self) -> Path | None:
        """Finish the pending save, if any; the newest checkpoint."""
        if self.pending is not None:
            self._finish(block=True)
        return self.last

    def _finish(self, block: bool) -> None:
        p = self.pending
        if block and p.thread is not None:
            p.thread.join()
        written = p.thread is None or not p.thread.is_alive()
        flag = torch.tensor([-1 if p.error is not None else int(written)], dtype=torch.int32)
        comm.all_reduce(flag, "world", op=dist.ReduceOp.MIN, tag="checkpoint")
        if flag.item() < 0:
            self.pending = None
            if p.error is not None:
                raise RuntimeError(f"writing {p.tmp / rank_file(self.rank)} failed: "
                                   f"{p.error}") from p.error
            raise RuntimeError(f"another rank failed to write its part of {p.final.name}; "
                               "its log says why")
        if not flag.item():
            return
        if self.rank == 0:
            self._commit(p)
        comm.barrier()
        self.pending = None
        self.last = p.final

    def _commit(self, p: _Pending) -> None:
        files = [rank_file(r) for r in range(self.world_size)]
        meta = {"format": FORMAT, **asdict(p.meta)}
        shapes = meta.pop("shapes")
        meta["files"] = {f: (p.tmp / f).stat().st_size for f in files}
        meta["sha256"] = {f: (p.tmp / (f + HASH_SUFFIX)).read_text().strip() for f in files}
        for f in files:
            (p.tmp / (f + HASH_SUFFIX)).unlink()
        tensors = build_index(p.tmp, files, shapes)
        # Readable: the settings indented, then one line per tensor (its shape and pieces).
        head = json.dumps(meta, indent=1)[:-2]
        rows = ",\n".join(f"  {json.dumps(n)}: {json.dumps(e)}" for n, e in tensors.items())
        (p.tmp / META).write_text(f'{head},\n "tensors": {{\n{rows}\n }}\n}}\n')
        _fsync(p.tmp / META)
        old = None
        if p.final.exists():  # the same step saved again (a re-run): swap it whole
            old = p.final.with_name(f".{p.final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(p.final, old)
        os.replace(p.tmp, p.final)
        _fsync(self.root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        done = sorted(d for d in self.root.glob(f"{PREFIX}*") if (d / META).is_file())
        for gone in done[:-self.keep]:
            shutil.rmtree(gone, ignore_errors=True)


# -- reading -----------------------------------------------------------------------------------


class CheckpointReader:
    """Reads boxes of a checkpoint's tensors, opening only the files that hold them (each read is
    a slice of a memory-mapped file: a rank never loads what it does not hold)."""

    def __init__(self, path: Path, meta: dict, verified: bool = False):
        self.path, self.meta, self.verified = Path(path), meta, verified
        self._stack = ExitStack()
        self._files: dict[str, object] = {}

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _open(self, file: str):
        if file not in self._files:
            if not self.verified:  # read whole once: a changed byte is refused
                verify_file(self.path, self.meta, file)
            self._files[file] = self._stack.enter_context(
                safe_open(str(self.path / file), framework="pt", device="cpu"))
        return self._files[file]

    def _entry(self, name: str) -> dict:
        entry = self.meta["tensors"].get(name)
        if entry is None:
            raise CheckpointError(f"{self.path} holds no tensor {name!r}")
        return entry

    def check_shape(self, name: str, shape: list[int]) -> None:
        saved = self._entry(name)["shape"]
        if list(saved) != list(shape):
            raise CheckpointError(f"{name} is {saved} in {self.path} but {list(shape)} in this "
                                  "model")

    def states(self, name: str) -> list[str]:
        return list(self._entry(name)["states"])

    def is_scalar(self, name: str, state: str) -> bool:
        found = pieces(self.meta, name, state)
        return len(found) == 1 and not found[0].shape and not found[0].offset

    def _tensor(self, file: str, key: str, expect: tuple[int, ...]):
        f = self._open(file)
        if key not in f.keys():
            raise CheckpointError(f"{self.path / file} has no tensor {key!r}, which {META} lists")
        piece = f.get_slice(key)
        if tuple(piece.get_shape()) != tuple(expect):
            raise CheckpointError(f"{key} in {self.path / file} is {piece.get_shape()}, {META} "
                                  f"says {list(expect)}")
        return f, piece

    def scalar(self, name: str, state: str) -> torch.Tensor:
        (p,) = pieces(self.meta, name, state)
        f, _ = self._tensor(p.file, p.key, ())
        return f.get_tensor(p.key)

    def read_into(self, name: str, state: str, offset: tuple[int, ...],
                  out: torch.Tensor) -> None:
        """Fill `out`, the box of tensor `name` at `offset`, from the pieces it overlaps."""
        filled = 0
        for p in pieces(self.meta, name, state):
            lo = [max(a, b) for a, b in zip(offset, p.offset)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offset, out.shape, p.offset, p.shape)]
            if any(h <= low for low, h in zip(lo, hi)):
                continue
            _, piece = self._tensor(p.file, p.key, p.shape)
            src = piece[tuple(slice(a - b, c - b) for a, c, b in zip(lo, hi, p.offset))]
            out[tuple(slice(a - b, c - b) for a, c, b in zip(lo, hi, offset))].copy_(src)
            filled += int(np.prod([h - low for low, h in zip(lo, hi)]))
        if filled != out.numel():
            raise CheckpointError(f"{state} of {name}: {self.path} holds {filled} of the "
                                  f"{out.numel()} elements at {list(offset)} (a shard is missing)")
        if out.is_floating_point() and not bool(torch.isfinite(out).all()):
            # Training never saves one (a non-finite loss stops the run first): the file changed.
            files = sorted({p.file for p in pieces(self.meta, name, state)})
            raise CheckpointError(f"{state} of {name} in {self.path} ({', '.join(files)}) holds "
                                  "non-finite values (nan or inf), which no save writes: the "
                                  "file was changed after it. Resume an earlier checkpoint.")

    def tensor(self, name: str, state: str = VALUE) -> torch.Tensor:
        """The whole tensor `name` (its value, or an optimizer state), in the dtype it was saved
        in: for an export or a look at one weight, whatever layout wrote it."""
        if self.is_scalar(name, state):
            return self.scalar(name, state)
        first = pieces(self.meta, name, state)[0]
        dtype = self._tensor(first.file, first.key, first.shape)[0].get_tensor(first.key).dtype
        out = torch.empty(self._entry(name)["shape"], dtype=dtype)
        self.read_into(name, state, (0,) * out.dim(), out)
        return out

    def restore_rng(self, rank: int) -> None:
        """This rank's generators as saved; in a world of another size, saved rank r mod N's."""
        f = self._open(rank_file(rank % self.meta["world_size"]))
        tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith("rng/")}
        restore_rng(tensors, f.metadata() or {})

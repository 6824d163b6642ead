"""The checkpoint format on disk, read and checked without torch (docs/checkpoints.md).

    <dir>/step_00000010/
        meta.json                 step, samples consumed, the LR schedule, the config that wrote it,
                                  each file's size and SHA-256, and the index: where every piece of
                                  every tensor is
        rank_00000.safetensors    the pieces rank 0 wrote, its RNG state
        ...

State is layout-free: for each plain-model parameter name, the full-shape value (fp32 master when
there is one) and each optimizer-state tensor ("exp_avg", "exp_avg_sq", a Muon momentum, ...) are
cut into pieces, each piece a box of the full tensor. A rank writes the boxes it owns, under the
key `<state>/<name>@<offset,offset,...>` (the box's first element in the full tensor; its shape is
in the safetensors header), so that any other layout reads back exactly the boxes it needs. A
scalar state (Adam's "step") is one piece with no offset.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

FORMAT = "ultrascale-checkpoint/2"
META = "meta.json"
HASH_SUFFIX = ".sha256"  # a rank's digest of its file, beside it until rank 0 indexes them
_HASH_CHUNK = 16 * 2**20
PREFIX = "step_"
VALUE = "param"  # the state name of the parameter's own value


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: names the folder, the file or the tensor, and why."""


class CheckpointDamage(CheckpointError):
    """A checkpoint that is not what its save wrote (a file missing, cut, changed; a tensor's
    pieces lost): `checkpoint.resume=auto` goes on to an older one (resume.py, agree.py)."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"{PREFIX}{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def piece_key(state: str, name: str, offset: tuple[int, ...]) -> str:
    return f"{state}/{name}@{','.join(str(o) for o in offset)}"


def parse_key(key: str) -> tuple[str, str, tuple[int, ...]]:
    """(state, name, offset) of a piece's key."""
    head, _, offset = key.rpartition("@")
    state, _, name = head.partition("/")
    return state, name, tuple(int(o) for o in offset.split(",") if o)


def find_latest(root: Path, skip: tuple[Path, ...] = ()) -> Path | None:
    """The newest complete checkpoint under `root` (a folder being written is `.step_*.tmp`, and
    has no meta.json until it is renamed: never picked), other than those in `skip`."""
    root = Path(root)
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob(f"{PREFIX}*") if (p / META).is_file() and p not in skip)
    return done[-1] if done else None


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file, read in chunks (a checkpoint file may be larger than memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify_file(folder: Path, meta: dict, file: str) -> None:
    """Refuse a file whose content is not what its save wrote (meta.json's "sha256", recorded
    since issue 50; older checkpoints have only the sizes load_meta checks)."""
    expected = (meta.get("sha256") or {}).get(file)
    if expected is None:
        return
    actual = file_sha256(Path(folder) / file)
    if actual != expected:
        raise CheckpointDamage(
            f"{Path(folder) / file} is not the file that was saved: its SHA-256 is "
            f"{actual[:16]}..., {META} recorded {expected[:16]}... (a byte changed on disk or in "
            "a copy; its size is unchanged). Resume an earlier checkpoint, or copy this one again "
            "from where it was written.")


def read_header(path: Path) -> dict:
    """A safetensors file's header (tensor name -> dtype, shape, offsets; `__metadata__`)."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 * 2**20:
                raise ValueError(f"header of {size} bytes")
            return json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file ({exc}).") from None


@dataclass(frozen=True)
class Piece:
    """One box of one state of one tensor, stored in `file` under `key`."""

    file: str
    key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def as_dict(self) -> dict:
        return {"file": self.file, "key": self.key, "offset": list(self.offset),
                "shape": list(self.shape)}


def build_index(folder: Path, files: list[str], shapes: dict[str, list[int]]) -> dict:
    """meta.json's "tensors": for each parameter name its full shape and, per state, the pieces,
    read from the headers of the files the ranks wrote."""
    tensors = {name: {"shape": list(shape), "states": {}} for name, shape in shapes.items()}
    for file in files:
        for key, info in read_header(folder / file).items():
            if key == "__metadata__" or key.startswith("rng/"):
                continue
            state, name, offset = parse_key(key)
            if name not in tensors:
                raise CheckpointError(f"{file} holds {key!r}, a piece of no parameter of the "
                                      "model.")
            tensors[name]["states"].setdefault(state, []).append(
                Piece(file, key, offset, tuple(info["shape"])).as_dict())
    for entry in tensors.values():
        for pieces in entry["states"].values():
            pieces.sort(key=lambda p: p["offset"])
    return tensors


def pieces(meta: dict, name: str, state: str) -> list[Piece]:
    return [Piece(p["file"], p["key"], tuple(p["offset"]), tuple(p["shape"]))
            for p in meta["tensors"][name]["states"].get(state, [])]


def load_meta(path: Path) -> dict:
    """meta.json of the checkpoint folder `path`, checked: its format, and that every file it
    lists is there with the size it had when written."""
    path = Path(path)
    meta_file = path / META
    if not meta_file.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {META}). Give a "
                              "step_XXXXXXXX folder written by ultrascale, or "
                              "checkpoint.resume=auto.")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointDamage(f"{meta_file} cannot be read ({exc}).") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} was written in an older checkpoint format (per-rank state, no {FORMAT!r} in "
            f"{META}); this version reads only {FORMAT}. Resume it with the version that wrote "
            "it, or start afresh.")
    for file, size in meta["files"].items():
        f = path / file
        if not f.is_file():
            raise CheckpointDamage(f"{f} is missing: {META} lists {len(meta['files'])} files "
                                  f"written by {meta['world_size']} ranks. Copy it back, or "
                                  "resume an earlier checkpoint.")
        if f.stat().st_size != size:
            raise CheckpointDamage(f"{f} has {f.stat().st_size} bytes, {META} recorded {size}: it "
                                  "was truncated or changed after the save. Resume an earlier "
                                  "checkpoint.")
    return meta


def coverage_problems(meta: dict) -> list[str]:
    """Tensors whose pieces do not tile them exactly: a piece missing (a lost shard), outside the
    tensor, or a state that is not there at all."""
    problems = []
    for name, entry in meta["tensors"].items():
        shape = entry["shape"]
        states = entry["states"]
        if VALUE not in states:
            problems.append(f"{name}: no value saved")
        for state, plist in states.items():
            if len(plist) == 1 and not plist[0]["shape"] and not plist[0]["offset"]:
                continue  # a scalar state
            covered = 0
            for p in plist:
                box = zip(p["offset"], p["shape"], shape)
                if len(p["offset"]) != len(shape) or any(o < 0 or o + s > n for o, s, n in box):
                    problems.append(f"{state} of {name}: piece {p['key']} in {p['file']} lies "
                                    f"outside its shape {shape}")
                covered += math.prod(p["shape"])
            if covered != math.prod(shape):
                problems.append(f"{state} of {name}: the pieces hold {covered} of its "
                                f"{math.prod(shape)} elements (a shard is missing)")
    return problems

"""Each rank's last collectives, kept where a hang can still be read: a small memory-mapped file.

comm.py notes every transfer here as it enters it and again when it returns: its kind, its mesh
view, its bytes, and its sequence number on that view (the n-th transfer this rank made on that
view; every rank of the view's group makes the same ones in the same order, so the numbers match
across ranks). The file is `<run>/rank_logs/rank_N.collectives`: a rank that is stuck, stopped
(SIGSTOP), killed, or aborted by NCCL's watchdog without a Python exception leaves it current,
and the launcher reads every rank's to say which rank never entered which collective
(`diagnose`). Writing one is a few stores into mapped memory: no system call per collective.

Torch-free: the launcher reads these files without importing torch.
"""

from __future__ import annotations

import json
import mmap
import struct
import time
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"USCOLL1\0"
HEADER = struct.Struct("<8sii")  # magic, rank, slots written so far (mod SLOTS: the next one)
VIEW = struct.Struct("<16sq")  # view name, transfers entered on it
SLOT = struct.Struct("<q16s16sqddib")  # seq, view, kind, bytes, entered, returned, peer, state
MAX_VIEWS = 24
SLOTS = 32  # the last transfers kept
VIEWS_AT = HEADER.size
SLOTS_AT = VIEWS_AT + MAX_VIEWS * VIEW.size
SIZE = SLOTS_AT + SLOTS * SLOT.size
OPEN, DONE = 1, 2
# Collectives every rank of a group enters in the same order (point-to-point transfers pair two
# ranks, whose counts need not match).
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "barrier")
P2P = "~p2p"  # a view's point-to-point transfers are counted under `<view>~p2p`


def record_path(log_dir: Path, rank: int) -> Path:
    return Path(log_dir) / f"rank_{rank}.collectives"


def views_path(log_dir: Path, rank: int) -> Path:
    """The ranks of each of this rank's mesh views (JSON), written once when recording starts."""
    return Path(log_dir) / f"rank_{rank}.views.json"


class Recorder:
    """The writing side, one per rank (comm.py holds it)."""

    def __init__(self, log_dir: Path, rank: int, peers: dict[str, list[int]]):
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        views_path(log_dir, rank).write_text(json.dumps(peers))
        path = record_path(log_dir, rank)
        with path.open("wb") as f:
            f.write(bytes(SIZE))
        self._file = path.open("r+b")
        self._map = mmap.mmap(self._file.fileno(), SIZE)
        self._rank = rank
        HEADER.pack_into(self._map, 0, MAGIC, rank, 0)
        self._views: dict[str, int] = {}  # view -> its row in the table
        self._counts: dict[str, int] = {}
        self._written = 0

    def enter(self, kind: str, view: str, nbytes: int, peer: int = -1) -> int:
        """Note a transfer as entered; returns its slot (for `returned`)."""
        counter = view if kind in COLLECTIVES else view + P2P  # the two are numbered apart
        row = self._views.get(counter)
        if row is None:
            row = self._views[counter] = min(len(self._views), MAX_VIEWS - 1)
        seq = self._counts[counter] = self._counts.get(counter, 0) + 1
        VIEW.pack_into(self._map, VIEWS_AT + row * VIEW.size, counter.encode()[:16], seq)
        slot = self._written % SLOTS
        SLOT.pack_into(self._map, SLOTS_AT + slot * SLOT.size, seq, view.encode()[:16],
                       kind.encode()[:16], nbytes, time.time(), 0.0, peer, OPEN)
        self._written += 1
        HEADER.pack_into(self._map, 0, MAGIC, self._rank, self._written)
        return slot

    def returned(self, slot: int) -> None:
        at = SLOTS_AT + slot * SLOT.size
        fields = list(SLOT.unpack_from(self._map, at))
        fields[5], fields[7] = time.time(), DONE
        SLOT.pack_into(self._map, at, *fields)

    def close(self) -> None:
        self._map.close()
        self._file.close()


@dataclass
class Entry:
    seq: int
    view: str
    kind: str
    bytes: int
    entered: float
    returned: float | None
    peer: int

    def name(self) -> str:
        return f"{self.kind} on {self.view} #{self.seq} ({_size(self.bytes)})"


@dataclass
class RankRecord:
    rank: int
    counts: dict[str, int]  # view -> transfers entered
    entries: list[Entry]  # oldest first
    peers: dict[str, list[int]]

    def waiting(self) -> Entry | None:
        """The oldest transfer entered and not returned: where this rank is (or was) stuck."""
        return next((e for e in self.entries if e.returned is None), None)

    def last(self, view: str | None = None) -> Entry | None:
        return next((e for e in reversed(self.entries) if view is None or e.view == view), None)


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode(errors="replace")


def read_record(log_dir: Path, rank: int) -> RankRecord | None:
    """A rank's record, or None when it has none (never started recording, or unreadable)."""
    try:
        data = record_path(log_dir, rank).read_bytes()
        peers = json.loads(views_path(log_dir, rank).read_text())
    except (OSError, ValueError):
        return None
    if len(data) < SIZE or data[:8] != MAGIC:
        return None
    _, rank_in, written = HEADER.unpack_from(data, 0)
    counts = {}
    for row in range(MAX_VIEWS):
        name, count = VIEW.unpack_from(data, VIEWS_AT + row * VIEW.size)
        if name.strip(b"\0"):
            counts[_text(name)] = count
    entries = []
    for i in range(max(0, written - SLOTS), written):
        seq, view, kind, nbytes, entered, returned, peer, state = SLOT.unpack_from(
            data, SLOTS_AT + (i % SLOTS) * SLOT.size)
        entries.append(Entry(seq, _text(view), _text(kind), nbytes, entered,
                             returned if state == DONE else None, peer))
    return RankRecord(rank_in, counts, entries, peers)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _doing(record: RankRecord | None, now: float) -> str:
    """What a rank that did not come was doing, from its own record."""
    if record is None:
        return "it left no record of its collectives (it died before its first one, or its " \
               "files are on another node)"
    waiting = record.waiting()
    if waiting is not None:
        return f"it waits in {waiting.name()} itself, since {now - waiting.entered:.1f} s"
    last = record.last()
    if last is None:
        return "it made no collective yet"
    return (f"its last was {last.name()}, returned {now - (last.returned or now):.1f} s ago: "
            "since then it computes, or is stalled or stopped outside any collective")


def diagnose(records: dict[int, RankRecord | None], now: float | None = None) -> list[str]:
    """Which collective each stuck rank waits in, and which rank of its group never entered it.

    `records`: every rank of the run -> its record (None where it has none)."""
    now = time.time() if now is None else now
    waits: dict[tuple, list[int]] = {}
    for rank, record in sorted(records.items()):
        entry = record.waiting() if record else None
        if entry is None:
            continue
        if entry.kind in COLLECTIVES:
            group = tuple(record.peers.get(entry.view, []))
            key = (entry.kind, entry.view, entry.seq, group, entry.bytes)
            waits.setdefault(key, []).append(rank)
        else:  # a point-to-point transfer waits for one peer
            waits.setdefault((entry.kind, entry.view, entry.seq, (rank, entry.peer), entry.bytes),
                             []).append(rank)
    found: list[tuple[int, list[str]]] = []  # (0: a rank that never came, 1: other), lines
    for (kind, view, seq, group, nbytes), waiters in waits.items():
        name = f"{kind} on {view} #{seq} ({_size(nbytes)})"
        since = max(now - records[r].waiting().entered for r in waiters)
        if kind not in COLLECTIVES:
            peer = group[1]
            found.append((1, [f"{_ranks(waiters)} waits in {kind} on {view} with rank {peer} (its "
                              f"#{seq}, {since:.1f} s); rank {peer}: "
                              f"{_doing(records.get(peer), now)}"]))
            continue
        missing = [p for p in group if p not in waiters and
                   (records.get(p) is None or records[p].counts.get(view, 0) < seq)]
        other = [p for p in group if p not in waiters and p not in missing]
        verb = "waits" if len(waiters) == 1 else "wait"
        head = f"{_ranks(waiters)} {verb} in {name} since {since:.1f} s"
        if missing:
            found.append((0, [f"{_ranks(missing)} never entered {name}, which {_ranks(waiters)} "
                              f"{verb} in since {since:.1f} s"]
                          + [f"  rank {p}: {_doing(records.get(p), now)}" for p in missing]))
        elif other:
            found.append((1, [f"{head}; {_ranks(other)} entered it and returned: the ranks "
                              "disagree on the order of collectives (a rank-dependent branch)"]))
        else:
            found.append((1, [f"{head}: every rank of the group ({_ranks(group)}) entered it; "
                              "the transfer itself stalled (a rank stopped inside it, or the "
                              "network)"]))
    covered = {(key[1], key[3]) for key in waits}
    found += _behind(records, covered, now)
    return [line for _, block in sorted(found, key=lambda f: f[0]) for line in block]


def _behind(records: dict[int, RankRecord | None], covered: set, now: float) -> list:
    """Groups whose ranks entered different numbers of collectives while none of them waits
    in one (NCCL: a collective returns once queued on the GPU, so a hang shows as a count that
    stayed behind): the ranks behind never entered the others' last."""
    found, seen = [], set()
    for record in (r for r in records.values() if r is not None):
        for view, peers in record.peers.items():
            group = tuple(peers)
            if (view, group) in covered or (view, group) in seen:
                continue
            seen.add((view, group))
            counts = {p: records[p].counts.get(view, 0) for p in group if records.get(p)}
            top = max(counts.values(), default=0)
            behind = [p for p, n in counts.items() if n < top]
            if not behind:
                continue
            ahead = [p for p, n in counts.items() if n == top]
            last = next((e for e in reversed(records[ahead[0]].entries)
                         if e.view == view and e.seq == top), None)
            name = last.name() if last else f"collective #{top} on {view}"
            found.append((0, [f"{_ranks(behind)} never entered {name}, which {_ranks(ahead)} "
                              "entered"] + [f"  rank {p}: {_doing(records.get(p), now)}"
                                            for p in behind]))
    return found


def diagnose_dir(log_dir: Path, world: int) -> list[str]:
    """`diagnose` over the records of ranks 0..world-1 in `log_dir`."""
    return diagnose({r: read_record(log_dir, r) for r in range(world)})

"""`checkpoint.resume=auto` resumes the newest checkpoint that is what its save wrote.

A restart after a crash resumes by itself (launch.max_restarts, torchrun's agent): a damaged
newest checkpoint (a disk's error, a cut or changed copy) would stop every later attempt at the
same place. Under auto, resume.py already passes over one whose files are missing or cut or whose
tensors lack pieces (meta.json tells, before launch); here the ranks also check the content before
reading it: each hashes every world-size-th of the candidate's files against meta.json's SHA-256
(index.verify_file; each file hashed once, by one rank), one all-reduce agrees on the first bad
file, and a checkpoint with one is passed over for the next older one. Once one passes, rank 0
renames the damaged ones `.<name>.corrupt` (kept, never picked again) and says so. With none left
the run stops naming the newest damage rather than start afresh. A checkpoint given by folder is
used as given: its files are checked as they are opened (store.CheckpointReader).
"""

from __future__ import annotations

import torch

from ultrascale.checkpoint.index import CheckpointError, verify_file
from ultrascale.checkpoint.resume import ResumePlan, plan_resume
from ultrascale.config import Config
from ultrascale.distributed import comm
from ultrascale.train.progress import tell


def _first_bad_file(plan: ResumePlan, rank: int, world: int) -> int:
    """The index of the first file of this rank's share that fails its hash, or len(files)."""
    files = sorted(plan.meta["files"])
    for i in range(rank % world, len(files), world):
        try:
            verify_file(plan.path, plan.meta, files[i])
        except CheckpointError:
            return i
    return len(files)


def _set_aside(plan: ResumePlan, rank: int) -> None:
    """Rank 0 renames each damaged checkpoint `.<name>.corrupt` beside it (kept, never picked
    again, not a later branch of the run for run_folder.check), says so; the ranks wait for it."""
    if rank == 0:
        for path, why in plan.skipped:
            aside = path.with_name(f".{path.name}.corrupt")
            if path.is_dir() and not aside.exists():
                path.rename(aside)
            tell(f"warning: checkpoint {path} is damaged ({why}); set aside as {aside}")
        tell(f"resume: {plan.path} instead, the newest intact checkpoint")
    comm.barrier()


def agreed_plan(cfg: Config, rank: int, world: int) -> ResumePlan | None:
    """The resume plan every rank follows: plan_resume's, and under auto the newest checkpoint
    whose files all pass their hash (verified: the reader does not hash them again)."""
    plan = plan_resume(cfg)
    if plan is None or cfg.checkpoint.resume != "auto":
        return plan
    while True:
        first = torch.tensor([_first_bad_file(plan, rank, world)], dtype=torch.int64)
        comm.all_reduce(first, "world", op=torch.distributed.ReduceOp.MIN, tag="resume check")
        files = sorted(plan.meta["files"])
        if int(first) == len(files):
            break
        why = f"{files[int(first)]} is not the file its save wrote: its SHA-256 differs"
        # Raises once every checkpoint is passed over: never a fresh start.
        plan = plan_resume(cfg, (*plan.skipped, (plan.path, why)))
    plan.verified = True
    if plan.skipped:
        _set_aside(plan, rank)
    return plan

"""`comm.batch_p2p`, the one door of the pipeline's point-to-point transfers: data arrives, sends
and receives are counted apart, and the handles work whether the backend returns one work per
op (gloo) or one work for the whole batch (NCCL coalesces it; emulated here on gloo)."""

from __future__ import annotations

from distributed import run_ranks

N = 1000


class _Coalesced:
    """One handle for every op of a batch, as NCCL's batch_isend_irecv returns."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        # Each of gloo's works is waited on once (a second wait on one hung here).
        # NCCL's single work returns at once when waited on again.
        while self.works:
            self.works.pop().wait()
        return True

    def is_completed(self):
        return not self.works


def _exchange_rank(coalesce: bool) -> dict:
    import torch
    import torch.distributed as dist

    from ultrascale.distributed import comm
    from ultrascale.distributed.mesh import ParallelContext

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    comm.set_context(ParallelContext.without_mesh("cpu", rank, world, pp=world))
    if coalesce:
        real = dist.batch_isend_irecv
        dist.batch_isend_irecv = lambda ops: [_Coalesced(real(ops))]
    peer = 1 - rank
    send = torch.full((N,), float(rank + 1))
    recv = torch.zeros(N)
    comm.stats.reset()
    # Both directions in one batch, as the pipeline posts a send next to a receive.
    ops = [("send", send, peer), ("recv", recv, peer)] if rank == 0 else \
          [("recv", recv, peer), ("send", send, peer)]
    works = comm.batch_p2p(ops, dim="world", tag="test")
    for w in works:
        w.wait()
    done = all(w.is_completed() for w in works)
    counts = {k: (c.calls, c.bytes, c.wire_bytes) for (k, _), c in comm.stats.counters.items()}
    return {"received": recv.tolist(), "handles": len(works), "done": done, "counts": counts}


def _check(results):
    nbytes = N * 4
    for rank, r in enumerate(results):
        assert r["received"] == [float(2 - rank)] * N  # the peer's rank + 1
        assert r["handles"] == 2 and r["done"]
        assert r["counts"] == {"send": (1, nbytes, nbytes), "recv": (1, nbytes, 0.0)}


def test_batch_p2p_exchanges_and_counts_each_direction():
    _check(run_ranks(2, _exchange_rank, False))


def test_batch_p2p_hands_every_op_the_coalesced_work_nccl_returns():
    _check(run_ranks(2, _exchange_rank, True))


def test_batch_p2p_of_nothing_launches_nothing():
    from ultrascale.distributed import comm

    assert comm.batch_p2p([]) == []

"""The tests' spawner is the package's (`ultrascale.distributed.local_ranks`: calibrate, the tests
and the benchmarks start their local ranks the same way); this name stays for the tests that
import it from here."""

from ultrascale.distributed.local_ranks import free_port, rank_context, run_ranks

__all__ = ["free_port", "rank_context", "run_ranks"]

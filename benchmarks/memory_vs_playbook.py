"""The memory estimator against the playbook's H100 runs (nanotron, 1.34B and 3.57B Llama models).

    python benchmarks/memory_vs_playbook.py [--csv PATH] [--outside-gib G] [--show N] [--json]

Two comparisons, per row of `benchmarks/data/playbook_bench_1b_3b.csv`:

1. `Mem Alloc (GB)` of the successful runs against the estimator's optimizer-step peak of rank 0.
   nanotron logs `torch.cuda.max_memory_allocated()` in the benchmark row, but its `log_memory`
   (called right after `train_batch_iter` during the first steps) resets the peak statistics, so
   the figure is the peak from the end of the backward through gradient sync, clipping and the
   optimizer step: parameters, gradients, optimizer state, buffers kept from step to step, and
   ZeRO-1's all-gather of the updated parameters. It never saw the activations (a 1.34B run shows
   the same 25.07 GiB at one or two sequences per micro-batch). Rank 0 is pipeline stage 0.
2. The OOM rows: the estimator calls a layout out of memory when the forward/backward peak of its
   most loaded stage, with the allocator's fragmentation (`reserved`), exceeds 80 GiB less what
   the CUDA context and NCCL hold outside the allocator (`--outside-gib`, by default the H100
   profile's `outside_allocator_bytes`, 5 GiB). Rows marked Other failed for other reasons and are
   left out.

The model shapes come from the columns; the MLP width is not a column, so it is solved from the
published parameter count (`num_params`). nanotron splits pipeline stages by compute cost
(`get_block_compute_costs`: a decoder layer costs 4 h^2 + 3 h f, the output head V h, the
embedding nothing; a rank takes blocks until their cumulative cost passes its share). The runs used
two versions of its boundary test (cost > share, then >=); on an exact tie, which only the 1.34B
model's power-of-two costs produce, the split is read from the run's `Local Params` column.

The code is the package's: `ultrascale.memory.playbook` (also `python -m ultrascale.memory.playbook`).
"""

import sys

from ultrascale.memory.playbook import main

if __name__ == "__main__":
    sys.exit(main(description=__doc__))

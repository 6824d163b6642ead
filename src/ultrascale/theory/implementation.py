"""The implementations the theory describes: which tensors each keeps and how it runs a step.

The layout says what is split; an implementation decides which tensors exist (fused kernels,
DDP's gradient buckets, ZeRO's copies, ...). `ULTRASCALE` is ours, `NANOTRON` the runtime behind
the playbook's H100 benchmarks, `PLAYBOOK` the playbook's own formulas. (`ultrascale memory
--runtime NAME` and the planner's `runtime=` name them.) Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class TensorRules:
    """Implementation details that decide which tensors a Llama block saves."""

    norm_saves_normalized: bool  # RMSNorm keeps x/rms beside its output (unfused, as ours)
    norm_upcast: bool  # RMSNorm keeps an fp32 copy of a half-precision input (ours under autocast)
    rotary_saves_input: bool  # the rotary kernel keeps q, k before rotation
    attention: str  # "flash": output + logsumexp; "eager": also the a*s*s_kv probabilities
    attention_output_copy: bool  # the attention output is copied before the output projection
    swiglu_fused: bool  # silu(gate)*up as one kernel (or autograd function) saving gate, up only
    sp_saves_gathered: bool  # sequence parallel keeps the all-gathered norm output (else the shard)
    # Selective recompute also reruns silu(gate) * up, keeping gate and up but not silu(gate).
    selective_swiglu: bool = False
    # Under sequence parallel the final norm's output is gathered whole before the output head,
    # which keeps that full copy (ours) rather than the shard.
    sp_head_gathered: bool = False
    # The rotary tables are made once per forward and shared by the layers (ours), not per layer.
    rotary_tables_shared: bool = False
    # The loss without tensor parallel (F.cross_entropy, ours) peaks in its backward: the fp32
    # gradients of the log-probabilities and of the logits at once, beside the kept
    # log-probabilities (8 bytes a logit over the 4 kept; measured by the fake step).
    loss_backward_grads: bool = False
    # Where FlashAttention does not apply (fp32, or a head_dim it does not take), the attention
    # core runs the memory-efficient kernel, which takes as many kv heads as query heads: k and v
    # are expanded first, and the kernel keeps the expanded ones (ours: `ops.attention`).
    kv_expanded_off_flash: bool = False


@dataclass(frozen=True)
class Implementation:
    """What an implementation of training (ours, nanotron, the playbook's formulas) keeps besides
    the layout's own tensors, and the few choices of it that change the step time."""

    name: str
    activations: str  # "tensors" (block.saved_layer) or "playbook" (Korthikanti's form)
    rules: TensorRules
    # A parameter-dtype .grad beside an fp32 accumulation buffer: "always", "dp" (only when dp > 1:
    # DDP's gradient buckets), "dp_zero0" (dp > 1 without ZeRO: a cast of the reduced fp32 sum
    # that stays allocated from step to step) or "never".
    half_grads: str = "always"
    # Which gradients outlive the optimizer step: "always" (ours since its flat gradient buffers,
    # parallel/flat.py: one process's buffer and ZeRO-2/3's shard buffer are made once and kept),
    # or "buckets" (only data parallel's and ZeRO-1's buckets; one process and ZeRO-2/3 drop
    # them, so that with one micro-batch the backward starts without any).
    grads_between_steps: str = "always"
    # The gradient norm squares each gradient in float64 element by element: a copy and its
    # square of the largest one exist while it runs (ours before the fused path: its
    # `torch._foreach_norm(dtype=float64)` makes no copy).
    norm_float64: bool = False
    # ZeRO-2 accumulates micro-batches in the full gradient buffer and frees all but its shard
    # only after the last one is reduce-scattered: the full buffer exists during backward.
    zero2_full_grads_in_backward: bool = False
    # ZeRO-1 reduce-scatters each bucket into a fresh shard-sized buffer that lives until the
    # backward ends (parallel/zero.py): at the end of the backward every bucket's is held (a whole
    # fp32 copy of the expert gradients where the experts' ZeRO group is one rank).
    zero1_reduced_held: bool = False
    # What ZeRO-1/2 copies to all-gather the updated parameters: "full" (a flat temporary of all
    # of them plus the local shard, nanotron), "shard" (a copy of the local shard, ours), "none".
    zero_gather_copy: str = "none"
    # Data parallel reduces through buckets of bucket_mb separate from the gradients (else the
    # gradients are views of the buckets, as in ours and in DDP).
    grad_bucket_copy: bool = False
    # Buffers of b*s*h elements kept from step to step when tp > 1 with sequence parallel
    # (nanotron's MemoryBuffer: the all-gathered input, and the gathered gradient in backward).
    sp_gather_buffers: int = 0
    # Tensors beside the layers' saved activations (token ids, logits and loss probabilities, the
    # layer rebuilt by full recompute); the playbook's formula counts only the layers.
    count_extras: bool = True
    # With tp above the kv-head count, every rank keeps all kv projection weights (ours; Megatron
    # keeps only the kv head its query heads use).
    whole_kv: bool = False
    # ZeRO-3 keeps only each rank's fp32 shard (ours, zero3.py): it is the parameters' storage
    # and the master copy at once, and the compute-dtype parameters exist only while gathered.
    zero3_shard_is_master: bool = False
    # Library workspaces and small tables (cuBLAS workspaces, rotary caches), bytes.
    workspace: int = 0
    # The caching allocator's overhead on memory that comes and goes within a step (activations,
    # transients): a fraction of it, reserved but not allocated. Only the `reserved` figure and
    # the fits verdict use it. The GPU runtimes use 0.25: on the playbook's H100 runs the median
    # of (reserved - steady) / (peak - steady) is 1.29 (docs/memory.md).
    fragmentation: float = 0.0
    # Timing, read by the planner's cost model: whether the ZeRO-1/2 gradient reduce-scatter runs
    # under the last backward (ours, like DDP's all-reduce) or holds it up bucket by bucket.
    zero_reduce_overlaps: bool = True
    # How pipeline ranks split the model: "even" (layers as even as possible, the head on the last
    # rank; ours) or "cost" (nanotron: blocks go to ranks in order until each rank's share of the
    # summed block costs, 4 h^2 + 3 f h per layer and vocab x h for the head, is passed). Read by
    # the cost model; the memory estimate keeps the even split.
    pp_partition: str = "even"
    # All-reduces of a few numbers per token in the vocabulary-parallel cross-entropy (ours: the
    # maximum logit, then the sum of exponentials and the target logit together; nanotron: three).
    loss_all_reduces: int = 2


# Ours: models/llama.py run by PyTorch autograd (unfused RMSNorm, SDPA; the SwiGLU one autograd
# function keeping gate and up only, `ops.swiglu`), with parallel/recompute.py's selective mode
# (attention core and SwiGLU product rerun in backward).
ULTRASCALE = Implementation(
    name="ultrascale", activations="tensors",
    rules=TensorRules(norm_saves_normalized=True, norm_upcast=True, rotary_saves_input=False,
                      attention="flash", attention_output_copy=False, swiglu_fused=True,
                      sp_saves_gathered=False, selective_swiglu=True, sp_head_gathered=True,
                      rotary_tables_shared=True, loss_backward_grads=True,
                      kv_expanded_off_flash=True),
    # A low-precision gradient is added into the fp32 buffer and dropped as it comes
    # (parallel/buckets.py, replicated.py), and the fp32 master weights step on the fp32 sum
    # (parallel/precision.py); parallel/zero.py gathers parameters from a copy of the local
    # shard and, at stage 2, reduce-scatters the full buffer after the last micro-batch.
    half_grads="never", zero_gather_copy="shard", zero2_full_grads_in_backward=True,
    whole_kv=True, zero3_shard_is_master=True, grads_between_steps="always",
    zero1_reduced_held=True,
    fragmentation=0.25,
)
# nanotron as used for the playbook's benchmark runs: Triton RMSNorm (keeps input and 1/rms),
# in-place flash rotary, flash attention, merged gate/up projection, DDP with an fp32 accumulation
# hook, ZeRO-1 all-gather through a flat copy, persistent all-gather buffers under sequence
# parallel. The 80 MiB workspace is calibrated on those runs (docs/memory.md): one cuBLAS workspace
# per stream (32 MiB each on Hopper for compute and communication streams) and small caches.
NANOTRON = Implementation(
    name="nanotron", activations="tensors",
    rules=TensorRules(norm_saves_normalized=False, norm_upcast=False, rotary_saves_input=False,
                      attention="flash", attention_output_copy=False, swiglu_fused=False,
                      sp_saves_gathered=False),
    half_grads="dp", zero_gather_copy="full", sp_gather_buffers=2, workspace=80 * 2**20,
    fragmentation=0.25,
    # Its fp32 accumulation hook issues ZeRO's reduce-scatter through a helper whose completion
    # callback copies the reduced shard back on the compute stream: that copy waits for the
    # collective, so each bucket's reduce-scatter holds up the rest of the backward. (Without
    # ZeRO, the hook's all-reduce is only waited for after the backward, and overlaps it.)
    zero_reduce_overlaps=False,
    loss_all_reduces=3,
)
# The playbook's own accounting: its activation formula (layers only) and the ZeRO formulas.
PLAYBOOK = Implementation(
    name="playbook", activations="playbook", rules=ULTRASCALE.rules, count_extras=False,
)
# nanotron with its own pipeline partition. The H100 constants were fitted with the even split
# (`nanotron`); with this one, refitted, they leave their bounds (docs/planner.md), which is the
# next step for the playbook comparison (`planner_vs_playbook.py --runtime nanotron-balanced`).
NANOTRON_BALANCED = replace(NANOTRON, name="nanotron-balanced", pp_partition="cost")
# Ours on a CPU (the tests' runs, `ultrascale memory --measure-kernels cpu`): PyTorch's CPU
# attention takes grouped kv heads in every dtype, so nothing is expanded.
ULTRASCALE_CPU = replace(ULTRASCALE, name="ultrascale-cpu",
                         rules=replace(ULTRASCALE.rules, kv_expanded_off_flash=False))
IMPLEMENTATIONS = {r.name: r for r in (ULTRASCALE, ULTRASCALE_CPU, NANOTRON, NANOTRON_BALANCED,
                                       PLAYBOOK)}


def implementation(name_or_impl: "Implementation | str") -> "Implementation":
    """An implementation by name (IMPLEMENTATIONS), or the one given."""
    if isinstance(name_or_impl, Implementation):
        return name_or_impl
    return IMPLEMENTATIONS[name_or_impl]

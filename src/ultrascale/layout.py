"""A parallel layout as the estimator and the planner see it: every knob that changes memory or time.

`Layout` is the flat, hashable twin of the `parallel`, `training` and `precision` keys that change
memory or time, so that a layout can be enumerated and parsed from `dp=8,tp=2,...`. Which key
feeds which field is declared once, at the key (config_sections.py `key(..., layout="mbs")`):
the config makes its layout (`Config.layout()`) and a layout's sections
(`config.layout_sections`); this module never reaches back for the config.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
# What a run in each compute dtype keeps in memory and moves between ranks: FP8 quantises the
# inputs of the blocks' matmuls only, so its parameters, activations and collectives are bf16
# (parallel/precision.py).
STORAGE_DTYPE = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp8": "bf16"}


def storage_bytes(dtype: str) -> int:
    """Bytes per element of the parameters and activations of a run computing in `dtype`."""
    return DTYPE_BYTES[STORAGE_DTYPE.get(dtype, dtype)]


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    # ZeRO-3: auto, step (gathered once a step, kept through it) or micro_batch (for every use);
    # rules.zero3_gathers_per_step resolves auto.
    zero3_gather: str = "auto"
    dp_shard: int | None = None  # hybrid sharding group size (None: shard over all of dp)
    sequence_parallel: bool = False
    recompute: str = "none"  # none, selective, full
    mbs: int = 1  # micro-batch size, sequences
    grad_accum: int = 1  # micro-batches per step (the pipeline's m)
    seq_len: int = 4096
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    dtype: str = "bf16"  # compute / parameter dtype on the device
    master_dtype: str = "fp32"
    grad_accum_dtype: str = "fp32"
    bucket_mb: float = 25.0
    cp_mode: str = "ring"  # ring, all_gather, ulysses (context parallel's attention)
    optimizer: str = "adamw"  # adamw, muon (one momentum buffer for the blocks' matrices)
    fp8_cache: bool = False  # fp8: linears keep their input quantised (fp8_cache_activations)
    fp8_experts: bool = False  # fp8: the routed experts multiply in FP8 (precision.fp8_experts)
    chunked_loss: bool = False  # the head and loss a chunk of tokens at a time (no full logits)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def global_batch_size(self) -> int:
        return self.mbs * self.grad_accum * self.dp

    @property
    def global_batch_tokens(self) -> int:
        return self.global_batch_size * self.seq_len

    def with_(self, **changes) -> "Layout":
        return replace(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)

    def short(self) -> str:
        """A compact name, e.g. dp8-tp2-pp1-zero1-mbs2-acc4-sel."""
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}" + ("" if self.cp_mode == "ring" else f"{self.cp_mode}"))
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts.append(f"zero{self.zero}")
        if self.zero == 3 and self.zero3_gather != "auto":
            parts.append({"step": "gstep", "micro_batch": "gmb"}.get(self.zero3_gather,
                                                                  self.zero3_gather))
        parts += [f"mbs{self.mbs}", f"acc{self.grad_accum}"]
        if self.sequence_parallel:
            parts.append("sp")
        if self.recompute != "none":
            parts.append(self.recompute[:3])
        if self.chunked_loss:
            parts.append("cl")
        if self.pp > 1:
            many = self.pp_virtual_stages > 1 and self.pp_schedule != "dualpipev"  # its V: 2
            parts.append(self.pp_schedule + (f"v{self.pp_virtual_stages}" if many else ""))
        return "-".join(parts)


# Short names a layout string may use for a field (`acc=4` for grad_accum=4), and the config's
# names of the batch fields.
LAYOUT_ALIASES = {"micro_batch_size": "mbs", "acc": "grad_accum", "grad_accum_steps": "grad_accum",
                  "sp": "sequence_parallel", "seq": "seq_len", "schedule": "pp_schedule",
                  "vpp": "pp_virtual_stages", "v": "pp_virtual_stages",
                  "gather": "zero3_gather"}


def parse_layout(text: str, base: Layout | None = None) -> Layout:
    """Parse `dp=8,tp=1,pp=2,zero=1,mbs=2,...` over `base` (defaults when None)."""
    names = {f.name: f.type for f in fields(Layout)}
    changes: dict = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise ValueError(f"layout item {item!r} is not key=value (e.g. dp=8,tp=2,zero=1)")
        key, value = (s.strip() for s in item.split("=", 1))
        key = LAYOUT_ALIASES.get(key, key)
        if key not in names:
            raise ValueError(f"unknown layout key {key!r}; known: {', '.join(names)}")
        kind = names[key]
        if "bool" in str(kind):
            changes[key] = value.lower() in ("1", "true", "yes", "on")
        elif "float" in str(kind):
            changes[key] = float(value)
        elif "int" in str(kind):
            changes[key] = None if value.lower() == "none" else int(value)
        else:
            changes[key] = value
    return replace(base or Layout(), **with_schedule_chunks(changes))


def with_schedule_chunks(given: dict) -> dict:
    """`given` (layout or config keys) with DualPipeV's two chunks per rank (its V) where the
    schedule is named and the chunk count is not: the default of the config, `--layout` and the
    memory flags alike. An explicit other count stays, for the schedule's rules to refuse."""
    if given.get("pp_schedule") == "dualpipev" and "pp_virtual_stages" not in given:
        return {**given, "pp_virtual_stages": 2}
    return given

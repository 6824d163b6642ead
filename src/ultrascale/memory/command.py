"""`ultrascale memory`: the per-device memory of a layout, before any run.

    ultrascale memory configs/llama3-8b.yaml --gpu h100
    ultrascale memory --preset llama3-70b --tp 8 --pp 4 --dp 8 --zero 1 --seq-len 8192 --gpu h100
    ultrascale memory --hf-config path/to/config.json --dp 8 --json

The model and layout come from a training config (CONFIG.yaml), or from flags: the model as
`--preset NAME`, `--hf-config PATH` or shape flags (which also override a preset), the layout as
flags named like the config keys. Flags given with a config override it. Bad input exits with
code 2 and one paragraph.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace

from ultrascale.config import ConfigError, ModelConfig
from ultrascale.config_keys import add_layout_flags, layout_names
from ultrascale.layout import Layout, with_schedule_chunks
from ultrascale.memory.estimator import LayoutError, estimate
from ultrascale.theory.implementation import IMPLEMENTATIONS

_SHAPE_FLAGS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size",
                "vocab_size", "num_experts", "experts_top_k", "shared_experts",
                "moe_ffn_hidden_size", "first_k_dense")
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


def parse_size(text: str) -> int:
    """'80GiB' -> 85899345920, '141GB' -> 141e9, '1.5e9' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ConfigError(f"--device-memory {text!r} is not a size; write e.g. 80GiB, 141GB or a "
                          "number of bytes.")
    return int(float(match.group(1)) * _UNITS[unit])


def gpu_memory(name: str) -> tuple[int, str]:
    """The memory a named GPU leaves the framework, and a line saying so: its capacity less what
    the CUDA context and NCCL hold outside the allocator (planner.hardware,
    `usable_memory_bytes`)."""
    from ultrascale.planner.hardware import PROFILES  # plain data and YAML: no torch import

    key = name.lower()
    if key not in PROFILES:
        raise ConfigError(f"--gpu {name!r} is not a known device; choose one of "
                          f"{', '.join(sorted(PROFILES))}, or give --device-memory SIZE.")
    hw = PROFILES[key]
    note = (f"device memory: the {hw.name}'s {hw.memory_bytes / 2**30:.1f} GiB less "
            f"{hw.outside_allocator_bytes / 2**30:.1f} GiB for the CUDA context and NCCL")
    return int(hw.usable_memory_bytes), note


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("memory", help="per-device memory of a layout, before any run",
                              description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", metavar="CONFIG.yaml",
                   help="a training config: its model and layout (flags given as well override "
                        "them)")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="set one key, as `ultrascale train --set` does: of CONFIG.yaml, else of the "
                        "defaults (with --preset, model.* keys change the preset); flags given "
                        "override it")
    model = p.add_argument_group("model (a preset, a Hugging Face config.json, or shape flags)")
    model.add_argument("--preset", help="e.g. tiny, llama3-8b, llama3-70b")
    model.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json")
    for name in _SHAPE_FLAGS:
        model.add_argument("--" + name.replace("_", "-"), type=int)
    model.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None)

    # One flag per layout key, from its declaration (config_keys.add_layout_flags): defaults are
    # None so that a flag the user gave can override CONFIG.yaml; the help shows Layout()'s, used
    # without a config.
    lay = p.add_argument_group("layout (defaults: a config's, else those shown)")
    add_layout_flags(lay)
    lay.add_argument("--pp-layers", help="layers per pipeline stage, e.g. 10,10,12 (uneven split)")

    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="one JSON object for programs")
    out.add_argument("--plot", metavar="PNG", help="also draw the breakdown, and memory against "
                     "sequence length, into this PNG file (needs matplotlib)")
    out.add_argument("--device-memory", metavar="SIZE", help="e.g. 80GiB: give a fit verdict")
    out.add_argument("--gpu", help="a device name (h100, h200, ...): its memory, less what the "
                     "CUDA context and NCCL hold (5 GiB on the GPU profiles)")
    out.add_argument("--runtime", choices=sorted(IMPLEMENTATIONS), default="ultrascale",
                     help="whose tensors to count: ours, nanotron's, or the playbook's formulas")
    out.add_argument("--stage", type=int, help="report this pipeline stage, not the most loaded")
    out.add_argument("--measure", action="store_true",
                     help="also run the engine's own training step for the layout on fake "
                     "tensors (no memory behind them) and report its peak beside the estimate")
    out.add_argument("--measure-kernels", choices=("cuda", "cpu"), default="cuda",
                     help="with --measure: make a GPU's kernel choices (default) or this CPU's")
    out.add_argument("--headroom", type=float, default=0.0,
                     help="fraction of the device kept free in the verdict, on top of what --gpu "
                     "already keeps (use it with --device-memory SIZE for the CUDA context and "
                     "NCCL)")


def _model(**data) -> ModelConfig:
    """ModelConfig(**data), its validation error turned into our one-paragraph ConfigError."""
    from pydantic import ValidationError

    try:
        return ModelConfig(**data)
    except ValidationError as err:
        msgs = []
        for e in err.errors():
            inner = (e.get("ctx") or {}).get("error")
            loc = ".".join(str(x) for x in e["loc"])
            msgs.append(str(inner) if inner else f"model.{loc}: {e['msg']}")
        raise ConfigError(" ".join(msgs)) from None


def load_training_config(args):
    """The training config named on the command line (with its --set overrides), or one of the
    --set keys alone (on the defaults; the flags override both), or None."""
    from ultrascale.config import build_config, load_config

    if not getattr(args, "config", None):
        if not getattr(args, "set", None):
            return None
        # On --preset's model, not the defaults' (tiny): model.num_experts=4 is checked with the
        # preset's experts_top_k.
        preset = getattr(args, "preset", None)
        return build_config({"model": {"preset": preset}} if preset else {}, args.set)
    return load_config(args.config, args.set or [])


def build_model(args, cfg=None) -> ModelConfig:
    shape = {k: getattr(args, k) for k in _SHAPE_FLAGS if getattr(args, k) is not None}
    if args.tie_embeddings is not None:
        shape["tie_embeddings"] = args.tie_embeddings
    if args.preset and args.hf_config:
        raise ConfigError("Give either --preset or --hf-config, not both.")
    if cfg is not None and not args.preset and not args.hf_config:
        return _model(**{**cfg.model.keys(), **shape}) if shape else cfg.model
    if args.preset and not getattr(args, "config", None) and cfg is not None:
        # --preset with --set keys and no CONFIG.yaml: the config is the preset's, the model keys
        # among them applied (`load_training_config`).
        return _model(**{**cfg.model.keys(), **shape}) if shape else cfg.model
    if args.hf_config:
        from ultrascale.memory.hf import from_hf_config
        base = from_hf_config(args.hf_config)
        if not shape:
            return base
        data = base.keys()
        data.update(shape)
        return _model(**data)
    if not args.preset and not shape:
        raise ConfigError("No model given. Give a training config (ultrascale memory "
                          "CONFIG.yaml), --preset NAME (e.g. llama3-8b), --hf-config PATH, or the "
                          "shape flags (--hidden-size, --num-layers, --num-heads, ...).")
    return _model(preset=args.preset, **shape)


def config_layout(cfg) -> Layout:
    """A training config's layout (its `precision.dtype: auto` resolved for this machine when the
    config was validated: bf16 on CUDA and on CPUs with bf16 instructions, else fp32)."""
    return cfg.layout()


def build_layout(args, cfg=None) -> tuple[Layout, list[int] | None]:
    pp_layers = list(cfg.parallel.pp_layers) if cfg is not None and cfg.parallel.pp_layers \
        else None
    if args.pp_layers:
        try:
            pp_layers = [int(x) for x in args.pp_layers.split(",")]
        except ValueError:
            raise ConfigError(f"--pp-layers {args.pp_layers!r} must be comma-separated integers, "
                              "one per pipeline stage.") from None
    given = with_schedule_chunks({name: getattr(args, name) for name in layout_names()
                                  if getattr(args, name) is not None})
    if cfg is not None and not getattr(args, "config", None):
        base = _set_layout(cfg, args.set)
    else:
        base = config_layout(cfg) if cfg is not None else Layout()
    return replace(base, **given), pp_layers


def _set_layout(cfg, sets: list[str]) -> Layout:
    """--set keys without a CONFIG.yaml: this command's own defaults (dp 1, seq 4096, ...), not
    `ultrascale train`'s, with the layout keys the --set items name (`parallel.bucket_mb=5`)."""
    from ultrascale.config import layout_keys, parse_override

    named = {".".join(parse_override(item)[0]) for item in sets}
    full = config_layout(cfg)
    return replace(Layout(), **{k.layout: getattr(full, k.layout) for k in layout_keys()
                                if k.name in named})


def _print_table(est, model: ModelConfig, layout: Layout, device_note: str = "",
                 measured=None) -> None:
    from ultrascale.memory.report import format_table, rows, table_unit

    zero3_master = IMPLEMENTATIONS[est.runtime].zero3_shard_is_master
    title = (f"{model.preset or 'model'} ({_params(model.num_params())} params), "
             f"{layout.short()}, seq {layout.seq_len}, {layout.dtype}")
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(format_table(est, layout, zero3_master))
        if device_note:
            print(device_note)
        return
    unit, scale = table_unit(est)
    caption = f"{est.rank_desc}; runtime {est.runtime}" + (f"; {device_note}" if device_note else "")
    table = Table(title=title, caption=caption)
    table.add_column("memory per device")
    table.add_column(unit, justify="right")
    if measured is not None:
        from ultrascale.memory.measured import caption, measured_cell

        table.add_column("measured", justify="right")
        table.caption += "\n" + caption(measured)
    table.add_column("")
    for item, text, note in rows(est, layout, zero3_master, lambda n: f"{n / scale:,.2f}"):
        bold = not item.startswith(" ") and item in ("total (peak)", "device memory")
        cells = [item, text]
        if measured is not None:
            cells.append(measured_cell(item, measured, scale))
        table.add_row(*cells, note, style="bold" if bold else None)
    Console().print(table)


def _params(n: int) -> str:
    """`8.03B`, `783.7M`: parameters in the unit that shows them (the tiny preset is not 0.00B)."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def evaluate(args):
    """The estimate of the flags: (estimate, model, layout, device note). Raises ConfigError,
    LayoutError or ValueError on bad input."""
    cfg = load_training_config(args)
    model = build_model(args, cfg)
    layout, pp_layers = build_layout(args, cfg)
    device, device_note = None, ""
    if args.device_memory:
        device = parse_size(args.device_memory)
    elif args.gpu:
        device, device_note = gpu_memory(args.gpu)
    est = estimate(model, layout, device_memory=device, runtime=args.runtime,
                   stage=args.stage, pp_layers=pp_layers, headroom=args.headroom)
    return est, model, layout, device_note


def report(args) -> dict:
    """The object `ultrascale memory --json` prints for these flags (the web app's /api/memory)."""
    return _as_json(*evaluate(args))


def _as_json(est, model: ModelConfig, layout: Layout, device_note: str) -> dict:
    out = est.to_dict()
    out["model"] = model.model_dump()
    out["layout"] = layout.as_dict()
    if device_note:
        out["device_note"] = device_note
    return out


def run(args) -> int:
    try:
        est, model, layout, device_note = evaluate(args)
        out = _as_json(est, model, layout, device_note)
        if args.plot:
            from ultrascale.memory.plot import draw_memory

            path = draw_memory(out, _seq_len_series(args, layout.seq_len), args.plot)
        measured = _measure(args, model) if args.measure else None
    except (ConfigError, LayoutError, ValueError) as exc:
        print(f"ultrascale memory: {exc}", file=sys.stderr)
        return 2
    if measured is not None:
        out["measured"] = measured.as_dict()
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        _print_table(est, model, layout, device_note, measured)
    if args.plot:
        print(f"picture: {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _measure(args, model: ModelConfig):
    """The engine's step for this layout on fake tensors (memory/measured.py)."""
    from ultrascale.memory.measured import config_for, measure

    cfg = load_training_config(args)
    layout, pp_layers = build_layout(args, cfg)
    return measure(config_for(model, layout, pp_layers, base=cfg), args.measure_kernels)


def _seq_len_series(args, seq_len: int) -> list[tuple[int, dict]]:
    """(sequence length, report) for the playbook's memory-against-sequence-length chart: powers of
    two from 1k to 16k and the layout's own length, those the layout accepts."""
    lengths = sorted({2**k for k in range(10, 15)} | {seq_len})
    series = []
    for n in lengths:
        try:
            series.append((n, report(argparse.Namespace(**{**vars(args), "seq_len": n}))))
        except (ConfigError, LayoutError, ValueError):
            continue  # (a length this layout's cp or tp does not divide)
    return series


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ultrascale memory", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

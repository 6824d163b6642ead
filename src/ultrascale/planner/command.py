"""`ultrascale plan`: rank layouts for a model on a cluster, or predict one given layout.

    ultrascale plan --preset llama3-8b --gpus 64 --gpu h100 --global-batch-tokens 4M
    ultrascale plan --preset llama3-8b --gpus 16 --layout dp=8,tp=2,zero=1,mbs=1,acc=32
    ultrascale plan --config configs/llama3-8b.yaml          # predict a training config's layout
    ultrascale plan --config configs/llama3-8b.yaml --gpus 16  # its model and batch on 16 GPUs

The winner's `ultrascale train` config goes to plan.yaml (a fresh plan-N.yaml when that exists,
unless --force); the path is printed. `--config-out -` writes it to stdout (the table then goes to
stderr), `--config-out none` nowhere. On a terminal a bar on stderr shows the search's progress
(a cluster of a thousand GPUs has ~100,000 layouts to cost: about a minute).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from contextlib import contextmanager
from pathlib import Path

import yaml

from ultrascale.config import ConfigError, ModelConfig, build_config, layout_sections
from ultrascale.config_keys import add_layout_flag
from ultrascale.layout import Layout, parse_layout
from ultrascale.planner.cost import Prediction, predict, uneven_pp_layers
from ultrascale.planner.hardware import PROFILES, get_hardware
from ultrascale.planner.search import Plan, PlanError, SearchSpace, plan
from ultrascale.rules import engine_violations

GiB = 2**30
DEFAULT_PRESET = "llama3-8b"
DEFAULT_SEQ_LEN = 4096
DEFAULT_BATCH_TOKENS = "1M"
_SUFFIX = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}

# The runtime every prediction is for, and how far its step times were off our own measured runs.
RUNTIME = "ultrascale"
RUNTIME_NOTE = ("Predicted for the ultrascale runtime (this engine's step); its error on our "
                "own measured runs: docs/planner.md, \"On our own runtime\".")


def parse_tokens(text: str) -> int:
    """`16M` = 16 x 2^20 tokens (batches are powers of two of sequences), `4096`, `1.5K`."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGkmg]?)\s*", str(text))
    if not m:
        raise ValueError(f"--global-batch-tokens {text!r} is not a number of tokens such as 1048576, "
                         "1M or 16M (K, M, G are powers of 1024).")
    value = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if value != int(value) or value <= 0:
        raise ValueError(f"--global-batch-tokens {text!r} is not a positive whole number of tokens.")
    return int(value)


def model_from_args(args, cfg=None) -> ModelConfig:
    if cfg is not None:
        return cfg.model
    if getattr(args, "hf_config", None):
        from ultrascale.memory.hf import from_hf_config
        return from_hf_config(args.hf_config)
    return build_config({"model": {"preset": args.preset or DEFAULT_PRESET}}).model


def model_name(args) -> str:
    """What the output calls the model: the config file, the preset, or a Hugging Face config's
    own name (its folder or `_name_or_path`, and its class)."""
    if getattr(args, "hf_config", None):
        from ultrascale.hf_arch import model_label
        return model_label(args.hf_config)
    return args.config or args.preset or DEFAULT_PRESET


def _ints(text: str | None, flag: str = "") -> list[int] | None:
    try:
        return [int(x) for x in text.split(",")] if text else None
    except ValueError:
        raise ValueError(f"{flag} {text!r} is not a list of whole numbers such as 1,2,4."
                         ) from None


def _strs(text: str | None) -> list[str] | None:
    return [x.strip() for x in text.split(",")] if text else None


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="rank parallel layouts, or predict one",
                              description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help=f"model preset (default {DEFAULT_PRESET})")
    src.add_argument("--hf-config", help="a Hugging Face config.json instead of a preset")
    src.add_argument("--config", metavar="CONFIG.yaml",
                     help="a training config: its model, seq_len, global batch and dtype; its "
                          "layout is predicted, or with --gpus N layouts are ranked")
    p.add_argument("--gpus", type=int, help="devices in the cluster (default: the layout's size)")
    p.add_argument("--gpu", default="h100", help=f"hardware profile: {', '.join(PROFILES)}, "
                   "local (after `ultrascale calibrate`) or a YAML path")
    p.add_argument("--global-batch-tokens",
                   help=f"tokens per optimizer step (default {DEFAULT_BATCH_TOKENS}, or the "
                        "config's)")
    add_layout_flag(p, "seq_len", default_note=", or the config's")
    p.add_argument("--layout", help="predict this layout instead of searching: dp=8,tp=2,zero=1,...")
    p.add_argument("--pp-layers", metavar="N,N,...|balanced",
                   help="with one layout (--layout, or a config's): the layers of each pipeline "
                        "stage to cost, or 'balanced' for the split that leaves the busiest rank "
                        "least busy (default: the config's parallel.pp_layers, else the "
                        "engine's split)")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--config-out", default="plan.yaml",
                   help="where to write the winner's `ultrascale train` config (plan.yaml; a "
                        "fresh plan-N.yaml if it exists, unless --force); '-' for stdout (the "
                        "table then goes to stderr), 'none' for nowhere")
    p.add_argument("--force", action="store_true", help="overwrite --config-out if it exists")
    add_layout_flag(p, "dtype", default_note=", or the config's")
    add_layout_flag(p, "optimizer", default_note=", or the config's; muon: docs/muon.md")
    for name in FP8_FLAGS:
        add_layout_flag(p, name, default_note=", or the config's; docs/precision.md")
    for dim, example in (("tp", "1,2,4"), ("pp", "1,2,4"), ("cp", "1,2"), ("ep", "1,8"),
                         ("zero", "0,1"), ("mbs", "1,2,4")):
        p.add_argument(f"--search-{dim}", help=f"only these {dim} values, e.g. {example}")
    p.add_argument("--search-recompute",
                   help="only these: none,selective,full,norms_and_mla_up (DeepSeek-V3's, searched "
                        "by default for models with multi-head latent attention)")
    p.add_argument("--search-schedules",
                   help="only these: afab,1f1b,interleaved,zero_bubble,dualpipev")
    p.add_argument("--search-gathering", help="ZeRO-3 under pp: only these ways of gathering: "
                                                "step,micro_batch (docs/pipeline.md)")


def _space(args) -> SearchSpace:
    space = SearchSpace(tp=_ints(args.search_tp, "--search-tp"),
                        pp=_ints(args.search_pp, "--search-pp"),
                        cp=_ints(args.search_cp, "--search-cp"),
                        ep=_ints(args.search_ep, "--search-ep"),
                        mbs=_ints(args.search_mbs, "--search-mbs"), dtype=args.dtype,
                        optimizer=getattr(args, "optimizer", None) or "adamw",
                        **_fp8_flags(args))
    if args.search_zero:
        space.zero = _ints(args.search_zero, "--search-zero")
        space.zero_with_pp = True  # stages asked for by name are tried with pp too
    if args.search_gathering:
        space.zero3_gather = _strs(args.search_gathering)
    if args.search_recompute:
        space.recompute = _strs(args.search_recompute)
    if args.search_schedules:
        space.schedules = _strs(args.search_schedules)
    return space


def _name(p: Prediction) -> str:
    """The layout's short name, starred when our engine does not run it yet (`unsupported`),
    marked `+` when its layers are split otherwise than the engine's default (`own_split`)."""
    return p.layout.short() + ("+" if p.split_given else "") + ("*" if p.unsupported else "")


def _row(i: int, p: Prediction, width: int = 44, same: list[str] | None = None,
         unit: int = GiB) -> str:
    mem = f"{p.memory_bytes / unit:7.1f}" if p.memory_bytes is not None else "      ?"
    ties = f"  (same time: {', '.join(same)})" if same else ""
    return (f"{i:>2}  {_name(p):<{width}} {mem}  {p.tokens_per_s_per_device:>10,.0f}  "
            f"{p.mfu:6.1%}  {p.step_time_s:8.3f}  {p.dominant} ({p.shares()[p.dominant]:.0%})"
            + ties)


def _table(rows: list[tuple[int, Prediction]], same_time: dict | None = None) -> str:
    """The header and rows, the layout column as wide as its longest name; a row lists the
    layouts predicted at the very same step time (shown once: `Plan.same_time`)."""
    same_time = same_time or {}
    width = max([44] + [len(_name(p)) for _, p in rows])
    small = all(p.memory_bytes is None or p.memory_bytes < GiB for _, p in rows)
    unit, name = (2**20, "mem MiB") if small else (GiB, "mem GiB")  # never a column of 0.0
    header = (f"{'#':>2}  {'layout':<{width}} {name:>7}  {'tok/s/dev':>10}  {'MFU':>6}  "
              f"{'step s':>8}  dominant cost")
    notes = sorted({why for _, p in rows for why in p.unsupported})
    footer = ["* not run by ultrascale's engine yet: " + " ".join(notes)] if notes else []
    if any(p.split_given for _, p in rows):
        footer.append("+ its layers split to balance the pipeline ranks (the head's rank holds "
                      "fewer): parallel.pp_layers in its config")
    return "\n".join([header] + [_row(i, p, width, same_time.get(p.layout.short()), unit)
                                 for i, p in rows] + footer)


def train_config(model: ModelConfig, layout: Layout, pp_layers=None) -> dict:
    """The `ultrascale train` config of a layout: the model section plus the layout's sections,
    with the layers of each pipeline stage as predicted: `pp_layers` where given (a split the
    prediction costed), else the engine's where they do not divide evenly."""
    stages = layout.pp * layout.pp_virtual_stages
    if stages > model.num_layers:  # (the estimator costs empty stages; the trainer has none)
        raise ValueError(f"pp={layout.pp} x pp_virtual_stages={layout.pp_virtual_stages} makes "
                         f"{stages} pipeline stages for the model's {model.num_layers} layers: "
                         f"every stage needs a layer. Choose pp x pp_virtual_stages <= "
                         f"{model.num_layers}.")
    data = {"model": model.model_dump(mode="json"), **layout_sections(layout)}
    if pp_layers is None or layout.pp == 1:
        pp_layers = uneven_pp_layers(model, layout)
    if pp_layers:
        data["parallel"]["pp_layers"] = list(pp_layers)
    build_config(data)  # refuse a config the trainer would refuse
    return data


def runnable_config(model: ModelConfig, layout: Layout, hw, pp_layers=None) -> dict:
    """`train_config` plus what a run needs besides the layout, spelled out to be edited: the
    device the profile describes, the data (the built-in corpus until set) and the run's
    length."""
    data = train_config(model, layout, pp_layers)
    defaults = build_config({})
    return {"model": data.pop("model"),
            "device": "cpu" if hw.host_cores else "cuda",  # (a calibrated CPU profile has cores)
            "data": {"source": defaults.data.source, "tokenizer": defaults.data.tokenizer},
            **data, "training": {"steps": defaults.training.steps, **data["training"]}}


CONFIG_HEADER = """\
# `ultrascale train THIS.yaml`: the layout `ultrascale plan` ranked first ({why}).
# Set data.source (and data.tokenizer) to your data and training.steps to the run's length;
# `ultrascale train THIS.yaml --dry-run` checks it on the machine that will run it.
"""


def config_text(data: dict, why: str) -> str:
    return CONFIG_HEADER.format(why=why) + yaml.safe_dump(data, sort_keys=False)


def fresh_path(path: Path) -> Path:
    """`path`, or `stem-2.suffix`, `stem-3.suffix`, ... the first that does not exist."""
    n, out = 1, path
    while out.exists():
        n += 1
        out = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return out


def write_train_config(text: str, path: str | Path, force: bool = True) -> Path:
    """A ready `ultrascale train` config (`config_text`) written; without force, an existing file
    is kept and a fresh name taken (`fresh_path`)."""
    path = Path(path) if force else fresh_path(Path(path))
    path.write_text(text)
    return path


def _from_config(args):
    """Fill the model, seq_len, batch and dtype flags from --config (flags given win)."""
    from ultrascale.devices import resolve_dtype

    cfg = None
    cpu = _cpu_profile(args.gpu)
    if args.config:
        from ultrascale.config import load_config
        # Plan for the GPUs, not this CPU run: `auto` means bf16 there (cuda=True), and an fp32
        # CPU run would compute in bf16 on a GPU. With a CPU profile (`--gpu local`, calibrated)
        # the plan is for this machine's run: the dtype it computes in here (issue 50: an fp32
        # run was predicted at the bf16 matmul rate).
        cfg = load_config(args.config, cuda=not cpu)
    layout = None
    if cfg is not None:
        layout = cfg.layout()
        if not cpu and layout.dtype == "fp32" and cfg.device == "cpu":
            layout = layout.with_(dtype="bf16")
        args.seq_len = cfg.training.seq_len if args.seq_len is None else args.seq_len
        args.global_batch_tokens = args.global_batch_tokens or str(
            cfg.global_batch_size * cfg.training.seq_len)
        args.dtype = args.dtype or layout.dtype
        args.optimizer = getattr(args, "optimizer", None) or layout.optimizer
        for name in FP8_FLAGS:
            if getattr(args, name, None) is None:
                setattr(args, name, getattr(layout, name))
    args.seq_len = DEFAULT_SEQ_LEN if args.seq_len is None else args.seq_len
    args.global_batch_tokens = args.global_batch_tokens or DEFAULT_BATCH_TOKENS
    # (a CPU profile: the dtype `auto` gives a run on this machine, as for a config above)
    args.dtype = args.dtype or (resolve_dtype("auto", cuda=False) if cpu else "bf16")
    args.optimizer = getattr(args, "optimizer", None) or "adamw"
    if layout is not None:
        layout = layout.with_(seq_len=args.seq_len, dtype=args.dtype, optimizer=args.optimizer,
                              **_fp8_flags(args))
    return cfg, layout


FP8_FLAGS = ("fp8_cache", "fp8_experts")  # precision.fp8_cache_activations, precision.fp8_experts


def _fp8_flags(args) -> dict:
    """The FP8 storage and experts flags given (or the config's), off where neither says."""
    return {name: bool(getattr(args, name, None)) for name in FP8_FLAGS}


def _cpu_profile(name) -> bool:
    """Whether `--gpu` names a CPU profile (a calibration of CPUs records their cores)."""
    try:
        return bool(get_hardware(name).host_cores)
    except ValueError:
        return False  # (an unknown name is refused where the profile is read)


def run(args) -> int:
    try:
        return _run(args)
    except (ValueError, ConfigError, PlanError) as exc:
        print(f"ultrascale plan: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    cfg, config_layout = _from_config(args)
    model = model_from_args(args, cfg)
    hw = get_hardware(args.gpu)
    if args.layout or (config_layout is not None and not args.gpus):
        return _predict_one(args, model, hw, config_layout, cfg)
    to_stdout = args.config_out == "-" and not args.json
    result, written, text = _search(args, model, hw)
    if args.json:
        print(json.dumps(_plan_json(result, written, model_name(args), model, hw), indent=2))
    else:  # the config alone on stdout when it goes there (`... --config-out - > run.yaml`)
        _print_plan(result, args, hw, written, file=sys.stderr if to_stdout else sys.stdout)
    if to_stdout and text is not None:
        sys.stdout.write(text)
    return 0 if result.best is not None else 1


def report(args) -> dict:
    """The object `ultrascale plan --json` prints for these flags (the web app's /api/plan, which
    sets config_out to None: no file); like the command, it writes the winner's config to
    --config-out unless that is '-' or 'none'. `train_config` holds it in any case."""
    cfg, config_layout = _from_config(args)
    model = model_from_args(args, cfg)
    hw = get_hardware(args.gpu)
    if args.layout or (config_layout is not None and not args.gpus):
        return _predict(args, model, hw, config_layout, cfg).as_dict()
    result, written, _ = _search(args, model, hw)
    return _plan_json(result, written, model_name(args), model, hw)


@contextmanager
def _progress_on_a_terminal():
    """A progress bar on stderr for `plan`'s progress, where stderr is a terminal (a plan for a
    large cluster costs 100,000 layouts: a minute); None elsewhere (logs, pipes, the web app)."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        tasks: dict[str, int] = {}

        def show(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total)
            bar.update(tasks[phase], completed=done)
        yield show


def _search(args, model: ModelConfig, hw) -> tuple[Plan, Path | None, str | None]:
    """The plan, the file its winner's config went to (None: stdout or nowhere), and the
    config's text (None when nothing fits)."""
    tokens = parse_tokens(args.global_batch_tokens)
    if getattr(args, "pp_layers", None):
        raise ValueError("--pp-layers applies to one layout (--layout, or a config's without "
                         "--gpus); the search costs each pipelined layout on the engine's split "
                         "and on the balanced one itself.")
    if not args.gpus or args.gpus < 1:
        raise ValueError("give --gpus N (the devices to plan for), or --layout to predict one layout.")
    with _progress_on_a_terminal() as progress:
        result = plan(model, args.gpus, tokens, hw, seq_len=args.seq_len, top=args.top,
                      space=_space(args), progress=progress)
    if result.best is None:
        return result, None, None
    best = result.best
    text = config_text(runnable_config(model, best.layout, hw, best.own_split),
                       f"{model_name(args)} on {args.gpus} x {hw.name}: {best.step_time_s:.3g} s "
                       f"a step, MFU {best.mfu:.1%} predicted")
    written = None
    if args.config_out not in (None, "-", "none"):
        written = write_train_config(text, args.config_out, args.force)
    return result, written, text


def _plan_json(result: Plan, written, name: str, model: ModelConfig, hw) -> dict:
    ranked = []
    for p in result.ranked:
        row = p.as_dict()
        row["same_time"] = result.same_time.get(p.layout.short(), [])
        ranked.append(row)
    return {"model": name, "runtime": RUNTIME, "runtime_note": RUNTIME_NOTE,
            "considered": result.considered, "left_out": result.left_out,
            "ranked": ranked, "why": result.why, "config": str(written) if written else None,
            "train_config": (runnable_config(model, result.best.layout, hw,
                                             result.best.own_split)
                             if result.best is not None else None),
            "smallest": result.smallest.as_dict() if result.smallest else None,
            "advice": result.advice}


def _print_plan(result: Plan, args, hw, written, file=None) -> None:
    out = file or sys.stdout
    left_out = (f" ({result.left_out} more that ultrascale's engine does not run yet left out)"
                if result.left_out else "")
    print(f"{model_name(args)} on {args.gpus} x "
          f"{hw.name}, global batch "
          f"{parse_tokens(args.global_batch_tokens):,} tokens, seq {args.seq_len}: "
          f"{result.considered} layouts considered{left_out}", file=out)
    print(RUNTIME_NOTE, file=out)
    if result.best is None:
        print("No layout fits in memory.", file=out)
        print(_table([(0, result.smallest)]), file=out)
        for line in result.advice:
            print(" - " + line, file=out)
        return
    print(_table(list(enumerate(result.ranked, 1)), result.same_time), file=out)
    print("\nWhy: " + result.why, file=out)
    if written:
        kept = (f" ({args.config_out} exists and is kept; --force overwrites it)"
                if Path(written) != Path(args.config_out) else "")
        print(f"Config for `ultrascale train`: written to {written}{kept}", file=out)
    elif args.config_out == "-":
        print("Config for `ultrascale train`: written to stdout", file=out)


def _predict(args, model: ModelConfig, hw, config_layout: Layout | None = None,
             config=None) -> Prediction:
    parse_tokens(args.global_batch_tokens)  # (a bad value is refused here too)
    base = config_layout or Layout(seq_len=args.seq_len, dtype=args.dtype,
                                   optimizer=getattr(args, "optimizer", None) or "adamw",
                                   **_fp8_flags(args))
    layout = parse_layout(args.layout, base=base) if args.layout else base
    if args.gpus and layout.world_size != args.gpus:
        raise ValueError(f"--layout {args.layout!r} uses dp x tp x pp x cp = {layout.world_size} "
                         f"devices but --gpus is {args.gpus}. Change one of them.")
    train_config(model, layout)
    split = _pp_layers(args, layout, config)
    p = predict(model, layout, hw, pp_layers=split)
    p.unsupported = [v.line() for v in engine_violations(model, layout)]
    return p


def _pp_layers(args, layout: Layout, config=None):
    """The split to cost: --pp-layers ('balanced', or counts), else the config's own while the
    layout keeps its stages, else None (the engine's)."""
    given = getattr(args, "pp_layers", None)
    if given:
        if given.strip() == "balanced":
            return "balanced"
        try:
            return [int(n) for n in given.split(",")]
        except ValueError:
            raise ValueError(f"--pp-layers {given!r}: give the layers of each pipeline stage "
                             "(4,4,4,1) or 'balanced'.") from None
    split = getattr(getattr(config, "parallel", None), "pp_layers", None)
    if split is not None and len(split) != layout.pp * layout.pp_virtual_stages:
        return None
    return split


def layout_config(args) -> str:
    """The `ultrascale train` config (YAML, with its header) of the layout `--layout` names, for
    the model and profile of these flags: what the web app's layout rows offer for download."""
    cfg, config_layout = _from_config(args)
    model = model_from_args(args, cfg)
    hw = get_hardware(args.gpu)
    if not args.layout:
        raise ValueError("give the layout (layout=dp=8,tp=2,...) whose config to write.")
    p = _predict(args, model, hw, config_layout, cfg)
    return config_text(runnable_config(model, p.layout, hw, p.own_split),
                       f"{model_name(args)} on {p.layout.world_size} x {hw.name}: "
                       f"{p.step_time_s:.3g} s a step, MFU {p.mfu:.1%} predicted")


def _predict_one(args, model: ModelConfig, hw, config_layout: Layout | None = None,
                 config=None) -> int:
    p = _predict(args, model, hw, config_layout, config)
    if args.json:
        print(json.dumps(p.as_dict(), indent=2))
        return 0
    print(RUNTIME_NOTE)
    print(_table([(1, p)]))
    print("fits in memory" if p.fits else "DOES NOT FIT in memory", f"({hw.name})")
    if p.layout.pp > 1:
        print(f"layers per stage {p.pp_layers}; costed on pipeline rank {p.costed_rank}, the "
              "busiest")
    for k, v in sorted(p.breakdown.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<12} {v * 1e3:10.1f} ms  {v / p.step_time_s:6.1%}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ultrascale plan", description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

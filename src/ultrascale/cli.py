"""`ultrascale`: train, tokenize, the prediction tools (memory, plan, calibrate, sweep), the
pictures (ui, plot), and what to do with a checkpoint (export, generate)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from ultrascale.config import ConfigError

# Subcommands that live with their feature: module path -> each module has register(subparsers),
# which adds the subcommand and sets `func` to its run(args) -> exit code.
FEATURE_COMMANDS = [
    "ultrascale.memory.command",
    "ultrascale.planner.command",
    "ultrascale.planner.calibrate",
    "ultrascale.planner.sweep",
    "ultrascale.ui.command",
    "ultrascale.ui.pictures",
    "ultrascale.checkpoint.command",
]


def check_overrides(args) -> None:
    """`--set training.steps 10` (a space instead of '='): argparse took `10` for the config file;
    say what happened instead of "Config file '10' does not exist"."""
    for item in args.set or []:
        if "=" not in item:
            hint = ""
            if args.config is not None and not Path(args.config).is_file():
                hint = (f" (the next word, {args.config!r}, was read as the config file: did you "
                        f"mean --set {item}={args.config}?)")
            raise ConfigError(f"--set {item!r} has no '=': an override is one word, "
                              f"section.key=value: --set {item}=VALUE{hint}.")


def cmd_train(args) -> int:
    from ultrascale import elastic, launch
    from ultrascale.config import load_config

    launch.guard_rank()  # a rank never outlives its launcher
    launch.adopt_slurm_env()
    check_overrides(args)
    cfg = load_config(args.config, args.set or [], world_size=launch.launcher_world_size())
    launch.check_world_size(cfg)
    cfg = elastic.resume_on_restart(launch.resolve_paths(cfg))  # a restarted attempt resumes
    elastic.FaultDrill.from_env()  # a malformed drill is refused before anything starts
    elastic.check_torchrun_restarts()
    if launch.is_spawned_rank():  # started by our launcher, which has checked everything
        return launch.run_rank(cfg)
    launched = launch.is_launched_rank()
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.parallel.world_size)) if launched \
        else cfg.parallel.world_size
    report = launch.preflight(cfg, local_ranks, strict=not args.dry_run,
                              count_ranks=not launched)
    report.notes += elastic.notes(cfg, launched)
    if launch.rank() == 0:
        print(launch.describe(cfg, report, local_ranks, launched), flush=True)
    if args.dry_run:
        if launch.rank() == 0:
            for problem in report.problems:
                print(f"would be refused on this machine: {problem}")
            print("dry run: nothing started" + (f" ({len(report.problems)} problem(s) on this "
                                                 "machine)" if report.problems else ""))
        return 0
    if launched:
        if launch.rank() == 0:
            launch.write_run_files(cfg)
        return launch.run_rank(cfg)
    return launch.spawn_local(cfg, report)


def cmd_config(args) -> int:
    from ultrascale.config import known_keys
    from ultrascale.config_keys import format_keys

    if args.action == "keys":
        sections = {k.split(".")[0] for k in known_keys()}
        if args.section and args.section not in sections:
            raise ConfigError(f"{args.section!r} is not a section; choose one of "
                              f"{', '.join(sorted(sections))}.")
        print(format_keys(args.section))
    return 0


def cmd_tokenize(args) -> int:
    from ultrascale.data.dataset import document_chunks, write_tokenized
    from ultrascale.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    count = write_tokenized(document_chunks(args.source, tokenizer, args.text_key),
                            Path(args.out), tokenizer)
    dtype = "uint16" if tokenizer.vocab_size <= 65536 else "uint32"
    print(f"wrote {count:,} tokens ({dtype}) to {args.out} (+ {args.out}.json, and "
          f"{args.out}.docs: where its documents begin)")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ultrascale")
    except PackageNotFoundError:  # running from a source tree that was not installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    from ultrascale.config_keys import format_keys

    parser = argparse.ArgumentParser(prog="ultrascale", description=__doc__)
    parser.add_argument("--version", action="version", version=f"ultrascale {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train", help="train a model (starts the local ranks, or runs as one rank under "
                      "torchrun/srun)",
        description="Train a model: a YAML config plus --set overrides, checked before any "
                    "process starts. Under torchrun/srun (RANK and WORLD_SIZE set) this process "
                    "is one rank; otherwise it starts dp x tp x pp x cp local ranks.",
        epilog="configuration keys (default, meaning); also `ultrascale config keys`:\n\n"
               + format_keys(), formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("config", nargs="?", help="YAML config file (default: tiny model, built-in "
                                                 "corpus, dp=2 on the CPU); see configs/")
    train.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                       help="override one config key; repeatable")
    train.add_argument("--dry-run", action="store_true",
                       help="print the resolved config, the layout, the memory estimate and the "
                            "ranks it would start, and what this machine would refuse; start "
                            "nothing")
    train.set_defaults(func=cmd_train)

    config = sub.add_parser("config", help="the configuration keys, their defaults and meanings")
    config.add_argument("action", choices=["keys"], help="keys: list every key")
    config.add_argument("section", nargs="?", help="only this section (e.g. training)")
    config.set_defaults(func=cmd_config)

    tok = sub.add_parser("tokenize", help="write a pre-tokenized .bin for data.source")
    tok.add_argument("source", help="'builtin', a text/JSON-lines/Parquet file, a folder of them, "
                                    "or a save_to_disk folder")
    tok.add_argument("--out", required=True, help="output .bin path")
    tok.add_argument("--tokenizer", default="byte",
                     help="'byte', a local tokenizer.json, or a Hugging Face model folder")
    tok.add_argument("--text-key", default="text",
                     help="field (JSON-lines, Parquet, datasets) holding the text")
    tok.set_defaults(func=cmd_tokenize)

    for module in FEATURE_COMMANDS:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `ultrascale ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit's flush
        return 0


if __name__ == "__main__":
    sys.exit(main())

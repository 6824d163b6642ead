"""`ultrascale`: train, tokenize, the prediction tools (memory, plan, calibrate, sweep), and the
pictures (ui, plot)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

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
]


def cmd_train(args) -> int:
    from rich.console import Console

    from ultrascale.config import load_config
    from ultrascale.launch import (SPAWNED_ENV, adopt_slurm_env, is_launched_rank, preflight,
                                   resolve_paths, run_rank, spawn_local)

    adopt_slurm_env()
    cfg = load_config(args.config, args.set or [])
    cfg = resolve_paths(cfg)
    preflight(cfg)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if rank0 and not os.environ.get(SPAWNED_ENV):
        console = Console()
        console.print("[bold]ultrascale train[/] with this configuration:")
        console.print(cfg.to_yaml(), markup=False, highlight=False)
        console.print(f"global batch: {cfg.global_batch_size} sequences x "
                      f"{cfg.training.seq_len} tokens; {cfg.parallel.world_size} rank(s)")
    if is_launched_rank() or cfg.parallel.world_size == 1:
        return run_rank(cfg)
    code = spawn_local(cfg)
    if code != 0:
        print(f"error: training failed (exit code {code}); the failing rank's error is shown "
              f"above, and every rank's log is in {cfg.logging.run_dir}/rank_logs.",
              file=sys.stderr)
    return code


def cmd_tokenize(args) -> int:
    from pathlib import Path

    from ultrascale.data.dataset import tokenize_source, write_tokenized
    from ultrascale.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    tokens = tokenize_source(args.source, tokenizer, args.text_key)
    write_tokenized(tokens, Path(args.out), tokenizer)
    print(f"wrote {tokens.size:,} tokens ({tokens.dtype}) to {args.out} (+ {args.out}.json)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ultrascale", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model (spawns local ranks, or runs as one rank "
                                         "under torchrun/srun)")
    train.add_argument("config", nargs="?", help="YAML config file (default: tiny model, built-in "
                                                 "corpus, dp=2 on the CPU)")
    train.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                       help="override one config key; repeatable")
    train.set_defaults(func=cmd_train)

    tok = sub.add_parser("tokenize", help="write a pre-tokenized .bin for data.source")
    tok.add_argument("source", help="'builtin', a text/JSON-lines file or a folder of them")
    tok.add_argument("--out", required=True, help="output .bin path")
    tok.add_argument("--tokenizer", default="byte", help="'byte' or a local tokenizer.json")
    tok.add_argument("--text-key", default="text", help="field of JSON-lines records with the text")
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


if __name__ == "__main__":
    sys.exit(main())

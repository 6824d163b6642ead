"""The web app's server: the page, its assets (all in the package: it works offline) and a JSON API
over the CLI's own code, so that the page and the command line give the same numbers.

    GET /api/memory?preset=llama3-8b&dp=8&zero=1   what `ultrascale memory ... --json` prints
    GET /api/plan?preset=llama3-8b&gpus=64          what `ultrascale plan ... --json` prints
    GET /api/config?preset=llama3-8b&layout=dp=8,tp=1,...   that layout's `ultrascale train`
                                                   config (YAML, a download: plan.yaml)
    GET /api/options                               presets, GPU profiles, the flags' choices
    GET /api/runs                                  run folders (metrics.jsonl) and sweeps
    GET /api/run?path=DIR&after=N                  a run's chart series from metric line N on
    GET /api/sweep?path=DIR                        a sweep's heatmap data

A query parameter is a flag of the command, named with `_` or `-` (`seq_len=8192`, `hf_config=PATH`,
`sequence_parallel=true`). Bad input answers 400 with the command's own message.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ultrascale.config import ConfigError
from ultrascale.memory import command as memory_command
from ultrascale.memory.estimator import LayoutError
from ultrascale.planner import command as plan_command
from ultrascale.planner.search import PlanError
from ultrascale.ui import runs as run_files

STATIC = Path(__file__).parent / "static"
BAD_INPUT = (ConfigError, LayoutError, PlanError, ValueError, FileNotFoundError)
# Flags the API does not take: it answers JSON and writes no file.
REFUSED = {"plot": "the API draws no file; use `ultrascale memory --plot PNG`",
           "config_out": "the API writes no file; use `ultrascale plan --config-out PATH`",
           "force": "the API writes no file; use `ultrascale plan --force`",
           "config": "the API reads no file; use `ultrascale plan --config CONFIG.yaml`",
           "set": "the API reads no file; use `ultrascale memory CONFIG.yaml --set KEY=VALUE`"}


class QueryError(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    """The command's own parser, raising instead of exiting on bad input."""

    def error(self, message):
        raise QueryError(message)


def command_parser(add_arguments, prog: str) -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, add_help=False)
    add_arguments(parser)
    return parser


def query_args(parser: argparse.ArgumentParser, params: list[tuple[str, str]]) -> argparse.Namespace:
    """Query parameters -> the command line they stand for -> the command's parsed arguments."""
    flags = {opt[2:].replace("-", "_"): action for action in parser._actions
             for opt in action.option_strings if opt.startswith("--")}
    argv = []
    for key, value in params:
        name = key.replace("-", "_")
        if name in REFUSED:
            raise QueryError(f"{key}: {REFUSED[name]}.")
        if name == "json":
            continue  # (the answer is the --json object anyway)
        action = flags.get(name)
        if action is None or name.startswith("no_"):
            known = sorted(k for k in flags
                           if not k.startswith("no_") and k not in REFUSED and k != "json")
            raise QueryError(f"unknown parameter {key!r}; the command's flags are: "
                             f"{', '.join(known)}.")
        flag = "--" + name.replace("_", "-")
        if action.nargs == 0:  # a switch: true/false (BooleanOptionalAction has --no-...)
            on = value.lower() in ("", "1", "true", "yes", "on")
            if not on and value.lower() not in ("0", "false", "no", "off"):
                raise QueryError(f"{key}={value!r}: give true or false.")
            if on:
                argv.append(flag)
            elif "--no-" + flag[2:] in action.option_strings:
                argv.append("--no-" + flag[2:])
        else:
            argv += [flag, value]
    return parser.parse_args(argv)


def create_app(roots: list[Path] | None = None, hosts: list[str] | None = None) -> Starlette:
    """The app. `roots`: the folders the Runs view may read; `hosts`: the Host headers it answers
    (the loopback names when it listens on localhost, so that no other site's page can reach it
    through DNS rebinding)."""
    roots = [Path(r) for r in (roots or run_files.default_roots())]
    memory_parser = command_parser(memory_command.add_arguments, "ultrascale memory")
    plan_parser = command_parser(plan_command.add_arguments, "ultrascale plan")

    def answer(fn):
        try:
            return JSONResponse(fn())
        except BAD_INPUT as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)

    def memory(request: Request):
        return answer(lambda: memory_command.report(
            query_args(memory_parser, request.query_params.multi_items())))

    def plan(request: Request):
        def run():
            args = query_args(plan_parser, request.query_params.multi_items())
            args.config_out = None  # (no file: the answer's `train_config` holds it)
            return plan_command.report(args)
        return answer(run)

    def config(request: Request):
        try:
            args = query_args(plan_parser, request.query_params.multi_items())
            text = plan_command.layout_config(args)
        except BAD_INPUT as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        return PlainTextResponse(text, media_type="application/yaml", headers={
            "Content-Disposition": 'attachment; filename="plan.yaml"'})

    def options(request: Request):
        from ultrascale.presets import PRESETS
        from ultrascale.planner.hardware import PROFILES

        choices = {a.dest: list(a.choices) for a in memory_parser._actions if a.choices}
        return JSONResponse({"presets": list(PRESETS), "gpus": list(PROFILES),
                             "choices": choices, "charts": run_files.CHARTS})

    def runs(request: Request):
        return JSONResponse({"roots": [str(r) for r in roots],
                             "runs": run_files.discover(roots)})

    def run(request: Request):
        def read():
            folder = run_files.inside(request.query_params.get("path", ""), roots)
            after = int(request.query_params.get("after", 0))
            records, next_line = run_files.read_records(folder, after)
            reset = next_line < after  # the file was started again
            if reset:
                records, next_line = run_files.read_records(folder, 0)
            return {"series": run_files.series(records), "next": next_line, "reset": reset,
                    "steps": [r.get("step") for r in records]}
        return answer(read)

    def sweep(request: Request):
        from ultrascale.planner.sweep_report import read_heatmap

        return answer(lambda: read_heatmap(
            run_files.inside(request.query_params.get("path", ""), roots)))

    def index(request: Request):
        return FileResponse(STATIC / "index.html")

    routes = [Route("/", index), Route("/api/memory", memory), Route("/api/plan", plan),
              Route("/api/config", config),
              Route("/api/options", options), Route("/api/runs", runs), Route("/api/run", run),
              Route("/api/sweep", sweep), Mount("/static", StaticFiles(directory=STATIC))]
    middleware = [Middleware(TrustedHostMiddleware, allowed_hosts=hosts)] if hosts else []
    return Starlette(routes=routes, middleware=middleware)

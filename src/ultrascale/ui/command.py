"""`ultrascale ui`: the local web app (memory widget, layout explorer, run dashboard).

    ultrascale ui                     # http://127.0.0.1:8765/, runs from ./runs and ./sweeps
    ultrascale ui --port 9000 --runs-dir /scratch/runs
    ultrascale ui --host 0.0.0.0      # also reachable from other machines (it has no login)
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("ui", help="local web app: memory widget, layout explorer, run "
                              "dashboard", description=__doc__,
                              formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: any free one)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--runs-dir", action="append", metavar="DIR",
                   help="a folder of runs or sweeps for the Runs view (repeatable; default "
                        "./runs and ./sweeps)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    try:
        import uvicorn

        from ultrascale.ui.server import create_app
    except ImportError as exc:
        print(f"ultrascale ui: {exc.name} is missing; install it with `pip install starlette "
              "uvicorn` (requirements.txt pins them).", file=sys.stderr)
        return 2
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
        sock.listen(128)  # (a request that comes before the server loop runs waits in the queue)
    except OSError as exc:
        print(f"ultrascale ui: cannot listen on {args.host}:{args.port} ({exc.strerror}); choose "
              "another --port, or --port 0 for any free one.", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    hosts = ["127.0.0.1", "localhost", "[::1]"] if args.host in LOOPBACK else None
    roots = [Path(d) for d in args.runs_dir] if args.runs_dir else None
    app = create_app(roots, hosts)
    shown = f"[{args.host}]" if family == socket.AF_INET6 else args.host
    print(f"ultrascale ui: http://{shown}:{port}/  (Ctrl-C stops it)", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])
    return 0

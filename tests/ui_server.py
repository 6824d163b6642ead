"""`ultrascale ui` in a subprocess, as a user starts it, for the API and browser tests."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

from cli_helpers import runtime_only_env


@contextlib.contextmanager
def serve(*runs_dirs, cwd=None):
    """Start `ultrascale ui --port 0` (any free port) with requirements.txt's packages alone (the
    test-only ones hidden); yield its base URL and the seconds it took to answer its first
    request."""
    cmd = [sys.executable, "-m", "ultrascale.cli", "ui", "--port", "0"]
    for d in runs_dirs:
        cmd += ["--runs-dir", str(d)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=runtime_only_env(dict(os.environ, OMP_NUM_THREADS="1")))
    try:
        line = proc.stdout.readline()
        match = re.search(r"http://(\S+?)/", line)
        assert match, f"`ultrascale ui` did not start: {line}{proc.stdout.read()}"
        base = f"http://{match.group(1)}"
        get(base + "/api/options")
        yield base, time.perf_counter() - start
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def get(url: str, headers: dict | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a GET."""
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        body = err.read()
        try:
            return err.code, json.loads(body)
        except json.JSONDecodeError:
            return err.code, {"text": body.decode(errors="replace")}


def query(params: dict) -> str:
    return urllib.parse.urlencode(params)

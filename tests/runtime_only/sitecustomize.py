"""Started in a subprocess whose PYTHONPATH begins with this folder, it makes the packages that
only requirements-test.txt installs unimportable, as on a machine where `pip install -r
requirements.txt -e .` alone ran: a README command that needs one of them (scipy, once) then
fails its test as it would fail a user. Imports of them find nothing, as for a package that is
not installed (`ModuleNotFoundError`, `importlib.util.find_spec` -> None)."""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _requirements(name: str) -> set[str]:
    names = set()
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            names.add(re.split(r"[<>=!~\[; ]", line)[0].lower())
    return names


def _import_names(distribution: str) -> set[str]:
    """The top-level modules a distribution installs (its top_level.txt, else its name)."""
    try:
        text = importlib.metadata.distribution(distribution).read_text("top_level.txt")
    except importlib.metadata.PackageNotFoundError:
        text = None
    names = set((text or "").split()) or {distribution.replace("-", "_")}
    return names


HIDDEN = {m for d in _requirements("requirements-test.txt") - _requirements("requirements.txt")
          for m in _import_names(d)}


class _Hiding:
    """A finder of sys.meta_path that finds nothing of the hidden packages."""

    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        find = getattr(self._finder, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, attr):
        return getattr(self._finder, attr)


sys.meta_path[:] = [_Hiding(f) for f in sys.meta_path]

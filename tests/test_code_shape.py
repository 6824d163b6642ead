"""Small files: no module in src/ultrascale over 600 lines, no function (or method, nested ones
included) over 80, counted from its `def` line to its last line. A module that grows past the limit
splits along a seam a reader expects (as config.py into config_model.py and config_sections.py, or
rules.py into the rules package, one module per subject)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "ultrascale"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def too_long(path: Path) -> list[str]:
    """`path` itself if it has more than MAX_MODULE_LINES lines, and each function of it longer than
    MAX_FUNCTION_LINES, as `where:line name (n lines)`."""
    text = path.read_text()
    where = path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE.parent) else path
    found = []
    lines = len(text.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{where} ({lines} lines)")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{where}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_module_over_600_lines_no_function_over_80():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 50  # the package, not an empty folder
    offenders = [item for path in modules for item in too_long(path)]
    assert offenders == [], f"split these: {offenders}"


def test_the_check_sees_a_long_module_and_a_long_function(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 2))
    fits = tmp_path / "fits.py"
    fits.write_text("@staticmethod\ndef f():\n" + body + "    return 0\n")  # def..return: 80
    assert too_long(fits) == []
    long_function = tmp_path / "long_function.py"  # a method holding a function of 81 lines
    long_function.write_text("class A:\n    def g(self):\n        def inner():\n"
                             + "".join("        " + line + "\n" for line in body.splitlines())
                             + "            pass\n            return 1\n        return inner\n")
    assert sorted(item.split(" ", 1)[1] for item in too_long(long_function)) == [
        "g (83 lines)", "inner (81 lines)"]
    long_module = tmp_path / "long_module.py"
    long_module.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert too_long(long_module) == [f"{long_module} ({MAX_MODULE_LINES + 1} lines)"]

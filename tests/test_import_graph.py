"""No import cycle in `src/ultrascale`: a module never needs, directly or through others, a module
that needs it. Imports inside functions count (they still tie the two modules together); imports
under `if TYPE_CHECKING:` do not (they never run).

And the torch-free base that every part asks (the config tree, presets, layouts, the layout rules,
parameter counts, device peaks, the Hugging Face architecture table) imports no part of the package above it: the model, the engine,
the estimator and the planner build on it, never the other way round."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "ultrascale"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (`from a.b import c` means a.b.c when that is a
    module, else a.b)."""
    files = {_module_name(p): p for p in (SRC / PACKAGE).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_lines(tree)
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[:len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in files else base)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


BASE = ("config", "presets", "layout", "rules", "params", "devices", "hf_arch")


# The engine's data-parallel wrappers import each other (issue 27, engine half): listed here until
# that lands, then this entry goes (the test fails while an entry no longer matches a cycle).
def test_no_import_cycle_between_modules():
    cycles = _cycles(import_graph())
    assert cycles == [], f"import cycles: {cycles}"


def test_the_base_imports_only_the_base():
    graph = import_graph()
    base = {f"{PACKAGE}.{name}" for name in BASE}
    for module in sorted(base & set(graph)):
        above = graph[module] - base
        assert not above, f"{module} imports {sorted(above)}, above the torch-free base"


def test_the_graph_sees_imports_inside_functions_and_not_type_checking_ones():
    graph = import_graph()
    # layout.py imports Config only for type checking; launch.py imports the trainer in a function.
    assert "ultrascale.config" not in graph["ultrascale.layout"]
    assert "ultrascale.train.trainer" in graph["ultrascale.launch"]


def test_the_trainer_does_not_import_the_planner():
    """The peak rates for MFU come from devices.py, which the planner's profiles also read."""
    graph = import_graph()
    for module in (m for m in graph if m.startswith(f"{PACKAGE}.train")):
        assert not [t for t in graph[module] if t.startswith(f"{PACKAGE}.planner")], module


def test_no_module_imports_another_modules_private_names():
    """A leading underscore means "this module's own": calibrate.py asks cost.py's public
    `block_times`, not its internals."""
    private = []
    for path in (SRC / PACKAGE).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
                private += [f"{_module_name(path)}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
    assert private == []


def test_primitive_math_only_in_ops():
    """The model and every strategy go through models/ops.py for matmuls and attention, so that a
    precision recipe or a fused kernel replaces them in one place."""
    offenders = []
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        if path == SRC / PACKAGE / "models" / "ops.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and (
                    node.attr == "scaled_dot_product_attention"
                    or (node.attr == "linear" and ast.unparse(node.value) in ("F", "functional",
                                                                            "torch.nn.functional"))):
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno} {ast.unparse(node)}")
    assert offenders == []


ROOT = SRC.parent
# Until the theory helper's move of the fitter into src/ultrascale/planner/ lands (issue 43), these
# two tests import it from benchmarks/ through sys.path: then these entries go (the test fails while
# an entry no longer matches an edit).
SYS_PATH_EDITS_PENDING = {"tests/test_planner.py", "tests/test_estimator.py"}


def _sys_path_edits(path: Path) -> list[int]:
    """Lines that change sys.path: sys.path.insert/append/extend/remove, an assignment to it, or
    site.addsitedir."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            if (owner == "sys.path" and node.func.attr in ("insert", "append", "extend", "remove")
                    or ast.unparse(node.func) == "site.addsitedir"):
                lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(ast.unparse(t).startswith("sys.path") for t in targets):
                lines.append(node.lineno)
    return sorted(lines)


def test_tests_and_benchmarks_do_not_edit_sys_path():
    """The package is imported as installed (or from PYTHONPATH), the tests' helpers through
    pytest's `pythonpath`, a benchmark's neighbours as its script folder's: a sys.path edit would
    make what runs depend on where it was started from."""
    found = {}
    for folder in ("tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            lines = _sys_path_edits(path)
            if lines:
                found[str(path.relative_to(ROOT))] = lines
    assert set(found) == SYS_PATH_EDITS_PENDING, {k: v for k, v in found.items()
                                                  if k not in SYS_PATH_EDITS_PENDING}


def test_the_sys_path_check_sees_an_edit(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import sys\nsys.path.insert(0, 'x')\nsys.path += ['y']\n")
    assert _sys_path_edits(probe) == [2, 3]

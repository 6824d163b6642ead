"""No import cycle in `src/ultrascale`: a module never needs, directly or through others, a module
that needs it. Imports inside functions count (they still tie the two modules together); imports
under `if TYPE_CHECKING:` do not (they never run).

And the torch-free base that every part asks (the config tree and how its keys are declared,
presets, layouts, the layout rules, parameter counts, this machine and its devices, the Hugging
Face architecture table) imports no part of the package above it: the model, the engine, the
estimator and the planner build on it, never the other way round."""

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


# theory.shape: the model's shape, which the parameter counts (params.py) read.
BASE = ("config", "config_fields", "config_model", "config_sections", "config_keys", "presets",
        "layout", "rules", "rules.violation", "rules.shape", "rules.layout", "rules.pipeline",
        "rules.precision", "rules.engine", "params", "devices", "hf_arch", "hf_deepseek",
        "hf_window", "theory.shape")


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
    assert "ultrascale.train.trainer" in graph["ultrascale.launch"]  # imported in a function
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from ultrascale.config import Config\n")
    assert _type_checking_lines(tree) == {3}


def test_the_layout_does_not_know_the_config():
    """The config makes its layout (`Config.layout()`); the layout, which the estimator and the
    planner take, never reaches back for the config, not even for type checking."""
    text = (SRC / PACKAGE / "layout.py").read_text()
    assert "ultrascale.config" not in text


def test_no_lazy_module_attributes():
    """A module-level `__getattr__` (PEP 562) loads names on first use, which a reader and an IDE
    cannot follow (the trainer into `parallelize`): every name is imported where it is used."""
    lazy = []
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and node.name in ("__getattr__", "__dir__"):
                lazy.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}")
    assert lazy == []


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


TORCH_NAMES = ("F", "functional", "torch", "torch.nn.functional")
# Matmuls that replace a primitive, each in the one module beside its one consumer: the FP8
# numerics beside parallel/precision.py, the grouped GEMM beside models/moe.py.
REPLACEMENTS = {"_scaled_mm": "parallel/fp8.py", "scaled_mm": "parallel/fp8.py",
                "grouped_mm": "models/grouped_gemm.py"}


def test_primitive_math_only_in_ops():
    """The model and every strategy go through models/ops.py for matmuls and attention, so that a
    precision recipe or a fused kernel replaces them in one place. The replacements (FP8, the
    grouped GEMM, the Triton adapters) live beside their one consumer and reach `F.linear` and
    SDPA only through the primitives too; each of torch's special matmuls is called from its one
    module."""
    offenders = []
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        where = str(path.relative_to(SRC / PACKAGE))
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            torch_call = ast.unparse(node.value) in TORCH_NAMES
            primitive = node.attr == "scaled_dot_product_attention" \
                or (node.attr == "linear" and torch_call)
            if primitive and where != "models/ops.py" or torch_call and \
                    REPLACEMENTS.get(node.attr, where) != where:
                offenders.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    assert offenders == []


# models/ops.py holds the primitives and what makes them (rotary tables and their scalings, the
# SDPA and variable-length backend choice, the operands' dtype on a CPU, the chunked loss's row passes, the
# target that counts nothing). Context parallel's block attention is beside ring attention
# (parallel/attention_blocks.py); it reaches the fused kernel through the flash primitives here.
PRIMITIVES = {
    "linear", "linear_grad_input", "linear_grad_weight", "rms_norm", "swiglu", "Rope",
    "rotary_tables", "llama3_frequencies", "yarn_frequencies", "yarn_attention_factor",
    "yarn_mscale", "rotary", "attention", "attention_backend",
    "sdpa_backend", "SDPA_BACKENDS", "varlen_applies", "cpu_core", "flash_attention_with_lse",
    "one_width", "takes_value_width", "linear_fp32",
    "flash_attention_with_lse_backward", "cross_entropy", "IGNORE", "row_stats", "softmax_grad_",
    "VocabColumns", "linear_cross_entropy",
}


def test_ops_holds_the_primitives_only():
    """A new recipe or kernel goes beside its consumer, not into ops.py."""
    tree = ast.parse((SRC / PACKAGE / "models" / "ops.py").read_text())
    public = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
              and not n.name.startswith("_")}
    public |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
               if isinstance(t, ast.Name) and not t.id.startswith("_")}
    assert public <= PRIMITIVES, f"not primitives: {sorted(public - PRIMITIVES)}"


def _imports_torch(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch"
                                                for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            return True
    return False


def test_the_theory_wing_is_torch_free():
    """theory/ is arithmetic on sizes: no theory module imports torch, directly or through the
    package modules it reaches (imports inside functions included, and the packages whose
    __init__ runs on the way), so the estimator and the planner answer for tens of thousands of
    layouts, and `ultrascale memory` without torch."""
    graph = import_graph()
    files = {_module_name(p): p for p in (SRC / PACKAGE).rglob("*.py")}
    theory = sorted(m for m in graph if m.startswith(f"{PACKAGE}.theory"))
    assert f"{PACKAGE}.theory.terms" in theory
    torch_importers = {m for m, path in files.items() if _imports_torch(path)}
    for module in theory:
        seen, todo = set(), [module]
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            parts = m.split(".")
            todo += [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in files]
            todo += graph.get(m, ())
        with_torch = sorted(seen & torch_importers)
        assert not with_torch, f"{module} reaches torch through {with_torch}"


def test_the_torch_check_sees_an_import_inside_a_function(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    import torch.nn as nn\n    return nn\n")
    assert _imports_torch(path)
    path.write_text("import torchvision_like_name\n")
    assert not _imports_torch(path)


ROOT = SRC.parent


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
    assert found == {}


def test_the_sys_path_check_sees_an_edit(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import sys\nsys.path.insert(0, 'x')\nsys.path += ['y']\n")
    assert _sys_path_edits(probe) == [2, 3]

"""The package's layering, read from its source: folders (and the ground floor's modules) import downwards only, and a
module imports another inside a function only to keep a heavy library out of the commands that answer at once.

docs/ARCHITECTURE.md draws the floors; this test is what keeps the drawing true.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "accel_fsdp"

# Lowest first. A node is a folder of the package, or a module at its top (the ground floor's modules, preflight.py).
FLOORS = [
    {"accel_fsdp", "errors", "quiet", "layout", "hardware", "files"},  # the ground: what every floor may know
    {"config"},
    {"data"},
    {"model"},  # a tokenizer may be trained on the recipe's data: model reads data
    {"checkpoint"},
    {"run"},  # a start decides from the checkpoints a run folder holds
    {"preflight"},
    {"train"},
    {"planning", "launch"},
    {"tools"},
    {"cli"},
    {"__main__"},
]
UPWARD_ALLOWED: set[tuple[str, str]] = set()
"""Imports from a lower floor to a higher one that are accepted (at most one; none today)."""

HEAVY = {"torch", "transformers", "accelerate", "datasets", "peft", "safetensors", "tokenizers", "numpy", "pyarrow",
         "matplotlib", "tensorboard"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    name = ".".join(rel.parts)
    return name.removesuffix(".__init__")


def _node(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "accel_fsdp"


def _imports(path: Path):
    """(imported module, line, at module level) for every import of the package's own modules and every external
    top-level package, from the source of one module. `if TYPE_CHECKING:` blocks import nothing at run time."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    for n in tree.body:  # imports inside top-level try/if still run at import time
        if isinstance(n, (ast.Try, ast.If)) and not (isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)):
            top |= {id(c) for c in ast.walk(n)}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            if n.level:
                base = package.split(".")[: len(package.split(".")) - (n.level - 1)]
                target = ".".join(base + ([n.module] if n.module else []))
            else:
                target = n.module or ""
            names = [f"{target}.{a.name}" for a in n.names]
            for name in names:  # `from accel_fsdp.data import batches` imports a module
                if name.startswith("accel_fsdp.") and _exists(name):
                    yield name, n.lineno, id(n) in top
                    break
            else:
                yield target, n.lineno, id(n) in top
        elif isinstance(n, ast.Import):
            for a in n.names:
                yield a.name, n.lineno, id(n) in top


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").is_file() or (PACKAGE / rel / "__init__.py").is_file()


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _graph():
    edges = {}
    for module, path in _modules().items():
        edges[module] = list(_imports(path))
    return edges


def _floor(node: str) -> int:
    for i, floor in enumerate(FLOORS):
        if node in floor:
            return i
    raise AssertionError(f"{node} is on no floor of FLOORS: place it")


def test_every_folder_has_a_floor():
    for module in _modules():
        _floor(_node(module))


def test_imports_go_down_the_floors():
    upward = []
    for module, imports in _graph().items():
        for target, line, _ in imports:
            if not target.startswith("accel_fsdp"):
                continue
            a, b = _node(module), _node(target)
            if a != b and _floor(b) > _floor(a) and (a, b) not in UPWARD_ALLOWED:
                upward.append(f"{module}:{line} imports {target} ({a} is below {b})")
    assert not upward, "imports from a lower floor to a higher one:\n  " + "\n  ".join(upward)
    assert len(UPWARD_ALLOWED) <= 1


def test_the_folder_graph_has_no_cycle():
    nodes: dict[str, set[str]] = {}
    for module, imports in _graph().items():
        for target, _, _ in imports:
            if target.startswith("accel_fsdp") and _node(target) != _node(module):
                nodes.setdefault(_node(module), set()).add(_node(target))
    state: dict[str, int] = {}

    def visit(node, path):
        if state.get(node) == 1:
            raise AssertionError("import cycle: " + " -> ".join(path + [node]))
        if state.get(node) == 2:
            return
        state[node] = 1
        for nxt in sorted(nodes.get(node, ())):
            visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(nodes):
        visit(node, [])


def _heavy_at_import(module: str, graph, memo: dict) -> set[str]:
    """The heavy libraries importing `module` loads (its module-level imports, followed through the package)."""
    if module in memo:
        return memo[module]
    memo[module] = set()
    heavy = set()
    parents = [".".join(module.split(".")[:i]) for i in range(2, len(module.split(".")))]
    for target, _, top in graph.get(module, []):
        if not top:
            continue
        root = target.split(".")[0]
        if root in HEAVY:
            heavy.add(root)
        elif target in graph:
            heavy |= _heavy_at_import(target, graph, memo)
    for parent in parents:
        heavy |= _heavy_at_import(parent, graph, memo)
    memo[module] = heavy
    return heavy


def test_the_package_imports_its_own_modules_at_module_level_unless_that_loads_a_heavy_library():
    """A function-level import of one of our modules is there only when the module-level one would load torch,
    transformers or another heavy library that the importing module does not load already (so `recipe list`,
    `validate` and `--help` answer at once); never to hide an import cycle."""
    graph, memo = _graph(), {}
    needless = []
    for module, imports in graph.items():
        mine = _heavy_at_import(module, graph, memo)
        for target, line, top in imports:
            if top or target not in graph:
                continue
            if not _heavy_at_import(target, graph, memo) - mine:
                needless.append(f"{module}:{line} imports {target} inside a function")
    assert not needless, "lazy imports that keep no heavy library out:\n  " + "\n  ".join(sorted(needless))


def test_the_ground_floor_keeps_heavy_libraries_out():
    graph, memo = _graph(), {}
    for module in ("accel_fsdp.errors", "accel_fsdp.layout", "accel_fsdp.hardware", "accel_fsdp.quiet",
                   "accel_fsdp.files"):
        assert not _heavy_at_import(module, graph, memo), module

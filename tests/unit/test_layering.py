"""h3_core's packages keep the layering of docs/architecture.md: each module imports only from its own layer or the
layers below (attention at the bottom, then parallel, models, formats, memory, media, pipeline), and no set of modules
imports each other in a cycle. Every import counts, at the top of a module or inside a function, read from the source
(AST)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "h3_core"
# Bottom to top; the package's root modules (errors, ...) sit below everything.
LAYERS = ("", "attention", "parallel", "models", "formats", "memory", "media", "pipeline")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer(module: str) -> int:
    parts = module.split(".")
    package = parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else ""
    assert package in LAYERS, f"{module}: h3_core/{package} is in no layer of {LAYERS}"
    return LAYERS.index(package)


def imported(module: str) -> set[str]:
    path = MODULES[module]
    return imports_of(path.read_text(), module, path.name == "__init__.py")


def imports_of(source: str, module: str, is_package: bool) -> set[str]:
    """The h3_core modules ``source`` (the text of ``module``) imports, wherever the import statement stands (a
    name imported from a package counts as its submodule when one of that name exists)."""
    package = module if is_package else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target.startswith("h3_core") and target != module:
                found.add(target)
    return found


GRAPH = {module: imported(module) for module in MODULES}


def test_no_module_imports_from_a_layer_above_its_own():
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        for target in targets
        if layer(target) > layer(module)
    )
    assert upward == []


def test_no_import_cycles():
    cycles, state = [], {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(GRAPH[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_walk_sees_imports_inside_functions():
    """A cycle hidden in a function body counts: the walk reads every import statement, at any depth."""
    source = (
        "import torch\n\n\ndef late():\n    from ..formats import keymap\n"
        "    if True:\n        from .dit import H3DiT\n"
    )
    assert imports_of(source, "h3_core.models.example", False) == {"h3_core.formats.keymap", "h3_core.models.dit"}


# ---- no module sets another module's attributes ------------------------------------------------------------

PRODUCT = {
    name: path
    for name, path in {
        **MODULES,
        **{module_name(p): p for p in (ROOT / "nodes").rglob("*.py")},
    }.items()
}


def module_bindings(tree: ast.AST, module: str, is_package: bool) -> dict[str, str]:
    """The names ``module``'s source binds to the product's modules (``import h3_core.x as y``, ``from . import x``,
    ``from ..models import dit``), whatever their scope."""
    package = module if is_package else module.rsplit(".", 1)[0]
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ("h3_core", "nodes"):
                    bound[alias.asname or alias.name.split(".")[0]] = alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                source = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                if f"{source}.{alias.name}" in PRODUCT:
                    bound[alias.asname or alias.name] = f"{source}.{alias.name}"
    return bound


def attribute_writes(source: str, module: str, is_package: bool) -> list[str]:
    """Where ``source`` assigns to (or deletes, or ``setattr``s) an attribute of another product module."""
    tree = ast.parse(source)
    bound = module_bindings(tree, module, is_package)
    found = []

    def root_module(target: ast.expr) -> str | None:
        while isinstance(target, ast.Attribute):
            target = target.value
        return bound.get(target.id) if isinstance(target, ast.Name) else None

    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            if node.args and (owner := root_module(node.args[0])):
                found.append(f"{module}:{node.lineno} {node.func.id} on {owner}")
            continue
        while targets:
            target = targets.pop(0)
            if isinstance(target, (ast.Tuple, ast.List)):
                targets.extend(target.elts)
            elif isinstance(target, ast.Starred):
                targets.append(target.value)
            elif isinstance(target, ast.Attribute) and (owner := root_module(target.value)):
                found.append(f"{module}:{target.lineno} sets {owner} ({ast.unparse(target)})")
    return found


def test_no_module_sets_another_modules_attributes():
    """Options travel as arguments and objects: no module of h3_core or nodes assigns, deletes or ``setattr``s an
    attribute of another of their modules."""
    writes = [
        write
        for module, path in sorted(PRODUCT.items())
        for write in attribute_writes(path.read_text(), module, path.name == "__init__.py")
    ]
    assert writes == []


def test_the_attribute_check_sees_each_form_of_writing():
    source = (
        "from ..models import dit\nimport h3_core.memory.policy as policy\nfrom ..models import run_options\n\n\n"
        "def f(x):\n    dit.H3DiT.chunk_rows = 4\n    policy.FUSED += 1\n    setattr(run_options, 'x', 1)\n"
        "    del dit.Block\n    x.fused = 1\n    a, (b, policy.LEVEL) = 1, (2, 3)\n"
    )
    writes = attribute_writes(source, "h3_core.pipeline.example", False)
    assert sorted(w.split(" ", 1)[1] for w in writes) == sorted(
        [
            "sets h3_core.models.dit (dit.H3DiT.chunk_rows)",
            "sets h3_core.memory.policy (policy.FUSED)",
            "setattr on h3_core.models.run_options",
            "sets h3_core.models.dit (dit.Block)",
            "sets h3_core.memory.policy (policy.LEVEL)",
        ]
    )

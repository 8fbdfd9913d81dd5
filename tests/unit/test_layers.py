"""The package's layers, as docs/architecture.md documents them, are what the code does: every import (top-level
and inside functions) runs from a layer to the same or a lower one, and no imports form a circle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "posttrain"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
#: the one tie back: the registry imports the built-ins table on its first look-up
ALLOWED_UP = {("posttrain.registry", "posttrain.builtins")}


def documented_layers() -> dict[str, int]:
    """``module prefix -> layer`` from the table under ``## Layers``."""
    text = ARCHITECTURE.read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    layers: dict[str, int] = {}
    for line in section.splitlines():
        match = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if match:
            for name in re.findall(r"`([\w.]+)`", match.group(2)):
                layers["posttrain" if name == "posttrain" else f"posttrain.{name}"] = int(match.group(1))
    assert layers, "docs/architecture.md has no layer table under '## Layers'"
    return layers


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = PACKAGE.parent / name.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def runtime_imports(path: Path, types_too: bool = False) -> set[str]:
    """The posttrain modules ``path`` imports when it runs (``from a import b`` is module ``a.b`` when that is a
    module, else ``a``); ``types_too``: and those it imports for type checkers only."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if not types_too and _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "posttrain")
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").startswith("posttrain")
        ):
            module = node.module or ""
            for alias in node.names:
                child = f"{module}.{alias.name}"
                found.add(child if is_module(child) else module)
    return found


def import_graph(types_too: bool = False) -> dict[str, set[str]]:
    return {
        module_name(p): runtime_imports(p, types_too) - {module_name(p)}
        for p in sorted(PACKAGE.rglob("*.py"))
    }


def layer_of(module: str, layers: dict[str, int]) -> int:
    prefixes = [p for p in layers if module == p or module.startswith(p + ".")]
    if not prefixes:
        raise AssertionError(f"{module} is in no layer of docs/architecture.md: add it to the table")
    return layers[max(prefixes, key=len)]


def test_every_import_follows_the_documented_layers() -> None:
    layers = documented_layers()
    graph = import_graph()
    wrong = [
        f"{source} (layer {layer_of(source, layers)}) imports {target} (layer {layer_of(target, layers)})"
        for source, targets in graph.items()
        for target in sorted(targets)
        if layer_of(target, layers) > layer_of(source, layers) and (source, target) not in ALLOWED_UP
    ]
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_no_import_circles() -> None:
    graph = {m: {t for t in ts if (m, t) not in ALLOWED_UP} for m, ts in import_graph().items()}
    circles = [c for c in strongly_connected(graph) if len(c) > 1]
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(sorted(c)) for c in circles)


def test_no_circle_of_type_imports_reaches_the_runs_floor() -> None:
    """With the imports for type checkers counted too, no circle runs through the stages and the run (layer 8
    and up): the types the registry's hooks name (``plan.DataPlan``, ``plan.Batches``) live below them."""
    layers = documented_layers()
    circles = [c for c in strongly_connected(import_graph(types_too=True)) if len(c) > 1]
    through = [sorted(c) for c in circles if any(layer_of(m, layers) >= 8 for m in c)]
    assert not through, "circles through the run's floor:\n" + "\n".join(" <-> ".join(c) for c in through)


def test_the_checks_see_function_level_imports_and_circles() -> None:
    """The checker itself: an import inside a function counts, and a circle of two is found."""
    registry = import_graph()["posttrain.registry"]
    assert "posttrain.builtins" in registry  # imported inside load_builtins()
    found = strongly_connected({"a": {"b"}, "b": {"a"}, "c": {"a"}})
    assert sorted(map(sorted, found)) == [["a", "b"], ["c"]]


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_module_table_names_every_module_that_exists() -> None:
    """docs/architecture.md's module table: every module of the package is named (itself or its directory),
    and every name in it exists (a bare file name in a directory's row is in that directory)."""
    section = ARCHITECTURE.read_text().split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    named: set[str] = set()
    for row in (line for line in section.splitlines() if line.startswith("| ") and "`" in line):
        module_cell, holds_cell = row.split("|")[2:4]
        directories = re.findall(r"`([\w/]+/)`", module_cell)
        bare_in_holds = re.findall(r"`(\w+\.py)`", holds_cell) if directories else []
        for name in re.findall(r"`([\w/]+(?:\.py|/))`", module_cell) + bare_in_holds:
            where = [name] if "/" in name else [name, *(d + name for d in directories)]
            found = [w for w in where if (PACKAGE / w).exists()]
            assert found, f"docs/architecture.md names {name}, which does not exist"
            named.add(found[0])
    unnamed = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py")
        and str(path.relative_to(PACKAGE)) not in named
        and f"{path.parent.relative_to(PACKAGE)}/" not in named
    ]
    assert not unnamed, "modules missing from docs/architecture.md: " + ", ".join(sorted(unnamed))


#: the package's top-level modules (``__init__`` and ``__main__`` aside): the rest live in packages by concern
TOP_LEVEL_LIMIT = 14


def test_the_package_keeps_few_top_level_modules() -> None:
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(top) <= TOP_LEVEL_LIMIT, f"{len(top)} top-level modules (at most {TOP_LEVEL_LIMIT}): {top}"


def test_the_loop_and_its_seams_share_one_package_on_one_layer() -> None:
    """The training loop, its step feeds, step extras, stops, engine and profilers are one package, and the
    layer table puts it on one floor."""
    training = {p.stem for p in (PACKAGE / "training").glob("*.py")} - {"__init__"}
    assert {"loop", "steps", "extras", "stops", "engine", "profiling"} <= training
    layers = documented_layers()
    assert not [name for name in layers if name.startswith("posttrain.training.")]
    assert "posttrain.training" in layers


def _defines(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
            return True
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
    return False


def test_the_run_page_names_functions_that_exist() -> None:
    """Every ``module.function`` the run's flow on docs/architecture.md names is defined there."""
    block = ARCHITECTURE.read_text().split("\n## The run\n", 1)[1].split("```", 2)[1]
    wrong = []
    for dotted in sorted(set(re.findall(r"(?<![\w.`/])([a-z_]+(?:\.[A-Za-z_]+)+)", block))):
        parts = dotted.split(".")
        if parts[-1] in ("json", "jsonl", "yaml", "py", "md", "npy", "bin"):
            continue  # a file name
        modules = [i for i in range(len(parts), 0, -1) if is_module("posttrain." + ".".join(parts[:i]))]
        if not modules:
            continue  # not a posttrain module (factory.facts, spec.prepare...)
        at = modules[0]
        if at == len(parts):
            continue  # a module itself
        path = PACKAGE.parent / "posttrain" / "/".join(parts[:at])
        path = path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"
        if not _defines(path, parts[at]):
            wrong.append(f"{dotted}: {path.relative_to(ROOT)} defines no {parts[at]}")
    assert not wrong, "docs/architecture.md's run names what does not exist:\n" + "\n".join(wrong)

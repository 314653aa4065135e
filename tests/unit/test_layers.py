"""The package's layer rule, checked over its import graph (every `import`, function-level ones included).

Run as a script (`python tests/unit/test_layers.py`) it prints each layer with its modules and what they import.
"""

import ast
import sys
from collections import defaultdict
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[2] / "trl_es"

DESIGN = PACKAGE.parent / "docs" / "design.md"


def read_layers() -> list[tuple[str, str]]:
    """The layers, bottom up, with what each owns: the rows of the table under "## Layers" in docs/design.md, the
    rule's one statement. A module may import its own package's modules and those of any layer below it."""
    section = DESIGN.read_text(encoding="utf-8").split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| `")]
    return [(cell.strip().strip("`").removesuffix("/").removesuffix(".py"), owns.strip()) for cell, owns in rows]


LAYERS = read_layers()


def module_name(path: Path) -> str:
    parts = ["trl_es", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    """The layer of a module of trl_es: its first component below the package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports() -> dict[str, set[str]]:
    """Every module of trl_es and the modules of trl_es it imports anywhere in its code (a name imported from a
    package counts as that package, or as its submodule when one has that name)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if alias.name.startswith("trl_es")}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if not source.startswith("trl_es"):
                    continue
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    targets.add(submodule if submodule in modules else source)
        graph[module] = {target for target in targets if target != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_module_belongs_to_a_layer():
    names = [name for name, _ in LAYERS]
    assert sorted({layer_of(module) for module in imports()} - set(names)) == []


def test_no_module_imports_a_layer_above_its_own():
    rank = {name: k for k, (name, _) in enumerate(LAYERS)}
    upward = [
        f"{module} -> {target}"
        for module, targets in imports().items()
        for target in targets
        if rank[layer_of(target)] > rank[layer_of(module)]
    ]
    assert upward == []


def test_no_import_cycle():
    """The `__init__` of a package that re-exports its modules is left out: importing a module imports its package
    first, which is not a cycle of the code."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check itself
    graph = imports()
    faces = {module for module in graph if (PACKAGE / Path(*module.split(".")[1:]) / "__init__.py").is_file()}
    modules = {module: targets - faces for module, targets in graph.items() if module not in faces}
    assert cycles(modules) == []


def test_the_algorithm_imports_nothing_but_itself():
    outside = {target for module, targets in imports().items() if layer_of(module) == "es" for target in targets}
    assert {target for target in outside if layer_of(target) != "es"} == set()


def report() -> str:
    """Each layer, top first, with its modules and the layers they import."""
    graph, lines = imports(), []
    by_layer = defaultdict(list)
    for module in sorted(graph):
        by_layer[layer_of(module)].append(module)
    for name, description in reversed(LAYERS):
        uses = sorted({layer_of(t) for m in by_layer[name] for t in graph[m]} - {name})
        lines.append(f"{name:11} {description}")
        lines.append(f"{'':11} {len(by_layer[name])} module(s); imports {', '.join(uses) or 'nothing of trl_es'}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(print(report()))

"""The house's layout rule, read from the import statements: dtrain's modules import each other
without a cycle (a stage imports the stages below it, never one that imports it back), so that each
stage can be read, and tested, on its own."""

from __future__ import annotations

import ast
from pathlib import Path

import dtrain

PACKAGE = Path(dtrain.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, modules: set[str]) -> set[str]:
    """The dtrain modules `path` imports (module-level or not), each as the module it names (a
    `from package import name` of a submodule counts as that submodule)."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base])
            found |= {
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            }
    return {name for name in found if name in modules}


def test_dtrain_modules_import_each_other_without_a_cycle():
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {name: imported(path, set(paths)) - {name} for name, path in paths.items()}
    visiting, done, cycles = [], set(), []

    def visit(name: str) -> None:
        if name in done:
            return
        if name in visiting:
            cycles.append(visiting[visiting.index(name) :] + [name])
            return
        visiting.append(name)
        for dep in sorted(graph[name]):
            visit(dep)
        visiting.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)

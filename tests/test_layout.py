"""The layout stays readable: no import cycles, the core never imports the pictures, and no file or
function grows past the size where it starts to hold two jobs (STYLE.md; a function's docstring
is not counted)."""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "qkv"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60
# The core: what ``import qkv`` and ``qkv.attention`` load. Pictures (viz) depend on it, never
# the other way round.
CORE = ("qkv.functional", "qkv.canonical", "qkv.trace", "qkv.observers", "qkv.modules", "qkv.cache")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str) -> set[str]:
    """The qkv modules that module ``name`` imports, at any depth of its code."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in MODULES else base)
    return {module for module in found if module in MODULES and module != name}


def test_there_are_modules_to_check() -> None:
    assert {"qkv", "qkv.functional", "qkv.backends.dispatch"} <= MODULES.keys()


def test_no_import_cycles() -> None:
    graph = {name: _imports(name) for name in MODULES}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for child in sorted(graph[name]):
            if state.get(child) == 1:
                cycle = [*path[path.index(child) :], child] if child in path else [name, child]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if child not in state:
                visit(child, [*path, child])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


@pytest.mark.parametrize("name", CORE)
def test_the_core_never_imports_viz(name: str) -> None:
    seen, todo = set(), [name]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(_imports(module))
    assert not {module for module in seen if module.startswith("qkv.viz")}


def _private_names_used_from_other_modules(name: str) -> set[str]:
    """``module._name`` or ``from module import _name`` where module is another qkv module."""
    tree = ast.parse(MODULES[name].read_text())
    aliases: dict[str, str] = {}  # local name -> qkv module it is bound to
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qkv"):
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                if child in MODULES:
                    aliases[alias.asname or alias.name] = child
                elif alias.name.startswith("_"):
                    used.add(f"{node.module}.{alias.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            used.add(f"{aliases[node.value.id]}.{node.attr}")
    # A package's own private helpers (qkv._checks) are shared on purpose; the rule is about
    # reaching into another module's private state.
    return {used_name for used_name in used if not used_name.startswith("qkv._checks")}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_reads_another_modules_private_names(name: str) -> None:
    assert not _private_names_used_from_other_modules(name)


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function from its ``def`` to its end, its docstring left out."""
    assert node.end_lineno is not None
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        assert first.end_lineno is not None
        lines -= first.end_lineno - first.lineno + 1
    return lines


@pytest.mark.parametrize("name", sorted(MODULES))
def test_files_and_functions_stay_small(name: str) -> None:
    path = MODULES[name]
    source = path.read_text()
    assert source.count("\n") <= MAX_FILE_LINES, f"{path.name}: over {MAX_FILE_LINES} lines"
    too_long = {
        node.name: _code_lines(node)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and _code_lines(node) > MAX_FUNCTION_LINES
    }
    assert not too_long, f"{name}: functions over {MAX_FUNCTION_LINES} lines: {too_long}"

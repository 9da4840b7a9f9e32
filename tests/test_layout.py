"""The layout stays readable: no import cycles, the core never imports the pictures, and no file or
function grows past the size where it starts to hold two jobs (STYLE.md; a function's docstring
is not counted). The compiled kernel's C++ is held to the same file size and to functions of at
most 80 lines (its comments and blank lines included)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "qkv"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60
MAX_CPP_FUNCTION_LINES = 80
CPP_FILES = sorted(path for path in PACKAGE.rglob("*") if path.suffix in (".cpp", ".h"))
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


# What the C++ counter blanks out before it matches braces (a brace inside them is no brace):
# comments, string and character literals (not a digit separator: 1'000) and preprocessor lines
# with their continuations. (Raw string literals are not read.)
_CPP_NOISE = re.compile(
    r"""
      //[^\n]*
    | /\*.*?\*/
    | "(?:\\.|[^"\\\n])*"
    | (?<![\w'])'(?:\\.|[^'\\\n])+'
    | ^[ \t]*\#(?:\\\n|[^\n])*
    """,
    re.DOTALL | re.MULTILINE | re.VERBOSE,
)
_CPP_PUNCTUATION = re.compile(r"[;{}]")
# A declaration whose brace opens a scope of declarations (not a body): a namespace, a class.
_CPP_SCOPE = re.compile(r"^\s*(?:template\s*<[^{}]*>\s*)?(?:namespace|struct|class|union|extern)\b")
# A declaration whose brace opens a function's body: it ends with the parameters' ")", then
# perhaps qualifiers, a trailing return type or a constructor's initialisers.
_CPP_FUNCTION = re.compile(r"\)\s*(?:const|noexcept|override|final|->[^;{}]*|:[^;{}]*)*\s*$")


def _blank(match: re.Match[str]) -> str:
    return re.sub(r"[^\n]", " ", match.group())


def _cpp_function_lines(source: str) -> dict[str, int]:
    """The C++ functions of ``source`` (at namespace scope or in a class), each as
    ``name:line`` with its lines from its declaration's first line (``template <…>`` included) to
    its closing brace. Braces inside a body (blocks, lambdas, initialisers) belong to it."""
    code = _CPP_NOISE.sub(_blank, source)
    found: dict[str, int] = {}
    start = 0  # where the current declaration begins: after the last ';', '{' or '}' read
    position = 0
    while (match := _CPP_PUNCTUATION.search(code, position)) is not None:
        position = match.end()
        declaration = code[start : match.start()]
        if match.group() != "{" or (
            _CPP_SCOPE.search(declaration) and not _CPP_FUNCTION.search(declaration)
        ):
            start = position  # the next declaration, in this scope or the one just opened
            continue
        end = _closing_brace(code, match.start())
        if _CPP_FUNCTION.search(declaration):  # else an enum's or an initialiser's braces
            first = start + len(declaration) - len(declaration.lstrip())
            names = re.findall(r"(operator\s*\S+?|~?\w+)\s*\(", declaration)
            line = code.count("\n", 0, first) + 1
            found[f"{names[0] if names else 'lambda'}:{line}"] = code.count("\n", first, end) + 1
        start = position = end + 1
    return found


def _closing_brace(code: str, opening: int) -> int:
    depth = 0
    for index in range(opening, len(code)):
        depth += {"{": 1, "}": -1}.get(code[index], 0)
        if depth == 0:
            return index
    raise AssertionError(f"unbalanced braces from offset {opening}")


def test_the_cpp_counter_finds_each_function_and_its_length() -> None:
    source = """#include <vector>  // {
#define BRACE(x) { \\
  x }
namespace {
constexpr float kTable[] = {1.f, 2.f};
/* not a function() { */
template <typename T>
struct Holder {
  T value;
  int get() const { return value; }
  Holder(int x) : value(x) {}
};
enum class Kind : int { kA = 0 };
template <int N>
inline std::vector<int> make(int n,
                             char c = '{') {
  const char* text = "}";
  auto twice = [](int x) { return 2 * x; };
  if (n) { return {twice(n)}; }
  return {};
}
}  // namespace
PYBIND11_MODULE(name, module) {
  module.def("make", &make<1>);
}
"""
    assert _cpp_function_lines(source) == {
        "get:10": 1,
        "Holder:11": 1,
        "make:14": 8,
        "PYBIND11_MODULE:23": 3,
    }


def test_the_cpp_counter_reads_the_kernel() -> None:
    functions = set()
    for path in CPP_FILES:
        functions.update(name.split(":")[0] for name in _cpp_function_lines(path.read_text()))
    assert {"forward", "backward", "decode", "decode_step", "PYBIND11_MODULE"} <= functions


@pytest.mark.parametrize("path", CPP_FILES, ids=lambda path: path.name)
def test_cpp_files_and_functions_stay_small(path: pathlib.Path) -> None:
    source = path.read_text()
    assert source.count("\n") <= MAX_FILE_LINES, f"{path.name}: over {MAX_FILE_LINES} lines"
    lengths = _cpp_function_lines(source)
    too_long = {name: n for name, n in lengths.items() if n > MAX_CPP_FUNCTION_LINES}
    assert not too_long, f"{path.name}: functions over {MAX_CPP_FUNCTION_LINES} lines: {too_long}"

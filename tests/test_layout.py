"""The package's layering, read from the source: no import circle, and the runtime never imports a tool.

Imports are read with ast, at module level and inside functions alike: a lazy import
still ties two modules together (renaming one breaks the other at run time).
"""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mempath"
# Below the engine or part of it: these run inside every serving process.
RUNTIME = ("mempath.engine", "mempath.kv", "mempath.model", "mempath.memory")
# Above the engine: commands and reports built on top of it.
ABOVE_RUNTIME = ("mempath.tools", "mempath.cli", "mempath.server")


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imported_modules(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The mempath modules `path` imports; `from pkg import sub` counts as the submodule."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imported_modules(path, name, modules) for name, path in modules.items()}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, on_stack, stack, circles = {}, {}, set(), [], []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
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
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def inside(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_no_import_circle():
    circles = import_circles(import_graph())
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_runtime_imports_no_tool():
    wrong = [f"{module} imports {target}" for module, targets in sorted(import_graph().items())
             if inside(module, RUNTIME) for target in sorted(targets) if inside(target, ABOVE_RUNTIME)]
    assert not wrong, "the runtime imports a layer above it: " + "; ".join(wrong)


def test_the_circle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_circles(graph) == [["a", "b", "c"]]


# The Triton kernels are long by nature (a kernel is one function, tiled by hand).
KERNELS = PACKAGE / "kernels"
MAX_FILE_LINES = 700
MAX_FUNCTION_LINES = 60


def function_lengths(path: Path) -> list[tuple[str, int]]:
    """(name, lines) of every function in a file, its docstring not counted."""
    lengths = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                lines -= first.end_lineno - first.lineno + 1
            lengths.append((node.name, lines))
    return lengths


def test_no_file_or_function_outgrows_the_house_limits():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if KERNELS in path.parents:
            continue
        if len(path.read_text().splitlines()) > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(PACKAGE)} ({len(path.read_text().splitlines())} lines)")
        too_long += [f"{path.relative_to(PACKAGE)}::{name} ({n} lines)"
                     for name, n in function_lengths(path) if n > MAX_FUNCTION_LINES]
    assert not too_long, "over the limits (files 700 lines, functions 60 without the docstring): " + "; ".join(too_long)


def test_function_lengths_leave_out_the_docstring(tmp_path):
    source = tmp_path / "m.py"
    source.write_text('def f():\n    """Doc\n\n    more doc.\n    """\n    a = 1\n    return a\n\n\ndef g():\n    return 2\n')
    assert function_lengths(source) == [("f", 3), ("g", 2)]

"""The package's modules import each other in one direction: no module reaches, through any chain
of imports (at the top or inside a function), back to itself. Read from the source with ``ast``,
so an import that only runs on CUDA or inside a command counts too."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "course_attn"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports: ``from .x import y`` gives ``course_attn.x``,
    or ``course_attn.x.y`` when that is a module."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imported_modules(p, modules) for p in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop as [a, b, ..., a], or None: depth-first search for a back edge."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_is_read_from_the_imports():
    graph = import_graph()
    assert "course_attn.timing" in graph["course_attn.bench"]
    assert "course_attn.linear_bench" in graph["course_attn.bench"]
    assert "course_attn.model" in graph["course_attn.decode_bench"]


def test_no_module_of_the_package_imports_itself_through_a_loop():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import loop: " + " -> ".join(cycle)


def test_a_loop_is_found_when_there_is_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_benchmarks_time_with_the_timing_module_not_with_each_other():
    graph = import_graph()
    for bench in ("course_attn.decode_bench", "course_attn.linear_bench"):
        assert "course_attn.timing" in graph[bench]
        assert "course_attn.bench" not in graph[bench]


def test_a_graded_kernel_imports_no_notebook_tooling():
    """Every graded notebook's kernel imports ``course_attn.grading`` (the harness, ``check()``);
    nbformat's schema validators (jsonschema, its URI grammars) would cost each one a second."""
    import subprocess
    import sys
    code = ("import sys, course_attn.grading.harness, course_attn.grading; "
            "print(sorted(m for m in ('nbformat', 'jsonschema') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=PACKAGE.parent, check=True)
    assert done.stdout.strip() == "[]"

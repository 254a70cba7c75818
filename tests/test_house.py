"""The house's structure, read from the source with ``ast``: the attention layer never asks which
cache it holds, and the modules above the caches do not import the sliding-window module to get
one (issue 22)."""

import ast
import inspect
import textwrap
from pathlib import Path

import pytest

import course_attn
from course_attn.multihead import MultiHeadAttention

PACKAGE = Path(course_attn.__file__).parent
CACHE_CLASSES = {"KVCache", "RollingKVCache", "_KVBuffers"}


def imported_modules(source: str) -> set[str]:
    """The modules ``source`` imports, relative ones without their dots (``.local`` -> "local")."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.ImportFrom):     # from . import local
            names.update(alias.name for alias in node.names)
    return names


def isinstance_calls(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name) and node.func.id == "isinstance"]


def names_in(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def asks_for_a_cache(call: ast.Call) -> bool:
    """True for ``isinstance(cache..., ...)`` or an isinstance against a cache class."""
    subject, types = call.args
    return bool(names_in(types) & CACHE_CLASSES) or "cache" in ast.unparse(subject).lower()


@pytest.mark.parametrize("module", ["multihead", "model"])
def test_the_layers_do_not_import_the_sliding_window_module(module):
    imports = imported_modules((PACKAGE / f"{module}.py").read_text())
    assert imports, module
    assert not {"local", "course_attn.local"} & imports, imports


def test_forward_never_asks_which_cache_it_holds():
    tree = ast.parse(textwrap.dedent(inspect.getsource(MultiHeadAttention.forward)))
    calls = isinstance_calls(tree)
    assert calls                        # it does check x's type: the search finds isinstance
    assert not [ast.unparse(c) for c in calls if asks_for_a_cache(c)]


@pytest.mark.parametrize("module", ["multihead", "model"])
def test_no_isinstance_on_a_cache_class_in_the_layers(module):
    calls = isinstance_calls(ast.parse((PACKAGE / f"{module}.py").read_text()))
    assert not [ast.unparse(c) for c in calls if names_in(c.args[1]) & CACHE_CLASSES]


def test_the_search_finds_what_it_forbids():
    """The checks above can fail: they flag the code this issue removed."""
    old = ("def forward(self, cache):\n"
           "    if isinstance(cache, RollingKVCache):\n        pass\n")
    assert any(asks_for_a_cache(c) for c in isinstance_calls(ast.parse(old)))
    assert not any(asks_for_a_cache(c) for c in isinstance_calls(
        ast.parse("isinstance(x, Tensor)")))
    for source in ("from .local import RollingKVCache", "from . import local",
                   "import course_attn.local", "from course_attn.local import RollingKVCache"):
        assert {"local", "course_attn.local"} & imported_modules(source), source

"""Cells that only draw are collapsed; cells that teach stay open (issue 45).

Read from the notebooks' JSON, without running them. A cell *draws* when its code calls a
drawing entry point (``DRAWS``: matplotlib's figure set-up or display, or the package's plot
helpers). Such a cell must carry the ``hide-input`` tag, so the book shows its figure and a
toggle instead of its code; and a cell behind that toggle must teach nothing: no ``print``, and
no ``assert`` other than one on the figure itself (``FIGURE_CHECKS``). Together: whatever a
chapter computes, prints or asserts sits in an open cell, and the drawing that follows it in a
collapsed one.
"""

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "book").glob("*.ipynb"))

# plt.<name>(...) and <name>(...) calls that make or show a figure
DRAWS = {"plt.subplots", "plt.figure", "plt.show", "plot_attention", "plot_bench",
         "interactive_attention", "interactive_curves"}
# calls an assert in a collapsed cell may make: checks of the drawn figure, not of the course
FIGURE_CHECKS = {"overlapping_tick_labels"}


def called(node: ast.AST) -> set[str]:
    """The dotted names of every call in ``node``: {"plt.subplots", "print", ...}."""
    names = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            func = call.func
            if isinstance(func, ast.Name):
                names.add(func.id)
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                names.add(f"{func.value.id}.{func.attr}")
    return names


def code_cells(path: Path):
    """(index, tags, parsed source) of each code cell; an IPython magic reads as ``pass``."""
    for index, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        lines = [re.sub(r"^(\s*)[%!].*", r"\1pass", line) for line in source.splitlines()]
        yield index, cell["metadata"].get("tags", []), ast.parse("\n".join(lines))


def misplaced(path: Path) -> list[str]:
    """What breaks the rule in one notebook, one line per cell."""
    found = []
    for index, tags, tree in code_cells(path):
        draws = called(tree) & DRAWS
        if draws and "hide-input" not in tags:
            found.append(f"cell {index} draws ({', '.join(sorted(draws))}) but is not collapsed")
        if "hide-input" not in tags:
            continue
        if "print" in called(tree):
            found.append(f"cell {index} is collapsed but prints")
        for node in ast.walk(tree):
            if isinstance(node, ast.Assert) and not called(node) & FIGURE_CHECKS:
                found.append(f"cell {index} is collapsed but asserts (line {node.lineno})")
    return found


@pytest.mark.parametrize("path", [
    pytest.param(path, id=path.stem, marks=[pytest.mark.xfail(
        reason="chapter 12 is another engineer's part of issue 45: its two drawing cells "
               "are not split yet", strict=False)] if path.stem == "12_serving" else [])
    for path in NOTEBOOKS])
def test_drawing_cells_are_collapsed_and_teach_nothing(path):
    assert misplaced(path) == []


def test_the_rule_sees_a_drawing_cell_left_open_and_a_collapsed_one_that_teaches(tmp_path):
    cells = [
        {"cell_type": "code", "metadata": {}, "source": "x = 2\nprint(x)", "outputs": []},
        {"cell_type": "code", "metadata": {}, "source": "fig, ax = plt.subplots()\nax.plot([x])",
         "outputs": []},
        {"cell_type": "code", "metadata": {"tags": ["hide-input"]},
         "source": "assert x == 2\nplot_attention(w)", "outputs": []},
        {"cell_type": "code", "metadata": {"tags": ["hide-input"]},
         "source": "fig = plot_bench(rows)\nassert overlapping_tick_labels(fig) == []",
         "outputs": []},
    ]
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps({"cells": cells}))
    assert misplaced(path) == ["cell 1 draws (plt.subplots) but is not collapsed",
                               "cell 2 is collapsed but asserts (line 1)"]

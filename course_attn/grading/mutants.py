"""Mistakes generated, not imagined (issue 42): the mutants of every exercise's reference, each
run on the public cases and the hidden cases of many seeds, in this process.

A mutant is the reference's source with one small change (``mutations``): a comparison or an
arithmetic operator flipped, an integer or float constant or a slice bound moved by one, the
first two positional arguments of a call swapped, a term of a sum dropped, a unary minus or a
``not`` dropped, ``and`` and ``or`` exchanged. A mutant that gives another answer than the
reference's on some input the exercise allows must lose points on every seed: it fails a
case (public, or hidden of that seed), which costs points whatever the credit rule. A mutant
that passes every case of every seed is a survivor: it is equivalent (the change cannot alter
an answer on the exercise's inputs), and ``EQUIVALENT`` (``equivalent_mutants.txt``) says why,
or the hidden cases miss an edge. A mutant killed on some seeds and not others means a regime
is not drawn on every grading.

    python -m course_attn.grading.mutants [KEY ...] [--seeds 20] [--solutions solutions]

prints, for each exercise, its mutants, those killed on every seed, the equivalent ones and
any other survivor, and exits 1 if there is one (``make mutants`` runs every exercise).
"""

import argparse
import ast
import copy
import inspect
import signal
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

from .exercise import all_exercises, get, hidden_cases, load_hidden

EQUIVALENT = Path(__file__).with_name("equivalent_mutants.txt")
# a mutant that loops (a flipped loop condition) is stopped, and so killed, after this many
# seconds or this many times what the reference took on the same case, whichever is longer (on a
# busy machine the reference itself took 9 s on a case of ch04.leak_pattern)
SECONDS_PER_CALL = 10.0
TIMES_THE_REFERENCE = 20.0

_FLIPS = {ast.Lt: (ast.LtE, ast.Gt), ast.LtE: (ast.Lt, ast.GtE), ast.Gt: (ast.GtE, ast.Lt),
          ast.GtE: (ast.Gt, ast.LtE), ast.Eq: (ast.NotEq,), ast.NotEq: (ast.Eq,),
          ast.Is: (ast.IsNot,), ast.IsNot: (ast.Is,), ast.In: (ast.NotIn,),
          ast.NotIn: (ast.In,)}
_ARITHMETIC = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
               ast.FloorDiv: ast.Div, ast.Pow: ast.Mult, ast.Mod: ast.FloorDiv}
_SYMBOL = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==",
           ast.NotEq: "!=", ast.Is: "is", ast.IsNot: "is not", ast.In: "in",
           ast.NotIn: "not in", ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/",
           ast.FloorDiv: "//", ast.Pow: "**", ast.Mod: "%"}


def _variants(node):
    """(description, make) for each mutation of ``node`` alone; ``make(copy)`` returns the
    node that replaces the copy of ``node`` in a copy of the tree."""
    line = f"{getattr(node, 'lineno', 0)}:{getattr(node, 'col_offset', 0)}"
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            for new in _FLIPS.get(type(op), ()):
                def make(n, i=i, new=new):
                    n.ops[i] = new()
                    return n
                yield f"line {line}: {_SYMBOL[type(op)]} -> {_SYMBOL[new]}", make
    elif isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        new = _ARITHMETIC[type(node.op)]

        def flip(n, new=new):
            n.op = new()
            return n
        yield f"line {line}: {_SYMBOL[type(node.op)]} -> {_SYMBOL[new]}", flip
        if isinstance(node.op, (ast.Add, ast.Sub)):
            yield f"line {line}: a {_SYMBOL[type(node.op)]} b -> a", lambda n: n.left
            yield f"line {line}: a {_SYMBOL[type(node.op)]} b -> b", lambda n: n.right
    elif isinstance(node, ast.Constant) and type(node.value) in (int, float):
        for step in (1, -1):
            yield (f"line {line}: {node.value!r} -> {node.value + step!r}",
                   lambda n, step=step: ast.Constant(n.value + step))
    elif isinstance(node, ast.Slice):
        for bound in ("lower", "upper"):
            if getattr(node, bound) is not None and not isinstance(getattr(node, bound),
                                                                   ast.Constant):
                for step, op in ((1, ast.Add), (-1, ast.Sub)):
                    def move(n, bound=bound, op=op):
                        setattr(n, bound, ast.BinOp(getattr(n, bound), op(), ast.Constant(1)))
                        return n
                    yield f"line {line}: slice {bound} bound {step:+d}", move
    elif isinstance(node, ast.Call) and len(node.args) >= 2 and \
            not any(isinstance(a, ast.Starred) for a in node.args[:2]):
        def swap(n):
            n.args[0], n.args[1] = n.args[1], n.args[0]
            return n
        yield f"line {line}: the first two arguments of a call swapped", swap
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Not)):
        yield f"line {line}: {'-' if isinstance(node.op, ast.USub) else 'not '}x -> x", \
            lambda n: n.operand
    elif isinstance(node, ast.BoolOp):
        new = ast.Or if isinstance(node.op, ast.And) else ast.And

        def swap_bool(n, new=new):
            n.op = new()
            return n
        yield f"line {line}: {'and -> or' if new is ast.Or else 'or -> and'}", swap_bool


def _replace(tree, old, new) -> None:
    for parent in ast.walk(tree):
        for name, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, name, new)
                return
            if isinstance(value, list) and any(item is old for item in value):
                value[[i for i, item in enumerate(value) if item is old][0]] = new
                return


def _body_nodes(function: ast.FunctionDef) -> list:
    """The nodes a mutation may change: the function's body, without its docstring (the
    decorators and the signature's defaults are not the computation)."""
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
            isinstance(body[0].value.value, str):
        body = body[1:]
    return [node for statement in body for node in ast.walk(statement)]


def mutations(source: str, first_line: int = 1) -> list[tuple[str, ast.Module]]:
    """Every one-change mutant of the function defined by ``source`` (whose first line is line
    ``first_line`` of its file): (description, module); a description names the line and
    column of the change in the file."""
    tree = ast.parse(textwrap.dedent(source))
    ast.increment_lineno(tree, first_line - 1)
    function = tree.body[0]
    found = []
    for index, node in enumerate(_body_nodes(function)):
        for description, make in _variants(node):
            mutant = copy.deepcopy(tree)
            target = _body_nodes(mutant.body[0])[index]
            _replace(mutant, target, make(target))
            found.append((description, ast.fix_missing_locations(mutant)))
    return found


def mutant_functions(reference):
    """(description, function) for each mutant of ``reference``, defined in its module's
    globals (so the helpers it calls are the module's); [] if it has no source of its own."""
    try:
        lines, first_line = inspect.getsourcelines(reference)
    except (OSError, TypeError):
        return []
    source = "".join(lines)
    if not source.lstrip().startswith("def "):
        return []
    module = sys.modules[reference.__module__]
    functions = []
    for number, (description, tree) in enumerate(mutations(source, first_line)):
        namespace = dict(vars(module))
        try:
            exec(compile(tree, f"<mutant {number} of {reference.__qualname__}>", "exec"),
                 namespace)
        except Exception:      # a mutant that does not compile is no mistake a student runs
            continue
        functions.append((description, namespace[reference.__name__]))
    return functions


class _Slow(Exception):
    pass


def _stop(signum, frame):
    raise _Slow()


def _expected(exercise, case):
    """(the reference's answer to ``case``, how long a mutant may take on it)."""
    started = time.perf_counter()
    expected = exercise.expected(case)
    return expected, max(SECONDS_PER_CALL, TIMES_THE_REFERENCE * (time.perf_counter() - started))


def _fails(exercise, fn, case, expected, seconds: float = SECONDS_PER_CALL) -> bool:
    """Whether ``fn`` fails ``case``: an error, a time out (after ``seconds``), or an answer
    the comparison rejects."""
    previous = signal.signal(signal.SIGALRM, _stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        value = fn(*copy.deepcopy(case.args), **copy.deepcopy(dict(case.kwargs)))
    except BaseException as error:
        if isinstance(error, KeyboardInterrupt):
            raise
        return True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    try:
        exercise.compare(value, expected, case)
    except Exception:
        return True
    return False


@dataclass
class Outcome:
    key: str
    mutants: int = 0
    killed: list[str] = field(default_factory=list)      # on every seed
    equivalent: list[str] = field(default_factory=list)  # survivors listed in EQUIVALENT
    survived: list[str] = field(default_factory=list)    # on every seed, not listed
    partly: list[tuple[str, list[int]]] = field(default_factory=list)  # seeds it survived
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.survived and not self.partly


def equivalent_list(path: Path = EQUIVALENT) -> dict[tuple[str, str], str]:
    """(exercise key, mutation) -> why the mutant is equivalent, from ``path``: one line each,
    ``key | mutation | reason``; lines starting with # are comments."""
    listed = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                key, mutation, reason = (part.strip() for part in line.split("|", 2))
                listed[(key, mutation)] = reason
    return listed


def run(key: str, seeds, listed=None) -> Outcome:
    """Every mutant of ``key``'s reference on the public cases and the hidden cases of each
    of ``seeds`` (the hidden cases must be loaded)."""
    started = time.perf_counter()
    exercise = get(key)
    listed = equivalent_list() if listed is None else listed
    outcome = Outcome(key)
    if exercise.kind != "function":
        return outcome
    public = [(case, *_expected(exercise, case)) for case in exercise.public_cases()]
    by_seed = {}
    for description, mutant in mutant_functions(exercise.reference):
        outcome.mutants += 1
        if any(_fails(exercise, mutant, *judged) for judged in public):
            outcome.killed.append(description)
            continue
        survived = []
        for seed in seeds:
            if seed not in by_seed:
                by_seed[seed] = [(case, *_expected(exercise, case))
                                 for case in hidden_cases(key, seed)]
            if not any(_fails(exercise, mutant, *judged) for judged in by_seed[seed]):
                survived.append(seed)
        if not survived:
            outcome.killed.append(description)
        elif len(survived) < len(seeds):
            outcome.partly.append((description, survived))
        elif (key, description) in listed:
            outcome.equivalent.append(description)
        else:
            outcome.survived.append(description)
    outcome.seconds = time.perf_counter() - started
    return outcome


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("keys", nargs="*", help="exercises (default: every one)")
    parser.add_argument("--seeds", type=int, default=20, help="hidden seeds per mutant")
    parser.add_argument("--solutions", default="solutions", help="the folder of hidden/")
    options = parser.parse_args(argv)
    load_hidden(options.solutions)
    keys = options.keys or sorted(all_exercises())
    totals = dict(mutants=0, killed=0, equivalent=0, survived=0, partly=0)
    bad = []
    for key in keys:
        outcome = run(key, range(options.seeds))
        counts = dict(mutants=outcome.mutants, killed=len(outcome.killed),
                      equivalent=len(outcome.equivalent), survived=len(outcome.survived),
                      partly=len(outcome.partly))
        for name, value in counts.items():
            totals[name] += value
        print(f"{key:34s} {outcome.mutants:4d} mutants, {len(outcome.killed):4d} killed on "
              f"every seed, {len(outcome.equivalent):3d} equivalent, "
              f"{len(outcome.survived):3d} survived, {len(outcome.partly):3d} killed on some "
              f"seeds only ({outcome.seconds:.0f} s)", flush=True)
        for description in outcome.survived:
            bad.append(f"{key} | {description} | survived every seed: equivalent (say why in "
                       f"{EQUIVALENT.name}) or an edge the hidden cases miss")
        for description, seeds in outcome.partly:
            bad.append(f"{key} | {description} | survived seeds {seeds[:10]}"
                       f"{' ...' if len(seeds) > 10 else ''}: a regime not drawn every time")
    print(f"\n{totals['mutants']} mutants of {len(keys)} exercises' references, "
          f"{options.seeds} seeds each: {totals['killed']} killed on every seed, "
          f"{totals['equivalent']} equivalent (listed with a reason), {totals['survived']} "
          f"survived unexplained, {totals['partly']} killed on some seeds only")
    for line in bad:
        print(line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

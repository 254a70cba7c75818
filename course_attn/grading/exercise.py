"""What an exercise is: the function a student writes, the cases it is tried on, the reference
that gives the expected answers, what it may not call, and the typical mistakes it names.

A chapter's module (``course_attn/grading/ch03.py``) declares its exercises::

    register(Exercise(
        key="ch03.causal_mask", function="causal_mask", reference=masks.causal_mask,
        cases=public_cases, compare=expect_tensor,
        banned=("course_attn", "torch.nn.attention.bias.causal_lower_right"),
        mistakes=(Mistake("aligned top-left, as PyTorch's is_causal", top_left),),
    ))

The keys: a chapter is ``NN``; an exercise is ``chNN.name`` in the notebook's grade cell
(``grade_id`` ``chNN-name``, nbgrader's spelling), in ``check("chNN.name", ...)`` and here.

Public cases are seeded and shown by ``check()`` in the notebook. Hidden cases live with the
solutions, in ``solutions/hidden/chNN.py`` (never in the package or a notebook): each registers
a generator of cases with ``@hidden("chNN.name")``; the grader draws them with a fresh seed for
every notebook it grades, so a table of answers to the public cases is worth nothing.
"""

import importlib
import importlib.util
import pkgutil
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch

KEY = re.compile(r"^ch(\d\d)\.([A-Za-z_][A-Za-z0-9_]*)$")

# What an exercise asks of the student (the instructors' table lists each exercise's task):
TASKS = {
    "implement": "write a function the chapter sets up but does not show",
    "warm-up": "write a function the chapter shows, as a first step (fewer points)",
    "debug": "find and repair the bug of a given function, graded on the repaired outputs",
    "predict": "choose among named options before running anything, compared exactly",
    "measure": "run an experiment and report what it shows, on sizes or seeds drawn at grading",
    "derive": "work out counts as formulas of the sizes, checked on sizes drawn at grading",
}


@dataclass(frozen=True)
class Case:
    """One input for the student's function: ``fn(*args, **kwargs)``. ``hint`` says what the
    case tries, for when it fails and no typical mistake explains the answer. ``part``: for an
    answer with several parts (a dict, ``cases.Questions``), the key this case judges."""

    name: str
    args: tuple = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    hint: str = ""
    part: str = ""  # for a multi-part answer (a dict): the one key this case judges


@dataclass(frozen=True)
class Mistake:
    """A typical wrong answer: ``fn`` computes it (same signature as the exercise), ``hint``
    names it. A failed case whose answer equals ``fn``'s gets this hint."""

    hint: str
    fn: Callable


@dataclass(frozen=True)
class Exercise:
    """``kind="function"``: the notebook defines ``function``, called on each case.
    ``kind="value"``: the notebook assigns ``function`` (a prediction, a measurement), compared
    once with ``reference()``.

    ``task``: what it asks of the student, one of ``TASKS`` (implement, warm-up, debug,
    predict, measure, derive).

    ``compare(actual, expected, case)`` raises AssertionError with a message for the student.
    ``ops``: the ATen operations the function may run (``operations.py``); None: the default
    for its kind (``operations.default_operations``). ``banned``: functions refused by name,
    whatever route reaches them ("torch.softmax" refuses ``Tensor.softmax`` and
    ``torch.ops.aten._softmax`` too), for the shortcuts torch decomposes into allowed
    operations; "course_attn" refuses running any code of the package, except the functions
    named in ``allowed`` (and whatever they run). ``no_copy``: ((position, name)) of the
    tensor arguments the function must read where they are, never copy; ``no_table``: the
    positions of q, k and the block size of a tiled computation, which may not make a whole
    (Tq, Tk) table; ``read_once``: the arguments a one-pass computation reads only once
    (``harness.Guard``), and ``read_once_why`` what a second read misses, for the student;
    ``feeds``: of a generation with a cache, (position of the weights, a dict; the keys of
    those that make what the cache keeps; position of the prompt; position of the count of new
    tokens): it may run only P + n - 1 tokens through them (``harness._Feeds``), and a loop that
    runs more is told ``read_once_why``.
    ``given``: for a debug exercise, the buggy function as the notebook
    gives it (same signature): a regime of the hidden cases in which it is already right is no
    regime of the exercise (``judge.Judgement.parts``), so handing it in unchanged scores 0.
    """

    key: str
    function: str
    reference: Callable
    cases: Callable[[], Iterable[Case]]
    compare: Callable[[Any, Any, Case], None]
    kind: str = "function"
    banned: tuple[str, ...] = ()
    allowed: tuple[str, ...] = ()
    mistakes: tuple[Mistake, ...] = ()
    ops: frozenset | None = None
    task: str = "implement"  # one of TASKS
    no_copy: tuple[tuple[int, str], ...] = ()
    no_table: tuple[int, int, int] | None = None
    read_once: tuple[tuple[int, str], ...] = ()
    given: Callable | None = None
    read_once_why: str = "it takes each chunk once, in one pass"
    feeds: tuple | None = None

    @property
    def chapter(self) -> str:
        return self.key.split(".")[0]

    @property
    def grade_id(self) -> str:
        return grade_id_of(self.key)

    def operations(self) -> frozenset | None:
        """The ATen operations the student's function may run; None: any (a value)."""
        if self.kind == "value":
            return None
        if self.ops is not None:
            return frozenset(self.ops)
        from .operations import default_operations
        return default_operations(self.banned)

    def public_cases(self) -> list[Case]:
        return list(self.cases())

    def expected(self, case: Case):
        return self.reference(*case.args, **dict(case.kwargs))


_EXERCISES: dict[str, Exercise] = {}
_HIDDEN: dict[str, Callable[[torch.Generator], Iterable[Case]]] = {}
_REGIMES: dict[str, dict[str, Callable[[Case], bool]]] = {}
_CENTRAL: dict[str, frozenset[str]] = {}


def validate_key(key: str) -> str:
    if not isinstance(key, str) or not KEY.match(key):
        raise ValueError(f"exercise keys look like 'ch03.causal_mask', got {key!r}")
    return key


def grade_id_of(key: str) -> str:
    """``"ch03.causal_mask"`` -> ``"ch03-causal_mask"``, the grade cell's nbgrader grade_id."""
    return validate_key(key).replace(".", "-", 1)


def key_of(grade_id: str) -> str | None:
    """The exercise key of a grade cell's ``grade_id``, or None if it names no exercise."""
    key = grade_id.replace("-", ".", 1) if isinstance(grade_id, str) else ""
    return key if KEY.match(key) else None


def register(exercise: Exercise) -> Exercise:
    validate_key(exercise.key)
    if exercise.kind not in ("function", "value"):
        raise ValueError(f"{exercise.key}: kind must be 'function' or 'value'")
    if exercise.task == "debug" and exercise.given is None:
        raise ValueError(f"{exercise.key}: a debug exercise declares its given function")
    if exercise.task not in TASKS:
        raise ValueError(f"{exercise.key}: task must be one of {sorted(TASKS)}, "
                         f"got {exercise.task!r}")
    _EXERCISES[exercise.key] = exercise
    return exercise


def hidden(key: str, regimes: Mapping[str, Callable[[Case], bool]] | None = None,
           central: Iterable[str] = ()):
    """Decorator for ``solutions/hidden/chNN.py``: ``@hidden("ch03.causal_mask", regimes=...)``
    registers a generator ``(torch.Generator) -> cases``.

    ``regimes``: the regions of the exercise's inputs that its hidden cases sample, by name,
    each a predicate on a case (``"Tq > Tk + 1": lambda case: case.args[0] > case.args[1] +
    1``). A hidden set is a sample of the inputs, so it is drawn by regime, not by range: the
    generator draws at least one case inside every regime on every seed (the random part
    inside the regime), and ``tests/test_hidden_regimes.py`` proves it for seeds 0-99, and
    that an answer wrong in one regime only fails there.

    ``central``: the regimes that are the point of the exercise (what the chapter does not
    show, the edge the task is about): an answer that fails a case in one of them earns
    nothing, however many other regimes it gets right (``judge.Judgement.credit``)."""
    central = frozenset(central)
    unknown = central - set(regimes or {})
    if unknown:
        raise ValueError(f"{key}: central regimes {sorted(unknown)} are not among its regimes")

    def decorate(make: Callable[[torch.Generator], Iterable[Case]]):
        _HIDDEN[validate_key(key)] = make
        _REGIMES[key] = dict(regimes or {})
        _CENTRAL[key] = central
        return make
    return decorate


def credit_parts(key: str) -> str:
    """What an exercise's points are split into when the grader gives partial credit: "N
    parts" for a multi-part answer, "N regimes" (of its hidden cases) for one in one piece."""
    parts = {case.part for case in get(key).public_cases() if case.part}
    if len(parts) > 1:
        return f"{len(parts)} parts"
    return f"{len(hidden_regimes(key))} regimes"


def hidden_regimes(key: str) -> dict[str, Callable[[Case], bool]]:
    """The regimes ``key``'s hidden cases declare (see ``hidden``); {} if none."""
    return dict(_REGIMES.get(key, {}))


def central_regimes(key: str) -> frozenset[str]:
    """The regimes ``key``'s hidden cases declare central (see ``hidden``); empty if none."""
    return _CENTRAL.get(key, frozenset())


def get(key: str) -> Exercise:
    """The exercise ``key``, importing its chapter's module if needed."""
    validate_key(key)
    if key not in _EXERCISES:
        try:
            importlib.import_module(f"{__package__}.{key.split('.')[0]}")
        except ModuleNotFoundError:
            pass
    if key not in _EXERCISES:
        raise ValueError(f"no exercise named {key!r}; known: {sorted(all_exercises())}")
    return _EXERCISES[key]


def all_exercises() -> dict[str, Exercise]:
    """Every exercise, after importing every chapter module of ``course_attn.grading``."""
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if re.fullmatch(r"ch\d\d", info.name):
            importlib.import_module(f"{__package__}.{info.name}")
    return dict(_EXERCISES)


def load_hidden(solutions_dir: Path | str) -> list[str]:
    """Import every ``solutions_dir/hidden/chNN.py`` (registering its hidden cases); returns
    the keys that have hidden cases."""
    folder = Path(solutions_dir) / "hidden"
    for path in sorted(folder.glob("ch[0-9][0-9].py")):
        name = f"_course_attn_hidden_{path.stem}"
        if name in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sorted(_HIDDEN)


def hidden_cases(key: str, seed: int) -> list[Case]:
    """The hidden cases of ``key`` drawn with ``seed``; [] if it has none (or none loaded)."""
    make = _HIDDEN.get(key)
    return list(make(torch.Generator().manual_seed(seed))) if make else []

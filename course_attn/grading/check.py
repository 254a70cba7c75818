"""``check("ch03.causal_mask", causal_mask)``: immediate feedback in the notebook.

It runs the exercise's public cases on the student's function, in the student's own process,
with the same comparisons, hints and banned calls as the grader, and prints a table. It decides
nothing: the grade comes from ``python -m course_attn.grade``, which sends its own inputs,
hidden ones included, and judges the answers outside the student's process.
"""

import copy
from pathlib import Path

from ..colab import tell_where_the_grader_runs
from .exercise import Exercise, get
from .harness import Guard, WireError, decode, encode, error_as_data
from .judge import Answer, Judgement, format_judgement, judge_case
from .operations import guard_options

PACKAGE_DIR = str(Path(__file__).resolve().parents[1])


class ExerciseFailed(AssertionError):
    """Raised by ``check`` so that a failing exercise stops the notebook, visibly."""

    def _render_traceback_(self):  # IPython shows this instead of a traceback
        return [f"ExerciseFailed: {self}"]


def run_exercise(exercise: Exercise, fn, cases=None, *, watch_banned: bool = True,
                 hidden=()) -> Judgement:
    """Judge ``fn`` (a function, or the value of a ``kind="value"`` exercise) on ``cases``
    (default: the public ones), in this process; never raises for a broken ``fn``. ``hidden``:
    cases judged after them as the grader's hidden ones, and the credit given by regime, as
    the grader gives it (``grade_here``)."""
    hidden = list(hidden)
    judgement = Judgement(exercise.key, by_regime=bool(hidden))
    cases = exercise.public_cases() if cases is None else cases
    cases = [(case, False) for case in cases] + [(case, True) for case in hidden]
    options = guard_options(exercise, PACKAGE_DIR, imports=False)
    guard = Guard.from_options(options) if watch_banned else Guard()
    for case, secret in cases:
        expected = exercise.expected(case)
        if exercise.kind == "value":
            answer = Answer(value=fn)
        elif not callable(fn):
            answer = Answer(error={"type": "TypeError",
                                   "message": f"expected a function, got {type(fn).__name__}"})
        else:
            args = copy.deepcopy(case.args)
            try:
                value = guard.call(fn, args, dict(case.kwargs))
                answer = _as_sent(value)
            except Exception as error:
                answer = Answer(error=error_as_data(error))
            else:
                changed = [i for i, (a, b) in enumerate(zip(args, case.args))
                           if _encoded(a) != _encoded(b)]
                answer.mutated_argument = changed[0] if changed else None
        judgement.results.append(judge_case(exercise, case, expected, answer, secret))
    judgement.banned = list(guard.hits)
    return judgement


def grade_here(exercise: Exercise, fn, seed: int, *, watch_banned: bool = True) -> Judgement:
    """``fn`` judged as the grader judges it with hidden seed ``seed`` (public cases, then the
    hidden ones, credit by regime), but in this process: for tests and ``make mutants``, which
    try many answers on many seeds. ``judgement.credit()`` is the share the grader gives."""
    from .exercise import hidden_cases
    return run_exercise(exercise, fn, watch_banned=watch_banned,
                        hidden=hidden_cases(exercise.key, seed))


def _as_sent(value) -> Answer:
    """The answer as the grader would see it: sent as plain data and read back, so a value
    that the grader refuses (a tensor subclass, an object) fails here too."""
    try:
        return Answer(value=decode(encode(value)))
    except WireError as error:
        return Answer(unsendable=str(error))


def _encoded(value):
    try:
        return encode(value)
    except Exception:
        return repr(value)


def check(key: str, fn) -> None:
    """Run exercise ``key``'s public cases on ``fn`` and print what passed, what failed and a
    hint. An unanswered exercise prints "not answered yet"; a wrong one raises ExerciseFailed
    after the table."""
    try:
        exercise = get(key)
    except ValueError:
        chapter = Path(__file__).with_name(f"{str(key).split('.')[0]}.py")
        if isinstance(key, str) and not chapter.exists() and chapter.stem.startswith("ch"):
            # the grader's sandbox: its copy of the package has no exercise declarations
            print(f"{key}: check() is off while the grader runs this notebook; it runs its own "
                  "checks")
            return
        raise
    judgement = run_exercise(exercise, fn)
    print(format_judgement(judgement))
    tell_where_the_grader_runs()
    if not judgement.passed and not judgement.not_implemented:
        failed = sum(not r.passed for r in judgement.results)
        what = judgement.reason() if judgement.banned else \
            f"{failed} of {len(judgement.results)} checks failed (see above)"
        raise ExerciseFailed(f"{key}: {what}")

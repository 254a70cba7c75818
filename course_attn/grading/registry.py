"""Exercise checks: each exercise is a list of cases run against a student's function.

A chapter module (``course_attn/grading/ch03.py``) registers its exercises::

    @exercise("ch03.causal_mask")
    def _(fn):
        yield Case("square, T=4", lambda: assert_close(fn(4, 4), causal_mask(4, 4)),
                   hint="query i may attend to keys 0..i")

The reference is always the package's own function, never anything the notebook defines.

**Calling the reference is not an answer.** ``check`` (and the grader) fail a case whose student
function entered the code of a reference: a function of the ``course_attn`` package (outside
``course_attn.grading``) that the case itself calls, from the chapter's check code, while it runs
(``causal_mask(tq, tk)`` in the lambda above). The code object is what is recognised, so
``from course_attn import causal_mask as cm``, ``functools.partial(cm)``, a wrapper, or
``causal_mask = course_attn.causal_mask`` are all caught. Build a case's *inputs* in the generator
body (as ``ch03.masked_attention`` does with its masks), not inside ``Case.run``: a package
function called there counts as a reference, and the student's function may then not use it.
``run_checks`` does not enforce this unless asked (``forbid_reference=True``), so tests can check
that the package itself passes the cases.
"""

import contextlib
import functools
import importlib
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

CheckFn = Callable[[Callable], Iterable["Case"]]
_EXERCISES: dict[str, CheckFn] = {}


@dataclass
class Case:
    """One check: ``run()`` raises (usually AssertionError) when the student's code is wrong."""

    name: str
    run: Callable[[], object]
    hint: str = ""


@dataclass
class CaseResult:
    name: str
    passed: bool
    message: str = ""
    hint: str = ""
    reference_called: str = ""  # the package function the student's code called, if it did


@dataclass
class Report:
    exercise: str
    results: list[CaseResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    @property
    def n_passed(self) -> int:
        return sum(r.passed for r in self.results)


def exercise(name: str) -> Callable[[CheckFn], CheckFn]:
    """Register the cases of exercise ``name`` ("chNN.something")."""
    def decorate(fn: CheckFn) -> CheckFn:
        _EXERCISES[name] = fn
        return fn
    return decorate


def _load(name: str) -> CheckFn:
    if not isinstance(name, str) or "." not in name:
        raise ValueError(f"exercise names look like 'ch03.causal_mask', got {name!r}")
    module = name.split(".", 1)[0]
    try:
        importlib.import_module(f"{__package__}.{module}")
    except ModuleNotFoundError:
        pass
    if name not in _EXERCISES:
        raise ValueError(f"no exercise named {name!r}; known: {sorted(_EXERCISES)}")
    return _EXERCISES[name]


def exercises() -> list[str]:
    """Names of every registered exercise (after importing every chapter's checks)."""
    import pkgutil
    from pathlib import Path
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name.startswith("ch"):
            importlib.import_module(f"{__package__}.{info.name}")
    return sorted(_EXERCISES)


def _describe(exc: BaseException) -> str:
    if type(exc) is NotImplementedError:
        return "not implemented yet (raise NotImplementedError)"
    text = str(exc).strip() or type(exc).__name__
    if not isinstance(exc, AssertionError):
        frame = traceback.extract_tb(exc.__traceback__)[-1:]
        where = f" (line {frame[0].lineno})" if frame else ""
        text = f"{type(exc).__name__}: {text}{where}"
    return text


# Code objects name their file as it was imported, so these paths are not resolved either.
_GRADING_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_PACKAGE_DIR = os.path.dirname(_GRADING_DIR.rstrip(os.sep)) + os.sep
_GRADING_MACHINERY = {os.path.abspath(__file__), os.path.join(_GRADING_DIR, "sealed.py")}
_PROFILER_SWITCHES = (sys.setprofile,)
_CodeKey = tuple[str, int, str]  # (file, first line, name): survives importlib.reload


class _ReferenceWatch:
    """Which package functions a case calls from check code (its references), and which package
    functions the student's function enters while it runs, seen through ``sys.setprofile``."""

    def __init__(self, check_file: str):
        self.check_file = check_file
        self.references: dict[_CodeKey, str] = {}  # key -> qualified name
        self.entered: set[_CodeKey] = set()  # by the student's function, in the current case
        self.touched_profiler = False  # the student's function switched the profiler
        self._inside = 0
        self._hook = self._profile  # one bound method, so ``sys.getprofile() is`` works

    def wrap(self, fn: Callable) -> Callable:
        """``fn``, marking the time it runs as the student's."""
        @functools.wraps(fn)
        def student_function(*args, **kwargs):
            self._inside += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside -= 1
        return student_function

    def _is_check_code(self, filename: str) -> bool:
        return filename == self.check_file or (filename.startswith(_GRADING_DIR)
                                               and filename not in _GRADING_MACHINERY)

    def _profile(self, frame, event, arg):
        if event == "call":
            filename = frame.f_code.co_filename
            if not filename.startswith(_PACKAGE_DIR) or filename.startswith(_GRADING_DIR):
                return
            key = (filename, frame.f_code.co_firstlineno, frame.f_code.co_name)
            if self._inside:
                self.entered.add(key)
            elif frame.f_back is not None and self._is_check_code(frame.f_back.f_code.co_filename):
                module = frame.f_globals.get("__name__", "?")
                self.references.setdefault(key, f"{module}.{frame.f_code.co_qualname}")
        elif event == "c_call" and self._inside and arg in _PROFILER_SWITCHES:
            self.touched_profiler = True

    @contextlib.contextmanager
    def watching(self):
        """Profile the body (one case): afterwards ``entered`` and ``touched_profiler`` hold."""
        self.entered, self.touched_profiler = set(), False
        previous = sys.getprofile()
        sys.setprofile(self._hook)
        try:
            yield self
        finally:
            if sys.getprofile() is not self._hook:
                self.touched_profiler = True
            try:
                sys.setprofile(previous)
            except TypeError:  # a C-level profiler (cProfile) cannot be put back from Python
                sys.setprofile(None)


def run_checks(name: str, fn: Callable, *, forbid_reference: bool = False) -> Report:
    """Run every case of exercise ``name`` against ``fn``; never raises for a broken ``fn``.

    With ``forbid_reference`` a case fails when ``fn`` called the package function that the
    case compares it with (see the module's docstring); ``check`` always asks for that.
    """
    return run_cases(name, _load(name), fn, forbid_reference=forbid_reference)


def run_cases(name: str, make_cases: CheckFn, fn: Callable, *,
              forbid_reference: bool = False) -> Report:
    """``run_checks`` with the exercise's case generator given rather than looked up."""
    report = Report(name)
    if not callable(fn):
        report.results.append(CaseResult("is a function", False,
                                         f"expected a function, got {type(fn).__name__}"))
        return report
    watch = _ReferenceWatch(getattr(getattr(make_cases, "__code__", None), "co_filename", ""))
    cases: Iterator[Case] = iter(make_cases(watch.wrap(fn) if forbid_reference else fn))
    entered: list[tuple[set[_CodeKey], bool]] = []  # per result: what fn entered, profiler?
    while True:
        try:
            case = next(cases)
        except StopIteration:
            break
        except Exception as exc:  # building a case called the student's code and it failed
            report.results.append(CaseResult("setting up the checks", False, _describe(exc)))
            entered.append((set(), False))
            break
        with watch.watching() if forbid_reference else contextlib.nullcontext():
            try:
                case.run()
                result = CaseResult(case.name, True, hint=case.hint)
            except Exception as exc:
                result = CaseResult(case.name, False, _describe(exc), case.hint)
        report.results.append(result)
        entered.append((watch.entered, watch.touched_profiler))
    if forbid_reference:
        _fail_reference_calls(report, entered, watch.references)
    return report


def _fail_reference_calls(report: Report, entered, references: dict[_CodeKey, str]) -> None:
    """Fail each case in which the student's function entered a reference, or the profiler."""
    for result, (keys, touched_profiler) in zip(report.results, entered):
        called = sorted(references[key] for key in keys if key in references)
        if called:
            result.passed, result.reference_called = False, called[0]
            result.message = (f"your function calls {called[0]}, the package's reference that "
                              "this exercise is checked against; write the computation yourself")
            result.hint = ""
        elif touched_profiler:
            result.passed = False
            result.message = ("your function calls sys.setprofile, which check() uses to watch "
                              "for calls to the package's reference; remove that call")
            result.hint = ""


def format_report(report: Report) -> str:
    lines = [f"{report.exercise}: {report.n_passed}/{len(report.results)} checks passed"]
    for r in report.results:
        lines.append(f"  {'✓' if r.passed else '✗'} {r.name}")
        if not r.passed:
            lines.append(f"      {r.message}")
            if r.hint:
                lines.append(f"      hint: {r.hint}")
    return "\n".join(lines)


class ExerciseFailed(AssertionError):
    """Raised by ``check`` so a failing exercise stops the cell, visibly."""


def check(name: str, fn: Callable) -> None:
    """Run exercise ``name``'s checks on ``fn``, print what passed and failed, raise if any failed.

    A function that calls the package's reference for the exercise fails (see the module's
    docstring).
    """
    report = run_checks(name, fn, forbid_reference=True)
    print(format_report(report))
    if not report.passed:
        failed = len(report.results) - report.n_passed
        raise ExerciseFailed(f"{name}: {failed} of {len(report.results)} checks failed (see above)")


def assert_close(actual, expected, *, what: str = "result", atol: float | None = None,
                 rtol: float | None = None) -> None:
    """AssertionError with shapes, dtypes and the largest error unless ``actual`` ≈ ``expected``.

    ``actual`` must be a plain ``torch.Tensor``: a subclass could redefine the comparisons.
    """
    if not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{what} should be a torch.Tensor, got {type(actual).__name__}")
    if type(actual) is not torch.Tensor:
        raise AssertionError(f"{what} should be a plain torch.Tensor, got the subclass "
                             f"{type(actual).__name__}")
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{what} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    if expected.dtype == torch.bool or actual.dtype == torch.bool:
        if actual.dtype != expected.dtype:
            raise AssertionError(f"{what} has dtype {actual.dtype}, expected {expected.dtype}")
        wrong = (actual != expected).sum().item()
        if wrong:
            raise AssertionError(f"{what}: {wrong} of {expected.numel()} entries differ")
        return
    if actual.device != expected.device:
        raise AssertionError(f"{what} is on {actual.device}, expected {expected.device}")
    actual = actual.to(expected.dtype)
    default_rtol, default_atol = _TOLERANCES.get(expected.dtype, (0.0, 0.0))
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    if not torch.isclose(actual, expected, rtol=rtol, atol=atol, equal_nan=False).all():
        diff = (actual - expected).abs()
        worst = diff.nan_to_num(float("inf")).max().item() if diff.numel() else 0.0
        nan = actual.isnan().any().item()
        raise AssertionError(
            f"{what} differs from the reference: largest error {worst:.3g}"
            + (" (it contains NaN)" if nan else ""))


# (rtol, atol) by dtype: torch.testing.assert_close's defaults, |actual - expected| <= atol +
# rtol * |expected| everywhere. (torch.testing.assert_close itself imports torch.distributed on
# its first call, which costs most of a second in every fresh kernel.)
_TOLERANCES = {
    torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7), torch.complex64: (1.3e-6, 1e-5), torch.complex128: (1e-7, 1e-7),
}

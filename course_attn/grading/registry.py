"""Exercise checks: each exercise is a list of cases run against a student's function.

A chapter module (``course_attn/grading/ch03.py``) registers its exercises::

    @exercise("ch03.causal_mask")
    def _(fn):
        yield Case("square, T=4", lambda: assert_close(fn(4, 4), causal_mask(4, 4)),
                   hint="query i may attend to keys 0..i")

The reference is always the package's own function, never anything the notebook defines.
"""

import importlib
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


def run_checks(name: str, fn: Callable) -> Report:
    """Run every case of exercise ``name`` against ``fn``; never raises for a broken ``fn``."""
    make_cases = _load(name)
    report = Report(name)
    if not callable(fn):
        report.results.append(CaseResult("is a function", False,
                                         f"expected a function, got {type(fn).__name__}"))
        return report
    cases: Iterator[Case] = iter(make_cases(fn))
    while True:
        try:
            case = next(cases)
        except StopIteration:
            break
        except Exception as exc:  # building a case called the student's code and it failed
            report.results.append(CaseResult("setting up the checks", False, _describe(exc)))
            break
        try:
            case.run()
            report.results.append(CaseResult(case.name, True, hint=case.hint))
        except Exception as exc:
            report.results.append(CaseResult(case.name, False, _describe(exc), case.hint))
    return report


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
    """Run exercise ``name``'s checks on ``fn``, print what passed and failed, raise if any failed."""
    report = run_checks(name, fn)
    print(format_report(report))
    if not report.passed:
        failed = len(report.results) - report.n_passed
        raise ExerciseFailed(f"{name}: {failed} of {len(report.results)} checks failed (see above)")


def assert_close(actual, expected, *, what: str = "result", atol: float | None = None,
                 rtol: float | None = None) -> None:
    """AssertionError with shapes, dtypes and the largest error unless ``actual`` ≈ ``expected``."""
    if not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{what} should be a torch.Tensor, got {type(actual).__name__}")
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
    if not actual.dtype.is_floating_point:
        actual = actual.to(expected.dtype)
    try:
        torch.testing.assert_close(actual.to(expected.dtype), expected, atol=atol, rtol=rtol,
                                   equal_nan=False)
    except AssertionError:
        diff = (actual.to(expected.dtype) - expected).abs()
        worst = diff.nan_to_num(float("inf")).max().item() if diff.numel() else 0.0
        nan = actual.isnan().any().item()
        raise AssertionError(
            f"{what} differs from the reference: largest error {worst:.3g}"
            + (" (it contains NaN)" if nan else "")) from None

"""Helpers that every chapter's exercises share: seeded inputs, comparisons that explain a
wrong answer to a student (each raises AssertionError with the message), and typical mistakes
made of a reference's answers."""

import inspect
import math

import torch


def randn(*shape: int, seed: int | torch.Generator, dtype: torch.dtype = torch.float32,
          scale: float = 1.0) -> torch.Tensor:
    """Standard normal numbers of ``shape`` (times ``scale``), the same for a seed on every
    machine (drawn in float64 on the CPU, then cast)."""
    generator = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(dtype)


def random_mask(*shape: int, seed: int | torch.Generator, p_keep: float = 0.6) -> torch.Tensor:
    """A bool mask of ``shape``, True with probability ``p_keep``."""
    generator = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=generator) < p_keep


def randint(low: int, high: int, seed: torch.Generator) -> int:
    """An int in [low, high] drawn from ``seed``."""
    return int(torch.randint(low, high + 1, (), generator=seed))


# (rtol, atol) by dtype: torch.testing.assert_close's defaults.
TOLERANCES = {
    torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7), torch.complex64: (1.3e-6, 1e-5), torch.complex128: (1e-7, 1e-7),
}


def softmax_without_shift(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """A softmax that exponentiates the raw scores, as a typical mistake does: inf / inf = NaN
    once a score passes 709 (float64) or 88 (float32)."""
    e = x.exp()
    return e / e.sum(dim=dim, keepdim=True)


def _what(case) -> str:
    return getattr(case, "name", None) or "the result"


def expect_tensor(actual, expected: torch.Tensor, case=None, *, rtol: float | None = None,
                  atol: float | None = None) -> None:
    """``actual`` is a tensor of ``expected``'s shape, dtype and device, close to it (exactly
    equal for bool and integer tensors)."""
    what = "your result"
    if not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{what} should be a torch.Tensor, got {type(actual).__name__}")
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{what} has shape {tuple(actual.shape)}, expected "
                             f"{tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{what} has dtype {actual.dtype}, expected {expected.dtype}")
    device = getattr(actual, "grading_device", str(actual.device))
    if device != str(expected.device):
        raise AssertionError(f"{what} is on {device}, expected {expected.device}")
    if not (expected.is_floating_point() or expected.is_complex()):
        wrong = int((actual != expected).sum())
        if wrong:
            raise AssertionError(f"{what}: {wrong} of {expected.numel()} entries differ")
        return
    default_rtol, default_atol = TOLERANCES.get(expected.dtype, (0.0, 0.0))
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    if not torch.isclose(actual, expected, rtol=rtol, atol=atol).all():
        diff = (actual - expected).abs()
        worst = diff.nan_to_num(float("inf")).max().item() if diff.numel() else 0.0
        nan = " (it contains NaN)" if actual.isnan().any().item() else ""
        raise AssertionError(f"{what} differs from the expected one: largest error "
                             f"{worst:.3g}{nan}")


def expect_tensors(names):
    """Compare a tuple of tensors named ``names`` item by item, as ``expect_tensor`` does; a
    wrong item is named in the message (e.g. "acc: your result has shape ...")."""
    def compare(actual, expected, case=None) -> None:
        if not isinstance(actual, (tuple, list)) or len(actual) != len(names):
            raise AssertionError(f"your function should return a tuple ({', '.join(names)}), "
                                 f"got {type(actual).__name__}"
                                 + (f" of length {len(actual)}"
                                    if isinstance(actual, (tuple, list)) else ""))
        for name, got, want in zip(names, actual, expected):
            try:
                expect_tensor(got, want, case)
            except AssertionError as error:
                raise AssertionError(f"{name}: {error}") from None
    return compare


def expect_close_tensor(rtol: float, atol: float):
    """``expect_tensor`` with these tolerances (for an answer computed another, valid way)."""
    def compare(actual, expected, case=None):
        expect_tensor(actual, expected, case, rtol=rtol, atol=atol)
    return compare


def expect_float_list(actual, expected: list, case=None, *, rtol: float = 1e-7,
                      atol: float = 1e-9) -> None:
    """``actual`` is a list of Python floats, as long as ``expected`` and close to it."""
    if not isinstance(actual, list):
        raise AssertionError(f"your result should be a list, got {type(actual).__name__}")
    if len(actual) != len(expected):
        raise AssertionError(f"your list has {len(actual)} entries, expected {len(expected)}")
    for i, (a, e) in enumerate(zip(actual, expected)):
        if isinstance(a, bool) or not isinstance(a, (int, float)):
            raise AssertionError(f"entry {i} should be a Python float, got {type(a).__name__}")
        if not math.isclose(a, e, rel_tol=rtol, abs_tol=atol):
            raise AssertionError(f"entry {i} is {a:.6g}, expected {e:.6g}")


def expect_number(actual, expected: float, case=None, *, rtol: float = 1e-6,
                  atol: float = 0.0) -> None:
    """``actual`` is a real number (int or float, or a one-element tensor) close to
    ``expected``."""
    if isinstance(actual, torch.Tensor) and actual.numel() == 1 and not actual.is_complex():
        actual = actual.item()
    if isinstance(actual, bool) or not isinstance(actual, (int, float)):
        raise AssertionError(f"your answer should be a number, got {type(actual).__name__}")
    if not math.isclose(actual, expected, rel_tol=rtol, abs_tol=atol):
        raise AssertionError(f"your answer is {actual:.6g}, expected {expected:.6g}")


def as_number(actual) -> float | None:
    """``actual`` as a Python number (a one-element real tensor is read out); None if it is not
    one (a bool is not a number here)."""
    if isinstance(actual, torch.Tensor) and actual.numel() == 1 and not actual.is_complex():
        actual = actual.item()
    if isinstance(actual, bool) or not isinstance(actual, (int, float)):
        return None
    return actual


class Questions:
    """A predict or derive exercise: a function of the sizes of the problem answers several
    questions at once, as a dict, and each question on each set of sizes is one case, so each
    is graded and hinted on its own. The answers depend on sizes drawn at grading time (the
    hidden cases), so a number worked out once, in a cell, is worth nothing.

    ``questions``: {key: (case name, hint)}, in the order they are asked.
    ``same(key, actual, expected) -> bool``: whether an answer is right.
    ``wrong(key, actual, expected) -> str``: what to tell a student whose answer is wrong; it
    may say whether the answer is too large or too small, never what it is or by what factor.
    Use ``cases=lambda: questions.cases(SIZES), compare=questions.compare`` in the
    ``Exercise``, and ``questions.cases(drawn sizes, ...)`` for the hidden cases.
    """

    def __init__(self, questions: dict, *, same, wrong):
        from .exercise import Case     # exercise.py imports nothing of this module's
        self.questions, self.same, self.wrong = dict(questions), same, wrong
        self._case = Case
        self._key_of_case = {name: key for key, (name, _) in self.questions.items()}

    def cases(self, *sizes: dict, keys=None):
        """One case per question (or per question in ``keys``) for each dict of keyword
        arguments in ``sizes``; without sizes, the questions of a function of no arguments."""
        for size in sizes or ({},):
            label = ", ".join(f"{name}={value}" for name, value in size.items())
            for key, (name, hint) in self.questions.items():
                if keys is None or key in keys:
                    yield self._case(f"{name} ({label})" if label else name, kwargs=dict(size),
                                     hint=hint, part=key)

    def compare(self, actual, expected: dict, case=None) -> None:
        """With a case, the one answer that case asks about must be right; without one (when
        matching a typical mistake), every answer ``expected`` holds."""
        if not isinstance(actual, dict):
            raise AssertionError(f"your function should return a dict with the keys "
                                 f"{list(self.questions)}, got {type(actual).__name__}")
        part = getattr(case, "part", "") or self._key_of_case.get(getattr(case, "name", None))
        keys = [part] if part else list(expected)
        for key in keys:
            if key not in actual:
                raise AssertionError(f"your dict has no key {key!r}")
            if not self.same(key, actual[key], expected[key]):
                raise AssertionError(self.wrong(key, actual[key], expected[key]))


def count_questions(questions: dict, *, rel_tol: float = 1e-9, near_miss: bool = False,
                    direction_only: tuple = ()) -> Questions:
    """``Questions`` whose answers are counts (multiply-adds, bytes, tiles, lengths): an answer is
    right within ``rel_tol``. A wrong one is told only whether it is too large or too small,
    never by what factor (a factor would let a student fix the number by multiplying). With
    ``near_miss``, an answer within 0.1% is told so. ``direction_only`` is kept for callers
    that name the keys; every key is answered that way now."""
    def same(key, actual, expected) -> bool:
        got = as_number(actual)
        return got is not None and math.isclose(got, expected, rel_tol=rel_tol)

    def wrong(key, actual, expected) -> str:
        got = as_number(actual)
        if got is None:
            return f"{key!r} should be a number, got {type(actual).__name__}"
        direction = "too large" if got > expected else "too small"
        if near_miss and expected and abs(got / expected - 1) < 1e-3:
            return f"your {key!r} is a little {direction} (by less than 0.1%)"
        return f"your {key!r} is {direction}"

    return Questions(questions, same=same, wrong=wrong)


def answers_changed(reference, changes: dict, *, sizes=None):
    """A typical mistake in a derive or predict exercise, with ``reference``'s signature: the
    reference's answers (a dict) with the entry of each key of ``changes`` computed another way,
    ``changes[key](**named)``. ``named``: the arguments by their names in ``reference``, or
    ``sizes(**arguments)`` when given (to rename them, or to add one derived from them)."""
    signature = inspect.signature(reference)

    def mistake(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        named = dict(bound.arguments) if sizes is None else sizes(**bound.arguments)
        return {**reference(*bound.args, **bound.kwargs),
                **{key: rule(**named) for key, rule in changes.items()}}
    return mistake

"""Judging: the student's answers against the references, case by case, with the hint that
names the mistake. Pure computation on plain values; ``check()`` uses it in the notebook and
the grader uses it in its own process, on the answers the kernel sent back."""

import copy
import hashlib
import json
import math
from dataclasses import dataclass, field

import torch

from .exercise import Case, Exercise, central_regimes, get, hidden_regimes
from .harness import COPY_OF, READ_AGAIN, SWITCHES_OFF, TABLE_OF, encode

NOT_IMPLEMENTED = "not answered yet"
OUT_OF_MEMORY = ("can't allocate memory", "Cannot allocate memory", "out of memory",
                 "std::bad_alloc")


@dataclass
class Answer:
    """What the student's code gave for one case: a value, or an error (``error`` = its type
    and message), or a value that could not be sent back (``unsendable``)."""

    value: object = None
    error: dict | None = None
    unsendable: str = ""
    mutated_argument: int | None = None


@dataclass
class CaseResult:
    name: str
    passed: bool
    message: str = ""
    hint: str = ""
    hidden: bool = False
    named: bool = False  # the hint names a typical mistake (not the case's own hint)
    part: str = ""       # the part of a multi-part answer this case judges (Case.part)
    regimes: tuple[str, ...] = ()  # the regimes of the exercise's hidden cases it lies in
    # what the answer and the expected answer were (``fingerprint``; "" where there was none, or
    # where the exercise asks for one value, not a function), and whether a debug exercise's
    # given function is already right on this case
    answer_key: str = ""
    expected_key: str = ""
    given_right: bool = False
    matched: tuple[str, ...] = ()  # the hints of every typical mistake this answer is, here
    case: Case | None = field(default=None, repr=False, compare=False)
    expected: object = field(default=None, repr=False, compare=False)


OTHER_CASES = "the cases in no regime"
CONSTANT = "it gives the same answer whatever the input"


@dataclass
class Judgement:
    key: str
    results: list[CaseResult] = field(default_factory=list)
    banned: list[str] = field(default_factory=list)
    missing: bool = False  # the notebook does not define the function
    by_regime: bool = False  # the grader's rule: an answer in one piece earns each regime it passes
    _settled: bool = field(default=False, repr=False, compare=False)  # settle_hints ran

    @property
    def passed(self) -> bool:
        return (not self.missing and not self.banned and bool(self.results)
                and all(r.passed for r in self.results))

    def parts(self) -> dict[str, bool]:
        """For a multi-part answer (cases with ``part``): each part, in the order asked, and
        whether every case that judges it passed. {} for an answer judged as one, unless
        ``by_regime``: then each regime of the exercise's hidden cases is a part, passed when
        every case in it (public or hidden) passed, and the cases in no regime one more."""
        if len(self.results) < 2:
            return {}
        if all(r.part for r in self.results):
            parts: dict[str, bool] = {}
            for r in self.results:
                parts[r.part] = parts.get(r.part, True) and r.passed
            return parts if len(parts) > 1 else {}
        if not self.by_regime or not any(r.regimes for r in self.results):
            return {}
        regimes: dict[str, bool] = {}
        sampled: set[str] = set()      # the regimes that hold a hidden case
        broken: set[str] = set()       # the regimes where a given function is wrong somewhere
        for r in self.results:
            for regime in r.regimes or (OTHER_CASES,):
                regimes[regime] = regimes.get(regime, True) and r.passed
                if r.hidden:
                    sampled.add(regime)
                if not r.given_right:
                    broken.add(regime)
        # a regime counts only where the grader's own draws test it (a table of the public
        # answers passes every public case), and, for a debug exercise, only where the given
        # function is wrong somewhere: a regime where it is already right is no regime of the
        # exercise
        if sampled:
            regimes = {k: v for k, v in regimes.items() if k in sampled}
        if any(r.given_right for r in self.results):
            regimes = {k: v for k, v in regimes.items() if k in broken}
        return regimes if len(regimes) > 1 else {}

    def settle_hints(self) -> None:
        """A failed case keeps a hint that names a typical mistake only where the answer is
        that mistake: equal to the mistake's answer on every case where the mistake is wrong
        (of its part, for a multi-part answer), never right where the mistake is wrong, and
        never for an answer that is the same whatever the input. An answer that is a
        mistake's on one case and right, or something else, where that mistake is wrong is
        not that mistake: the message alone says what differs (which entries, which regime).
        A second mistake of its own, on cases the first gets right, keeps both named."""
        if self._settled:
            return
        self._settled = True
        constant = self.non_answer() == CONSTANT
        for part in {r.part for r in self.results if not r.passed}:
            group = [r for r in self.results if r.part == part]
            hints = dict.fromkeys(h for r in group if not r.passed for h in r.matched)
            named = set() if constant else {h for h in hints if self._is(h, group)}
            for r in group:
                if r.passed or not r.named or r.hint in named:
                    continue
                kept = [h for h in r.matched if h in named]
                r.hint, r.named = (kept[0], True) if kept else ("", False)

    def _is(self, hint: str, group: list[CaseResult]) -> bool:
        """Whether the answer is the typical mistake ``hint`` names on ``group``: on every
        case, the mistake's answer is the student's, or the mistake is right there and the
        student is not (a mistake of the student's own), or the mistake is not defined there
        (it raises)."""
        try:
            exercise = get(self.key)
        except ValueError:    # an exercise made up in a test: only what was matched
            return all(hint in r.matched for r in group if not r.passed)
        mistakes = [m for m in exercise.mistakes if m.hint == hint]
        for r in group:
            if not r.passed and hint in r.matched:
                continue
            if r.case is None:
                return False
            verdicts = [_right(exercise, m, r) for m in mistakes]
            if not any(verdicts) and False in verdicts:   # None: not defined for that input
                return False
        return True

    def _by_regime(self, parts) -> bool:
        return bool(parts) and not all(r.part for r in self.results)

    def credit(self) -> float:
        """The share of the points earned: 1 when every case passes; for a multi-part answer,
        or by regime (``by_regime``), the share of its parts whose every case passes (the
        points split evenly among the parts); 0 otherwise, and always 0 with a refused call or
        no answer."""
        if self.missing or self.banned or not self.results:
            return 0.0
        if self.passed:
            return 1.0
        if self.non_answer():
            return 0.0
        parts = self.parts()
        return sum(parts.values()) / len(parts) if parts else 0.0

    def non_answer(self) -> str:
        """Why a partly right answer earns nothing, or "": it fails every hidden case (a table
        of the public answers), it fails a case of a central regime (the point of the
        exercise, ``exercise.hidden(central=...)``), or it gives one answer whatever the input
        (a constant) where the right answers differ."""
        hidden = [r for r in self.results if r.hidden]
        if hidden and not any(r.passed for r in hidden):
            return "it fails every hidden case"
        central = central_regimes(self.key)
        missed = next((regime for r in self.results if not r.passed for regime in r.regimes
                       if regime in central), None)
        if missed:
            return f"it fails the regime the exercise is about ({missed})"
        answers = {r.answer_key for r in self.results}
        if len(self.results) > 1 and len(answers) == 1 and "" not in answers and \
                len({r.expected_key for r in self.results}) > 1:
            return CONSTANT
        return ""

    @property
    def not_implemented(self) -> bool:
        return not self.banned and (self.missing or bool(self.results) and all(
            r.message == NOT_IMPLEMENTED for r in self.results))

    def reason(self) -> str:
        """One sentence: why the exercise failed, or "passed"."""
        if self.banned:  # a guard switched off first, then the package, then what came first
            what = next((h for h in self.banned if h.endswith(SWITCHES_OFF)),
                        next((h for h in self.banned if h.startswith("course_attn.")),
                             self.banned[0]))
            if what.endswith(SWITCHES_OFF):
                return (f"switches off the check of the operations it runs "
                        f"({what.removesuffix(SWITCHES_OFF).strip()}), which no exercise allows")
            if what.startswith(READ_AGAIN):
                name, _, how = what.removeprefix(READ_AGAIN).partition(": ")
                return (f"reads {name} a second time, in {how}, which this exercise does not "
                        f"allow: {_read_once_why(self.key)}")
            if what.startswith(TABLE_OF):
                return (f"makes {what}, which this exercise does not allow: it works tile by "
                        "tile, so what it holds grows as T, not T²")
            if what.startswith(COPY_OF):
                return (f"makes {what}, which this exercise does not allow: compute with the "
                        "tensors as they were given (views are free; a copy is not)")
            return (f"calls {what}, which this exercise does not allow: write the computation "
                    "yourself")
        if self.missing:
            return "not answered: the notebook does not define it"
        if self.not_implemented:
            return "not implemented"
        failed = [r for r in self.results if not r.passed]
        if not failed:
            return "passed"
        self.settle_hints()
        nothing = self.non_answer()
        nothing = f"earns nothing: {nothing}; " if nothing else ""
        # The case to show: one whose answer is a typical mistake's, so the hint names it,
        # the public ones first (the student can rerun them); else the first that failed.
        shown = min(failed, key=lambda r: (not r.named, r.hidden))
        where = (f"a hidden case ({'; '.join(shown.regimes)})" if shown.regimes else
                 "a hidden case") if shown.hidden else repr(shown.name)
        parts = self.parts()
        if self._by_regime(parts):
            wrong = "; ".join(regime for regime, passed in parts.items() if not passed)
            right = f"{sum(parts.values())} of {len(parts)} regimes right (failed: {wrong}); "
        else:
            right = f"{sum(parts.values())} of {len(parts)} parts right; " if parts else ""
        which = "first" if shown is failed[0] else "one that names the mistake"
        text = f"{nothing}{right}{len(failed)} of {len(self.results)} cases failed ({which}, " \
               f"{where}: {shown.message}"
        return text + (f"; hint: {shown.hint})" if shown.hint else ")")


def _read_once_why(key: str) -> str:
    try:
        return get(key).read_once_why
    except ValueError:
        return Exercise.read_once_why


# Hints for errors that say by themselves what the student did, whatever the exercise: shown in
# place of the case's own hint, which would speak of something else (issue 31: a `.view` after a
# transpose was told about causality).
NO_PROCESS = ("from its first graded exercise on, a graded notebook can start no process: no "
              "subprocess, multiprocessing or shell command")
ERROR_HINTS = (
    ("[Errno 1] Operation not permitted", NO_PROCESS),  # what confine.py's filter answers
    ("view size is not compatible with input tensor's size and stride",
     "your .view met a tensor whose memory is not laid out in that order (after a transpose or "
     "a permute, a view cannot merge those axes): .reshape copies where it must"),
)


def error_hint(error: dict) -> str:
    message = str(error.get("message") or "")
    return next((hint for sign, hint in ERROR_HINTS if sign in message), "")


def describe_error(error: dict) -> str:
    if error.get("type") == "NotImplementedError":
        return NOT_IMPLEMENTED
    line = f" (line {error['line']} of its cell)" if error.get("line") else ""
    message = str(error.get("message") or "").strip()
    if error.get("type") == "MemoryError" or any(sign in message for sign in OUT_OF_MEMORY):
        where = f", line {error['line']} of its cell" if error.get("line") else ""
        return f"ran out of memory ({error.get('type', 'Exception')}{where})"
    return f"{error.get('type', 'Exception')}: {message}{line}" if message else \
        f"{error.get('type', 'Exception')}{line}"


def _without_shared_nans(a, b):
    """``a`` and ``b`` with 0 where both hold NaN: floats, tensors of one shape and dtype, and
    tuples or lists of one length, item by item; anything else unchanged. The references never
    hold NaN, but typical mistakes do (exp overflowing to inf / inf, a row of -inf giving 0 / 0)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return 0.0, 0.0
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and \
            a.dtype == b.dtype and b.is_floating_point():
        both = a.isnan() & b.isnan()
        if both.any():
            device = getattr(a, "grading_device", None)
            a, b = a.masked_fill(both, 0.0), b.masked_fill(both, 0.0)
            if device is not None:
                a.grading_device = device
    elif isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b):
        pairs = [_without_shared_nans(x, y) for x, y in zip(a, b)]
        a, b = type(a)(x for x, _ in pairs), type(b)(y for _, y in pairs)
    return a, b


def same_answer(exercise: Exercise, a, b, case: Case | None = None) -> bool:
    """Whether ``exercise.compare`` accepts ``a`` for ``b``, NaN matching NaN: how a student's
    wrong answer is recognised as a typical mistake's. With a ``case`` that judges one part of
    a multi-part answer (``Case.part``), only that part is compared, so each part's mistakes
    are named on their own, whatever else the answer gets wrong."""
    a, b = _without_shared_nans(a, b)
    try:
        exercise.compare(a, b, case)
        return True
    except Exception:
        return False


def name_the_mistake(exercise: Exercise, case: Case, value) -> str:
    """The hint of the first typical mistake whose answer for ``case`` equals ``value``, or "".
    Where several give the part of the answer that ``case`` judges, the first whose whole
    answer is the student's too."""
    return _mistakes_giving(exercise, case, value)[0]


def _mistakes_giving(exercise: Exercise, case: Case, value) -> tuple[str, tuple[str, ...]]:
    """The hint ``name_the_mistake`` names, and the hints of every mistake that gives
    ``value`` for ``case``."""
    matching = []
    for mistake in exercise.mistakes:
        try:
            wrong = mistake.fn(*case.args, **dict(case.kwargs))
        except Exception:
            continue
        if same_answer(exercise, value, wrong, case):
            matching.append((mistake, wrong))
    hints = tuple(dict.fromkeys(m.hint for m, _ in matching))
    if len(matching) > 1 and case.part:
        whole = [m for m, wrong in matching if same_answer(exercise, value, wrong)]
        if whole:
            return whole[0].hint, hints
    return (matching[0][0].hint if matching else ""), hints


def name_the_error(exercise: Exercise, case: Case, error: dict) -> str:
    """The hint of the first typical mistake that raises, on ``case``, the error the student's
    code raised (same type, same message): a ``.view`` after a transpose, a reduction without
    ``keepdim`` that cannot broadcast. "" if none does."""
    hints = _mistakes_raising(exercise, case, error)
    return hints[0] if hints else ""


def _mistakes_raising(exercise: Exercise, case: Case, error: dict) -> tuple[str, ...]:
    hints = []
    for mistake in exercise.mistakes:
        try:
            mistake.fn(*case.args, **dict(case.kwargs))
        except Exception as raised:
            if type(raised).__name__ == error.get("type") and \
                    str(raised).strip() == str(error.get("message") or "").strip():
                hints.append(mistake.hint)
    return tuple(dict.fromkeys(hints))


def tensor_pairs(value, expected, case: Case | None = None, where: str = "your result"):
    """Each tensor of ``value`` with the tensor in its place in ``expected``, and where it is
    (``"your result[1]['k']"``): tuples and lists item by item, dicts key by key (only the key
    that ``case`` judges, for a multi-part answer); [] where the two are not laid out alike."""
    if isinstance(value, torch.Tensor) and isinstance(expected, torch.Tensor):
        return [(where, value, expected)]
    if isinstance(value, (tuple, list)) and isinstance(expected, (tuple, list)):
        if len(value) != len(expected):
            return []
        items = [(f"{where}[{i}]", v, e) for i, (v, e) in enumerate(zip(value, expected))]
    elif isinstance(value, dict) and isinstance(expected, dict):
        keys = [case.part] if case is not None and case.part else list(expected)
        if any(key not in value or key not in expected for key in keys):
            return []
        items = [(f"{where}[{key!r}]", value[key], expected[key]) for key in keys]
    else:
        return []
    return [pair for item in items for pair in tensor_pairs(item[1], item[2], None, item[0])]


def dtype_hint(where: str, actual: torch.Tensor, expected: torch.Tensor) -> str:
    """The hint for a tensor of the wrong dtype, which says nothing of the values yet."""
    return (f"return {expected.dtype}, not {actual.dtype} (.to({expected.dtype}) converts "
            f"{where}): the values are compared once the dtype is right")


def not_computed(pairs) -> str:
    """What says that the answer could not be computed, for the first tensor of ``pairs``
    (``tensor_pairs``) that holds NaN or an infinity where the expected one is finite, the
    shapes and dtypes all right; "" if there is none."""
    if any(a.shape != b.shape or a.dtype != b.dtype for _, a, b in pairs):
        return ""
    for where, actual, expected in pairs:
        if not (actual.is_floating_point() or actual.is_complex()):
            continue
        try:
            finite = expected.isfinite()
            nan = int((actual.isnan() & finite).sum())
            inf = int((actual.isinf() & finite).sum())
        except Exception:  # another device, a meta or sparse tensor: the comparison's message
            return ""
        if nan or inf:
            held = "NaN or inf" if nan and inf else "NaN" if nan else "inf"
            return (f"{where} could not be computed in {nan + inf} of its {actual.numel()} "
                    f"entries: {held} where the expected ones are finite (0/0, inf - inf and "
                    "exp of a large number give these)")
    return ""


def judge_case(exercise: Exercise, case: Case, expected, answer: Answer,
               hidden: bool = False) -> CaseResult:
    """One case judged. A failed case's hint speaks only of what the student did: a typical
    mistake's, where the student's answer (or error) is that mistake's on this case; else the
    dtype's, where the dtype is what differs; else an error's own (``ERROR_HINTS``); else none,
    and the message alone says what differs. The case's own hint is for ``check()``'s table of
    a passed case's idea, never a guess at a failure. A hidden case that fails names the
    regimes it lies in."""
    name, part = case.name, case.part
    regimes = tuple(regime for regime, holds in hidden_regimes(exercise.key).items()
                    if _holds(holds, case))
    seen = dict(given_right=given_is_right(exercise, case, expected), case=case,
                expected=expected)
    if exercise.kind == "function" and answer.error is None and not answer.unsendable:
        seen.update(answer_key=fingerprint(answer.value), expected_key=fingerprint(expected))

    def failed(message, hint="", named=False):
        return CaseResult(name, False, message, hint, hidden, named, part, regimes, **seen)
    if answer.error is not None:
        if answer.error.get("type") == "NotImplementedError":
            return failed(describe_error(answer.error))
        matched = _mistakes_raising(exercise, case, answer.error)
        named = matched[0] if matched else ""
        seen["matched"] = matched
        return failed(describe_error(answer.error), named or error_hint(answer.error),
                      bool(named))
    if answer.unsendable:
        return failed(f"your function returned {answer.unsendable}, which is not a tensor, "
                      "number, string or list of them")
    try:
        exercise.compare(answer.value, expected, case)
    except AssertionError as error:
        named, seen["matched"] = _mistakes_giving(exercise, case, answer.value)
        pairs = tensor_pairs(answer.value, expected, case)
        wrong_dtype = next(((where, a, b) for where, a, b in pairs if a.dtype != b.dtype), None)
        hint = dtype_hint(*wrong_dtype) if wrong_dtype is not None else ""
        return failed(not_computed(pairs) or str(error) or "wrong answer", named or hint,
                      bool(named))
    except Exception as error:  # an answer of a shape the comparison did not foresee
        return failed(f"your answer could not be compared: {error}")
    if answer.mutated_argument is not None:
        return failed(f"your function changed its argument {answer.mutated_argument + 1} in "
                      "place", "compute a new tensor or list instead of writing into the input")
    return CaseResult(name, True, hint=case.hint, hidden=hidden, part=part, regimes=regimes,
                      **seen)


def _right(exercise: Exercise, mistake, result: CaseResult) -> bool | None:
    """Whether ``mistake`` answers ``result``'s case right; None where it raises (a mistake
    declared for some inputs only, as a formula of a plain model is)."""
    case = result.case
    try:
        value = mistake.fn(*copy.deepcopy(case.args), **copy.deepcopy(dict(case.kwargs)))
    except Exception:
        return None
    return same_answer(exercise, value, result.expected, case)


def fingerprint(value) -> str:
    """A digest of ``value`` as the grader receives it (so two equal answers have one digest);
    "" for a value that cannot be sent."""
    try:
        data = json.dumps(encode(value), sort_keys=True)
    except Exception:
        return ""
    return hashlib.sha256(data.encode()).hexdigest()


def given_is_right(exercise: Exercise, case: Case, expected) -> bool:
    """Whether a debug exercise's given function (``Exercise.given``) already answers ``case``
    right; False for an exercise with none."""
    if exercise.given is None:
        return False
    try:
        value = exercise.given(*copy.deepcopy(case.args), **copy.deepcopy(dict(case.kwargs)))
    except Exception:
        return False
    return same_answer(exercise, value, expected, case)


def _holds(predicate, case) -> bool:
    try:
        return bool(predicate(case))
    except Exception:
        return False


def format_judgement(judgement: Judgement) -> str:
    """The table that ``check()`` prints."""
    if judgement.not_implemented:
        return f"{judgement.key}: not answered yet ({len(judgement.results)} checks waiting)"
    passed = sum(r.passed for r in judgement.results)
    judgement.settle_hints()
    if judgement.banned:  # failed first: the checks below cannot make up for it
        lines = [f"{judgement.key}: failed: it {judgement.reason()}",
                 f"  (apart from that, {passed}/{len(judgement.results)} checks passed)"]
    else:
        lines = [f"{judgement.key}: {passed}/{len(judgement.results)} checks passed"]
        parts = judgement.parts()
        if parts and not all(parts.values()):
            lines[0] += (f"; parts right: {', '.join(k for k, ok in parts.items() if ok) or 'none'}"
                         f" ({sum(parts.values())} of {len(parts)}, each part graded on its own)")
    for r in judgement.results:
        lines.append(f"  {'✓' if r.passed else '✗'} {r.name}")
        if not r.passed:
            lines.append(f"      {r.message}")
            if r.hint:
                lines.append(f"      hint: {r.hint}")
    return "\n".join(lines)

"""Chapter 3's exercises: each typical mistake fails the case meant for it with its own hint, and a
banned call is reported by name. What every exercise must satisfy (the reference and the
solution pass public and hidden cases, a stub is "not answered yet", every declared mistake
names itself) is tested once, for all chapters, in test_exercises_conformance.py.

The wrong solutions below are written as a student would write them; each test names the case
it must fail and a fragment of the hint it must get.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

import course_attn
from course_attn.grading import get, run_exercise
from course_attn.grading.exercise import hidden_cases

from check_support import (assert_banned, assert_fails, assert_fails_on_every_seed,
                           assert_fails_unnamed, results)


# --- solutions as in solutions/03_masking.ipynb ---------------------------------------------------

def causal_mask(tq, tk):
    query_positions = torch.arange(tq)[:, None] + (tk - tq)
    return torch.arange(tk)[None, :] <= query_positions


def padding_mask(lengths, t):
    return (torch.arange(t, device=lengths.device)[None, :] < lengths[:, None])[:, None, None, :]


def masked_attention(q, k, v, mask):
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return weights.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0) @ v


def document_mask(doc_ids):
    same_document = doc_ids[:, :, None] == doc_ids[:, None, :]
    not_padding = (doc_ids >= 0)[:, :, None]
    t = doc_ids.shape[-1]
    return (same_document & not_padding & causal_mask(t, t))[:, None]


def fp16_fill(dtype, fill, scores):
    bits, largest = {"float16": (10, 65504.0), "float32": (23, 3.4028234663852886e38)}[dtype]

    def in_dtype(x):
        if math.isinf(x) or x == 0:
            return x
        spacing = 2.0 ** (math.frexp(x)[1] - 1 - bits)
        rounded = round(x / spacing) * spacing
        return rounded if abs(rounded) <= largest else math.copysign(math.inf, x)

    cast = in_dtype(fill)
    row = [in_dtype(cast + s) for s in scores]
    top = max(row)
    if top == -math.inf:
        dead_row = [math.nan] * len(scores)
    else:
        e = [math.exp(x - top) for x in row]
        dead_row = [w / sum(e) for w in e]
    return {"cast": cast,
            "masked_fill": "error" if math.isfinite(fill) and abs(fill) > largest else "fills",
            "dead_row": dead_row}


@pytest.mark.parametrize("key, fn", [
    ("ch03.causal_mask", causal_mask), ("ch03.padding_mask", padding_mask),
    ("ch03.masked_attention", masked_attention), ("ch03.document_mask", document_mask),
    ("ch03.fp16_fill", fp16_fill)])
def test_the_notebooks_solutions_pass_with_the_watch_on(key, fn):
    for cases in [None] + [hidden_cases(key, seed) or None for seed in range(5)]:
        judgement = run_exercise(get(key), fn, cases)
        assert judgement.passed, (judgement.banned, [(r.name, r.message) for r in
                                                     judgement.results if not r.passed])


# --- causal_mask -------------------------------------------------------------------------------

def test_causal_mask_mistakes():
    key, square = "ch03.causal_mask", "square, Tq=Tk=4"
    fewer = "fewer queries than keys, Tq=3, Tk=6"
    assert_fails(key, lambda tq, tk: torch.ones(tq, tk, dtype=torch.bool).tril(), fewer,
                 hint="aligned top-left")
    assert_fails(key, lambda tq, tk: torch.ones(tq, tk, dtype=torch.bool).triu(), square,
                 hint="the wrong triangle")
    assert_fails(key, lambda tq, tk: torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq - 1),
                 square, hint="leaves out the diagonal")
    assert_fails(key, lambda tq, tk: torch.ones(tq, tk, dtype=torch.bool).triu(tk - tq + 1),
                 square, hint="may NOT attend")
    assert_fails(key, lambda tq, tk: torch.ones(tq, tk).tril(tk - tq), square,
                 hint="0/1 numbers", message="dtype")
    assert_fails(key, lambda tq, tk: torch.zeros(tq, tk).masked_fill(
        ~causal_mask(tq, tk), float("-inf")), square, hint="additive float mask")


@pytest.mark.filterwarnings("ignore:Lower right causal bias")
def test_a_mask_wrong_only_past_a_gap_of_three_fails_on_every_seed():
    """Issue 31: aligned top-left only when Tq - Tk > 3, it passed 2 gradings in 5 when one
    random gap was drawn in the regime Tq > Tk + 1; the regime's largest gap is now always
    drawn. And a mask wrong only when Tq = Tk - 1 fails on every seed too."""
    def past_three(tq, tk):
        return torch.ones(tq, tk, dtype=torch.bool).tril(0 if tq - tk > 3 else tk - tq)

    def one_short(tq, tk):
        return torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq + (tq == tk - 1))

    for wrong in (past_three, one_short):
        assert_fails_on_every_seed("ch03.causal_mask", wrong)


def test_causal_mask_may_not_call_a_ready_made_mask():
    assert_banned("ch03.causal_mask", lambda tq, tk: course_attn.causal_mask(tq, tk),
                  "course_attn")

    def from_pytorch(tq, tk):
        return causal_lower_right(tq, tk)._materialize()
    assert_banned("ch03.causal_mask", from_pytorch, "causal_lower_right")


# --- padding_mask ------------------------------------------------------------------------------

def test_padding_mask_mistakes():
    key, first = "ch03.padding_mask", "lengths [3, 1, 4], T=5"
    assert_fails(key, lambda lengths, t: torch.arange(t)[None, :] < lengths[:, None], first,
                 hint="shape (B, T)", message="shape")
    assert_fails(key, lambda lengths, t: ~padding_mask(lengths, t), first,
                 hint="True on the padding")
    assert_fails(key, lambda lengths, t: (torch.arange(t)[None, :] <= lengths[:, None])
                 [:, None, None], "a length of 0 and a length of T", hint="not j <= lengths[b]")
    assert_fails(key, lambda lengths, t: (torch.arange(t)[None, :] < lengths[:, None] - 1)
                 [:, None, None], first, hint="not j < lengths[b] - 1")
    assert_fails(key, lambda lengths, t: padding_mask(lengths, t).transpose(-2, -1), first,
                 hint="it hides queries")


def test_padding_mask_may_not_call_the_package():
    assert_banned("ch03.padding_mask", course_attn.padding_mask, "course_attn")


# --- masked_attention --------------------------------------------------------------------------

def _scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


def test_masked_attention_mistakes():
    key = "ch03.masked_attention"
    empty = "a sequence of length 0: fully masked rows give zeros, not NaN"
    first = "causal (T, T) mask, B=2, H=3, T=5, D=8"

    def fill(value):
        return lambda q, k, v, mask: torch.softmax(_scores(q, k).masked_fill(~mask, value),
                                                   dim=-1) @ v

    assert_fails(key, fill(-1e9), empty, hint="gets the mean of the values")
    assert_fails(key, fill(torch.finfo(torch.float32).min), empty,
                 hint="gets the mean of the values")
    assert_fails(key, fill(float("-inf")), empty, hint="gives NaN", message="NaN")
    assert_fails(key, lambda q, k, v, mask: masked_attention(q, k, v, ~mask), first,
                 hint="where the mask is True")
    assert_fails(key, lambda q, k, v, mask: masked_attention(q * math.sqrt(q.shape[-1]), k, v,
                                                             mask), first, hint="did not scale")
    assert_fails(key, lambda q, k, v, mask: torch.softmax(_scores(q, k) + mask.float(), dim=-1)
                 @ v, first, hint="as numbers (0/1)")
    assert_fails(key, lambda q, k, v, mask: torch.softmax(_scores(q, k), dim=-1) * mask @ v,
                 first, hint="after the softmax")
    assert results(key, fill(-1e9))[first].passed  # the fill only matters for empty rows


def test_masked_attention_may_not_call_a_library_attention():
    one_line = lambda q, k, v, mask: F.scaled_dot_product_attention(  # noqa: E731
        q, k, v, attn_mask=mask).nan_to_num(0.0)
    assert_banned("ch03.masked_attention", one_line,
                  "torch.nn.functional.scaled_dot_product_attention")
    assert_banned("ch03.masked_attention", lambda q, k, v, mask:
                  course_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                  "course_attn")


# --- document_mask -----------------------------------------------------------------------------

def test_the_document_mask_of_the_task_is_the_one_drawn_there():
    drawn = ["1.....", "11....", "111...", "...1..", "...11.", "......"]
    mask = get("ch03.document_mask").reference(torch.tensor([[0, 0, 0, 1, 1, -1]]))[0, 0]
    assert ["".join("1" if x else "." for x in row) for row in mask.tolist()] == drawn


def test_the_document_mask_keeps_packed_documents_apart_in_attention():
    """Attention over a pack with the document mask equals attention over each document alone."""
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, -1, -1]])
    q, k, v = (torch.randn(1, 2, 10, 8, dtype=torch.float64) for _ in range(3))
    packed = masked_attention(q, k, v, document_mask(doc_ids))
    for start, end in ((0, 3), (3, 5), (5, 8)):
        alone = course_attn.scaled_dot_product_attention(
            q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], is_causal=True)
        torch.testing.assert_close(packed[:, :, start:end], alone)
    assert (packed[:, :, 8:] == 0).all()


def test_document_mask_mistakes():
    key, first = "ch03.document_mask", "three documents of lengths 3, 2, 3"
    padded = "padding (-1) at the end attends to nothing and is never attended to"

    def rule(fn):
        return lambda ids: fn(ids[:, :, None], ids[:, None, :],
                              causal_mask(ids.shape[1], ids.shape[1]))[:, None]

    assert_fails(key, rule(lambda qi, kj, causal: causal & (qi >= 0) & (kj >= 0)), first,
                 hint="earlier documents of the pack")
    assert_fails(key, rule(lambda qi, kj, causal: (qi == kj) & (qi >= 0)), first,
                 hint="later tokens of its own document")
    assert_fails(key, rule(lambda qi, kj, causal: (qi == kj) & causal), padded,
                 hint="padding positions (id -1)")
    assert_fails(key, rule(lambda qi, kj, causal: (qi == kj) & (qi >= 0) & causal.tril(-1)), first,
                 hint="leaves out the diagonal")
    assert_fails(key, lambda ids: ~document_mask(ids), first, hint="True where attention is "
                 "forbidden")
    assert_fails(key, lambda ids: document_mask(ids)[:, 0], first, hint="shape (B, T, T)")
    # "the same or an earlier id" is the causal mask while ids increase; with ids out of order
    # no typical mistake gives its answer: no hint, the message says how many entries differ
    assert_fails_unnamed(key, rule(lambda qi, kj, causal: (kj <= qi) & causal & (kj >= 0)),
                         "ids that are not 0, 1, 2 (7, 3, 12), int32", message="entries differ")


def test_document_mask_may_not_call_the_package():
    def with_the_package(ids):
        return document_mask(ids) & course_attn.causal_mask(ids.shape[1])
    assert_banned("ch03.document_mask", with_the_package, "course_attn")


# --- fp16_fill ---------------------------------------------------------------------------------

FILL = "dtype={}, fill={}, scores={}"
CAST, MASKED_FILL, DEAD_ROW = ("(a) torch.tensor(fill).to(dtype)",
                               "(b) s.masked_fill(~allowed, fill)",
                               "(c) torch.softmax(s + torch.tensor(fill).to(dtype), dim=-1), every "
                               "key masked")
CHAPTER_SCORES = (-10.0, 5.0, -20.0, 2.0)


def case(question, dtype, fill, scores=CHAPTER_SCORES):
    return f"{question} ({FILL.format(dtype, fill, scores)})"


def run_in_torch(dtype, fill, scores):
    """The three lines of the task, run here (the reference runs them its own way)."""
    d = getattr(torch, dtype)
    s = torch.tensor(scores).to(d)
    try:
        s.masked_fill(torch.tensor([True] + [False] * (len(scores) - 1)), fill)
        masked = "fills"
    except RuntimeError:
        masked = "error"
    cast = torch.tensor(fill).to(d)
    return cast.item(), masked, torch.softmax(s + cast, dim=-1)


def fill_sizes(seeds):
    exercise = get("ch03.fp16_fill")
    cases = exercise.public_cases() + [c for seed in seeds
                                       for c in hidden_cases("ch03.fp16_fill", seed)]
    return [dict(kw) for kw in {tuple(c.kwargs.items()): None for c in cases}]


def test_the_fill_predictions_are_what_pytorch_does():
    """On the public arguments and on the hidden ones of several seeds, the reference is what
    the task's lines give when they are run."""
    reference = get("ch03.fp16_fill").reference
    sizes = fill_sizes(range(10))
    assert len(sizes) > 6 + 7 * 5
    for size in sizes:
        expected = reference(**size)
        cast, masked, row = run_in_torch(**size)
        assert expected["cast"] == cast or (math.isnan(cast) and math.isnan(expected["cast"]))
        assert expected["masked_fill"] == masked
        torch.testing.assert_close(torch.tensor(expected["dead_row"], dtype=row.dtype), row,
                                   equal_nan=True)


def test_the_chapters_facts_behind_the_public_predictions():
    """The public answers checked against the facts they rest on (sections 7 and 8)."""
    reference = get("ch03.fp16_fill").reference
    low16 = torch.finfo(torch.float16).min
    first = reference("float16", -1e9, CHAPTER_SCORES)
    assert first["cast"] == -math.inf and first["masked_fill"] == "error"
    assert all(math.isnan(w) for w in first["dead_row"])
    assert torch.tensor(low16 - 15.0).half().item() == low16       # within half a spacing of 32
    assert torch.tensor(low16 - 16.0).half().item() == -math.inf   # rounds past the end
    assert reference("float16", low16, CHAPTER_SCORES)["dead_row"] == pytest.approx(
        [1 / 3, 1 / 3, 0.0, 1 / 3], abs=1e-3)
    assert torch.tensor(-1e9 - 31.0).item() == -1e9                # float32 spacing 64 near 1e9
    assert reference("float32", -1e9, CHAPTER_SCORES)["dead_row"] == [0.25] * 4
    assert reference("float32", -math.inf, (1.5, -0.5))["masked_fill"] == "fills"


def test_fp16_fill_is_a_choice_among_named_options():
    from course_attn.grading.ch03 import MASKED_FILL_OPTIONS
    assert MASKED_FILL_OPTIONS == ("error", "fills")
    key = "ch03.fp16_fill"
    fill = case(MASKED_FILL, "float16", -1e9)

    def answering(masked_fill):
        return lambda **kw: {**fp16_fill(**kw), "masked_fill": masked_fill}

    # padding is forgiven, and nothing else
    assert results(key, answering(" error\n"))[fill].passed
    for answer in ("no error: masked_fill just writes -inf", "Error", "RuntimeError", "raises",
                   "error!", "an error", "fills or error"):
        assert_fails(key, answering(answer), fill,
                     message="is not one of the options 'error', 'fills'")
    assert_fails(key, answering(None), fill, message="is not one of the options")
    # an option, but the wrong one: only that
    assert_fails(key, answering("fills"), fill, hint="masked_fill rounds its value",
                 message="your prediction 'masked_fill' is not what PyTorch gives")


def test_fp16_fill_mistakes():
    key = "ch03.fp16_fill"

    def predicting(rule):
        """fp16_fill with the parts that rule(dtype, fill, scores, right) returns changed."""
        def fn(dtype, fill, scores):
            right = fp16_fill(dtype, fill, scores)
            return {**right, **rule(dtype, fill, scores, right)}
        return fn

    def when(condition, wrong):
        """The dead row ``wrong(scores)`` where ``condition(fill, right)``, else the right one."""
        return predicting(lambda dtype, fill, scores, right: {
            "dead_row": wrong(scores) if condition(fill, right) else right["dead_row"]})

    def overflowed(fill, right):
        return math.isfinite(fill) and math.isinf(right["cast"])

    def finite(fill, right):
        return math.isfinite(right["cast"])

    def uniform(scores):
        return [1 / len(scores)] * len(scores)

    assert_fails(key, predicting(lambda dtype, fill, scores, right: {"cast": fill}),
                 case(CAST, "float16", -1e9), hint="survives the cast")
    assert_fails(key, predicting(lambda dtype, fill, scores, right: {
        "cast": -65504.0 if overflowed(fill, right) else right["cast"]}),
        case(CAST, "float16", -1e9), hint="saturates")
    assert_fails(key, predicting(lambda dtype, fill, scores, right: {"masked_fill": "fills"}),
                 case(MASKED_FILL, "float16", -1e9), hint="masked_fill rounds")
    assert_fails(key, predicting(lambda dtype, fill, scores, right: {
        "masked_fill": "error" if math.isinf(fill) else right["masked_fill"]}),
        case(MASKED_FILL, "float32", -math.inf, (1.5, -0.5, 2.0)), hint="refuses -inf")
    zeros = when(lambda fill, right: math.isinf(right["cast"]), lambda s: [0.0] * len(s))
    assert_fails(key, zeros, case(DEAD_ROW, "float16", -1e9), hint="guarded softmax")
    assert_fails(key, zeros, case(DEAD_ROW, "float32", -math.inf, (1.5, -0.5, 2.0)),
                 hint="guarded softmax")
    assert_fails(key, when(overflowed, uniform), case(DEAD_ROW, "float16", -1e9),
                 hint="stays a finite number in this dtype")
    # the misconception carried through: -1e9 survives, so the row is uniform
    survives = predicting(lambda dtype, fill, scores, right: {
        "cast": fill, "dead_row": uniform(scores) if overflowed(fill, right)
        else right["dead_row"]})
    assert_fails(key, survives, case(DEAD_ROW, "float16", -1e9), hint="survives the cast")
    for dtype, fill, scores in (("float16", -65504.0, CHAPTER_SCORES),
                                ("float32", -1e4, (1.5, -0.5, 2.0, 0.5)),
                                ("float16", -1e4, (5.5, -3.5, 1.5))):
        assert_fails(key, when(finite, uniform), case(DEAD_ROW, dtype, fill, scores),
                     hint="every fill + s rounds back")
    for dtype, fill, scores in (("float16", -65504.0, CHAPTER_SCORES),
                                ("float32", -1e9, CHAPTER_SCORES),
                                ("float16", -1e4, (5.5, -3.5, 1.5))):
        unchanged = [math.exp(s) / sum(math.exp(x) for x in scores) for s in scores]
        assert_fails(key, when(finite, lambda s: unchanged),
                     case(DEAD_ROW, dtype, fill, scores), hint="changes nothing")
    for wrong in (math.nan, 0.0):
        assert_fails(key, when(lambda fill, right: True, lambda s: [wrong] * len(s)),
                     case(DEAD_ROW, "float32", -1e9), hint="0/0 only when")
    # two wrong answers at once: each question's case says which is wrong
    two = results(key, predicting(lambda dtype, fill, scores, right: {
        "cast": -65504.0 if overflowed(fill, right) else right["cast"],
        "dead_row": uniform(scores) if finite(fill, right) else right["dead_row"]}))
    assert [name for name, r in two.items() if not r.passed] == [
        case(CAST, "float16", -1e9), case(DEAD_ROW, "float16", -65504.0),
        case(DEAD_ROW, "float32", -1e4, (1.5, -0.5, 2.0, 0.5)),
        case(DEAD_ROW, "float16", -1e4, (5.5, -3.5, 1.5))]
    assert_fails(key, lambda **kw: [-math.inf, "error"], case(CAST, "float16", -1e9),
                 message="should return a dict")
    assert_fails(key, lambda **kw: {**fp16_fill(**kw), "dead_row": [0.25] * 3},
                 case(DEAD_ROW, "float32", -1e9), message="a list of 4 floats, one per score")


def test_fp16_fill_never_shows_the_right_answer():
    key = "ch03.fp16_fill"
    wrong = {"cast": 12345.0, "masked_fill": "fills", "dead_row": [12345.0] * 4}
    for result in run_exercise(get(key), lambda **kw: wrong).results:
        if result.passed:       # "fills" is right where the fill fits
            continue
        assert "is not what PyTorch gives" in result.message or "a list of" in result.message
        for answer in ("inf", "nan", "error", "0.25", "0.333"):
            assert answer not in result.message


def test_pasting_the_public_predictions_fails_the_hidden_cases_of_every_seed():
    """Predictions worked out once (by running the lines in another cell) and pasted as
    constants get nothing right for sure on the arguments the grader draws."""
    exercise = get("ch03.fp16_fill")
    for public in fill_sizes(()):
        pasted = fp16_fill(**public)

        def constant(**arguments):
            return dict(pasted)
        assert run_exercise(exercise, constant, watch_banned=False).results
        for seed in range(20):
            assert not run_exercise(exercise, constant, hidden_cases("ch03.fp16_fill", seed),
                                    watch_banned=False).passed, (public, seed)


def test_fp16_fill_is_a_prediction_not_a_computation():
    def computed(dtype, fill, scores):
        cast = torch.tensor(fill).to(getattr(torch, dtype))
        return {**fp16_fill(dtype, fill, scores), "cast": cast.item(),
                "dead_row": torch.softmax(torch.tensor(scores).to(cast.dtype) + cast,
                                          -1).tolist()}
    assert run_exercise(get("ch03.fp16_fill"), computed, watch_banned=False).passed
    assert_banned("ch03.fp16_fill", computed, "torch.tensor")

"""Chapter 3's exercises: each typical mistake fails the case meant for it with its own hint, and a
banned call is reported by name. What every exercise must satisfy (the reference and the
solution pass public and hidden cases, a stub is "not answered yet", every declared mistake
names itself) is tested once, for all chapters, in test_exercises_conformance.py.

The wrong solutions below are written as a student would write them; each test names the case
it must fail and a fragment of the hint it must get.
"""

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

import course_attn
from course_attn.grading import get, run_exercise
from course_attn.grading.exercise import hidden_cases, load_hidden

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from check_support import assert_banned, assert_fails, results  # noqa: E402

load_hidden(Path(__file__).resolve().parents[1] / "solutions")


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


def fp16_fill():
    return {"minus_1e9_in_fp16": -math.inf, "masked_fill_fp16": "error",
            "dead_row_fp16_minus_1e9": [math.nan] * 4,
            "dead_row_fp16_min": [1 / 3, 1 / 3, 0.0, 1 / 3],
            "dead_row_fp32_minus_1e9": [0.25] * 4}


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
    # no typical mistake gives its answer, and the case's own hint says what is wrong
    assert_fails(key, rule(lambda qi, kj, causal: (kj <= qi) & causal & (kj >= 0)),
                 "ids that are not 0, 1, 2 (7, 3, 12), int32", hint="only equality of ids")


def test_document_mask_may_not_call_the_package():
    def with_the_package(ids):
        return document_mask(ids) & course_attn.causal_mask(ids.shape[1])
    assert_banned("ch03.document_mask", with_the_package, "course_attn")


# --- fp16_fill ---------------------------------------------------------------------------------

def test_the_fp16_predictions_are_what_pytorch_does():
    """The reference computes them; here they are checked against the facts they rest on."""
    expected = get("ch03.fp16_fill").reference()
    assert expected["minus_1e9_in_fp16"] == -math.inf
    assert expected["masked_fill_fp16"] == "error"
    assert all(math.isnan(w) for w in expected["dead_row_fp16_minus_1e9"])
    low = torch.finfo(torch.float16).min
    assert torch.tensor(low - 15.0).half().item() == low       # within half a spacing of 32
    assert torch.tensor(low - 16.0).half().item() == -math.inf  # rounds past the end
    assert expected["dead_row_fp16_min"] == pytest.approx([1 / 3, 1 / 3, 0.0, 1 / 3], abs=1e-3)
    assert torch.tensor(-1e9 - 31.0).item() == -1e9             # float32 spacing 64 near 1e9
    assert expected["dead_row_fp32_minus_1e9"] == [0.25] * 4


def test_fp16_fill_mistakes():
    key = "ch03.fp16_fill"

    def predicting(**wrong):
        return lambda: {**fp16_fill(), **wrong}

    assert_fails(key, predicting(minus_1e9_in_fp16=-1e9), "(a) torch.tensor(-1e9).half()",
                 hint="-1e9 survives the cast")
    assert_fails(key, predicting(minus_1e9_in_fp16=-65504.0), "(a) torch.tensor(-1e9).half()",
                 hint="saturates")
    assert_fails(key, predicting(masked_fill_fp16=[-10.0, -math.inf, -20.0, 2.0]),
                 "(b) scores.half().masked_fill(~allowed, -1e9)", hint="masked_fill rounds")
    assert_fails(key, predicting(dead_row_fp16_minus_1e9=[0.0] * 4),
                 "(c) a fully masked row in float16, fill -1e9", hint="guarded softmax")
    assert_fails(key, predicting(dead_row_fp16_minus_1e9=[0.25] * 4),
                 "(c) a fully masked row in float16, fill -1e9", hint="a uniform row, as in "
                 "float32")
    # the misconception carried through: -1e9 survives, so the row is uniform
    wrong = predicting(minus_1e9_in_fp16=-1e9, dead_row_fp16_minus_1e9=[0.25] * 4)
    assert_fails(key, wrong, "(c) a fully masked row in float16, fill -1e9",
                 hint="-1e9 survives the cast")
    assert_fails(key, predicting(dead_row_fp16_min=[0.25] * 4),
                 "(d) a fully masked row in float16, fill finfo(float16).min",
                 hint="every min + s rounds back")
    scores = [-10.0, 5.0, -20.0, 2.0]
    unchanged = [math.exp(s) / sum(math.exp(x) for x in scores) for s in scores]
    assert_fails(key, predicting(dead_row_fp16_min=unchanged),
                 "(d) a fully masked row in float16, fill finfo(float16).min",
                 hint="in float16 each min + s")
    assert_fails(key, predicting(dead_row_fp32_minus_1e9=unchanged),
                 "(e) a fully masked row in float32, fill -1e9", hint="in float32 each -1e9 + s")
    assert_fails(key, predicting(dead_row_fp32_minus_1e9=[math.nan] * 4),
                 "(e) a fully masked row in float32, fill -1e9", hint="-1e9 is finite in float32")
    # two wrong answers at once: each question's case says which is wrong
    two = results(key, predicting(minus_1e9_in_fp16=-65504.0, dead_row_fp16_min=[0.25] * 4))
    assert [name for name, r in two.items() if not r.passed] == [
        "(a) torch.tensor(-1e9).half()", "(d) a fully masked row in float16, fill "
        "finfo(float16).min"]
    assert_fails(key, lambda: [-math.inf, "error"], "(a) torch.tensor(-1e9).half()",
                 message="should return a dict")


def test_fp16_fill_never_shows_the_right_answer():
    key = "ch03.fp16_fill"
    for result in run_exercise(get(key), lambda: {k: 12345.0 for k in
                                                  get(key).reference()}).results:
        assert not result.passed and "is not what PyTorch gives" in result.message
        for answer in ("inf", "nan", "error", "0.25", "0.333"):
            assert answer not in result.message


def test_fp16_fill_is_a_prediction_not_a_computation():
    def computed():
        scores = torch.tensor([-10.0, 5.0, -20.0, 2.0])
        return {**fp16_fill(), "minus_1e9_in_fp16": torch.tensor(-1e9).half().item(),
                "dead_row_fp16_min": torch.softmax(scores.half() - 65504, -1).tolist()}
    assert run_exercise(get("ch03.fp16_fill"), computed, watch_banned=False).passed
    assert_banned("ch03.fp16_fill", computed, "torch.tensor")

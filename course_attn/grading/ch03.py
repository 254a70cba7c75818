"""Exercises of Chapter 3, masking.

    ch03.causal_mask        causal_mask(tq, tk) -> bool (Tq, Tk), bottom-right aligned
    ch03.padding_mask       padding_mask(lengths (B,), t) -> bool (B, 1, 1, T), True on real tokens
    ch03.masked_attention   masked_attention(q, k, v, mask) -> (B, H, Tq, Dv):
                            softmax(q kᵀ/√D, forbidden keys removed) v, with q (B, H, Tq, D),
                            k (B, H, Tk, D), v (B, H, Tk, Dv), a bool mask broadcastable to
                            (B, H, Tq, Tk); a row with no allowed key gives zeros
    ch03.document_mask      document_mask(doc_ids (B, T)) -> bool (B, 1, T, T): documents packed
                            in one sequence, causal inside each, nothing across; -1 is padding
    ch03.fp16_fill          fp16_fill(dtype, fill, scores) -> dict: predictions of what a
                            dtype ("float16" or "float32") does to a fill value: the cast, an
                            option of MASKED_FILL_OPTIONS for masked_fill, and the softmax of a
                            fully masked row (predict: compared with what PyTorch computes)

References: ``course_attn.causal_mask``, ``course_attn.padding_mask`` and
``course_attn.scaled_dot_product_attention``; the document mask from ``causal_mask``; the fill
predictions computed by PyTorch, run for the dtype, fill and scores of each case.
"""

import math

import torch

from ..attention import scaled_dot_product_attention
from ..masks import causal_mask, padding_mask
from .cases import Questions, as_number, expect_tensor, randn, random_mask
from .exercise import Case, Exercise, Mistake, register
from .operations import ELEMENTARY, NONE, NO_LIBRARY_ATTENTION, NO_LIBRARY_MASKS, SOFTMAX



def _causal_cases():
    yield Case("square, Tq=Tk=4", (4, 4),
               hint="query i may attend to keys 0..i: True on and below the diagonal")
    yield Case("Tq=Tk=1", (1, 1), hint="a single query may attend to its own key")
    yield Case("fewer queries than keys, Tq=3, Tk=6", (3, 6),
               hint="bottom-right: query i sits at position Tk - Tq + i, so the last query "
                    "sees every key")
    yield Case("one new query, many cached keys, Tq=1, Tk=5", (1, 5),
               hint="a single query is the last position: it may attend to all Tk keys")
    yield Case("more queries than keys, Tq=5, Tk=3", (5, 3),
               hint="the first Tq - Tk queries sit before every key: their rows are all False")


register(Exercise(
    key="ch03.causal_mask", function="causal_mask", reference=causal_mask,
    ops=ELEMENTARY,
    cases=_causal_cases, compare=expect_tensor, banned=NO_LIBRARY_MASKS,
    mistakes=(
        Mistake("your mask is aligned top-left (query i sees keys 0..i, PyTorch's is_causal); "
                "here query i sits at position Tk - Tq + i",
                lambda tq, tk: causal_mask(tq, tk, align="top_left")),
        Mistake("your mask is the wrong triangle: True must be on and below the diagonal (keys "
                "not after the query)",
                lambda tq, tk: causal_mask(tq, tk).flip(0).flip(1)),
        Mistake("your mask leaves out the diagonal: a query may attend to its own position",
                lambda tq, tk: torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq - 1)),
        Mistake("your mask is True where the query may NOT attend (nn.MultiheadAttention's "
                "convention); here True means may attend",
                lambda tq, tk: ~causal_mask(tq, tk)),
        Mistake("your mask holds 0/1 numbers: compare positions to get a bool tensor",
                lambda tq, tk: causal_mask(tq, tk).long()),
        Mistake("your mask holds 0/1 numbers: compare positions to get a bool tensor",
                lambda tq, tk: causal_mask(tq, tk).float()),
        Mistake("your mask is an additive float mask (0 / -inf): return a bool mask, True where "
                "the query may attend",
                lambda tq, tk: torch.zeros(tq, tk).masked_fill(~causal_mask(tq, tk),
                                                                float("-inf"))),
    ),
))


def _padding_cases():
    yield Case("lengths [3, 1, 4], T=5", (torch.tensor([3, 1, 4]), 5),
               hint="key j of sequence b is a real token exactly when j < lengths[b]")
    yield Case("a length of 0 and a length of T", (torch.tensor([0, 6, 2]), 6),
               hint="length 0 masks every key of that sequence; length T masks none")
    yield Case("B=1, T=1", (torch.tensor([1]), 1), hint="one sequence of one real token: all True")
    generator = torch.Generator().manual_seed(3)
    yield Case("8 random lengths in [0, 10], T=10",
               (torch.randint(0, 11, (8,), generator=generator), 10),
               hint="build one row of positions 0..T-1 and compare it with every length at once")


register(Exercise(
    key="ch03.padding_mask", function="padding_mask", reference=padding_mask,
    ops=ELEMENTARY,
    cases=_padding_cases, compare=expect_tensor, banned=("course_attn",),
    mistakes=(
        Mistake("your mask has shape (B, T): add the two axes of size 1 in the middle, "
                "(B, 1, 1, T), so it broadcasts over heads and queries",
                lambda lengths, t: padding_mask(lengths, t)[:, 0, 0, :]),
        Mistake("your mask is True on the padding: True must mark the real tokens (j < length)",
                lambda lengths, t: ~padding_mask(lengths, t)),
        Mistake("off by one: key j is real when j < lengths[b], not j <= lengths[b]",
                lambda lengths, t: (torch.arange(t)[None, :] <= lengths[:, None])[:, None, None]),
        Mistake("off by one: key j is real when j < lengths[b], not j < lengths[b] - 1",
                lambda lengths, t: (torch.arange(t)[None, :] < lengths[:, None] - 1)
                [:, None, None]),
        Mistake("your mask has shape (B, 1, T, 1): it hides queries; a padding mask hides keys, "
                "the last axis, (B, 1, 1, T)",
                lambda lengths, t: padding_mask(lengths, t).transpose(-2, -1)),
    ),
))


def _scores(q, k):
    return (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5


def _minus_1e9_attention(q, k, v, mask):
    return torch.softmax(_scores(q, k).masked_fill(~mask, -1e9), dim=-1) @ v


def _added_bool_attention(q, k, v, mask):
    return torch.softmax(_scores(q, k) + mask.to(q.dtype), dim=-1) @ v


def _masked_after_softmax(q, k, v, mask):
    return (torch.softmax(_scores(q, k), dim=-1) * mask) @ v


def _masked_cases():
    q, k, v = randn(2, 3, 5, 8, seed=30), randn(2, 3, 5, 8, seed=31), randn(2, 3, 5, 8, seed=32)
    yield Case("causal (T, T) mask, B=2, H=3, T=5, D=8", (q, k, v, causal_mask(5)),
               hint="scores = q kᵀ / sqrt(D); put -inf where the mask is False, then softmax")
    yield Case("padding mask (B, 1, 1, T), lengths [5, 3]",
               (q, k, v, padding_mask(torch.tensor([5, 3]), 5)),
               hint="the mask broadcasts against the scores (B, H, Tq, Tk); masked_fill does that")
    yield Case("a sequence of length 0: fully masked rows give zeros, not NaN",
               (q, k, v, padding_mask(torch.tensor([0, 4]), 5)),
               hint="a query with no allowed key must output zeros")
    q, k, v = randn(2, 2, 6, 8, seed=33), randn(2, 2, 4, 8, seed=34), randn(2, 2, 4, 3, seed=35)
    mask = random_mask(2, 1, 6, 4, seed=36)
    mask[0, 0, 2] = False
    mask[1, 0, 5] = False
    yield Case("Tq=6 != Tk=4, Dv=3, random mask with dead rows", (q, k, v, mask),
               hint="transpose only k's last two axes; the output's last size is v's, Dv")
    yield Case("T=1", (*(randn(1, 1, 1, 4, seed=s) for s in (37, 38, 39)),
                       torch.ones(1, 1, dtype=torch.bool)),
               hint="one query, one allowed key: the output is that key's value")
    # float64 (scores in the thousands, past exp's range): in float32, large scores carry rounding errors of ~1e-5 that any correct
    # order of operations (one query at a time, say) turns into output errors above float32's
    # default atol; this case is about overflow, not about rounding.
    yield Case("large scores (|q kᵀ/√D| in the thousands, float64)",
               (*(randn(1, 2, 6, 16, seed=s, scale=40.0, dtype=torch.float64)
                  for s in (40, 41, 42)), causal_mask(6)),
               hint="exp overflows for large scores: subtract each row's maximum before exp")
    yield Case("float64 in, float64 out, causal & padding",
               (*(randn(2, 2, 5, 8, seed=s, dtype=torch.float64) for s in (43, 44, 45)),
                causal_mask(5) & padding_mask(torch.tensor([5, 2]), 5)),
               hint="do not convert the inputs; let their dtype flow through")


register(Exercise(
    key="ch03.masked_attention", function="masked_attention",
    ops=ELEMENTARY | SOFTMAX,
    reference=lambda q, k, v, mask: scaled_dot_product_attention(q, k, v, attn_mask=mask),
    cases=_masked_cases, compare=expect_tensor, banned=NO_LIBRARY_ATTENTION,
    mistakes=(
        Mistake("a query that may attend to no key gets the mean of the values: filling "
                "forbidden scores with a large finite number (-1e9, finfo.min) makes such a row "
                "uniform, where zeros are due", _minus_1e9_attention),
        Mistake("a query that may attend to no key gives NaN: softmax of a row of -inf is 0/0; "
                "set such rows to zero",
                lambda q, k, v, mask: torch.softmax(
                    (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).masked_fill(
                        ~mask, float("-inf")), dim=-1) @ v),
        Mistake("you mask where the mask is True: True means the query may attend",
                lambda q, k, v, mask: scaled_dot_product_attention(q, k, v, attn_mask=~mask)),
        Mistake("you did not scale the scores by 1/sqrt(D)",
                lambda q, k, v, mask: scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                   scale=1.0)),
        Mistake("you added the bool mask to the scores as numbers (0/1): that only nudges the "
                "allowed keys up; forbidden scores must become -inf", _added_bool_attention),
        Mistake("you zeroed the forbidden weights after the softmax: the allowed weights then "
                "sum to less than 1; remove the forbidden scores before the softmax",
                _masked_after_softmax),
    ),
))


# --- ch03.document_mask: several documents packed into one sequence ----------------------------

def document_mask_reference(doc_ids):
    """(B, T) document ids, -1 on padding -> bool (B, 1, T, T): query i may attend to key j when
    both are in the same document (not padding) and j <= i."""
    same = doc_ids[:, :, None] == doc_ids[:, None, :]                  # (B, T, T)
    real = (doc_ids >= 0)[:, :, None]
    return (same & real & causal_mask(doc_ids.shape[-1], device=doc_ids.device))[:, None]


def _documents(*lengths, pad=0, dtype=torch.long):
    """A row of ids: document n repeated lengths[n] times, then ``pad`` positions of -1."""
    ids = [n for n, length in enumerate(lengths) for _ in range(length)] + [-1] * pad
    return torch.tensor(ids, dtype=dtype)


def _document_cases():
    yield Case("three documents of lengths 3, 2, 3", (_documents(3, 2, 3)[None],),
               hint="query i may attend to key j when doc_ids[i] == doc_ids[j] and j <= i: a "
                    "causal mask inside each document, nothing across documents")
    yield Case("B=2, packed differently", (torch.stack([_documents(1, 4, 2), _documents(5, 2)]),),
               hint="compare every position's id with every other position's id in its own row: "
                    "doc_ids[:, :, None] == doc_ids[:, None, :] gives (B, T, T)")
    yield Case("documents of length 1 attend only to themselves", (_documents(1, 1, 3, 1)[None],),
               hint="a document of one token: its query sees its own key and nothing else")
    yield Case("one document fills the sequence: the causal mask",
               (torch.zeros(1, 6, dtype=torch.long),),
               hint="with a single document the mask is the causal mask, (1, 1, T, T)")
    yield Case("padding (-1) at the end attends to nothing and is never attended to",
               (torch.stack([_documents(2, 3, pad=2), _documents(4, 1, 2)]),),
               hint="-1 marks a position that is in no document: its row and its column are all "
                    "False, even though -1 == -1")
    yield Case("ids that are not 0, 1, 2 (7, 3, 12), int32",
               (torch.tensor([[7, 7, 3, 3, 3, 12, 12]], dtype=torch.int32),),
               hint="only equality of ids matters, not their values or their order")
    yield Case("T=1", (torch.tensor([[5]]),), hint="a single token attends to itself")


def _document_mistake(rule):
    """A typical mistake: ``rule(query ids (B, T, 1), key ids (B, 1, T), causal (T, T))``, given
    the head axis: (B, 1, T, T)."""
    def fn(doc_ids):
        causal = causal_mask(doc_ids.shape[-1])
        return rule(doc_ids[:, :, None], doc_ids[:, None, :], causal)[:, None]
    return fn


register(Exercise(
    key="ch03.document_mask", function="document_mask", reference=document_mask_reference,
    ops=ELEMENTARY,
    cases=_document_cases, compare=expect_tensor, banned=NO_LIBRARY_MASKS,
    mistakes=(
        Mistake("your mask lets a query see the earlier documents of the pack (it is only "
                "causal): a key must also be in the query's own document",
                _document_mistake(lambda qi, kj, causal: causal.expand(
                    qi.shape[0], *causal.shape) & (qi >= 0) & (kj >= 0))),
        Mistake("your mask lets a query see the later tokens of its own document: inside a "
                "document it must be causal too (j <= i)",
                _document_mistake(lambda qi, kj, causal: (qi == kj) & (qi >= 0))),
        Mistake("your mask lets padding positions (id -1) attend to each other: -1 means no "
                "document, so equal ids are not enough",
                _document_mistake(lambda qi, kj, causal: (qi == kj) & causal)),
        Mistake("your mask leaves out the diagonal: a token may attend to itself",
                _document_mistake(lambda qi, kj, causal: (qi == kj) & (qi >= 0) &
                                  causal.tril(-1))),
        Mistake("your mask is True where attention is forbidden: True means may attend",
                lambda doc_ids: ~document_mask_reference(doc_ids)),
        Mistake("your mask has shape (B, T, T): add the head axis, (B, 1, T, T), so that it "
                "broadcasts over the heads",
                lambda doc_ids: document_mask_reference(doc_ids)[:, 0]),
    ),
))


# --- ch03.fp16_fill: predict what a dtype does to a fill value ---------------------------------

FILL_DTYPES = {"float16": torch.float16, "float32": torch.float32}
MASKED_FILL_OPTIONS = ("error", "fills")   # what s.masked_fill(~allowed, fill) does
FP16_QUESTIONS = {
    # key: (case name, hint of the case)
    "cast": (
        "(a) torch.tensor(fill).to(dtype)",
        "a cast rounds to the nearest number of the dtype: compare the fill with the dtype's "
        "largest finite magnitude (65504 in float16, about 3.4e38 in float32)"),
    "masked_fill": (
        "(b) s.masked_fill(~allowed, fill)",
        "masked_fill checks that its value fits the dtype before it writes anything"),
    "dead_row": (
        "(c) torch.softmax(s + torch.tensor(fill).to(dtype), dim=-1), every key masked",
        "work out each fill + s in the dtype (the nearest number of the dtype to the exact sum), "
        "then what torch.softmax does with that row (torch.softmax, not course_attn.softmax)"),
}
# The chapter's four scores with the three fills of its sections 7 and 8 (float16 -1e9, float16
# min, float32 -1e9), then -inf, and a fill small enough for float32 to keep the scores, and the
# same fill in float16, where the scores fall on a grid of 8. Together they catch every typical
# mistake below, each named by its own hint.
FILL_CASES = (
    dict(dtype="float16", fill=-1e9, scores=(-10.0, 5.0, -20.0, 2.0)),
    dict(dtype="float16", fill=-65504.0, scores=(-10.0, 5.0, -20.0, 2.0)),
    dict(dtype="float32", fill=-1e9, scores=(-10.0, 5.0, -20.0, 2.0)),
    dict(dtype="float32", fill=-math.inf, scores=(1.5, -0.5, 2.0)),
    dict(dtype="float32", fill=-1e4, scores=(1.5, -0.5, 2.0, 0.5)),
    dict(dtype="float16", fill=-1e4, scores=(5.5, -3.5, 1.5)),
)
NAN = float("nan")


def fp16_fill_reference(dtype, fill, scores):
    """What PyTorch (on the CPU) does with this dtype ("float16" or "float32"), fill (a Python
    float) and scores (one query's scores, a tuple of Python floats): run, not typed."""
    s = torch.tensor(scores).to(FILL_DTYPES[dtype])
    cast = torch.tensor(fill).to(FILL_DTYPES[dtype])
    allowed = torch.arange(len(scores)) % 2 == 0                  # any mask that hides a key
    try:
        s.masked_fill(~allowed, fill)
        masked = "fills"
    except RuntimeError:                                          # the value does not fit
        masked = "error"
    return {"cast": cast.item(), "masked_fill": masked,
            "dead_row": torch.softmax(s + cast, dim=-1).tolist()}


def _same_number(actual, expected) -> bool:
    """A number (inf and NaN allowed) within 1e-3 of ``expected``, NaN matching NaN."""
    actual = as_number(actual)
    if actual is None:
        return False
    if math.isnan(expected) or math.isnan(actual):
        return math.isnan(expected) and math.isnan(actual)
    return math.isclose(actual, expected, rel_tol=1e-3, abs_tol=1e-3)


def _same_fill_prediction(key, actual, expected) -> bool:
    if key == "masked_fill":                # a choice: one of the options, exactly
        return isinstance(actual, str) and actual.strip() == expected
    if key == "cast":
        return _same_number(actual, expected)
    return isinstance(actual, (list, tuple)) and len(actual) == len(expected) and \
        all(_same_number(a, e) for a, e in zip(actual, expected))


def _wrong_fill_prediction(key, actual, expected) -> str:
    """What is wrong with a prediction, never what the right one is."""
    if key == "masked_fill" and (not isinstance(actual, str) or
                                 actual.strip() not in MASKED_FILL_OPTIONS):
        shown = repr(actual) if isinstance(actual, str) else type(actual).__name__
        return (f"your 'masked_fill' is not one of the options "
                f"{', '.join(repr(o) for o in MASKED_FILL_OPTIONS)}: got {shown[:80]}")
    if key == "cast" and as_number(actual) is None:
        return (f"your 'cast' should be a float (-math.inf and math.nan are floats), got "
                f"{type(actual).__name__}")
    if key == "dead_row":
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            return (f"your 'dead_row' should be a list of {len(expected)} floats, one per "
                    f"score, got {type(actual).__name__}"
                    + (f" of length {len(actual)}" if isinstance(actual, (list, tuple)) else ""))
        if any(as_number(a) is None for a in actual):
            return "your 'dead_row' should hold only floats (math.nan is a float)"
    return f"your prediction {key!r} is not what PyTorch gives"


FP16 = Questions(FP16_QUESTIONS, same=_same_fill_prediction, wrong=_wrong_fill_prediction)


def _uniform(n):
    return [1.0 / n] * n


def _overflowed(right, fill) -> bool:
    """Whether a finite fill became infinite in the dtype."""
    return math.isfinite(fill) and math.isinf(right["cast"])


def _predicting(rule):
    """A typical wrong prediction: the right answers, with the parts that ``rule(right, dtype,
    fill, scores)`` returns changed."""
    def fn(dtype, fill, scores):
        right = fp16_fill_reference(dtype, fill, scores)
        return {**right, **rule(right, dtype, fill, tuple(scores))}
    return fn


SURVIVES = ("you assumed the fill survives the cast to the dtype unchanged: compare it first with "
            "the dtype's largest finite magnitude (65504 in float16)")
NOT_NAN_NOR_ZEROS = ("a fully masked row is 0/0 only when all its filled scores are -inf: with a "
                     "finite fill in the dtype the row's maximum is finite, and torch.softmax "
                     "divides by a sum of at least 1")

register(Exercise(
    key="ch03.fp16_fill", function="fp16_fill", reference=fp16_fill_reference,
    task="predict",
    ops=NONE,
    cases=lambda: FP16.cases(*FILL_CASES), compare=FP16.compare,
    # A prediction, not a computation: no tensors inside the function.
    banned=("course_attn", "torch.tensor", "torch.as_tensor", "torch.full", "torch.Tensor.half",
            "torch.Tensor.to", "torch.Tensor.masked_fill", "torch.softmax",
            "torch.Tensor.softmax", "torch.nn.functional.softmax"),
    mistakes=(
        # the misconception carried through: the fill stayed finite, so the row is uniform
        Mistake(SURVIVES, _predicting(lambda right, dtype, fill, scores: {
            "cast": fill,
            "dead_row": _uniform(len(scores)) if _overflowed(right, fill) else right["dead_row"]})),
        Mistake(SURVIVES, _predicting(lambda right, dtype, fill, scores: {"cast": fill})),
        Mistake("you assumed a cast past the end of the range saturates at the dtype's most "
                "negative finite number: a cast rounds to the nearest number of the dtype, it "
                "does not clamp",
                _predicting(lambda right, dtype, fill, scores: {
                    "cast": torch.finfo(FILL_DTYPES[dtype]).min if _overflowed(right, fill)
                    else right["cast"]})),
        Mistake("you assumed masked_fill rounds its value as a cast does: it first checks that "
                "the value fits the dtype",
                _predicting(lambda right, dtype, fill, scores: {"masked_fill": "fills"})),
        Mistake("you assumed masked_fill refuses -inf: its check is for a finite value beyond "
                "the dtype's largest magnitude, and infinities are values of every floating "
                "dtype",
                _predicting(lambda right, dtype, fill, scores: {
                    "masked_fill": "error" if math.isinf(fill) else right["masked_fill"]})),
        Mistake("you answered what course_attn's guarded softmax gives for a row of -inf "
                "(zeros); the line calls torch.softmax, which has no such guard",
                _predicting(lambda right, dtype, fill, scores: {
                    "dead_row": [0.0] * len(scores)
                    if all(math.isnan(w) for w in right["dead_row"]) else right["dead_row"]})),
        Mistake("you assumed the fill stays a finite number in this dtype, so that the row comes "
                "out uniform as in float32: work out first what the fill becomes in the dtype",
                _predicting(lambda right, dtype, fill, scores: {
                    "dead_row": _uniform(len(scores)) if _overflowed(right, fill)
                    else right["dead_row"]})),
        Mistake("you assumed every fill + s rounds back to the fill (a uniform row): near the "
                "fill the numbers of the dtype are a spacing apart, and each fill + s rounds to "
                "the nearest of them, which need not be the same one for every score",
                _predicting(lambda right, dtype, fill, scores: {
                    "dead_row": _uniform(len(scores)) if math.isfinite(right["cast"])
                    else right["dead_row"]})),
        Mistake("you assumed adding the same fill to every score changes nothing (true in exact "
                "arithmetic): in the dtype, each fill + s is rounded to the nearest number the "
                "dtype has, and near a large fill those are far apart",
                _predicting(lambda right, dtype, fill, scores: {
                    "dead_row": torch.softmax(torch.tensor(scores, dtype=torch.float64),
                                              dim=-1).tolist() if math.isfinite(right["cast"])
                    else right["dead_row"]})),
        Mistake(NOT_NAN_NOR_ZEROS, _predicting(lambda right, dtype, fill, scores: {
            "dead_row": [NAN] * len(scores)})),
        Mistake(NOT_NAN_NOR_ZEROS, _predicting(lambda right, dtype, fill, scores: {
            "dead_row": [0.0] * len(scores)})),
    ),
))

"""masks.py: which keys each query may attend to, and how masks combine."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

from course_attn import scaled_dot_product_attention
from course_attn.masks import (
    attention_mask, causal_mask, combine_masks, dead_rows, grouped_query_bias, padding_mask,
    sliding_window_mask, to_additive,
)

pytestmark = pytest.mark.filterwarnings("ignore:Lower right causal bias:UserWarning")

lengths_ = st.integers(1, 12)


def offsets(tq, tk, device):
    """i_abs - j for query i at bottom-right position Tk - Tq + i and key j, shape (Tq, Tk)."""
    return (torch.arange(tq, device=device)[:, None] + tk - tq) - torch.arange(tk, device=device)


# --- causal --------------------------------------------------------------------------------


@given(tq=lengths_, tk=lengths_)
def test_bottom_right_causal_equals_pytorchs_causal_lower_right(device, tq, tk):
    mask = causal_mask(tq, tk, device=device)
    assert mask.dtype == torch.bool and mask.shape == (tq, tk) and mask.device.type == device.type
    assert torch.equal(mask, causal_lower_right(tq, tk)._materialize(device))


@given(tq=lengths_, tk=lengths_)
def test_top_left_causal_equals_pytorchs_is_causal_layout(device, tq, tk):
    mask = causal_mask(tq, tk, align="top_left", device=device)
    # What PyTorch documents for is_causal=True: torch.ones(L, S).tril(diagonal=0).
    assert torch.equal(mask, torch.ones(tq, tk, dtype=torch.bool, device=device).tril())
    assert torch.equal(mask, causal_upper_left(tq, tk)._materialize(device))


@given(t=lengths_)
def test_square_causal_is_the_same_for_both_alignments(t):
    square = causal_mask(t)
    assert torch.equal(square, causal_mask(t, t, align="top_left"))
    assert square.sum() == t * (t + 1) // 2


@given(tq=lengths_, tk=lengths_)
def test_the_last_query_sees_every_key_and_each_earlier_query_one_fewer(tq, tk):
    visible = causal_mask(tq, tk).sum(-1)
    expected = torch.arange(tk - tq + 1, tk + 1).clamp(min=0)
    assert visible.tolist() == expected.tolist()


def test_empty_sequences_give_empty_masks():
    assert causal_mask(0, 3).shape == (0, 3)
    assert causal_mask(2, 0).shape == (2, 0)
    assert sliding_window_mask(0, 0, 2).shape == (0, 0)


def test_causal_mask_docstring_example():
    assert causal_mask(2, 3).int().tolist() == [[1, 1, 0], [1, 1, 1]]


# --- sliding window ------------------------------------------------------------------------


@given(tq=lengths_, tk=lengths_, window=st.integers(1, 14), causal=st.booleans())
def test_sliding_window_follows_its_definition(device, tq, tk, window, causal):
    d = offsets(tq, tk, device)
    expected = ((0 <= d) & (d < window)) if causal else (d.abs() < window)
    mask = sliding_window_mask(tq, tk, window, causal=causal, device=device)
    assert mask.dtype == torch.bool and mask.device.type == device.type
    assert torch.equal(mask, expected)


@given(tq=lengths_, tk=lengths_, w1=st.integers(1, 14), w2=st.integers(1, 14), causal=st.booleans())
def test_a_wider_window_keeps_everything_a_narrower_one_keeps(tq, tk, w1, w2, causal):
    narrow, wide = sorted((w1, w2))
    kept_narrow = sliding_window_mask(tq, tk, narrow, causal=causal)
    kept_wide = sliding_window_mask(tq, tk, wide, causal=causal)
    assert not (kept_narrow & ~kept_wide).any()


@given(tq=lengths_, tk=lengths_)
def test_a_window_as_long_as_the_keys_changes_nothing(tq, tk):
    window = tq + tk
    assert torch.equal(sliding_window_mask(tq, tk, window, causal=True), causal_mask(tq, tk))
    assert sliding_window_mask(tq, tk, window, causal=False).all()


@given(t=lengths_, window=st.integers(1, 14))
def test_causal_window_rows_hold_min_window_and_position_plus_one_keys(t, window):
    counts = sliding_window_mask(t, t, window, causal=True).sum(-1)
    assert counts.tolist() == [min(window, i + 1) for i in range(t)]
    both_ways = sliding_window_mask(t, t, window, causal=False)
    assert torch.equal(both_ways, both_ways.T)


def test_window_one_keeps_only_the_aligned_key():
    assert sliding_window_mask(2, 4, 1).int().tolist() == [[0, 0, 1, 0], [0, 0, 0, 1]]


# --- padding -------------------------------------------------------------------------------


@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=5))
def test_padding_mask_keeps_exactly_the_first_length_keys(device, lengths):
    t = 9
    mask = padding_mask(torch.tensor(lengths, device=device), t)
    assert mask.shape == (len(lengths), 1, 1, t) and mask.dtype == torch.bool
    assert mask.device.type == device.type
    for row, n in zip(mask[:, 0, 0], lengths):
        assert row.tolist() == [True] * n + [False] * (t - n)


def test_padding_mask_takes_a_list():
    assert padding_mask([1, 3], 3)[:, 0, 0].tolist() == [[True, False, False], [True, True, True]]


@given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=3), seed=st.integers(0, 1000))
def test_padding_plus_causal_equals_attention_on_each_unpadded_sequence(device, lengths, seed):
    """Right-padded batch + causal: each real query sees exactly its own prefix, as if unpadded."""
    t, g = 6, torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(len(lengths), 2, t, 4, generator=g, dtype=torch.float64).to(device)
               for _ in range(3))
    keep = padding_mask(torch.tensor(lengths, device=device), t)
    mask = attention_mask(t, t, attn_mask=keep, is_causal=True, device=device)
    assert torch.equal(mask, keep & causal_mask(t, device=device))
    out = scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=True)
    for b, n in enumerate(lengths):
        prefix = (x[b:b + 1, :, :n] for x in (q, k, v))
        alone = scaled_dot_product_attention(*prefix, is_causal=True)
        torch.testing.assert_close(out[b:b + 1, :, :n], alone, atol=1e-12, rtol=1e-12)


def test_padding_with_a_zero_length_sequence_gives_zero_rows():
    q = k = v = torch.randn(2, 1, 3, 2)
    out = scaled_dot_product_attention(q, k, v, attn_mask=padding_mask(torch.tensor([3, 0]), 3))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert out[0].abs().sum() > 0


# --- to_additive, combine_masks, attention_mask, dead_rows ---------------------------------


def test_to_additive_turns_true_into_zero_and_false_into_minus_inf(device):
    bias = to_additive(torch.tensor([True, False, True], device=device), torch.float16)
    assert bias.dtype == torch.float16
    assert bias.tolist() == [0.0, float("-inf"), 0.0]
    float_mask = torch.tensor([0.5, -1.0], device=device)
    assert torch.equal(to_additive(float_mask, torch.float64), float_mask.double())


bool_masks = st.lists(st.booleans(), min_size=6, max_size=6).map(
    lambda xs: torch.tensor(xs).view(2, 3))


@given(a=bool_masks, b=bool_masks, c=bool_masks)
def test_combining_bool_masks_is_their_and(a, b, c):
    combined = combine_masks(a, None, b, c)
    assert combined.dtype == torch.bool
    assert torch.equal(combined, a & b & c)


@given(a=bool_masks, bias=st.lists(st.floats(-5, 5), min_size=6, max_size=6))
def test_combining_bool_and_float_adds_minus_inf_where_the_bool_is_false(a, bias):
    bias = torch.tensor(bias, dtype=torch.float64).view(2, 3)
    for combined in (combine_masks(a, bias), combine_masks(bias, a)):
        assert combined.dtype == torch.float64
        assert torch.equal(combined, bias.masked_fill(~a, float("-inf")))


def test_combining_floats_sums_them_in_the_first_float_dtype_and_broadcasts():
    a = torch.tensor([[0.0, -1.0, 2.0]], dtype=torch.float16)          # (1, 3)
    b = torch.tensor([[1.0], [float("-inf")]], dtype=torch.float32)    # (2, 1)
    keep = torch.tensor([True, True, False])                           # (3,)
    combined = combine_masks(keep, a, b)
    assert combined.dtype == torch.float16 and combined.shape == (2, 3)
    assert combined.tolist() == [[1.0, 0.0, float("-inf")], [float("-inf")] * 3]


def test_combining_nothing_is_none():
    assert combine_masks() is None
    assert combine_masks(None, None) is None
    m = torch.tensor([True, False])
    assert combine_masks(None, m) is m


@given(tq=lengths_, tk=lengths_, window=st.one_of(st.none(), st.integers(1, 14)),
       causal=st.booleans(), kind=st.sampled_from([None, "bool", "float"]))
def test_attention_mask_requires_every_constraint(tq, tk, window, causal, kind):
    g = torch.Generator().manual_seed(tq * 100 + tk)
    user = None
    if kind == "bool":
        user = torch.rand(2, 1, tq, tk, generator=g) < 0.6
    elif kind == "float":
        user = torch.randn(2, 1, tq, tk, generator=g)
    mask = attention_mask(tq, tk, attn_mask=user, is_causal=causal, window=window)
    if user is None and not causal and window is None:
        assert mask is None
        return
    d = offsets(tq, tk, "cpu")
    allowed = torch.ones(tq, tk, dtype=torch.bool)
    if causal:
        allowed &= d >= 0
    if window is not None:
        allowed &= ((d >= 0) & (d < window)) if causal else (d.abs() < window)
    if kind == "float":
        assert torch.equal(mask, user.masked_fill(~allowed, float("-inf")))
    else:
        expected = allowed if user is None else user & allowed
        assert torch.equal(mask.expand_as(expected), expected)


def test_dead_rows_finds_queries_with_no_key(device):
    keep = torch.tensor([[True, False], [False, False], [False, True]], device=device)
    assert dead_rows(keep).flatten().tolist() == [False, True, False]
    assert dead_rows(to_additive(keep)).flatten().tolist() == [False, True, False]
    assert dead_rows(torch.ones(2, 2, dtype=torch.bool, device=device)) is None
    assert dead_rows(None) is None


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("lengths, message", [
    ([3, 6], r"every length must be in \[0, 5\], got \[3, 6\]"),
    ([-1, 2], r"every length must be in \[0, 5\], got \[-1, 2\]"),
    (torch.tensor([1.0, 2.0]), r"1-D integer tensor .*torch.float32"),
    (torch.tensor([[1, 2]]), r"1-D integer tensor \(B,\), got shape \(1, 2\)"),
    (torch.tensor([True]), r"1-D integer tensor .*torch.bool"),
])
def test_padding_mask_rejects_bad_lengths(lengths, message):
    with pytest.raises(ValueError, match=message):
        padding_mask(lengths, 5)


@pytest.mark.parametrize("align", ["top-left", "bottom", None, ""])
def test_causal_mask_rejects_an_unknown_alignment(align):
    with pytest.raises(ValueError, match=r"align must be 'bottom_right' or 'top_left', got"):
        causal_mask(3, 3, align=align)


@pytest.mark.parametrize("tq, tk, message", [
    (-1, 3, r"tq must be a non-negative int, got -1"),
    (3, -2, r"tk must be a non-negative int, got -2"),
    (2.0, 3, r"tq must be a non-negative int, got 2.0"),
    (True, 3, r"tq must be a non-negative int, got True"),
])
def test_causal_mask_rejects_bad_lengths(tq, tk, message):
    with pytest.raises(ValueError, match=message):
        causal_mask(tq, tk)


@pytest.mark.parametrize("window", [0, -2, True, 2.5, None, "3"])
def test_sliding_window_mask_rejects_a_bad_window(window):
    with pytest.raises(ValueError, match="window"):
        sliding_window_mask(3, 3, window)


# --- a tile's bias with the query heads of a key head stacked as rows (GQA) ------------------


@pytest.mark.parametrize("mask_shape", [(2, 6, 3, 5), (1, 6, 1, 5), (2, 1, 3, 1), (3, 5)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_grouped_query_bias_is_the_full_bias_with_the_heads_stacked(device, mask_shape, kind):
    """B = 2, Hq = 6 query heads over Hkv = 2 key heads (G = 3), a tile of n = 3 queries and
    m = 5 keys: query head h = kv·G + g and query i land on row g·n + i of the kv-th slice."""
    b, hkv, g, n, m = 2, 2, 3, 3, 5
    generator = torch.Generator().manual_seed(0)
    structural = to_additive(causal_mask(n, m, device=device), torch.float64)        # (n, m)
    if kind == "bool":
        mask = torch.rand(mask_shape, generator=generator) > 0.3
    else:
        mask = torch.randn(mask_shape, generator=generator, dtype=torch.float64)
    mask = mask.to(device)
    for structure in (structural, None):
        full = to_additive(mask, torch.float64).expand(b, hkv * g, n, m)   # (B, Hq, n, m)
        if structure is not None:
            full = full + structure
        expected = torch.empty(b * hkv, g * n, m, dtype=torch.float64, device=device)
        for batch in range(b):
            for kv in range(hkv):
                for head in range(g):
                    expected[batch * hkv + kv, head * n:(head + 1) * n] = full[batch, kv * g + head]
        got = grouped_query_bias(structure, mask, (b, hkv, g, n, m), torch.float64)
        assert torch.equal(got, expected)


def test_grouped_query_bias_without_a_mask_is_shared_by_every_batch_and_head(device):
    structural = to_additive(causal_mask(3, 5, device=device))                        # (3, 5)
    got = grouped_query_bias(structural, None, (2, 2, 4, 3, 5), torch.float32)
    assert torch.equal(got, torch.cat([structural] * 4))                              # (G·n, m)
    assert grouped_query_bias(None, None, (2, 2, 4, 3, 5), torch.float32) is None

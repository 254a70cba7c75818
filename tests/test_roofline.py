"""The roofline model against what the package does: FLOPs counted by PyTorch's FlopCounterMode
on the math attention, bytes from the tensors' own nbytes."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from course_attn import published, roofline
from course_attn.attention import scaled_dot_product_attention
from course_attn.masks import causal_mask


def _measured(b, hq, hkv, tq, tk, d, dtype=torch.bfloat16):
    """(FLOPs counted in the math attention, bytes of q, k, v and the output), non-causal."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, tq, d, generator=g).to(dtype)
    k, v = (torch.randn(b, hkv, tk, d, generator=g).to(dtype) for _ in range(2))
    with FlopCounterMode(display=False) as counter:
        out = scaled_dot_product_attention(q, k, v, enable_gqa=hq != hkv)
    return counter.get_total_flops(), q.nbytes + k.nbytes + v.nbytes + out.nbytes


SHAPES = [  # (B, Hq, Hkv, Tq, Tk, D)
    (2, 4, 4, 16, 16, 8),        # multi-head, square
    (1, 8, 2, 1, 64, 16),        # one decode step over a cache, GQA
    (3, 6, 1, 5, 37, 4),         # multi-query, ragged lengths
]


@pytest.mark.parametrize("b, hq, hkv, tq, tk, d", SHAPES)
def test_flops_and_bytes_match_the_math_attention(b, hq, hkv, tq, tk, d):
    flops, moved = _measured(b, hq, hkv, tq, tk, d)
    kw = dict(batch=b, heads=hq, q_len=tq, kv_len=tk, head_dim=d)
    assert roofline.attention_flops(**kw) == flops
    assert roofline.attention_bytes(kv_heads=hkv, **kw) == moved
    assert roofline.attention_intensity(kv_heads=hkv, **kw) == pytest.approx(flops / moved)


@pytest.mark.parametrize("bytes_per_element, dtype", [(2, torch.bfloat16), (4, torch.float32)])
def test_bytes_scale_with_the_element_size(bytes_per_element, dtype):
    _, moved = _measured(1, 4, 2, 3, 9, 8, dtype=dtype)
    assert roofline.attention_bytes(batch=1, heads=4, kv_heads=2, q_len=3, kv_len=9, head_dim=8,
                                    bytes_per_element=bytes_per_element) == moved


@pytest.mark.parametrize("tq, tk", [(1, 1), (7, 7), (3, 10), (12, 5)])
def test_causal_counts_only_the_pairs_the_mask_allows(tq, tk):
    # The math attention scores every pair and masks afterwards; a fused kernel skips masked
    # pairs. The causal count is the full one times the share the package's mask lets through.
    full, _ = _measured(2, 4, 2, tq, tk, 8)
    allowed = causal_mask(tq, tk).sum().item()
    causal = roofline.attention_flops(batch=2, heads=4, q_len=tq, kv_len=tk, head_dim=8,
                                      causal=True)
    assert causal * (tq * tk) == full * allowed


def test_ridge_point_of_an_h100_sxm():
    assert roofline.ridge_point() == pytest.approx(295.3, abs=0.1)       # 989.4 / 3.35
    assert roofline.ridge_point("H200 SXM") < roofline.ridge_point("H100 SXM")  # more bandwidth


def test_the_roof_and_which_side_of_the_ridge():
    ridge = roofline.ridge_point()
    peak = published.value("H100 SXM", "bf16_dense_tflops")
    assert roofline.attainable_tflops(ridge) == pytest.approx(peak)
    assert roofline.attainable_tflops(ridge / 2) == pytest.approx(peak / 2)
    assert roofline.attainable_tflops(10 * ridge) == peak
    assert roofline.bound(ridge * 0.99) == "memory" and roofline.bound(ridge * 1.01) == "compute"


def test_decode_is_memory_bound_and_prefill_compute_bound_for_llama3_8b():
    c = published.config("Llama 3 8B")
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    shape = dict(batch=1, heads=heads, kv_heads=kv_heads,
                 head_dim=c["hidden_size"] // heads)
    decode = roofline.attention_intensity(q_len=1, kv_len=4096, **shape)
    prefill = roofline.attention_intensity(q_len=4096, kv_len=4096, causal=True, **shape)
    assert roofline.bound(decode) == "memory" and roofline.bound(prefill) == "compute"
    # one decode step does about heads / kv_heads FLOP per byte (the group size), whatever L
    assert decode == pytest.approx(heads / kv_heads, rel=0.01)


def test_unknown_gpu_is_refused():
    with pytest.raises(KeyError, match="no published configuration"):
        roofline.ridge_point("H900")

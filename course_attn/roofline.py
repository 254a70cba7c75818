"""The roofline: is a kernel limited by arithmetic or by memory?

A GPU does at most P FLOP/s (its dense tensor-core peak) and moves at most W bytes/s to and from
its memory (HBM). A kernel that does F FLOPs while moving M bytes has arithmetic intensity
I = F / M (FLOP per byte) and runs at most at min(P, I · W) FLOP/s. Below the ridge point
I* = P / W the memory is the limit; above it, the arithmetic. The figures P and W come from
``course_attn.published`` (the card's datasheet), never typed here.

    >>> round(ridge_point("H100 SXM"))
    295
    >>> bound(attention_intensity(batch=1, heads=32, kv_heads=8, q_len=1, kv_len=4096,
    ...                           head_dim=128))
    'memory'
"""

from . import published

__all__ = ["attainable_tflops", "attention_bytes", "attention_flops", "attention_intensity",
           "bound", "ridge_point"]


def ridge_point(gpu: str = "H100 SXM") -> float:
    """FLOP per byte at which ``gpu`` turns from memory-bound to compute-bound: peak / bandwidth.

    Dense BF16 tensor-core peak over HBM bandwidth, both from the datasheet (about 295 for an
    H100 SXM: 989.4 TFLOP/s over 3.35 TB/s).
    """
    return published.value(gpu, "bf16_dense_tflops") / published.value(gpu, "hbm_bandwidth_tb_s")


def attainable_tflops(intensity: float, gpu: str = "H100 SXM") -> float:
    """The roof: min(peak, intensity · bandwidth) in TFLOP/s, for a kernel of that FLOP/byte."""
    return min(published.value(gpu, "bf16_dense_tflops"),
               intensity * published.value(gpu, "hbm_bandwidth_tb_s"))


def bound(intensity: float, gpu: str = "H100 SXM") -> str:
    """"memory" if a kernel of this intensity (FLOP/byte) sits left of ``gpu``'s ridge, else
    "compute"."""
    return "memory" if intensity < ridge_point(gpu) else "compute"


def _allowed_pairs(q_len: int, kv_len: int, causal: bool) -> int:
    """How many (query, key) pairs are scored; causal is bottom-right aligned (query i sits at
    position kv_len - q_len + i and sees keys 0 .. that position)."""
    if not causal:
        return q_len * kv_len
    return sum(max(0, min(kv_len, kv_len - q_len + i + 1)) for i in range(q_len))


def attention_flops(*, batch: int, heads: int, q_len: int, kv_len: int, head_dim: int,
                    causal: bool = False) -> int:
    """FLOPs of q kᵀ and p v for q: (batch, heads, q_len, head_dim), k, v: (.., kv_len, head_dim).

    Each scored (query, key) pair costs one dot product of length D in q kᵀ and one in p v, two
    FLOPs (a multiply and an add) per element: 4 · D per pair per query head. A causal mask
    scores only the allowed pairs, as a fused kernel that skips masked blocks does. The softmax
    (a few FLOPs per score) is left out: it is not tensor-core work.
    """
    return 4 * batch * heads * _allowed_pairs(q_len, kv_len, causal) * head_dim


def attention_bytes(*, batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int,
                    head_dim: int, bytes_per_element: int = 2) -> int:
    """Bytes moved between memory and chip: read q, k, v once, write the output once.

    q, out: (batch, heads, q_len, head_dim); k, v: (batch, kv_heads, kv_len, head_dim). This is
    the least a fused (flash) kernel moves: the scores never leave the chip, and each of the
    kv_heads key/value heads is read once for all heads / kv_heads query heads of its group.
    """
    q_and_out = 2 * batch * heads * q_len * head_dim
    k_and_v = 2 * batch * kv_heads * kv_len * head_dim
    return (q_and_out + k_and_v) * bytes_per_element


def attention_intensity(*, batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int,
                        head_dim: int, bytes_per_element: int = 2, causal: bool = False) -> float:
    """Arithmetic intensity (FLOP/byte) of one attention call, fused: ``attention_flops`` over
    ``attention_bytes``.

    Model: the FLOPs of q kᵀ and p v (4 · D per scored pair per query head; causal scores only
    the allowed pairs, bottom-right aligned) over the bytes of q, k, v read once and the output
    written once, at ``bytes_per_element`` (2 for bf16). Shapes: q (batch, heads, q_len, head_dim),
    k and v (batch, kv_heads, kv_len, head_dim). One decode step is q_len = 1: each cached key and
    value row of a KV head (4 · D bytes in bf16) serves heads / kv_heads query heads at 4 · D
    FLOPs each, so the step does about heads / kv_heads FLOP per byte, whatever kv_len.
    """
    flops = attention_flops(batch=batch, heads=heads, q_len=q_len, kv_len=kv_len,
                            head_dim=head_dim, causal=causal)
    moved = attention_bytes(batch=batch, heads=heads, kv_heads=kv_heads, q_len=q_len,
                            kv_len=kv_len, head_dim=head_dim, bytes_per_element=bytes_per_element)
    return flops / moved

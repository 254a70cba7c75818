"""Flash attention as a Triton GPU kernel: FlashAttention-2's forward and backward (chapter 9).

``flash.py`` teaches the algorithm in PyTorch; this module is the same algorithm written as GPU
kernels, where the tiles live in on-chip memory and the T×T matrix never reaches GPU memory:

- forward: one program per (block of queries, batch·head). It keeps, per query row, a running
  max ``m``, a running sum ``l`` and an output accumulator, all in float32, and walks over the
  key blocks; with ``is_causal`` it stops at the diagonal, so blocks above it are never loaded.
  It writes the output (input dtype) and the log-sum-exp (float32) that the backward needs.
- backward: ``D = rowsum(dO ∘ O)``, then one program per key block accumulates dK and dV over
  the query blocks (and over the query heads that share the key head, so GQA needs no atomics),
  and one program per query block accumulates dQ. Every tile of scores is recomputed from q, k
  and the log-sum-exp.

Supported: fp16, bf16 and fp32; head dims 1..128 (padded to a power of two by masked loads);
``is_causal`` (bottom-right aligned: query i sits at position Tk - Tq + i), ``scale``,
``enable_gqa``. Not supported, and refused with a ValueError: ``attn_mask``, ``window``, other
dtypes, and tensors off CUDA (except under Triton's interpreter, ``TRITON_INTERPRET=1``, which
runs the kernels on CPU tensors, slowly: that is how the tests check it without a GPU).

Importing this module needs Triton, which PyTorch's CUDA wheels bring; ``course_attn.backends``
imports it only where CUDA is present, so a CPU-only install never needs Triton.
``python -m course_attn.triton_flash`` measures the kernels' throughput next to PyTorch's.
"""

import math

import torch
from torch import Tensor

from .published import value as published_value
from .attention import check_attention_inputs

try:
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction
except ImportError as error:  # a CPU-only install: the backend registry skips this module
    raise ImportError(
        "course_attn.triton_flash needs Triton (`pip install triton`; PyTorch's CUDA wheels "
        "include it); without it, use the 'flash' or 'sdpa' backend"
    ) from error

LOG2E = 1.4426950408889634  # the kernels use exp2: e^x = 2^(x·log2 e)
# A global that a compiled kernel reads must be a constexpr (the interpreter does not check).
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(0.6931471805599453)
MAX_HEAD_DIM = 128
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --- forward kernel --------------------------------------------------------------------------


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """a @ b in float32. PRECISION: "ieee" (exact fp32), "tf32" (ignored for fp16/bf16), or
    "upcast": Triton's interpreter multiplies bf16 bit patterns (triton-lang/triton#11584), so
    under it bf16 operands are widened to fp32 first, which gives the same products."""
    if PRECISION == "upcast":
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=PRECISION)
    return c


@triton.jit
def _visible(rows, cols, TK, CAUSAL: tl.constexpr, SHIFT_ROWS):
    """(M, N) bool: key ``cols`` exists (< TK) and, when causal, is not after query ``rows``,
    which sits at position rows + SHIFT_ROWS (bottom-right: SHIFT_ROWS = Tk - Tq)."""
    keep = cols[None, :] < TK
    if CAUSAL:
        keep = keep & (cols[None, :] <= (rows + SHIFT_ROWS)[:, None])
    return keep


@triton.jit
def _key_block(k_ptrs, start_n, TK, D, stride_kn,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The key block that starts at key start_n: its positions ``cols`` (N,) and kᵀ (D, N),
    zeros past Tk and past D."""
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_t = tl.load(k_ptrs + start_n * stride_kn,
                  mask=(cols[None, :] < TK) & (offs_d[:, None] < D), other=0.0)
    return cols, k_t


@triton.jit
def _key_bounds(start_m, shift, TK, CAUSAL: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(full, hi) for the block of query rows from start_m, query row i sitting at key position
    i + shift: keys [0, full) are whole blocks that every row sees (no mask needed), keys
    [full, hi) the diagonal blocks and the ragged last one (masked per element); keys from hi on
    are after the block's last query (causal), unseen."""
    if CAUSAL:
        hi = tl.minimum(TK, start_m + BLOCK_M + shift)        # past the block's last query
        full = tl.maximum(tl.minimum(TK, start_m + shift + 1), 0) // BLOCK_N * BLOCK_N
    else:
        hi = TK
        full = TK // BLOCK_N * BLOCK_N
    return full, hi


@triton.jit
def _fwd_tile(acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, rows, TK, D, DV, qk_scale,
              stride_kn, stride_vn,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, SHIFT_ROWS,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              PRECISION: tl.constexpr):
    """One key block's update of (acc, l, m): the online softmax step, in log2 units."""
    cols, k_t = _key_block(k_ptrs, start_n, TK, D, stride_kn, BLOCK_N, BLOCK_D)    # kᵀ (D, N)
    offs_dv = tl.arange(0, BLOCK_DV)
    s = _dot(q, k_t, PRECISION) * qk_scale  # (M, N)
    if MASKED:
        s = tl.where(_visible(rows, cols, TK, CAUSAL, SHIFT_ROWS), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:  # a row with no key yet has m = -inf: subtract 0 instead, so exp2 gives 0, not NaN
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_safe = m_new
    p = tl.math.exp2(s - m_new_safe[:, None])
    alpha = tl.math.exp2(m_i - m_new_safe)       # rescales what was summed under the old max
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs + start_n * stride_vn,
                mask=(cols[:, None] < TK) & (offs_dv[None, :] < DV), other=0.0)  # (N, DV)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attn_fwd(Q, K, V, O, LSE,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_om, stride_od,
              H, TQ, TK, D, DV, qk_scale,
              GROUP: tl.constexpr, CAUSAL: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
    """O[b, h, rows] and LSE[b, h, rows] for one block of BLOCK_M query rows of one head."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    h_kv = h // GROUP                             # GQA: query head h reads key/value head h // G
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q = tl.load(Q + b * stride_qb + h * stride_qh
                + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=(rows[:, None] < TQ) & (offs_d[None, :] < D), other=0.0)
    k_ptrs = K + b * stride_kb + h_kv * stride_kh + offs_n[None, :] * stride_kn \
        + offs_d[:, None] * stride_kd
    v_ptrs = V + b * stride_vb + h_kv * stride_vh + offs_n[:, None] * stride_vn \
        + offs_dv[None, :] * stride_vd

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    shift = TK - TQ                               # query row i sits at key position i + shift
    full, hi = _key_bounds(start_m, shift, TK, CAUSAL, BLOCK_M, BLOCK_N)
    # Blocks that every row of this query block sees whole: no mask to apply.
    for start_n in range(0, full, BLOCK_N):
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, rows, TK, D, DV,
                                  qk_scale, stride_kn, stride_vn, False, CAUSAL, shift,
                                  BLOCK_N, BLOCK_D, BLOCK_DV, PRECISION)
    # The diagonal blocks and the ragged last block: mask per element.
    for start_n in range(full, hi, BLOCK_N):
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, rows, TK, D, DV,
                                  qk_scale, stride_kn, stride_vn, True, CAUSAL, shift,
                                  BLOCK_N, BLOCK_D, BLOCK_DV, PRECISION)

    dead = l_i == 0.0                             # a query with no key: out 0, lse -inf
    l_safe = tl.where(dead, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(dead, float("-inf"), (m_i + tl.math.log2(l_safe)) * _LN2)
    tl.store(O + b * stride_ob + h * stride_oh
             + rows[:, None] * stride_om + offs_dv[None, :] * stride_od,
             out.to(O.dtype.element_ty), mask=(rows[:, None] < TQ) & (offs_dv[None, :] < DV))
    tl.store(LSE + bh.to(tl.int64) * TQ + rows, lse, mask=rows < TQ)


# --- backward kernels ------------------------------------------------------------------------


@triton.jit
def _bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV_OUT,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_dob, stride_doh, stride_dom, stride_dod,
              HKV, TQ, TK, D, DV, qk_scale, scale,
              GROUP: tl.constexpr, CAUSAL: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
    """dK, dV for one block of BLOCK_N keys of one key/value head, summed over its query heads.

    dK and dV are contiguous (B, Hkv, Tk, D) and (B, Hkv, Tk, Dv).
    """
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)
    h_kv = (bh % HKV).to(tl.int64)
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    hq = HKV * GROUP

    k = tl.load(K + b * stride_kb + h_kv * stride_kh
                + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=(cols[:, None] < TK) & (offs_d[None, :] < D), other=0.0)     # (N, D)
    v = tl.load(V + b * stride_vb + h_kv * stride_vh
                + cols[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                mask=(cols[:, None] < TK) & (offs_dv[None, :] < DV), other=0.0)   # (N, DV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

    shift = TK - TQ
    if CAUSAL:  # queries before row start_n - shift see none of these keys: skip their blocks
        lo = tl.maximum(start_n - shift, 0) // BLOCK_M * BLOCK_M
    else:
        lo = 0
    # Rows of padding (>= TQ) load lse = +inf, so their p is 0; columns of padding (>= TK) only
    # touch rows of dK, dV that are never stored, so they need no mask here. A query that sees
    # no key (lse = -inf) exists only under the causal mask, whose `where` zeroes its p.
    for g in range(GROUP):
        h = h_kv * GROUP + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        row_base = (b * hq + h) * TQ
        for start_m in range(lo, TQ, BLOCK_M):
            rows = start_m + offs_m
            q = tl.load(q_base + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                        mask=(rows[:, None] < TQ) & (offs_d[None, :] < D), other=0.0)
            do = tl.load(do_base + rows[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                         mask=(rows[:, None] < TQ) & (offs_dv[None, :] < DV), other=0.0)
            lse = tl.load(LSE + row_base + rows, mask=rows < TQ, other=float("inf"))
            delta = tl.load(DELTA + row_base + rows, mask=rows < TQ, other=0.0)
            lse2 = lse * _LOG2E
            s_t = _dot(k, tl.trans(q), PRECISION) * qk_scale  # (N, M)
            p_t = tl.math.exp2(s_t - lse2[None, :])
            if CAUSAL:
                p_t = tl.where(cols[:, None] <= (rows + shift)[None, :], p_t, 0.0)
            dv += _dot(p_t.to(do.dtype), do, PRECISION)
            dp_t = _dot(v, tl.trans(do), PRECISION)  # (N, M)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += _dot(ds_t.to(q.dtype), q, PRECISION)

    out_rows = (b * HKV + h_kv) * TK + cols
    tl.store(DK + out_rows[:, None] * D + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=(cols[:, None] < TK) & (offs_d[None, :] < D))
    tl.store(DV_OUT + out_rows[:, None] * DV + offs_dv[None, :], dv.to(DV_OUT.dtype.element_ty),
             mask=(cols[:, None] < TK) & (offs_dv[None, :] < DV))


@triton.jit
def _dq_tile(dq, q, do, lse2, delta, k_ptrs, v_ptrs, start_n, rows, TK, D, DV, qk_scale,
             stride_kn, stride_vn,
             MASKED: tl.constexpr, CAUSAL: tl.constexpr, SHIFT_ROWS,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
             PRECISION: tl.constexpr):
    """One key block's contribution to dQ (before the final factor ``scale``)."""
    cols, k_t = _key_block(k_ptrs, start_n, TK, D, stride_kn, BLOCK_N, BLOCK_D)    # (D, N)
    offs_dv = tl.arange(0, BLOCK_DV)
    v_t = tl.load(v_ptrs + start_n * stride_vn,
                  mask=(cols[None, :] < TK) & (offs_dv[:, None] < DV), other=0.0)  # (DV, N)
    s = _dot(q, k_t, PRECISION) * qk_scale  # (M, N)
    p = tl.math.exp2(s - lse2[:, None])
    if MASKED:
        p = tl.where(_visible(rows, cols, TK, CAUSAL, SHIFT_ROWS), p, 0.0)
    dp = _dot(do, v_t, PRECISION)
    ds = p * (dp - delta[:, None])
    dq += _dot(ds.to(k_t.dtype), tl.trans(k_t), PRECISION)
    return dq


@triton.jit
def _bwd_dq(Q, K, V, DO, LSE, DELTA, DQ,
            stride_qb, stride_qh, stride_qm, stride_qd,
            stride_kb, stride_kh, stride_kn, stride_kd,
            stride_vb, stride_vh, stride_vn, stride_vd,
            stride_dob, stride_doh, stride_dom, stride_dod,
            H, TQ, TK, D, DV, qk_scale, scale,
            GROUP: tl.constexpr, CAUSAL: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
    """dQ for one block of BLOCK_M query rows of one head; DQ is contiguous (B, Hq, Tq, D)."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    h_kv = h // GROUP
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q = tl.load(Q + b * stride_qb + h * stride_qh
                + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=(rows[:, None] < TQ) & (offs_d[None, :] < D), other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh
                 + rows[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                 mask=(rows[:, None] < TQ) & (offs_dv[None, :] < DV), other=0.0)
    row_ids = bh.to(tl.int64) * TQ + rows
    lse = tl.load(LSE + row_ids, mask=rows < TQ, other=float("inf"))
    delta = tl.load(DELTA + row_ids, mask=rows < TQ, other=0.0)
    lse2 = lse * _LOG2E
    k_ptrs = K + b * stride_kb + h_kv * stride_kh + offs_n[None, :] * stride_kn \
        + offs_d[:, None] * stride_kd
    v_ptrs = V + b * stride_vb + h_kv * stride_vh + offs_n[None, :] * stride_vn \
        + offs_dv[:, None] * stride_vd
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    shift = TK - TQ
    full, hi = _key_bounds(start_m, shift, TK, CAUSAL, BLOCK_M, BLOCK_N)
    for start_n in range(0, full, BLOCK_N):
        dq = _dq_tile(dq, q, do, lse2, delta, k_ptrs, v_ptrs, start_n, rows, TK, D, DV, qk_scale,
                      stride_kn, stride_vn, False, CAUSAL, shift, BLOCK_N, BLOCK_D, BLOCK_DV,
                      PRECISION)
    for start_n in range(full, hi, BLOCK_N):
        dq = _dq_tile(dq, q, do, lse2, delta, k_ptrs, v_ptrs, start_n, rows, TK, D, DV, qk_scale,
                      stride_kn, stride_vn, True, CAUSAL, shift, BLOCK_N, BLOCK_D, BLOCK_DV,
                      PRECISION)
    tl.store(DQ + row_ids[:, None] * D + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=(rows[:, None] < TQ) & (offs_d[None, :] < D))


# --- launching -------------------------------------------------------------------------------


def interpreting() -> bool:
    """Whether the kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return not isinstance(_attn_fwd, JITFunction)


def available() -> bool:
    """Whether the kernels can run here on GPU tensors: CUDA is present (Triton is, or this
    module would not have imported)."""
    return torch.cuda.is_available()


def _block_dim(d: int) -> int:
    return max(16, triton.next_power_of_2(d))   # tl.dot needs every side >= 16


def _config(kernel: str, d: int, dv: int, dtype: torch.dtype) -> dict:
    """Block sizes and launch options for a kernel ("fwd", "dkdv", "dq"), head dims and dtype.

    Under the interpreter, small blocks, so that tiny tests cross several blocks. On the GPU,
    FlashAttention-2's usual shapes; checked by compiling for sm_90 (no spills, pipelined loads,
    wgmma), not yet timed. fp32 takes exact fp32 dots on the FMA units, with small blocks so
    that it fits in registers and shared memory; it is there for checking, not for speed.
    """
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=16)
    return gpu_config(kernel, d, dv, dtype)


def gpu_config(kernel: str, d: int, dv: int, dtype: torch.dtype) -> dict:
    """The GPU's block sizes and launch options (see ``_config``)."""
    wide = max(d, dv) > 64
    if dtype == torch.float32:   # 4 warps spill registers in dK/dV at D > 64 (Triton 3.9, sm_90)
        return dict(BLOCK_M=32, BLOCK_N=16, num_warps=8 if wide else 4, num_stages=2)
    if kernel == "fwd":
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8 if wide else 4, num_stages=3)
    if kernel == "dkdv":
        return dict(BLOCK_M=32, BLOCK_N=64 if wide else 128, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64 if wide else 128, BLOCK_N=32, num_warps=8 if wide else 4,
                num_stages=3)


def _common(q: Tensor, k: Tensor, v: Tensor) -> dict:
    d, dv = q.shape[-1], v.shape[-1]
    return dict(GROUP=q.shape[1] // k.shape[1], BLOCK_D=_block_dim(d), BLOCK_DV=_block_dim(dv),
                PRECISION=_precision(q.dtype))


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32:
        return "ieee"                            # tf32 would round fp32 inputs to 10 bits
    if dtype == torch.bfloat16 and interpreting():
        return "upcast"
    return "tf32"


def _forward(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float):
    """out (B, Hq, Tq, Dv) in q's dtype and lse (B, Hq, Tq) in float32."""
    b, hq, tq, d = q.shape
    tk, dv = k.shape[2], v.shape[-1]
    out = torch.empty(b, hq, tq, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, tq, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if tk == 0:                                  # no keys at all: every row is empty
        return out.zero_(), lse.fill_(float("-inf"))
    cfg = _config("fwd", d, dv, q.dtype)
    grid = (triton.cdiv(tq, cfg["BLOCK_M"]), b * hq)
    _attn_fwd[grid](q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                    hq, tq, tk, d, dv, scale * LOG2E, CAUSAL=is_causal, **_common(q, k, v),
                    **cfg)
    return out, lse


def _backward(q, k, v, out, lse, dout, is_causal: bool, scale: float):
    """dq, dk, dv (the shapes and dtype of q, k, v) from the output's gradient dout."""
    b, hq, tq, d = q.shape
    hkv, tk, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
    delta = (dout.float() * out.float()).sum(-1).contiguous()   # D = rowsum(dO ∘ O), (B, Hq, Tq)
    dq = torch.empty(b, hq, tq, d, dtype=q.dtype, device=q.device)
    dk = torch.empty(b, hkv, tk, d, dtype=k.dtype, device=k.device)
    dv = torch.empty(b, hkv, tk, dv_dim, dtype=v.dtype, device=v.device)
    common = _common(q, k, v)
    strides = (*q.stride(), *k.stride(), *v.stride(), *dout.stride())
    cfg = _config("dkdv", d, dv_dim, q.dtype)
    _bwd_dkdv[(triton.cdiv(tk, cfg["BLOCK_N"]), b * hkv)](
        q, k, v, dout, lse, delta, dk, dv, *strides, hkv, tq, tk, d, dv_dim, scale * LOG2E,
        scale, CAUSAL=is_causal, **common, **cfg)
    cfg = _config("dq", d, dv_dim, q.dtype)
    _bwd_dq[(triton.cdiv(tq, cfg["BLOCK_M"]), b * hq)](
        q, k, v, dout, lse, delta, dq, *strides, hq, tq, tk, d, dv_dim, scale * LOG2E,
        scale, CAUSAL=is_causal, **common, **cfg)
    return dq, dk, dv


class TritonFlashAttention(torch.autograd.Function):
    """out = attention(q, k, v) by the Triton kernels; backward recomputes from (q, k, v, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal: bool, scale: float):
        out, lse = _forward(q, k, v, is_causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        if 0 in q.shape or 0 in k.shape or 0 in v.shape[:-1]:   # nothing to launch over
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None
        dq, dk, dv = _backward(q, k, v, out, lse, dout, ctx.is_causal, ctx.scale)
        return dq, dk, dv, None, None


def unsupported(q: Tensor, k: Tensor, v: Tensor, *, attn_mask=None, window=None) -> str | None:
    """Why the Triton kernel cannot compute this call, or None if it can (inputs already valid)."""
    if attn_mask is not None:
        return "attn_mask is not supported by the 'triton' backend; use 'flash' or 'sdpa'"
    if window is not None:
        return f"window={window} is not supported by the 'triton' backend; use 'flash' or 'local'"
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} is not supported by the 'triton' backend; expected one of {DTYPES}"
    d, dv = q.shape[-1], v.shape[-1]
    if not (1 <= d <= MAX_HEAD_DIM and 1 <= dv <= MAX_HEAD_DIM):
        return (f"head dims D={d}, Dv={dv} are not supported by the 'triton' backend; "
                f"expected 1..{MAX_HEAD_DIM}")
    if interpreting():
        if q.device.type != "cpu":
            return (f"under TRITON_INTERPRET=1 the 'triton' backend needs CPU tensors, "
                    f"got device {q.device}")
    elif q.device.type != "cuda":
        return (f"the 'triton' backend needs CUDA tensors, got device {q.device} "
                "(or set TRITON_INTERPRET=1 before import to run it on the CPU, slowly)")
    return None


def triton_attention(
    q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None = None, is_causal: bool = False,
    scale: float | None = None, enable_gqa: bool = False, window: int | None = None,
) -> Tensor:
    """Attention by the Triton flash kernels, forward and backward.

    q: (B, Hq, Tq, D), k: (B, Hkv, Tk, D), v: (B, Hkv, Tk, Dv) -> (B, Hq, Tq, Dv), q's dtype.
    ``is_causal`` is bottom-right aligned (query i sits at position Tk - Tq + i); a query with no
    key (Tq > Tk) gets zeros. ``scale`` defaults to 1/sqrt(D); ``enable_gqa`` lets Hq be a
    multiple of Hkv. ``attn_mask``, ``window``, dtypes other than fp16/bf16/fp32, head dims over
    128 and non-CUDA tensors raise ValueError (see ``unsupported``).
    """
    check_attention_inputs(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa,
                           window=window)
    reason = unsupported(q, k, v, attn_mask=attn_mask, window=window)
    if reason is not None:
        raise ValueError(reason)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return TritonFlashAttention.apply(q, k, v, bool(is_causal), scale)


# --- throughput on a GPU ---------------------------------------------------------------------

# The cards whose ``torch.cuda.get_device_name()`` is known to name one card, with their row in
# ``course_attn.published``. "NVIDIA H100 80GB HBM3" is the SXM5 card; an H100 PCIe or NVL, with
# lower peaks, reports a name of its own. "NVIDIA H200" is the H200 SXM (vLLM's tuned-config
# files are named after this string: vllm-project/vllm#28349 loads "device_name=NVIDIA_H200" on
# one); the H200 NVL, with a lower peak, reports "NVIDIA H200 NVL" (vllm-project/vllm#23642).
PUBLISHED_CARDS = {"NVIDIA H100 80GB HBM3": "H100 SXM", "NVIDIA H200": "H200 SXM"}


def published_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 tensor-core peak, TFLOP/s, that ``course_attn.published`` gives for the
    CUDA device ``device_name`` (as ``torch.cuda.get_device_name()`` says it), or None for a
    card that the table does not know."""
    card = PUBLISHED_CARDS.get(device_name)
    return None if card is None else published_value(card, "bf16_dense_tflops")


def attention_flops(b: int, h: int, tq: int, tk: int, d: int, is_causal: bool,
                    backward: bool = False) -> float:
    """Matmul FLOPs: 4·B·H·Tq·Tk·D forward (q kᵀ and p v), halved when causal; the backward
    has 5 such matmuls to the forward's 2, so 2.5× that."""
    flops = 4.0 * b * h * tq * tk * d * (0.5 if is_causal else 1.0)
    return flops * 2.5 if backward else flops


def throughput_table(rows: list[dict], device_name: str, b: int, h: int, t: int) -> str:
    """``benchmark``'s rows (d, is_causal, backward, triton, sdpa in TFLOP/s) as a table, with
    each kernel's fraction of the card's published peak where ``published_peak_tflops`` knows
    the card, and without those columns, saying so, where it does not."""
    peak = published_peak_tflops(device_name)
    title = f"{device_name}  bf16  B={b} H={h} T={t}  "
    if peak is None:
        title += f"no published peak for {device_name}: fractions of peak withheld"
    else:
        title += f"published peak {peak} TFLOP/s (dense bf16, {PUBLISHED_CARDS[device_name]})"
    header = f"{'D':>4} {'causal':>6} {'pass':>4}  {'triton':>7} {'sdpa':>7}  {'ratio':>5}"
    lines = [title, header + (f"  {'triton/peak':>11} {'sdpa/peak':>9}" if peak is not None
                              else "")
             + "   (TFLOP/s)"]
    for row in rows:
        line = (f"{row['d']:>4} {str(row['is_causal']):>6} "
                f"{'bwd' if row['backward'] else 'fwd':>4}  {row['triton']:7.1f} "
                f"{row['sdpa']:7.1f}  {row['triton'] / row['sdpa']:5.2f}")
        if peak is not None:
            line += f"  {row['triton'] / peak:11.2f} {row['sdpa'] / peak:9.2f}"
        lines.append(line)
    return "\n".join(lines)


def benchmark(b: int = 4, h: int = 32, t: int = 4096, head_dims=(64, 128)) -> list[dict]:
    """TFLOP/s of the Triton kernels and of PyTorch's SDPA flash kernel, bf16, on this GPU.

    Square causal and non-causal attention, forward and backward; prints ``throughput_table``
    (fractions of the card's published peak only for a card ``course_attn.published`` knows)
    and returns its rows as dicts.
    """
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    rows = []
    for d in head_dims:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, generator=g)
                   .requires_grad_() for _ in range(3))
        for is_causal in (False, True):
            def ours():
                return triton_attention(q, k, v, is_causal=is_causal)

            def theirs():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return sdpa(q, k, v, is_causal=is_causal)

            torch.testing.assert_close(ours(), theirs(), atol=2e-2, rtol=2e-2)
            for backward in (False, True):
                tflops = {}
                for name, fn in (("triton", ours), ("sdpa", theirs)):
                    if backward:
                        out = fn()
                        dout = torch.randn_like(out)
                        ms = triton.testing.do_bench(
                            lambda: out.backward(dout, retain_graph=True), grad_to_none=[q, k, v])
                    else:
                        ms = triton.testing.do_bench(fn)
                    flops = attention_flops(b, h, t, t, d, is_causal, backward)
                    tflops[name] = flops / (ms * 1e-3) / 1e12
                rows.append(dict(d=d, is_causal=is_causal, backward=backward, **tflops))
    print(throughput_table(rows, torch.cuda.get_device_name(), b, h, t))
    return rows


if __name__ == "__main__":
    if not available():
        raise SystemExit("python -m course_attn.triton_flash measures GPU throughput: needs CUDA")
    benchmark()

"""Online softmax and flash attention: attention computed a tile at a time (chapter 9).

Attention over a set of keys can be summarised, for each query row, by two things: the
normalised output ``out`` (B, H, Tq, Dv) and the log-sum-exp ``lse`` (B, H, Tq) of the row's
scores. Two such summaries over disjoint key sets merge exactly (``merge_attention_states``),
which is all that tiling, split-KV decoding and ring attention need.

- ``online_softmax``: softmax in one pass over the row, a running max m and a running sum l.
- ``flash_attention``: the tiled forward (FlashAttention), which keeps (m, l, acc) for a block
  of queries while it walks over their key blocks, skipping the tiles that the causal mask or
  the window leave empty (``tile_schedule`` lists the ones it computes), and a backward that
  recomputes each tile from q, k, v, the output and the log-sum-exp (FlashAttention-2). Memory
  is O(T·D), never O(T²). Registered in ``backends`` as ``"flash"``.
- ``flash_decode``: split-KV decoding (flash-decoding): the keys cut into chunks, each chunk
  attended to separately, the partial results merged.
"""

import dataclasses
import functools
import itertools
import math

import torch
from torch import Tensor

from .arguments import check_non_negative_ints, check_positive_ints
from .attention import _accumulation_dtype, check_attention_inputs
from .masks import (band_mask, check_window, cut_mask, grouped_query_bias, key_reach,
                    to_additive)

__all__ = ["DEFAULT_BLOCK_K", "DEFAULT_BLOCK_Q", "flash_attention", "flash_decode",
           "merge_attention_states", "online_softmax", "tile_schedule"]

# Queries and keys per tile. Every tile is a few PyTorch calls made from Python, so on a CPU
# larger tiles pay that overhead less often: at T=4096 (B=1, H=8, D=64, causal, 2 cores) 64×64
# tiles took 3-3.9× SDPA's time, 128×128 about 2.2× (chapter 9; a GPU kernel picks its tiles
# to fit its on-chip memory instead, triton_flash.py).
DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128


# --- online softmax ----------------------------------------------------------------------------


def online_softmax(x: Tensor, dim: int = -1, *, block: int = 128) -> Tensor:
    """Softmax over ``dim`` in one pass over blocks of ``block`` entries, then a normalisation.

    Keeps, for every slice, a running max m and a running sum l = Σ exp(x - m); when a block
    raises the max to m', the sum so far is rescaled by exp(m - m') before the block's terms are
    added. Equals ``attention.softmax`` (any shape; a slice that is all -inf gives zeros).
    Computed in float32 at least, returned in x's dtype.
    """
    check_positive_ints(block=block)
    if x.shape[dim] == 0:
        return x.clone()
    dtype, work = x.dtype, _accumulation_dtype(x.dtype)
    x = x.movedim(dim, -1).to(work)
    # m starts at the lowest finite number, not -inf, so that exp(x - m) never meets -inf - -inf.
    m = torch.full(x.shape[:-1] + (1,), torch.finfo(work).min, dtype=work, device=x.device)
    l = torch.zeros_like(m)
    for start in range(0, x.shape[-1], block):
        xb = x[..., start:start + block]
        m_new = torch.maximum(m, xb.amax(dim=-1, keepdim=True))
        l = l * torch.exp(m - m_new) + torch.exp(xb - m_new).sum(dim=-1, keepdim=True)
        m = m_new
    p = torch.exp(x - m) / torch.where(l == 0, 1.0, l)
    return p.movedim(-1, dim).to(dtype)


# --- merging two partial attentions ------------------------------------------------------------


def merge_attention_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor,
                           lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Attention over the keys of A and of B together, from attention over each alone.

    out_a, out_b: (B, H, Tq, Dv)   lse_a, lse_b: (B, H, Tq)   ->   out (B, H, Tq, Dv), lse (B, H, Tq)

    ``lse = log(exp(lse_a) + exp(lse_b))`` and ``out`` is the average of the two outputs weighted
    by ``exp(lse_x - lse)``, each side's share of the row's total weight. The operation is
    associative and commutative; a side with no keys (lse = -inf) is the identity, and a row with
    no keys on either side stays out = 0, lse = -inf. Computed in float32 at least; ``out`` is
    returned in ``out_a``'s dtype, ``lse`` in float32 (or float64 for float64 inputs).
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(f"the two states must have one shape; got out {tuple(out_a.shape)} and "
                         f"{tuple(out_b.shape)}, lse {tuple(lse_a.shape)} and {tuple(lse_b.shape)}")
    if out_a.shape[:-1] != lse_a.shape:
        raise ValueError(f"lse must be out's shape without its last dim; got out "
                         f"{tuple(out_a.shape)} and lse {tuple(lse_a.shape)}")
    work = torch.promote_types(out_a.dtype, torch.float32)
    lse_a, lse_b = lse_a.to(work), lse_b.to(work)
    lse = torch.logaddexp(lse_a, lse_b)
    empty = lse == float("-inf")
    safe = torch.where(empty, torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe).masked_fill(empty, 0.0).unsqueeze(-1)   # (B, H, Tq, 1)
    w_b = torch.exp(lse_b - safe).masked_fill(empty, 0.0).unsqueeze(-1)
    out = w_a * out_a.to(work) + w_b * out_b.to(work)
    return out.to(out_a.dtype), lse


# --- which tiles are computed ------------------------------------------------------------------


def tile_schedule(tq: int, tk: int, block_q: int = DEFAULT_BLOCK_Q,
                  block_k: int = DEFAULT_BLOCK_K, is_causal: bool = False,
                  window: int | None = None) -> list[tuple[int, int]]:
    """The (query block, key block) pairs the tiled forward computes, query block by query block.

    Query block i holds queries i·block_q .. (i+1)·block_q - 1, key block j keys
    j·block_k .. (j+1)·block_k - 1 (the last ones shorter). Query i sits at position
    Tk - Tq + i (bottom-right); a tile is left out when no query in it may see any key in it:
    it lies entirely above the causal diagonal or entirely outside the window. Without
    ``is_causal`` and ``window`` every one of the ceil(Tq/block_q)·ceil(Tk/block_k) tiles is listed.
    """
    check_non_negative_ints(tq=tq, tk=tk)
    check_positive_ints(block_q=block_q, block_k=block_k)
    check_window(window)
    pairs = []
    for i in range(math.ceil(tq / block_q)):
        first = tk - tq + i * block_q                         # the block's first query position
        last = tk - tq + min((i + 1) * block_q, tq) - 1
        lo, hi = key_reach(first, last, tk, is_causal=is_causal, window=window)
        pairs += [(i, j) for j in range(lo // block_k, math.ceil(hi / block_k))]
    return pairs


def _tile_mask(shift: int, n: int, m: int, is_causal: bool, window: int | None,
               device) -> Tensor | None:
    """Bool (n, m): which keys of a tile each query may see; None when all of them may.

    Query i and key j of the tile lie ``shift + i - j`` positions apart (shift = the first
    query's position minus the first key's), so the pattern depends on the shift alone.
    """
    nearest, farthest = shift - (m - 1), shift + n - 1        # smallest and largest distance
    if ((not is_causal or nearest >= 0)
            and (window is None or (farthest < window and (is_causal or nearest > -window)))):
        return None
    return band_mask(shift, n, m, is_causal=is_causal, window=window, device=device)


@dataclasses.dataclass(frozen=True)
class _TileOptions:
    """What decides the tiles besides q, k, v and attn_mask; the forward keeps it for the
    backward. ``scale`` None means 1/sqrt(D)."""

    is_causal: bool
    scale: float | None
    window: int | None
    block_q: int
    block_k: int


class _Tiles:
    """q, k, v laid out for tiles, the schedule, and each tile's additive mask; for both passes.

    The G = Hq / Hkv query heads that share a key/value head (GQA) are stacked as extra rows: a
    query block is (B·Hkv, G·n, D) and a key block (B·Hkv, m, D), so that each tile is one
    batched matmul over every (batch, head) and keys are never repeated per query head.
    """

    def __init__(self, q, k, v, attn_mask, options: _TileOptions):
        (b, hq, self.tq, d), (hkv, self.tk) = q.shape, k.shape[1:3]
        self.batch_heads, self.g = (b, hkv), hq // hkv
        self.work = _accumulation_dtype(q.dtype)          # float32 for half-precision inputs
        self.options = options
        self.scale = 1.0 / math.sqrt(d) if options.scale is None else options.scale
        self.q = q.unflatten(1, (hkv, self.g))                         # (B, Hkv, G, Tq, D)
        self.k = k.to(self.work).flatten(0, 1)                         # (B·Hkv, Tk, D)
        self.v = v.to(self.work).flatten(0, 1)                         # (B·Hkv, Tk, Dv)
        self.mask = attn_mask                                # broadcastable to (B, Hq, Tq, Tk)
        self._shared = {}      # structural bias by (shift, n, m): diagonal tiles share one

    def query_blocks(self):
        """(qs, qe, [(ks, ke), ...]): each query block and the key blocks it computes."""
        block_q, block_k = self.options.block_q, self.options.block_k
        schedule = tile_schedule(self.tq, self.tk, block_q, block_k, self.options.is_causal,
                                 self.options.window)
        for i, pairs in itertools.groupby(schedule, key=lambda pair: pair[0]):
            qs, qe = i * block_q, min((i + 1) * block_q, self.tq)
            yield qs, qe, [(j * block_k, min((j + 1) * block_k, self.tk)) for _, j in pairs]

    def rows(self, x: Tensor, qs: int, qe: int) -> Tensor:
        """Queries qs:qe of x (B, Hkv, G, Tq, ...) as rows (B·Hkv, G·n, ...)."""
        return x[:, :, :, qs:qe].flatten(2, 3).flatten(0, 1)

    def put(self, dest: Tensor, qs: int, qe: int, rows: Tensor) -> None:
        """Write rows (B·Hkv, G·n, ...) into queries qs:qe of dest (B, Hkv, G, Tq, ...)."""
        dest[:, :, :, qs:qe] = rows.unflatten(1, (self.g, qe - qs)).unflatten(0, self.batch_heads)

    def queries(self, qs: int, qe: int) -> Tensor:
        """Queries qs:qe times the scale, in the working dtype: (B·Hkv, G·n, D)."""
        return self.rows(self.q, qs, qe).to(self.work) * self.scale

    def bias(self, qs: int, qe: int, ks: int, ke: int) -> Tensor | None:
        """The tile's additive mask (0 or -inf, plus a float attn_mask), broadcastable to its
        scores (B·Hkv, G·n, m); None when the tile needs none."""
        n, m, shift = qe - qs, ke - ks, self.tk - self.tq + qs - ks
        if (shift, n, m) not in self._shared:
            allowed = _tile_mask(shift, n, m, self.options.is_causal, self.options.window,
                                 self.k.device)
            self._shared[shift, n, m] = (None if allowed is None
                                         else to_additive(allowed, self.work))
        mask = None if self.mask is None else cut_mask(self.mask, qs, qe, ks, ke)
        return grouped_query_bias(self._shared[shift, n, m], mask,
                                  (*self.batch_heads, self.g, n, m), self.work)

    def scores(self, q_rows: Tensor, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        """S = scale · q kᵀ + bias of one tile, (B·Hkv, G·n, m), in the working dtype."""
        keys_t = self.k[:, ks:ke].transpose(1, 2)
        bias = self.bias(qs, qe, ks, ke)
        return torch.bmm(q_rows, keys_t) if bias is None else torch.baddbmm(bias, q_rows, keys_t)


# --- the tiled forward and backward ------------------------------------------------------------


def _forward(tiles: _Tiles, dv: int) -> tuple[Tensor, Tensor, Tensor]:
    """out (B, Hq, Tq, Dv) in q's dtype; each row's max score m and log l = log Σ exp(S - m)
    (B, Hq, Tq) in the working dtype, so that lse = m + log l."""
    (b, hkv), g, work, device = tiles.batch_heads, tiles.g, tiles.work, tiles.k.device
    out = torch.zeros(b, hkv, g, tiles.tq, dv, dtype=tiles.q.dtype, device=device)
    row_max = torch.full((b, hkv, g, tiles.tq, 1), torch.finfo(work).min, dtype=work,
                         device=device)
    log_sum = torch.full((b, hkv, g, tiles.tq, 1), -math.inf, dtype=work, device=device)
    for qs, qe, key_blocks in tiles.query_blocks():
        q_rows = tiles.queries(qs, qe)                                 # (B·Hkv, G·n, D)
        # The running max m starts at the lowest finite number, not -inf, so that a row whose
        # keys are all masked so far gives exp(-inf - m) = 0 rather than exp(-inf + inf) = NaN.
        m = torch.full(q_rows.shape[:-1] + (1,), torch.finfo(work).min, dtype=work,
                       device=device)                                  # running max of S
        l = torch.zeros_like(m)                                        # Σ exp(S - m)
        acc = q_rows.new_zeros(q_rows.shape[:-1] + (dv,))               # Σ exp(S - m) v
        for ks, ke in key_blocks:
            s = tiles.scores(q_rows, qs, qe, ks, ke)                    # (B·Hkv, G·n, m)
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            p = s.sub_(m_new).exp_()
            alpha = torch.exp(m - m_new)          # rescales what was summed under the old max
            l = l * alpha + p.sum(dim=-1, keepdim=True)
            acc = torch.baddbmm(acc * alpha, p, tiles.v[:, ks:ke])
            m = m_new
        tiles.put(out, qs, qe, acc / torch.where(l == 0, 1.0, l))      # no key: 0, not NaN
        tiles.put(row_max, qs, qe, m)
        tiles.put(log_sum, qs, qe, torch.log(l))                       # no key: -inf
    return out.flatten(1, 2), *(x.flatten(1, 2).squeeze(-1) for x in (row_max, log_sum))


def _backward(tiles: _Tiles, out: Tensor, lse: Tensor, row_max: Tensor, log_sum: Tensor,
              dout: Tensor, dlse: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv from the saved out and lse = m + log l, recomputing P = exp(S - lse) tile by
    tile as exp((S - m) - log l): m and log l are kept apart because their sum, rounded, loses
    log l when |m| is large (a row whose every key carries a finfo.min mask), and P would then
    no longer sum to 1.

    FlashAttention-2: D = rowsum(dO ∘ O); per tile dV += Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP - D),
    dQ += scale · dS K, dK += scale · dSᵀ Q. A gradient dlse of the log-sum-exp adds P · dlse to
    dS (d lse / d S = P), that is D - dlse in place of D.
    """
    (b, hkv), g, work = tiles.batch_heads, tiles.g, tiles.work
    delta = (dout.to(work) * out.to(work)).sum(dim=-1)                 # (B, Hq, Tq)
    if dlse is not None:
        delta = delta - dlse
    # lse - lse.detach() adds 0 but keeps the output lse in the graph of a double backward.
    # A row with no key has S = -inf, so P = exp(-inf) = 0 once its log l = -inf is made 0.
    log_sum = torch.where(log_sum == -math.inf, 0.0, log_sum + (lse - lse.detach()))
    as_rows = [x.unflatten(1, (hkv, g))
               for x in (dout, row_max.unsqueeze(-1), log_sum.unsqueeze(-1), delta.unsqueeze(-1))]
    dq = torch.zeros(tiles.q.shape, dtype=work, device=tiles.k.device)  # (B, Hkv, G, Tq, D)
    dk, dv = torch.zeros_like(tiles.k), torch.zeros_like(tiles.v)      # (B·Hkv, Tk, D | Dv)
    for qs, qe, key_blocks in tiles.query_blocks():
        q_rows = tiles.queries(qs, qe)                                 # scaled, (B·Hkv, G·n, D)
        do_rows, max_rows, log_sum_rows, delta_rows = (tiles.rows(x, qs, qe).to(work)
                                                        for x in as_rows)
        dq_rows = torch.zeros_like(q_rows)
        for ks, ke in key_blocks:
            p = (tiles.scores(q_rows, qs, qe, ks, ke)                  # P, recomputed
                 .sub_(max_rows).sub_(log_sum_rows).exp_())
            dv[:, ks:ke].baddbmm_(p.transpose(1, 2), do_rows)
            ds = torch.bmm(do_rows, tiles.v[:, ks:ke].transpose(1, 2)).sub_(delta_rows).mul_(p)
            dq_rows.baddbmm_(ds, tiles.k[:, ks:ke])
            dk[:, ks:ke].baddbmm_(ds.transpose(1, 2), q_rows)         # q_rows carries the scale
        tiles.put(dq, qs, qe, dq_rows * tiles.scale)
    return dq.flatten(1, 2), dk.unflatten(0, (b, hkv)), dv.unflatten(0, (b, hkv))


class _FlashAttention(torch.autograd.Function):
    """(q, k, v, attn_mask, _TileOptions) -> (out, lse); the backward recomputes the tiles."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, options):
        out, row_max, log_sum = _forward(_Tiles(q, k, v, attn_mask, options), v.shape[-1])
        lse = row_max + log_sum                                        # no key: -inf
        ctx.save_for_backward(q, k, v, attn_mask, out, lse, row_max, log_sum)
        ctx.options = options
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, attn_mask, out, lse, row_max, log_sum = ctx.saved_tensors
        if dout is None:                               # only lse was used
            dout = torch.zeros_like(out)
        dq, dk, dv = _backward(_Tiles(q, k, v, attn_mask, ctx.options), out, lse, row_max,
                               log_sum, dout, dlse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def flash_attention(
    q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None = None, is_causal: bool = False,
    scale: float | None = None, enable_gqa: bool = False, window: int | None = None,
    block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K, return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention a tile at a time, never holding the Tq×Tk scores: FlashAttention in PyTorch.

    q: (B, Hq, Tq, D), k: (B, Hkv, Tk, D), v: (B, Hkv, Tk, Dv) -> out (B, Hq, Tq, Dv); with
    ``return_lse=True``, (out, lse) where lse (B, Hq, Tq) is each row's log-sum-exp of scores
    (float32, float64 for float64 inputs; -inf for a row with no key). The keywords are those of
    ``attention.scaled_dot_product_attention``, whose numbers it returns: bottom-right causal,
    windows, bool or float ``attn_mask`` (cut per tile, never expanded to (Tq, Tk)), GQA.

    Queries go in blocks of ``block_q``, keys in blocks of ``block_k``. Each query block keeps a
    running max m, a running sum l and an unnormalised output acc while it meets its key blocks;
    the tiles that the causal mask or the window leave empty are skipped (``tile_schedule``).
    Memory is O((Tq + Tk)·D) plus one tile. Half precision is computed in float32.
    The backward recomputes each tile's probabilities from q, k, v, out and lse (FlashAttention-2)
    and differentiates lse too. No gradient is computed for ``attn_mask``: a float mask that
    requires grad is a ValueError while gradients are enabled (detach it, or use ``"math"``).
    """
    check_attention_inputs(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa,
                           window=window)
    check_positive_ints(block_q=block_q, block_k=block_k)
    if attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled():
        raise ValueError("flash_attention computes no gradient for attn_mask, which requires "
                         "grad; pass attn_mask.detach(), or use the 'math' backend")
    options = _TileOptions(bool(is_causal), scale, window, block_q, block_k)
    out, lse = _FlashAttention.apply(q, k, v, attn_mask, options)
    return (out, lse) if return_lse else out


# --- split-KV decoding -------------------------------------------------------------------------


def flash_decode(
    q: Tensor, k: Tensor, v: Tensor, *, num_splits: int, attn_mask: Tensor | None = None,
    scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Split-KV decoding (flash-decoding): the keys in ``num_splits`` chunks, each attended to
    on its own, the (out, lse) of the chunks merged with ``merge_attention_states``.

    q: (B, Hq, Tq, D) (usually Tq = 1: the new token, which sees every cached key),
    k: (B, Hkv, Tk, D), v: (B, Hkv, Tk, Dv) -> (B, Hq, Tq, Dv), or (out, lse) with
    ``return_lse``. Equals attention over all the keys without a causal mask. On a GPU the chunks
    run in parallel, so one query still fills the device; here they run one after the other.
    ``attn_mask`` (e.g. padding) is cut with the keys when its last dim is Tk. Chunks are
    contiguous and as equal as can be (``tensor_split``); an empty one is the merge's identity.
    """
    check_attention_inputs(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa)
    check_positive_ints(num_splits=num_splits)
    tk = k.shape[2]
    masks = ([attn_mask] * num_splits if attn_mask is None or attn_mask.shape[-1] != tk
             else attn_mask.tensor_split(num_splits, dim=-1))
    # half precision: the chunks' outputs stay in float32 until the last merge, so that the
    # rounding does not grow with num_splits
    work = _accumulation_dtype(q.dtype)
    states = [flash_attention(q.to(work), kc.to(work), vc.to(work), attn_mask=mask, scale=scale,
                              enable_gqa=enable_gqa, return_lse=True)
              for kc, vc, mask in zip(k.tensor_split(num_splits, dim=2),
                                      v.tensor_split(num_splits, dim=2), masks)]
    out, lse = functools.reduce(lambda a, b: merge_attention_states(*a, *b), states)
    out = out.to(v.dtype)
    return (out, lse) if return_lse else out

"""Multi-head attention: H small attentions side by side, each in its own subspace.

    q = x Wq, k = x Wk, v = x Wv                  (B, T, C) -> (B, T, H·D)
    split into heads                              (B, T, H·D) -> (B, H, T, D)
    attend, each head on its own                  (B, H, T, D)
    merge the heads, mix them with Wo             (B, H, T, D) -> (B, T, H·D) -> (B, T, C)

With ``n_kv_heads < n_heads`` (grouped-query attention), Wk and Wv make only ``n_kv_heads``
heads and each serves ``n_heads // n_kv_heads`` query heads. RoPE (``rope.py``), QK-norm
(``norm.py``), a sliding window, dropout on the weights and cross-attention are options of the
one module, applied to the heads between the split and the attention. With a ``KVCache``
(chapter 8) the new keys and values are appended to the cache and the queries attend to all of it;
with a windowed module, a ``RollingKVCache`` (chapter 11) keeps only the last ``window`` of them.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .arguments import check_positive_ints
from .attention import attention_weights, repeat_kv
from .backends import get_backend
from .kv_cache import KVCache, RollingKVCache, is_kv_cache
from .masks import check_window
from .norm import RMSNorm
from .rope import RotaryEmbedding, apply_rotary_emb

__all__ = ["MultiHeadAttention", "merge_heads", "repeat_kv", "split_heads"]


def split_heads(x: Tensor, n_heads: int) -> Tensor:
    """(B, T, H·D) -> (B, H, T, D): cut the channels into ``n_heads`` heads of D channels each."""
    if x.dim() != 3:
        raise ValueError(f"split_heads expects (B, T, H·D), got shape {tuple(x.shape)}")
    b, t, c = x.shape
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1 or c % n_heads:
        raise ValueError(f"cannot split {c} channels (shape {tuple(x.shape)}) into {n_heads!r} heads")
    return x.view(b, t, n_heads, c // n_heads).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """(B, H, T, D) -> (B, T, H·D): put the heads back side by side; undoes ``split_heads``."""
    if x.dim() != 4:
        raise ValueError(f"merge_heads expects (B, H, T, D), got shape {tuple(x.shape)}")
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


class MultiHeadAttention(nn.Module):
    """Attention with ``n_heads`` query heads, and every modern variant as an option.

    ``d_model`` = C, the width of the residual stream; each head has D = C / n_heads channels,
    unless ``head_dim`` sets D itself (Qwen3: H·D need not equal C).

    Options (all keyword-only; the defaults give plain multi-head self-attention):
      ``n_kv_heads``  None means ``n_heads``; fewer gives grouped-query attention (GQA), 1 gives
                      multi-query attention (MQA).
      ``bias``        biases in the four projections.
      ``backend``     any name in ``course_attn.backends.BACKENDS``; all give the same numbers.
      ``rope``        rotate q and k by their positions (``rope.py``); ``rope_base`` is the base,
                      ``max_seq_len`` the length whose cos/sin are cached, ``rope_interleaved``
                      the pairing of channels.
      ``qk_norm``     RMSNorm over the head dimension of q and of k, per head, before the dot
                      product; ``qk_norm_order`` puts it "before_rope" (OLMo 2, Qwen3, Gemma 3)
                      or "after_rope" (nanochat).
      ``window``      each query sees only the keys less than ``window`` positions away.
      ``dropout``     dropout on the attention weights, in training mode only; it needs the
                      weights themselves, which only ``backend="math"`` builds, so another
                      backend with ``dropout > 0`` is refused (ValueError).
      ``scale``       the factor of the scores; None is 1/sqrt(D).
      ``context_dim`` the width of ``context`` for cross-attention (default ``d_model``).
      ``head_dim``    D, when it is not d_model / n_heads (then d_model need not divide).

    The projections are ``q_proj`` (C -> H·D), ``k_proj`` and ``v_proj`` (context width ->
    Hkv·D) and ``out_proj`` (H·D -> C); with ``qk_norm``, ``q_norm`` and ``k_norm`` hold the
    gains (D,); with ``rope``, ``rotary`` is the ``RotaryEmbedding``.
    """

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: int | None = None,
                 bias: bool = False, backend: str = "math", rope: bool = False,
                 rope_base: float = 10000.0, max_seq_len: int = 4096,
                 rope_interleaved: bool = False, qk_norm: bool = False,
                 qk_norm_order: str = "before_rope", window: int | None = None,
                 dropout: float = 0.0, scale: float | None = None,
                 context_dim: int | None = None, head_dim: int | None = None):
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        context_dim = d_model if context_dim is None else context_dim
        check_positive_ints(d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads,
                            context_dim=context_dim)
        if head_dim is None and d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
        self.explicit_head_dim = head_dim is not None
        if self.explicit_head_dim:
            check_positive_ints(head_dim=head_dim)
            odd = f"head_dim={head_dim} is odd"
        else:
            head_dim = d_model // n_heads
            odd = f"head_dim = d_model / n_heads = {d_model} / {n_heads} = {head_dim} is odd"
        if rope and head_dim % 2:
            raise ValueError(f"rope rotates pairs of channels, but {odd}")
        if qk_norm_order not in ("before_rope", "after_rope"):
            raise ValueError(f"qk_norm_order must be 'before_rope' or 'after_rope', "
                             f"got {qk_norm_order!r}")
        check_window(window)
        if (isinstance(dropout, bool) or not isinstance(dropout, (int, float))
                or not 0 <= dropout < 1):
            raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
            raise ValueError(f"scale must be a number or None, got {scale!r}")
        get_backend(backend)  # fail now, not at the first forward
        if dropout > 0 and backend != "math":
            raise ValueError(f"dropout={dropout} drops attention weights, which only "
                             f"backend='math' builds; backend={backend!r} takes no dropout: use "
                             "backend='math' to train with dropout, or dropout=0")

        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim, self.context_dim = head_dim, context_dim
        self.backend, self.window, self.dropout, self.scale = backend, window, dropout, scale
        self.qk_norm_order, self.rope_interleaved = qk_norm_order, rope_interleaved
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(context_dim, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(context_dim, n_kv_heads * head_dim, bias=bias)
        self.out_proj = nn.Linear(n_heads * head_dim, d_model, bias=bias)
        self.rotary = RotaryEmbedding(head_dim, max_seq_len, rope_base) if rope else None
        self.q_norm = RMSNorm(head_dim) if qk_norm else None
        self.k_norm = RMSNorm(head_dim) if qk_norm else None

    def project(self, x: Tensor, *, context: Tensor | None = None,
                positions: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """The heads the dot product sees: x (B, T, C) -> q (B, H, T, D), k and v (B, Hkv, S, D).

        Keys and values come from ``context`` (B, S, context_dim) when given, else from x
        (S = T). q and k are normalised and rotated here when the module does so; ``positions``
        (T,) are the positions RoPE uses (default 0 .. T-1).
        """
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be (B, T, C={self.d_model}), got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
        source = x if context is None else context
        if context is not None:
            if (not isinstance(context, Tensor) or context.dim() != 3
                    or context.shape[0] != x.shape[0] or context.shape[-1] != self.context_dim):
                got = (tuple(context.shape) if isinstance(context, Tensor)
                       else type(context).__name__)
                raise ValueError(f"context must be (B={x.shape[0]}, S, "
                                 f"context_dim={self.context_dim}), got {got}")
            if self.rotary is not None:
                raise ValueError("rope rotates queries and keys by positions in one sequence; "
                                 "it is not defined for cross-attention (context=...)")
        q = split_heads(self.q_proj(x), self.n_heads)           # (B, H, T, D)
        k = split_heads(self.k_proj(source), self.n_kv_heads)   # (B, Hkv, S, D)
        v = split_heads(self.v_proj(source), self.n_kv_heads)   # (B, Hkv, S, D)
        if self.q_norm is not None and self.qk_norm_order == "before_rope":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            t = x.shape[1]
            if positions is None:
                positions = torch.arange(t, device=x.device)
            elif not isinstance(positions, Tensor) or positions.shape != (t,):
                got = tuple(positions.shape) if isinstance(positions, Tensor) else positions
                raise ValueError(f"positions must be a ({t},) tensor for x of shape "
                                 f"{tuple(x.shape)}, got {got!r}")
            cos, sin = self.rotary(positions)                    # (T, D/2)
            q = apply_rotary_emb(q, cos, sin, self.rope_interleaved)
            k = apply_rotary_emb(k, cos, sin, self.rope_interleaved)
        if self.q_norm is not None and self.qk_norm_order == "after_rope":
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def new_cache(self, batch_size: int, max_seq_len: int, *, dtype: torch.dtype | None = None,
                  device=None) -> KVCache:
        """An empty ``KVCache`` for this module's key/value heads: (B, Hkv, max_seq_len, D).

        ``dtype`` and ``device`` default to those of the module's weights."""
        weight = self.k_proj.weight
        return KVCache(batch_size, self.n_kv_heads, max_seq_len, self.head_dim,
                       dtype=weight.dtype if dtype is None else dtype,
                       device=weight.device if device is None else device)

    def new_rolling_cache(self, batch_size: int, *, sinks: int = 0,
                          dtype: torch.dtype | None = None, device=None) -> RollingKVCache:
        """An empty ``RollingKVCache`` of this module's window: (B, Hkv, sinks + window, D).

        Only for a module with a ``window``; ``dtype`` and ``device`` default to the weights'."""
        if self.window is None:
            raise ValueError("a rolling cache keeps only the last `window` tokens, but this module "
                             "has window=None (it attends to every earlier token): use new_cache")
        weight = self.k_proj.weight
        return RollingKVCache(batch_size, self.n_kv_heads, self.window, self.head_dim,
                              sinks=sinks, dtype=weight.dtype if dtype is None else dtype,
                              device=weight.device if device is None else device)

    def forward(self, x: Tensor, *, context: Tensor | None = None,
                attn_mask: Tensor | None = None, is_causal: bool | None = None,
                positions: Tensor | None = None,
                cache: KVCache | RollingKVCache | None = None,
                return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """x: (B, T, C) -> (B, T, C); with ``return_weights``, also the weights (B, H, T, S).

        ``context`` (B, S, context_dim): attend to it (cross-attention) instead of to x.
        ``attn_mask`` (bool: True = may attend, or float: added to the scores) broadcasts to
        (B, H, T, S). ``is_causal`` hides each token's future; None means True for
        self-attention and False for cross-attention. A key must pass the mask, the causal
        rule and the window. ``positions``: (T,) positions for RoPE, default 0 .. T-1.

        ``cache`` (a ``KVCache``, see ``new_cache``): x's keys and values are appended to it and
        the queries attend to every cached key, S = len(cache) after the update. x's tokens are
        then the last T of the sequence: RoPE positions default to len(cache) .. len(cache)+T-1
        (read before the update) and the causal mask is aligned bottom-right.

        A ``RollingKVCache`` (``new_rolling_cache``; for a module with a ``window`` no larger
        than the cache's, causal, without ``attn_mask``) returns its keys in its own order, so
        the mask comes from the cache (``RollingKVCache.append``): the window, plus the cache's
        attention sinks when it keeps some.

        ``return_weights``: the output is computed from the weights returned (dropped out in
        training), so attention runs once, by the "math" rule whatever the backend.
        """
        if is_causal is None:
            is_causal = context is None
        if cache is not None:
            if context is not None:
                raise ValueError("cache is for self-attention; cross-attention's keys come from "
                                 "context, which does not grow")
            if not is_kv_cache(cache):
                raise ValueError(f"cache must be a KVCache, got {type(cache).__name__} (or a "
                                 "RollingKVCache, for a module with a window)")
            if cache.n_kv_heads != self.n_kv_heads or cache.head_dim != self.head_dim:
                raise ValueError(f"the cache holds n_kv_heads={cache.n_kv_heads} heads of "
                                 f"head_dim={cache.head_dim}, this module makes "
                                 f"{self.n_kv_heads} of {self.head_dim}")
            if positions is None and isinstance(x, Tensor) and x.dim() == 3:
                positions = torch.arange(len(cache), len(cache) + x.shape[1], device=x.device)
        q, k, v = self.project(x, context=context, positions=positions)
        window = self.window
        if cache is not None:                                                  # (B, Hkv, S, D)
            k, v, attn_mask, is_causal, window = cache.append(
                k, v, attn_mask=attn_mask, is_causal=is_causal, window=window)
        options = dict(attn_mask=attn_mask, is_causal=is_causal, scale=self.scale,
                       enable_gqa=self.n_kv_heads != self.n_heads, window=window)
        dropping = self.training and self.dropout > 0      # backend "math" (see __init__)
        if not (dropping or return_weights):
            out = get_backend(self.backend)(q, k, v, **options)               # (B, H, T, D)
            return self.out_proj(merge_heads(out))                             # (B, T, C)
        weights = attention_weights(q, k, **options)                          # (B, H, T, S)
        kept = F.dropout(weights, self.dropout) if dropping else weights
        out = kept @ repeat_kv(v, self.n_heads // self.n_kv_heads)             # (B, H, T, D)
        out = self.out_proj(merge_heads(out))                                  # (B, T, C)
        return (out, weights) if return_weights else out

    def extra_repr(self) -> str:
        options = [f"d_model={self.d_model}", f"n_heads={self.n_heads}",
                   f"n_kv_heads={self.n_kv_heads}", f"backend={self.backend!r}"]
        if self.context_dim != self.d_model:
            options.append(f"context_dim={self.context_dim}")
        if self.explicit_head_dim:
            options.append(f"head_dim={self.head_dim}")
        if self.q_norm is not None:
            options.append(f"qk_norm={self.qk_norm_order!r}")
        if self.window is not None:
            options.append(f"window={self.window}")
        if self.dropout:
            options.append(f"dropout={self.dropout}")
        if self.scale is not None:
            options.append(f"scale={self.scale}")
        return ", ".join(options)

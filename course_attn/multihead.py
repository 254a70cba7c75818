"""Multi-head attention: H small attentions side by side, each in its own subspace.

    q = x Wq, k = x Wk, v = x Wv                  (B, T, C) -> (B, T, H·D)
    split into heads                              (B, T, H·D) -> (B, H, T, D)
    attend, each head on its own                  (B, H, T, D)
    merge the heads, mix them with Wo             (B, H, T, D) -> (B, T, H·D) -> (B, T, C)

With ``n_kv_heads < n_heads`` (grouped-query attention), Wk and Wv make only ``n_kv_heads``
heads and each serves ``n_heads // n_kv_heads`` query heads.
"""

from torch import Tensor, nn

from .attention import attention_weights, repeat_kv
from .backends import get_backend

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
    """Self-attention with ``n_heads`` query heads and ``n_kv_heads`` key/value heads.

    ``d_model`` = C, the width of the residual stream; each head has D = C / n_heads channels.
    ``n_kv_heads``: None means ``n_heads`` (plain multi-head); fewer gives grouped-query
    attention, 1 gives multi-query attention. ``backend``: any name in
    ``course_attn.backends.BACKENDS`` ("math", "sdpa", ...); all give the same numbers.
    """

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: int | None = None,
                 bias: bool = False, backend: str = "math"):
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        for name, n in (("d_model", d_model), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be a positive int, got {n!r}")
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
        get_backend(backend)  # fail now, not at the first forward

        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.backend = backend
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.out_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=bias)

    def forward(self, x: Tensor, *, attn_mask: Tensor | None = None, is_causal: bool = True,
                return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """x: (B, T, C) -> (B, T, C); with ``return_weights``, also the weights (B, H, T, T).

        ``attn_mask`` (bool: True = may attend, or float: added to the scores) broadcasts to
        (B, H, T, T); ``is_causal`` hides each token's future. A key must pass both.
        """
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be (B, T, C={self.d_model}), got shape {tuple(x.shape)}")
        q = split_heads(self.q_proj(x), self.n_heads)       # (B, H, T, D)
        k = split_heads(self.k_proj(x), self.n_kv_heads)    # (B, Hkv, T, D)
        v = split_heads(self.v_proj(x), self.n_kv_heads)    # (B, Hkv, T, D)
        options = dict(attn_mask=attn_mask, is_causal=is_causal,
                       enable_gqa=self.n_kv_heads != self.n_heads)
        out = get_backend(self.backend)(q, k, v, **options)  # (B, H, T, D)
        out = self.out_proj(merge_heads(out))                # (B, T, C)
        if return_weights:
            return out, attention_weights(q, k, **options)
        return out

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
                f"backend={self.backend!r}")

"""Multi-head latent attention (MLA, DeepSeek-V2): cache one small latent per token, not K and V.

GQA shrinks the KV cache by sharing key/value heads. MLA shrinks it further by caching, per token,
one vector c of ``latent_dim`` = Dc channels from which every head's key and value are rebuilt:

    c      = RMSNorm(x W_dkv)                   (B, T, Dc)       cached
    k_rope = RoPE(x W_kr)                       (B, T, Dr)       cached, one for all heads
    k_h    = [c W_uk,h ; k_rope]                (B, H, T, D + Dr)
    v_h    = c W_uv,h                           (B, H, T, D)
    q_h    = [q_nope,h ; RoPE(q_rope,h)] = x W_q (B, H, T, D + Dr)

so a token costs Dc + Dr numbers per layer in the cache instead of 2·H·D. The scores need the
keys only through q_h · k_h, and q_nope,h · (c W_uk,h) = (q_nope,h W_uk,hᵀ) · c: W_uk can be
"absorbed" into the query, and W_uv into the output, so that attention runs on the latents
directly, as multi-query attention with one key head [c ; k_rope] of width Dc + Dr whose values
are c. ``forward(..., absorb=False)`` rebuilds K and V (the uncompressed form);
``absorb=True`` attends to the latents; both give the same output.

RoPE cannot go through the latent (a rotation that depends on the position would sit between
the query and W_uk and could not be absorbed), hence the decoupled key k_rope, shared by the
heads, and its own Dr channels of each query.
"""

import math

import torch
from torch import Tensor, nn

from .arguments import check_positive_ints
from .backends import get_backend
from .kv_cache import KVCache
from .multihead import merge_heads, split_heads
from .norm import RMSNorm
from .rope import RotaryEmbedding, apply_rotary_emb

__all__ = ["MultiHeadLatentAttention"]


class MultiHeadLatentAttention(nn.Module):
    """Causal self-attention whose cache holds a latent of ``latent_dim`` and a RoPE key per token.

    ``d_model`` = C; ``n_heads`` = H heads of ``head_dim`` = D channels (default C / H) for the
    content part of q and k and for v; ``rope_dim`` = Dr (even) channels of q and of the shared
    key carry the position. Projections: ``q_proj`` (C -> H·(D+Dr)), ``kv_down`` (C -> Dc) and
    ``kv_norm``, ``k_rope_proj`` (C -> Dr), ``k_up`` and ``v_up`` (Dc -> H·D), ``out_proj``
    (H·D -> C). The cache (``new_cache``) is a ``KVCache`` with one head whose "keys" are the
    latents c (Dc wide) and whose "values" are the RoPE keys (Dr wide).
    """

    def __init__(self, d_model: int, n_heads: int, *, latent_dim: int, head_dim: int | None = None,
                 rope_dim: int = 16, rope_base: float = 10000.0, max_seq_len: int = 4096,
                 backend: str = "math"):
        super().__init__()
        head_dim = d_model // n_heads if head_dim is None else head_dim
        check_positive_ints(d_model=d_model, n_heads=n_heads, latent_dim=latent_dim,
                            head_dim=head_dim, rope_dim=rope_dim)
        if rope_dim % 2:
            raise ValueError(f"rope_dim rotates pairs of channels and must be even, got {rope_dim}")
        get_backend(backend)
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self.latent_dim, self.rope_dim, self.backend = latent_dim, rope_dim, backend
        self.q_proj = nn.Linear(d_model, n_heads * (head_dim + rope_dim), bias=False)
        self.kv_down = nn.Linear(d_model, latent_dim, bias=False)
        self.kv_norm = RMSNorm(latent_dim)
        self.k_rope_proj = nn.Linear(d_model, rope_dim, bias=False)
        self.k_up = nn.Linear(latent_dim, n_heads * head_dim, bias=False)
        self.v_up = nn.Linear(latent_dim, n_heads * head_dim, bias=False)
        self.out_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self.rotary = RotaryEmbedding(rope_dim, max_seq_len, rope_base)

    def new_cache(self, batch_size: int, max_seq_len: int, *, dtype: torch.dtype | None = None,
                  device=None) -> KVCache:
        """An empty cache for ``max_seq_len`` tokens: latents (B, 1, S, Dc), RoPE keys (B, 1, S, Dr)."""
        weight = self.kv_down.weight
        return KVCache(batch_size, 1, max_seq_len, self.latent_dim, value_dim=self.rope_dim,
                       dtype=weight.dtype if dtype is None else dtype,
                       device=weight.device if device is None else device)

    def compress(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """What the cache keeps of x (B, T, C): latents (B, 1, T, Dc) and RoPE keys (B, 1, T, Dr)."""
        latent = self.kv_norm(self.kv_down(x)).unsqueeze(1)                 # (B, 1, T, Dc)
        cos, sin = self.rotary(positions)                                   # (T, Dr/2)
        k_rope = apply_rotary_emb(self.k_rope_proj(x).unsqueeze(1), cos, sin)   # (B, 1, T, Dr)
        return latent, k_rope

    def forward(self, x: Tensor, *, positions: Tensor | None = None, cache: KVCache | None = None,
                absorb: bool = False) -> Tensor:
        """x: (B, T, C) -> (B, T, C), causal.

        ``positions`` (T,) for RoPE default to 0 .. T-1, or len(cache) .. with a ``cache``, to
        which x's latents and RoPE keys are appended. ``absorb``: attend to the latents directly
        instead of rebuilding each head's keys and values; the same output.
        """
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be (B, T, C={self.d_model}), got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
        t = x.shape[1]
        if cache is not None and (not isinstance(cache, KVCache) or cache.n_kv_heads != 1
                                  or cache.head_dim != self.latent_dim
                                  or cache.value_dim != self.rope_dim):
            raise ValueError("cache must come from this module's new_cache (one head of "
                             f"latent_dim={self.latent_dim} and rope_dim={self.rope_dim})")
        if positions is None:
            start = 0 if cache is None else len(cache)
            positions = torch.arange(start, start + t, device=x.device)
        latent, k_rope = self.compress(x, positions)          # (B, 1, T, Dc), (B, 1, T, Dr)
        if cache is not None:
            latent, k_rope = cache.update(latent, k_rope)      # (B, 1, S, Dc), (B, 1, S, Dr)
        h, d, s = self.n_heads, self.head_dim, latent.shape[2]
        q = split_heads(self.q_proj(x), h)                                     # (B, H, T, D+Dr)
        q_nope, q_rope = q.split([d, self.rope_dim], dim=-1)
        cos, sin = self.rotary(positions)
        q_rope = apply_rotary_emb(q_rope, cos, sin)                            # (B, H, T, Dr)
        scale = 1.0 / math.sqrt(d + self.rope_dim)
        attend = get_backend(self.backend)
        if absorb:
            w_uk = self.k_up.weight.view(h, d, self.latent_dim)                # (H, D, Dc)
            w_uv = self.v_up.weight.view(h, d, self.latent_dim)                # (H, D, Dc)
            q_latent = torch.cat([q_nope @ w_uk, q_rope], dim=-1)             # (B, H, T, Dc+Dr)
            k_latent = torch.cat([latent, k_rope], dim=-1)                    # (B, 1, S, Dc+Dr)
            out = attend(q_latent, k_latent, latent, is_causal=True, scale=scale,
                         enable_gqa=h > 1)                                    # (B, H, T, Dc)
            out = out @ w_uv.transpose(-2, -1)                                 # (B, H, T, D)
        else:
            c = latent.squeeze(1)                                              # (B, S, Dc)
            k = torch.cat([split_heads(self.k_up(c), h),
                           k_rope.expand(-1, h, s, -1)], dim=-1)              # (B, H, S, D+Dr)
            v = split_heads(self.v_up(c), h)                                   # (B, H, S, D)
            out = attend(torch.cat([q_nope, q_rope], dim=-1), k, v, is_causal=True,
                         scale=scale)                                          # (B, H, T, D)
        return self.out_proj(merge_heads(out))                                 # (B, T, C)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, head_dim={self.head_dim}, "
                f"latent_dim={self.latent_dim}, rope_dim={self.rope_dim}, "
                f"backend={self.backend!r}")

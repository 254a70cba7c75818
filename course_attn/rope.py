"""Rotary position embedding (RoPE): encode a token's position m by rotating its q and k.

The D channels of a head form D/2 pairs; pair i is rotated by the angle m·θᵢ, with

    θᵢ = base^(-2i/D),   i = 0 .. D/2 - 1                 (fast pairs first, slow pairs last)

    [x₁']   [cos mθᵢ  -sin mθᵢ] [x₁]
    [x₂'] = [sin mθᵢ   cos mθᵢ] [x₂]         (a rotation by +mθᵢ, as RoFormer and Llama)

Because a rotation by mθ followed by the dot product with a key rotated by nθ only sees the
difference, q_m · k_n depends on positions through m - n alone.

Which channels form a pair is a convention: ``interleaved=False`` pairs channel i with i + D/2
(GPT-NeoX, Llama in Hugging Face), ``interleaved=True`` pairs 2i with 2i + 1 (RoFormer, Meta's
Llama, written with complex numbers). Both are the same rotation up to a fixed permutation of D.

``scaled_rope_frequencies`` gives the frequencies that models stretched past their training
length use instead of θᵢ: position interpolation (every θᵢ / s), NTK-aware (a larger base) and
Llama 3.1's (long wavelengths / s, short ones kept).
"""

import torch
from torch import Tensor, nn

from .arguments import check_positive_ints

__all__ = ["RotaryEmbedding", "apply_rotary_emb", "rope_frequencies", "scaled_rope_frequencies"]


def _check_head_dim(head_dim) -> None:
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"RoPE rotates pairs of channels: head_dim must be an even int >= 2, "
                         f"got {head_dim!r}")


def rope_frequencies(head_dim: int, base: float = 10000.0, *, device=None) -> Tensor:
    """θᵢ = base^(-2i/D) for i = 0 .. D/2 - 1: shape (D/2,), float32, from 1 down to ~1/base."""
    _check_head_dim(head_dim)
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1:
        raise ValueError(f"base must be a number > 1, got {base!r}")
    i = torch.arange(head_dim // 2, dtype=torch.float64, device=device)
    return (float(base) ** (-2.0 * i / head_dim)).float()


SCALINGS = ("linear", "ntk", "llama3")


def _is_number(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float))


def scaled_rope_frequencies(head_dim: int, base: float = 10000.0, *, kind: str, factor: float,
                            original_max_len: int | None = None, low_freq_factor: float = 1.0,
                            high_freq_factor: float = 4.0, device=None) -> Tensor:
    """The frequencies θᵢ of ``rope_frequencies``, rescaled to stretch the context by ``factor``.

    Shape (D/2,), float32, like ``rope_frequencies(head_dim, base)``. With s = ``factor`` >= 1 and
    the wavelength λᵢ = 2π/θᵢ of pair i:

    - ``kind="linear"``: position interpolation (Chen et al. 2023), θᵢ / s for every pair; the
      same as dividing every position by s.
    - ``kind="ntk"``: "NTK-aware" scaling, the base multiplied by s^(D/(D-2)): pair 0 keeps
      θ₀ = 1, the last pair is divided by s, and the pairs between by s^(2i/(D-2)).
    - ``kind="llama3"``: Llama 3.1's rule for a model trained on ``original_max_len`` tokens
      (L): pairs with λᵢ < L / ``high_freq_factor`` are kept, pairs with
      λᵢ > L / ``low_freq_factor`` are divided by s, and in between
      θᵢ' = (1 - γ) θᵢ / s + γ θᵢ with γ = (L/λᵢ - low_freq_factor) /
      (high_freq_factor - low_freq_factor), which joins the two ends continuously.
    """
    theta = rope_frequencies(head_dim, base, device=device)            # checks head_dim, base
    if kind not in SCALINGS:
        raise ValueError(f"kind must be one of {SCALINGS}, got {kind!r}")
    if not _is_number(factor) or not factor >= 1 or factor == float("inf"):
        raise ValueError(f"factor must be a finite number >= 1, got {factor!r}")
    if kind == "linear":
        return theta / factor
    if kind == "ntk":
        if head_dim < 4:
            raise ValueError(f"kind='ntk' keeps the first pair and divides the last by factor: "
                             f"it needs two pairs, head_dim >= 4, got {head_dim}")
        return rope_frequencies(head_dim, float(base) * factor ** (head_dim / (head_dim - 2)),
                                device=device)
    check_positive_ints(original_max_len=original_max_len)
    if not (_is_number(low_freq_factor) and _is_number(high_freq_factor)
            and 0 < low_freq_factor < high_freq_factor < float("inf")):
        raise ValueError(f"need 0 < low_freq_factor < high_freq_factor, got {low_freq_factor!r} "
                         f"and {high_freq_factor!r}")
    theta = theta.double()
    wavelength = 2 * torch.pi / theta
    gamma = ((original_max_len / wavelength - low_freq_factor)
             / (high_freq_factor - low_freq_factor)).clamp(0, 1)   # 1: keep θ; 0: θ / s
    return ((1 - gamma) * theta / factor + gamma * theta).float()


class RotaryEmbedding(nn.Module):
    """The cos and sin of every angle m·θᵢ, cached for positions m < ``max_seq_len``.

    ``cos, sin = rope(positions)``: positions (T,) long -> cos, sin of shape (T, D/2), float32.
    Positions past the cache are computed on the fly (the cache only saves time), so a model may
    be run past the length it was trained on. A KV cache passes its offsets,
    ``torch.arange(start, start + T)``. ``scaling``: None for θᵢ, or the keyword arguments of
    ``scaled_rope_frequencies`` (``kind``, ``factor``, ...) for its rescaled frequencies.
    """

    def __init__(self, head_dim: int, max_seq_len: int = 4096, base: float = 10000.0, *,
                 scaling: dict | None = None):
        super().__init__()
        check_positive_ints(max_seq_len=max_seq_len)
        self.head_dim, self.max_seq_len, self.base = head_dim, max_seq_len, float(base)
        self.scaling = None if scaling is None else dict(scaling)
        self.register_buffer("inv_freq", self._frequencies(base), persistent=False)
        cos, sin = self._angles(torch.arange(max_seq_len))
        self.register_buffer("cos_cached", cos, persistent=False)
        self.register_buffer("sin_cached", sin, persistent=False)

    def _apply(self, fn, recurse=True):
        # ``.half()`` / ``.to(dtype)`` cast floating buffers too; θ in bfloat16 is off by 1 part
        # in 256, so m·θ by whole radians at m in the thousands. Move the table, never cast it.
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            device = self.inv_freq.device          # recomputed on the CPU (MPS has no float64)
            self.inv_freq = self._frequencies(self.base)
            cos, sin = self._angles(torch.arange(self.max_seq_len))
            self.inv_freq, self.cos_cached, self.sin_cached = (
                t.to(device) for t in (self.inv_freq, cos, sin))
        return self

    def _frequencies(self, base) -> Tensor:
        # ``base`` as given, so that rope_frequencies checks it (self.base is float(base))
        if self.scaling is None:
            return rope_frequencies(self.head_dim, base)
        return scaled_rope_frequencies(self.head_dim, base, **self.scaling)

    def _angles(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        # float64 angles, on the CPU (MPS has no float64): m·θ for m in the thousands loses
        # digits in float32. Returned on the positions' device; on the meta device (a model
        # built for its shapes only) there are no values to compute.
        if positions.is_meta or self.inv_freq.is_meta:
            shape = (positions.shape[0], self.inv_freq.shape[0])
            return torch.empty(shape, device="meta"), torch.empty(shape, device="meta")
        angles = (positions.cpu().to(torch.float64)[:, None]
                  * self.inv_freq.cpu().to(torch.float64)[None, :])
        return (angles.cos().float().to(positions.device),
                angles.sin().float().to(positions.device))

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions (T,) integer -> (cos, sin), each (T, D/2) on the module's device."""
        if (not isinstance(positions, Tensor) or positions.dim() != 1
                or positions.dtype.is_floating_point or positions.dtype == torch.bool):
            raise ValueError("positions must be a (T,) integer tensor, got "
                             + (f"{positions.dtype} of shape {tuple(positions.shape)}"
                                if isinstance(positions, Tensor) else type(positions).__name__))
        positions = positions.to(self.cos_cached.device)
        if torch.compiler.is_compiling():    # a compiled decode step (model.generate's), whose
            return self.cos_cached[positions], self.sin_cached[positions]  # caller checked them
        if positions.numel() and int(positions.min()) < 0:
            raise ValueError(f"positions must be >= 0, got min {int(positions.min())}")
        if positions.numel() == 0 or int(positions.max()) < self.max_seq_len:
            return self.cos_cached[positions], self.sin_cached[positions]
        return self._angles(positions)

    def extra_repr(self) -> str:
        scaling = "" if self.scaling is None else f", scaling={self.scaling}"
        return (f"head_dim={self.head_dim}, max_seq_len={self.max_seq_len}, base={self.base:g}"
                f"{scaling}")


def apply_rotary_emb(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """Rotate each channel pair of x by its angle: x (B, H, T, D) -> (B, H, T, D).

    ``cos``, ``sin``: (T, D/2) from ``RotaryEmbedding`` (anything that broadcasts to
    (B, H, T, D/2) works). ``interleaved=False`` pairs channel i with i + D/2;
    ``interleaved=True`` pairs 2i with 2i + 1. Computed in float32, returned in x's dtype.
    """
    if not isinstance(x, Tensor) or x.dim() < 2:
        raise ValueError(f"x must be a tensor (..., T, D), got "
                         f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    d = x.shape[-1]
    _check_head_dim(d)
    if not isinstance(cos, Tensor) or not isinstance(sin, Tensor):
        raise ValueError(f"cos and sin must be tensors, got {type(cos).__name__} and "
                         f"{type(sin).__name__}")
    target = (*x.shape[:-1], d // 2)
    # cos broadcasts to target (checked by hand: torch.broadcast_shapes costs more than the
    # rotation itself in a one-token decode step)
    fits = 1 <= cos.dim() <= len(target) and all(
        n in (1, m) for n, m in zip(reversed(cos.shape), reversed(target)))
    if cos.shape != sin.shape or not fits or cos.shape[-1] != d // 2:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both end in "
                         f"D/2 = {d // 2} and broadcast to x of shape {tuple(x.shape)}")
    acc = torch.promote_types(x.dtype, torch.float32)
    cos, sin = cos.to(acc), sin.to(acc)
    if interleaved:
        x1, x2 = x[..., 0::2].to(acc), x[..., 1::2].to(acc)
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:
        x1, x2 = x[..., : d // 2].to(acc), x[..., d // 2:].to(acc)
        out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x.dtype)

"""RMS normalisation: divide a vector by its root-mean-square, then scale each channel.

    rms_norm(x) = x / sqrt(mean(x², over the last axis) + eps) · weight     (..., D) -> (..., D)

Unlike LayerNorm it neither subtracts the mean nor adds a bias. QK-norm (chapter 6) is
``RMSNorm(head_dim)`` applied to every head of q and of k before their dot product.
"""

import torch
from torch import Tensor, nn

from .arguments import check_positive_ints

__all__ = ["RMSNorm", "rms_norm"]


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """x: (..., D) -> (..., D), each vector over the last axis divided by its RMS.

    ``weight``: (D,) gains, or None for all ones. Computed in float32 (or float64) and returned
    in x's dtype; equal to ``torch.nn.functional.rms_norm(x, (D,), weight, eps)``.
    """
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point or x.dim() == 0:
        raise ValueError("x must be a floating tensor of shape (..., D), got "
                         + (f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, Tensor)
                            else type(x).__name__))
    if weight is not None and (not isinstance(weight, Tensor) or weight.shape != x.shape[-1:]):
        raise ValueError(f"weight must have shape ({x.shape[-1]},) to match x {tuple(x.shape)}, "
                         f"got {tuple(weight.shape) if isinstance(weight, Tensor) else weight!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    acc = torch.promote_types(x.dtype, torch.float32)
    x32 = x.to(acc)
    out = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        out = out * weight.to(acc)
    return out.to(x.dtype)


class RMSNorm(nn.Module):
    """``rms_norm`` with a learned gain per channel, initialised to ones.

    (..., dim) -> (..., dim)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        check_positive_ints(dim=dim)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"eps must be a number >= 0, got {eps!r}")
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"

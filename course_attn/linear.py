"""Linear attention: softmax's kernel replaced by a dot product of features (chapter 10).

Katharopoulos et al. 2020, "Transformers are RNNs". Softmax attention weighs key j for query i by
exp(q_i·k_j / √D). Replace that kernel by φ(q_i)·φ(k_j) for a feature map φ: (..., D) -> (..., D')
with non-negative values, and the output of query i becomes

    out_i = φ(q_i)ᵀ S_i / φ(q_i)ᵀ z_i,    S_i = Σ_j φ(k_j) v_jᵀ  (D', Dv),   z_i = Σ_j φ(k_j)  (D',)

over all keys j (non-causal) or j <= i (causal). S and z do not depend on the query, so the T×T
matrix of weights never has to exist: φ(Q) (φ(K)ᵀ V) costs O(T·D'·Dv) instead of O(T²·D).
Causal attention can be computed three ways, all equal (``form=``):

- ``"quadratic"``: the T×T matrix φ(Q) φ(K)ᵀ, masked to j <= i: the reference, O(T²).
- ``"chunked"``: the quadratic form inside chunks of ``chunk_size`` tokens, and for everything
  before a chunk the state (S, z) summed over the earlier chunks: O(T·C·D + T·D'·Dv).
- ``"recurrent"``: one token at a time, S += φ(k_t) v_tᵀ, z += φ(k_t): an RNN whose memory is a
  D'×Dv matrix, whatever the length. ``linear_attention_step`` is one such step, for decoding.

Feature maps (``feature_map=``): ``"elu"`` (elu(x) + 1, the paper's), ``"relu"``, ``"performer"``
(``PerformerFeatures(D)``: positive random features whose dot product approximates softmax's own
kernel, Choromanski et al. 2021), or any callable (..., D) -> (..., D'), e.g. a
``PerformerFeatures`` with more features or another seed.

The delta rule (``delta_rule``, ``delta_rule_step``): DeltaNet and Gated DeltaNet, whose state is
not summed but rewritten, S_t = α_t (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ, in a recurrent and
a chunked (WY/UT) form; ``ShortConvolution``, the causal depthwise convolution DeltaNet puts on
q, k and v before it.
"""

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .arguments import check_positive_ints
from .attention import _accumulation_dtype, _shape, check_attention_inputs

FeatureMap = Callable[[Tensor], Tensor]  # (..., D) -> (..., D'), the same map for q and k
FEATURE_MAPS = ("elu", "relu", "performer")
FORMS = ("quadratic", "chunked", "recurrent")
EPS = 1e-6


def _random_rotation(d: int, generator: torch.Generator) -> Tensor:
    """A (d, d) orthogonal matrix drawn uniformly (Haar): QR of a Gaussian, signs fixed by R."""
    q, r = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


class PerformerFeatures:
    """Positive random features for the softmax kernel (Performer's FAVOR+).

    x: (..., D) -> φ(x): (..., num_features), with

        φ(x) = exp(W x' - |x'|² / 2) / √m,    x' = x / D^(1/4),   W: (m, D) random rows

    so that E[φ(q)·φ(k)] = exp(q·k / √D), softmax attention's weight before normalising. The
    rows of W are Gaussian, made orthogonal in blocks of D (``orthogonal=True``, which lowers the
    variance), drawn once from ``seed`` on the CPU in float64: the same features for q and k, on
    every run and device. More features, a closer approximation. Values are exponentials, so keep
    |x|² / √D moderate (as softmax needs too) or they overflow.
    """

    def __init__(self, head_dim: int, num_features: int = 256, *, seed: int = 0,
                 orthogonal: bool = True):
        check_positive_ints(head_dim=head_dim, num_features=num_features)
        self.head_dim, self.num_features, self.seed = head_dim, num_features, seed
        self.orthogonal = orthogonal
        g = torch.Generator().manual_seed(seed)
        gaussian = torch.randn(num_features, head_dim, generator=g, dtype=torch.float64)
        if orthogonal:
            blocks = [_random_rotation(head_dim, g)
                      for _ in range(math.ceil(num_features / head_dim))]
            # Orthogonal unit rows, given the lengths that Gaussian rows would have.
            gaussian = torch.cat(blocks)[:num_features] * gaussian.norm(dim=1, keepdim=True)
        self.projection = gaussian  # (m, D)

    def __call__(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"PerformerFeatures(head_dim={self.head_dim}) got x {_shape(x)}")
        x = x * self.head_dim ** -0.25
        w = self.projection.to(device=x.device, dtype=x.dtype)
        squared_norm = (x * x).sum(-1, keepdim=True) / 2
        return torch.exp(x @ w.T - squared_norm) / math.sqrt(self.num_features)

    def __repr__(self) -> str:
        return (f"PerformerFeatures(head_dim={self.head_dim}, num_features={self.num_features}, "
                f"seed={self.seed}, orthogonal={self.orthogonal})")


def elu_features(x: Tensor) -> Tensor:
    """elu(x) + 1: positive everywhere, x + 1 for x > 0. (..., D) -> (..., D)."""
    return F.elu(x) + 1


def relu_features(x: Tensor) -> Tensor:
    """max(x, 0): non-negative, and all zero when every coordinate is. (..., D) -> (..., D)."""
    return F.relu(x)


@functools.lru_cache(maxsize=16)
def _default_performer(head_dim: int) -> PerformerFeatures:
    return PerformerFeatures(head_dim)


def feature_map_fn(feature_map: str | FeatureMap, head_dim: int) -> FeatureMap:
    """The callable behind ``feature_map``: a name in ``FEATURE_MAPS``, or a callable as is."""
    if isinstance(feature_map, str):
        if feature_map == "elu":
            return elu_features
        if feature_map == "relu":
            return relu_features
        if feature_map == "performer":
            return _default_performer(head_dim)
        raise ValueError(f"unknown feature_map {feature_map!r}; expected one of "
                         f"{', '.join(FEATURE_MAPS)} or a callable")
    if not callable(feature_map):
        raise ValueError(f"feature_map must be one of {', '.join(FEATURE_MAPS)} or a callable, "
                         f"got {feature_map!r}")
    return feature_map


def _features(phi: FeatureMap, x: Tensor) -> Tensor:
    out = phi(x)
    if not isinstance(out, Tensor) or out.dim() != x.dim() or out.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"feature_map {phi!r} must map (..., D) to (..., D'); x {_shape(x)} "
                         f"gave {_shape(out)}")
    return out


def _check_options(form: str, chunk_size: int, eps: float) -> None:
    if form not in FORMS:
        raise ValueError(f"unknown form {form!r}; expected one of {', '.join(FORMS)}")
    check_positive_ints(chunk_size=chunk_size)
    _check_eps(eps)


def _check_eps(eps: float) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive number, got {eps!r}")


def _divide(num: Tensor, den: Tensor, eps: float) -> Tensor:
    # With non-negative features num is 0 wherever den is (every weight is 0): 0 / eps = 0.
    return num / den.clamp_min(eps).unsqueeze(-1)


def linear_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
    feature_map: str | FeatureMap = "elu", form: str = "chunked", chunk_size: int = 64,
    eps: float = EPS,
) -> Tensor:
    """out_i = φ(q_i)ᵀ S_i / φ(q_i)ᵀ z_i, over keys j <= i (``causal``) or all of them.

    q: (B, H, T, D)   k: (B, H, T, D)   v: (B, H, T, Dv)   ->   (B, H, T, Dv)

    Self-attention only: q and k have one length T (a query's position is its index), and one
    number of heads. No mask and no scale: the feature map is the kernel.

    ``form``: causal, the three forms of the module docstring, all equal. Non-causal, every query
    reads the same state over all T keys: ``"quadratic"`` builds the T×T weights, ``"chunked"``
    and ``"recurrent"`` both compute φ(Q) (φ(K)ᵀ V) in O(T). ``chunk_size``: tokens per chunk of
    the chunked form (any positive int; a chunk longer than T is the quadratic form).

    The denominator φ(q_i)ᵀ z_i is clamped below at ``eps``: a query whose features meet no key's
    (relu features all zero) gives zeros, not NaN. Computed in float32 at least, returned in q's
    dtype. ``ValueError`` for unknown options or shapes that do not fit.
    """
    check_attention_inputs(q, k, v)
    if q.shape != k.shape:
        raise ValueError(f"linear attention is self-attention: q {_shape(q)} and k {_shape(k)} "
                         "must have one shape (B, H, T, D)")
    _check_options(form, chunk_size, eps)
    phi = feature_map_fn(feature_map, q.shape[-1])
    acc = _accumulation_dtype(q.dtype)
    fq, fk = _features(phi, q.to(acc)), _features(phi, k.to(acc))
    v = v.to(acc)
    if form == "quadratic" or q.shape[2] == 0:  # T = 0: the empty result, no loop to run
        out = _quadratic(fq, fk, v, causal, eps)
    elif not causal:
        out = _global(fq, fk, v, eps)
    elif form == "chunked":
        out = _chunked(fq, fk, v, chunk_size, eps)
    else:
        out = _recurrent(fq, fk, v, eps)
    return out.to(q.dtype)


def _quadratic(fq: Tensor, fk: Tensor, v: Tensor, causal: bool, eps: float) -> Tensor:
    weights = fq @ fk.transpose(-2, -1)                        # (B, H, T, T)
    if causal:
        weights = weights.tril()
    return _divide(weights @ v, weights.sum(-1), eps)


def _global(fq: Tensor, fk: Tensor, v: Tensor, eps: float) -> Tensor:
    s = fk.transpose(-2, -1) @ v                               # (B, H, D', Dv)
    z = fk.sum(-2)                                             # (B, H, D')
    return _divide(fq @ s, (fq * z.unsqueeze(-2)).sum(-1), eps)


def _chunked(fq: Tensor, fk: Tensor, v: Tensor, chunk_size: int, eps: float) -> Tensor:
    """The T tokens in N chunks of C: inside a chunk, the masked C×C weights; before it, the
    state of the chunks before, the sum of their own states. Every chunk at once, no loop."""
    b, h, t, _ = fq.shape
    c = min(chunk_size, t)
    n = -(-t // c)
    if n * c > t:  # pad the last chunk with zero features: they add nothing to any state
        fq, fk, v = (F.pad(x, (0, 0, 0, n * c - t)) for x in (fq, fk, v))
    fq, fk, v = (x.reshape(b, h, n, c, x.shape[-1]) for x in (fq, fk, v))
    s = fk.transpose(-2, -1) @ v                               # (B, H, N, D', Dv): each chunk's
    z = fk.sum(-2).unsqueeze(-1)                               # (B, H, N, D', 1)
    s_before, z_before = s.cumsum(2) - s, z.cumsum(2) - z      # the chunks before each chunk
    weights = (fq @ fk.transpose(-2, -1)).tril_()              # (B, H, N, C, C): inside a chunk
    num = fq @ s_before + weights @ v                          # (B, H, N, C, Dv)
    den = (fq @ z_before)[..., 0] + weights.sum(-1)            # (B, H, N, C)
    return _divide(num, den, eps).reshape(b, h, n * c, -1)[:, :, :t]


def _recurrent(fq: Tensor, fk: Tensor, v: Tensor, eps: float) -> Tensor:
    state = LinearAttentionState.empty(fk[:, :, 0], v.shape[-1])
    outs = []
    for i in range(fk.shape[2]):
        state = state.add(fk[:, :, i], v[:, :, i])
        outs.append(state.read(fq[:, :, i], eps))
    return torch.stack(outs, dim=2)


@dataclass
class LinearAttentionState:
    """What causal linear attention remembers of the tokens it has read: the RNN's state.

    s: (B, H, D', Dv) = Σ_j φ(k_j) v_jᵀ     z: (B, H, D') = Σ_j φ(k_j)

    Its size does not depend on how many tokens it holds. Kept in float32 at least.
    """

    s: Tensor
    z: Tensor

    @staticmethod
    def empty(features: Tensor, value_dim: int) -> "LinearAttentionState":
        """The state of no token, for features like ``features`` (B, H, D') and values of Dv."""
        return LinearAttentionState(features.new_zeros(*features.shape, value_dim),
                                    torch.zeros_like(features))

    def add(self, fk: Tensor, v: Tensor) -> "LinearAttentionState":
        """The state after one more token: features fk (B, H, D') and value v (B, H, Dv)."""
        return LinearAttentionState(self.s + fk.unsqueeze(-1) * v.unsqueeze(-2), self.z + fk)

    def read(self, fq: Tensor, eps: float = EPS) -> Tensor:
        """A query's output from the state: features fq (B, H, D') -> (B, H, Dv)."""
        num = (fq.unsqueeze(-2) @ self.s).squeeze(-2)
        return _divide(num, (fq * self.z).sum(-1), eps)


def linear_attention_state(k: Tensor, v: Tensor, *,
                           feature_map: str | FeatureMap = "elu") -> LinearAttentionState:
    """The state after reading every token of k (B, H, T, D) and v (B, H, T, Dv): a prefill.

    φ(K)ᵀ V and the sum of φ(K) over T, in O(T); T = 0 gives the empty (zero) state.
    """
    check_attention_inputs(k, k, v)
    phi = feature_map_fn(feature_map, k.shape[-1])
    acc = _accumulation_dtype(k.dtype)
    fk = _features(phi, k.to(acc))
    return LinearAttentionState(fk.transpose(-2, -1) @ v.to(acc), fk.sum(-2))


def linear_attention_step(
    q_t: Tensor, k_t: Tensor, v_t: Tensor, state: LinearAttentionState | None = None, *,
    feature_map: str | FeatureMap = "elu", eps: float = EPS,
) -> tuple[Tensor, LinearAttentionState]:
    """One token of causal linear attention: the new token is read into the state, then its
    query reads the state. Time and memory O(1) in the number of tokens before it.

    q_t: (B, H, 1, D)   k_t: (B, H, 1, D)   v_t: (B, H, 1, Dv)   state: as returned before, or
    None to start from nothing   ->   out_t (B, H, 1, Dv), the new state (the old one is kept).

    Calling it for t = 0, 1, ... gives ``linear_attention(..., causal=True)`` token by token.
    """
    check_attention_inputs(q_t, k_t, v_t)
    if q_t.shape != k_t.shape or q_t.shape[2] != 1:
        raise ValueError(f"a step takes one token: q_t and k_t of shape (B, H, 1, D), got q_t "
                         f"{_shape(q_t)} and k_t {_shape(k_t)}")
    _check_eps(eps)
    phi = feature_map_fn(feature_map, q_t.shape[-1])
    acc = _accumulation_dtype(q_t.dtype)
    fq, fk = _features(phi, q_t[:, :, 0].to(acc)), _features(phi, k_t[:, :, 0].to(acc))
    v = v_t[:, :, 0].to(acc)
    if state is None:
        state = LinearAttentionState.empty(fk, v.shape[-1])
    elif state.s.shape != (*fk.shape, v.shape[-1]) or state.z.shape != fk.shape:
        raise ValueError(f"state s {_shape(state.s)}, z {_shape(state.z)} does not fit features "
                         f"{_shape(fk)} and values {_shape(v)}")
    state = state.add(fk, v)
    return state.read(fq, eps).unsqueeze(2).to(q_t.dtype), state


# ---------------------------------------------------------------- the delta rule

DELTA_FORMS = ("chunked", "recurrent")


def delta_rule(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, *, gate: Tensor | None = None,
    form: str = "chunked", chunk_size: int = 64, normalize: bool = True,
) -> Tensor:
    """Causal attention whose state is written by the delta rule: DeltaNet, and with ``gate``
    Gated DeltaNet.

    q: (B, H, T, Dk)   k: (B, H, T, Dk)   v: (B, H, T, Dv)   beta: (B, H, T) in [0, 1]
    gate: None or (B, H, T) in (0, 1]   ->   (B, H, T, Dv)

    The state S (B, H, Dk, Dv) starts at zero; each token t rewrites it, then its query reads it:

        S_t = α_t (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ,      o_t = S_tᵀ q_t

    that is, S_t = α_t S_{t-1} + β_t k_t (v_t - α_t S_{t-1}ᵀ k_t)ᵀ: before v_t is written under
    k_t, the value that the (decayed) memory returns for k_t is taken out, in proportion β_t (the
    write strength); α_t (the gate; 1 without one) decays the whole memory first. With a unit key
    and β_t = 1, the value stored under k_t becomes exactly v_t. DeltaNet: Schlag et al. 2021;
    Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence
    Length". Gated DeltaNet: Yang, Kautz and Hatamizadeh 2025 (§3). The papers write
    the state transposed, S = Σ v kᵀ (Dv, Dk) with o_t = S_t q_t; this module keeps linear
    attention's (Dk, Dv) with o_t = S_tᵀ q_t, as flash-linear-attention's naive references do.

    ``normalize``: L2-normalise q and k over Dk first, as both papers' layers do (I - β k kᵀ then
    has eigenvalues in [0, 1], and the state stays bounded); ``False`` uses q and k as given.
    No 1/√Dk: fla's kernels scale q by it by default; a caller who wants it scales the output.

    ``form``: ``"recurrent"`` (one token at a time, the formula) or ``"chunked"`` (chunks of
    ``chunk_size`` tokens in the WY/UT representation of Yang et al. 2024 §3, one loop over the
    chunks, products inside them): equal up to rounding. Computed in float32 at least, returned
    in q's dtype. ``ValueError`` for shapes that do not fit, β outside [0, 1], α outside (0, 1],
    or unknown options.
    """
    if form not in DELTA_FORMS:
        raise ValueError(f"unknown form {form!r}; expected one of {', '.join(DELTA_FORMS)}")
    check_positive_ints(chunk_size=chunk_size)
    out_dtype = q.dtype
    q, k, v, beta, gate = _delta_operands(q, k, v, beta, gate, normalize, tokens=None)
    if form == "recurrent" or q.shape[2] == 0:         # T = 0: no chunk to cut
        out = _delta_recurrent(q, k, v, beta, gate)
    else:
        out = _delta_chunked(q, k, v, beta, gate, chunk_size)
    return out.to(out_dtype)


def delta_rule_step(
    q_t: Tensor, k_t: Tensor, v_t: Tensor, beta_t: Tensor, state: Tensor | None = None, *,
    gate_t: Tensor | None = None, normalize: bool = True,
) -> tuple[Tensor, Tensor]:
    """One token of ``delta_rule``: the state is rewritten, then the token's query reads it.
    Time and memory O(1) in the number of tokens before it.

    q_t, k_t: (B, H, 1, Dk)   v_t: (B, H, 1, Dv)   beta_t, gate_t: (B, H, 1)   state: (B, H, Dk,
    Dv) as returned before, or None for the empty (zero) state   ->   out_t (B, H, 1, Dv) in
    q_t's dtype, and the new state (float32 at least; the old one is kept).

    Calling it for t = 0, 1, ... gives ``delta_rule(...)`` token by token.
    """
    q, k, v, beta, gate = _delta_operands(q_t, k_t, v_t, beta_t, gate_t, normalize, tokens=1)
    shape = (*q.shape[:2], q.shape[-1], v.shape[-1])
    if state is None:
        state = q.new_zeros(shape)
    elif not isinstance(state, Tensor) or state.shape != shape:
        raise ValueError(f"state {_shape(state)} does not fit q_t {_shape(q_t)} and v_t "
                         f"{_shape(v_t)}: expected {shape}")
    state = _delta_update(state.to(q), k[:, :, 0], v[:, :, 0], beta[:, :, 0],
                          None if gate is None else gate[:, :, 0])
    return _delta_read(state, q[:, :, 0]).unsqueeze(2).to(q_t.dtype), state


def _delta_operands(q, k, v, beta, gate, normalize, *, tokens):
    """Checked, in the accumulation dtype, q and k L2-normalised if asked."""
    check_attention_inputs(q, k, v)
    if q.shape != k.shape:
        raise ValueError(f"the delta rule is self-attention: q {_shape(q)} and k {_shape(k)} "
                         "must have one shape (B, H, T, Dk)")
    if tokens is not None and q.shape[2] != tokens:
        raise ValueError(f"a step takes one token: q_t, k_t of shape (B, H, 1, Dk), got q_t "
                         f"{_shape(q)}")
    _check_strength("beta", beta, q, zero_allowed=True)
    if gate is not None:
        _check_strength("gate", gate, q, zero_allowed=False)
    acc = _accumulation_dtype(q.dtype)
    q, k = q.to(acc), k.to(acc)
    if normalize:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    return q, k, v.to(acc), beta.to(acc), None if gate is None else gate.to(acc)


def _check_strength(name: str, x, q: Tensor, *, zero_allowed: bool) -> None:
    """ValueError unless x is a (B, H, T) tensor on q's device with values in [0, 1] (or (0, 1])."""
    if not isinstance(x, Tensor) or x.shape != q.shape[:3]:
        raise ValueError(f"{name} must be a tensor of shape (B, H, T) = {tuple(q.shape[:3])}, "
                         f"got {_shape(x)}")
    if x.device != q.device:
        raise ValueError(f"{name} is on {x.device}, q on {q.device}")
    below = x < 0 if zero_allowed else x <= 0
    if x.numel() and (below | (x > 1) | x.isnan()).any():
        interval = "[0, 1]" if zero_allowed else "(0, 1]"
        raise ValueError(f"{name} must lie in {interval}; got values from {x.min().item():g} to "
                         f"{x.max().item():g}")


def _delta_recurrent(q: Tensor, k: Tensor, v: Tensor, beta: Tensor,
                     gate: Tensor | None) -> Tensor:
    """The update and the read, one token at a time: (B, H, T, ·) -> (B, H, T, Dv)."""
    state, outs = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1]), []
    for t in range(q.shape[2]):
        state = _delta_update(state, k[:, :, t], v[:, :, t], beta[:, :, t],
                              None if gate is None else gate[:, :, t])
        outs.append(_delta_read(state, q[:, :, t]))
    return torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)


def _delta_update(state: Tensor, k: Tensor, v: Tensor, beta: Tensor,
                  gate: Tensor | None) -> Tensor:
    """S ← α S + β k (v - α Sᵀ k)ᵀ: state (B, H, Dk, Dv), k (B, H, Dk), v (B, H, Dv),
    β and α (B, H)."""
    if gate is not None:
        state = gate[..., None, None] * state
    stored = (k.unsqueeze(-2) @ state).squeeze(-2)                 # Sᵀ k: what k reads now
    return state + k.unsqueeze(-1) * (beta.unsqueeze(-1) * (v - stored)).unsqueeze(-2)


def _delta_read(state: Tensor, q: Tensor) -> Tensor:
    """o = Sᵀ q: state (B, H, Dk, Dv), q (B, H, Dk) -> (B, H, Dv)."""
    return (q.unsqueeze(-2) @ state).squeeze(-2)


def _delta_chunked(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, gate: Tensor | None,
                   chunk_size: int) -> Tensor:
    """The delta rule over N chunks of C tokens (Yang et al. 2024 §3; the gate as in Gated
    DeltaNet §3). Inside a chunk, with γ_r = α_1 ⋯ α_r (the gates since the chunk began; 1
    without a gate), Γ_ri = γ_r / γ_i for i <= r, and S_0 the state the chunk starts from, the
    values written are Δ = U - W S_0 with

        T = (I + tril(diag(β) (Γ ⊙ K Kᵀ), -1))⁻¹ diag(β),    W = T diag(γ) K,    U = T V

    (the UT transform: T is a triangular solve); the chunk's outputs and the next state are

        O = diag(γ) Q S_0 + tril(Γ ⊙ Q Kᵀ) Δ,      S_C = γ_C S_0 + (diag(γ_C / γ) K)ᵀ Δ.

    q, k: (B, H, T, Dk)  v: (B, H, T, Dv)  beta, gate: (B, H, T)  ->  (B, H, T, Dv).
    """
    b, h, t, dk = q.shape
    c = min(chunk_size, t)
    n = -(-t // c)
    if n * c > t:  # padding: zero keys and β write nothing, α = 1 decays nothing
        pad = n * c - t
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta = F.pad(beta, (0, pad))
        gate = None if gate is None else F.pad(gate, (0, pad), value=1.0)
    q, k, v = (x.reshape(b, h, n, c, x.shape[-1]) for x in (q, k, v))
    beta = beta.reshape(b, h, n, c, 1)
    kk, inside = k @ k.transpose(-2, -1), q @ k.transpose(-2, -1)      # (B, H, N, C, C)
    if gate is None:
        log_gamma = q.new_zeros(b, h, n, c)
        kk, inside = kk.tril(-1), inside.tril()
    else:
        log_gamma = gate.reshape(b, h, n, c).log().cumsum(-1)          # log γ_r
        gaps = log_gamma.unsqueeze(-1) - log_gamma.unsqueeze(-2)        # log Γ_ri
        on_or_below = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        decay = gaps.masked_fill(~on_or_below, -math.inf).exp()         # Γ, 0 above the diagonal
        kk, inside = (kk * decay).tril(-1), inside * decay
    gamma = log_gamma.exp().unsqueeze(-1)                               # (B, H, N, C, 1)
    lower = torch.eye(c, dtype=q.dtype, device=q.device) + beta * kk    # T = lower⁻¹ diag(β):
    # W = T diag(γ) K and U = T V, both from one triangular solve
    wu = torch.linalg.solve_triangular(lower, beta * torch.cat([gamma * k, v], dim=-1),
                                       upper=False, unitriangular=True)
    w, u = wu.split([dk, v.shape[-1]], dim=-1)
    gamma = gamma[..., 0]
    to_end = (log_gamma[..., -1:] - log_gamma).exp()                    # γ_C / γ_r
    state = q.new_zeros(b, h, dk, v.shape[-1])
    outs = []
    for i in range(n):
        written = u[:, :, i] - w[:, :, i] @ state                       # Δ: (B, H, C, Dv)
        outs.append(gamma[:, :, i, :, None] * (q[:, :, i] @ state) + inside[:, :, i] @ written)
        state = (gamma[:, :, i, -1, None, None] * state
                 + (to_end[:, :, i, :, None] * k[:, :, i]).transpose(-2, -1) @ written)
    return torch.cat(outs, dim=2)[:, :, :t]


class ShortConvolution(nn.Module):
    """DeltaNet's short convolution: a causal, depthwise 1-D convolution over time, one filter of
    ``kernel_size`` taps per channel, then SiLU (``activation=None`` leaves it out).

    x (B, T, C) -> (B, T, C). Output t of channel c is Σ_i w[c, i] x[t - K + 1 + i, c] over the K
    taps (positions before 0 read as zeros): it reads its own token and the K - 1 before it, never
    a later one. DeltaNet passes q, k and v through one each, right after their projections and
    before the delta rule, so a token's key can carry something of the tokens just before it
    (Yang et al. 2024; flash-linear-attention's ``ShortConvolution``: kernel 4, no bias).
    """

    def __init__(self, channels: int, kernel_size: int = 4, *, bias: bool = False,
                 activation: str | None = "silu"):
        super().__init__()
        check_positive_ints(channels=channels, kernel_size=kernel_size)
        if activation not in ("silu", None):
            raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
        self.kernel_size, self.activation = kernel_size, activation
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 3 or x.shape[-1] != self.conv.in_channels:
            raise ValueError(f"x must be (B, T, C={self.conv.in_channels}), got {_shape(x)}")
        # K - 1 zeros on the left only: output t sees inputs t - K + 1 .. t
        y = self.conv(F.pad(x.transpose(1, 2), (self.kernel_size - 1, 0))).transpose(1, 2)
        return F.silu(y) if self.activation == "silu" else y

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, activation={self.activation!r}"

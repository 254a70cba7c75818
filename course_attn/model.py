"""A tiny GPT built from the package's attention, and ``generate`` to sample from it.

    idx (B, T) -> token embedding (+ learned position embedding)   (B, T, C)
               -> n_layers × [x += attn(norm(x)); x += mlp(norm(x))]   (pre-norm blocks)
               -> final norm -> LM head                         (B, T, V) logits

``mlp=False`` leaves only attention in the blocks ("attention-only" transformers, the setting in
which induction heads were first described). ``position="rope"`` drops the learned position
embedding and rotates q and k in every attention layer instead; ``qk_norm`` and ``window`` are
passed to every ``MultiHeadAttention``, so later chapters train the same model with one switch
changed.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .multihead import MultiHeadAttention

__all__ = ["GPT", "GPTConfig", "generate", "queries_keys_values"]


@dataclass
class GPTConfig:
    """Sizes and options of a ``GPT``. V = vocab_size, T ≤ seq_len, C = d_model, H = n_heads.

    ``position``: "learned" (an embedding per position, GPT-2) or "rope" (rotary, in every
    attention layer; then T may exceed seq_len, the length RoPE's cos/sin are cached for).
    ``qk_norm``, ``qk_norm_order``, ``window``, ``rope_base``, ``dropout`` (on the attention
    weights): as ``MultiHeadAttention``'s options of the same names.
    """

    vocab_size: int
    seq_len: int
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    mlp: bool = True
    backend: str = "math"
    n_kv_heads: int | None = None
    mlp_ratio: int = 4
    bias: bool = False
    position: str = "learned"
    rope_base: float = 10000.0
    qk_norm: bool = False
    qk_norm_order: str = "before_rope"
    window: int | None = None
    dropout: float = 0.0

    def __post_init__(self):
        if self.position not in ("learned", "rope"):
            raise ValueError(f"position must be 'learned' or 'rope', got {self.position!r}")
        for name in ("vocab_size", "seq_len", "n_layers", "mlp_ratio"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be a positive int, got {n!r}")


class MLP(nn.Module):
    """Position-wise feed-forward network: (B, T, C) -> (B, T, C) through a wider hidden layer."""

    def __init__(self, d_model: int, hidden: int, bias: bool = False):
        super().__init__()
        self.up = nn.Linear(d_model, hidden, bias=bias)
        self.down = nn.Linear(hidden, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """One pre-norm transformer block: attention, then (optionally) an MLP, each added to x."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.d_model)
        self.attn = MultiHeadAttention(
            config.d_model, config.n_heads, n_kv_heads=config.n_kv_heads, bias=config.bias,
            backend=config.backend, rope=config.position == "rope", rope_base=config.rope_base,
            max_seq_len=config.seq_len, qk_norm=config.qk_norm,
            qk_norm_order=config.qk_norm_order, window=config.window, dropout=config.dropout)
        if config.mlp:
            self.mlp_norm = nn.LayerNorm(config.d_model)
            self.mlp = MLP(config.d_model, config.mlp_ratio * config.d_model, bias=config.bias)
        else:
            self.mlp = None

    def forward(self, x: Tensor, *, positions: Tensor | None = None,
                return_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """x: (B, T, C) -> (x: (B, T, C), attention weights (B, H, T, T) or None).

        ``positions`` (T,): where the tokens sit, for RoPE."""
        attended = self.attn(self.attn_norm(x), is_causal=True, positions=positions,
                             return_weights=return_weights)
        attended, weights = attended if return_weights else (attended, None)
        x = x + attended
        if self.mlp is not None:
            x = x + self.mlp(self.mlp_norm(x))
        return x, weights


class GPT(nn.Module):
    """A decoder-only transformer: token ids (B, T) -> next-token logits (B, T, V)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embedding = (nn.Embedding(config.seq_len, config.d_model)
                                   if config.position == "learned" else None)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.final_norm = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2's initialisation: small normal weights, zero biases.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor, *, return_attention: bool = False
                ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """idx: (B, T) long -> logits (B, T, V); with ``return_attention`` also, for each layer,
        its attention weights (B, H, T, T)."""
        if not isinstance(idx, Tensor) or idx.dim() != 2 or idx.dtype != torch.long:
            raise ValueError("idx must be a (B, T) torch.long tensor, got "
                             + (f"shape {tuple(idx.shape)} dtype {idx.dtype}"
                                if isinstance(idx, Tensor) else type(idx).__name__))
        t = idx.shape[1]
        if t < 1 or (self.position_embedding is not None and t > self.config.seq_len):
            raise ValueError(f"sequence length T={t} must be in [1, seq_len={self.config.seq_len}] "
                             "(learned positions stop at seq_len)")
        positions = torch.arange(t, device=idx.device)
        x = self.token_embedding(idx)                                        # (B, T, C)
        if self.position_embedding is not None:
            x = x + self.position_embedding(positions)
        attention = []
        for block in self.blocks:
            x, weights = block(x, positions=positions, return_weights=return_attention)
            attention.append(weights)
        logits = self.lm_head(self.final_norm(x))                            # (B, T, V)
        return (logits, attention) if return_attention else logits


@torch.no_grad()
def queries_keys_values(model: GPT, idx: Tensor) -> list[tuple[Tensor, Tensor, Tensor]]:
    """What every layer's attention computed on idx (B, T): per layer, ``(q, k, v)``.

    q: (B, H, T, D), k and v: (B, Hkv, T, D), as the dot product sees them (after QK-norm and
    RoPE where the model has them): layer l's scores are
    ``q @ k.transpose(-2, -1) / sqrt(D)`` (causal), and their softmax is the weights that
    ``model(idx, return_attention=True)`` returns. Read from a forward pass of the model itself
    (each attention layer's input is recorded, then projected), so they are the very vectors
    the model used.
    """
    inputs: list[Tensor] = []
    hooks = [block.attn.register_forward_pre_hook(lambda _, args: inputs.append(args[0]))
             for block in model.blocks]
    try:
        model(idx)
    finally:
        for hook in hooks:
            hook.remove()
    positions = torch.arange(idx.shape[1], device=idx.device)
    return [block.attn.project(x, positions=positions)                    # x: (B, T, C)
            for block, x in zip(model.blocks, inputs)]


@torch.no_grad()
def generate(model: GPT, idx: Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None) -> Tensor:
    """Extend idx (B, T) by ``max_new_tokens`` sampled tokens -> (B, T + max_new_tokens).

    Each step feeds the last ``seq_len`` tokens and samples from softmax(logits / temperature),
    restricted to the ``top_k`` most likely tokens when given. ``temperature == 0`` is greedy
    (always the most likely token). ``generator`` must live on idx's device.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    for _ in range(max_new_tokens):
        logits = model(idx[:, -model.config.seq_len:])[:, -1, :]            # (B, V)
        if temperature == 0:
            next_token = logits.argmax(dim=-1, keepdim=True)                 # (B, 1)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            next_token = torch.multinomial(probs, 1, generator=generator)   # (B, 1)
        idx = torch.cat([idx, next_token], dim=1)
    return idx

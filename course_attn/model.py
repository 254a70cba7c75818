"""A tiny GPT built from the package's attention, and ``generate`` to sample from it.

    idx (B, T) -> token embedding (+ learned position embedding)   (B, T, C)
               -> n_layers × [x += attn(norm(x)); x += mlp(norm(x))]   (pre-norm blocks)
               -> final norm -> LM head                         (B, T, V) logits

``mlp=False`` leaves only attention in the blocks ("attention-only" transformers, the setting in
which induction heads were first described). ``position="rope"`` drops the learned position
embedding and rotates q and k in every attention layer instead; ``qk_norm`` and ``window`` are
passed to every ``MultiHeadAttention``, so later chapters train the same model with one switch
changed.

With a KV cache per layer (``model.new_caches``), ``model(idx, caches=caches)`` takes only the
new tokens and attends to everything cached before them: ``generate`` prefills the prompt once,
then feeds one token per step (chapter 8). A model with a ``window`` may keep a rolling cache per
layer instead (``model.new_rolling_caches``, chapter 11): fixed memory, however long the sequence.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .arguments import check_non_negative_ints, check_positive_ints
from .kv_cache import KVCache, RollingKVCache, is_kv_cache
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
        check_positive_ints(vocab_size=self.vocab_size, seq_len=self.seq_len,
                            n_layers=self.n_layers, mlp_ratio=self.mlp_ratio)


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
                cache: KVCache | RollingKVCache | None = None, return_weights: bool = False
                ) -> tuple[Tensor, Tensor | None]:
        """x: (B, T, C) -> (x: (B, T, C), attention weights (B, H, T, S) or None).

        ``positions`` (T,): where the tokens sit, for RoPE. ``cache``: this layer's KV cache
        (then S = the cached length after x's tokens are added, else S = T)."""
        attended = self.attn(self.attn_norm(x), is_causal=True, positions=positions,
                             cache=cache, return_weights=return_weights)
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

    def new_caches(self, batch_size: int, max_seq_len: int | None = None, *,
                   dtype: torch.dtype | None = None, device=None) -> list[KVCache]:
        """One empty ``KVCache`` per layer, each (B, Hkv, max_seq_len, D) for keys and values.

        ``max_seq_len`` defaults to ``config.seq_len``; ``dtype`` and ``device`` to the weights'.
        """
        max_seq_len = self.config.seq_len if max_seq_len is None else max_seq_len
        return [block.attn.new_cache(batch_size, max_seq_len, dtype=dtype, device=device)
                for block in self.blocks]

    def new_rolling_caches(self, batch_size: int, *, sinks: int = 0,
                           dtype: torch.dtype | None = None, device=None) -> list[RollingKVCache]:
        """One empty ``RollingKVCache`` per layer, each (B, Hkv, sinks + window, D), for a model
        with ``config.window``: the last ``window`` tokens and the first ``sinks`` (attention
        sinks, StreamingLLM), whatever the length. With RoPE, decoding may then run past
        ``seq_len`` for ever in fixed memory. ``dtype`` and ``device`` default to the weights'.
        """
        return [block.attn.new_rolling_cache(batch_size, sinks=sinks, dtype=dtype, device=device)
                for block in self.blocks]

    def forward(self, idx: Tensor, *, caches: list[KVCache | RollingKVCache] | None = None,
                return_attention: bool = False,
                last_only: bool = False) -> Tensor | tuple[Tensor, list[Tensor]]:
        """idx: (B, T) long -> logits (B, T, V); with ``return_attention`` also, for each layer,
        its attention weights (B, H, T, S). ``last_only``: the logits of the last position only,
        (B, 1, V), all that generation reads (the output layer is the largest product of a
        small model's step: a prefill of T tokens would pay it T times).

        ``caches`` (one ``KVCache`` per layer, from ``new_caches``): idx holds the next T tokens
        of sequences whose first len(caches[0]) tokens are cached; they sit at positions
        len .. len + T - 1, their keys and values are appended, and S = len + T. Rolling caches
        (``new_rolling_caches``) work the same way, S being then what they hold. Without caches,
        S = T and the tokens sit at 0 .. T - 1.
        """
        if not isinstance(idx, Tensor) or idx.dim() != 2 or idx.dtype != torch.long:
            raise ValueError("idx must be a (B, T) torch.long tensor, got "
                             + (f"shape {tuple(idx.shape)} dtype {idx.dtype}"
                                if isinstance(idx, Tensor) else type(idx).__name__))
        start = 0
        if caches is not None:
            if (not isinstance(caches, (list, tuple)) or len(caches) != len(self.blocks)
                    or not all(is_kv_cache(c) for c in caches)):
                raise ValueError(f"caches must be a list of {len(self.blocks)} KVCache or "
                                 "RollingKVCache (one per layer, from model.new_caches or "
                                 "model.new_rolling_caches)")
            if len({len(c) for c in caches}) != 1:
                raise ValueError(f"the layers' caches hold different lengths "
                                 f"{[len(c) for c in caches]}; reset them together")
            start = len(caches[0])
        t = idx.shape[1]
        if t < 1:
            raise ValueError(f"idx must hold at least one token, got shape {tuple(idx.shape)}")
        if self.position_embedding is not None and start + t > self.config.seq_len:
            cached = f" after {start} cached tokens, at positions up to {start + t - 1}," if start else ""
            raise ValueError(f"sequence length T={t}{cached} must be in [1, seq_len="
                             f"{self.config.seq_len}] (learned positions stop at seq_len)")
        positions = torch.arange(start, start + t, device=idx.device)
        x = self.token_embedding(idx)                                        # (B, T, C)
        if self.position_embedding is not None:
            x = x + self.position_embedding(positions)
        attention = []
        for i, block in enumerate(self.blocks):
            x, weights = block(x, positions=positions, return_weights=return_attention,
                               cache=None if caches is None else caches[i])
            attention.append(weights)
        if last_only:
            x = x[:, -1:]
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


def _sample(logits: Tensor, temperature: float, top_k: int | None,
            generator: torch.Generator | None) -> Tensor:
    """The next token of each row, logits (B, V) -> (B, 1): argmax at temperature 0, else drawn
    from softmax(logits / temperature) restricted to the ``top_k`` largest."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)


def _cache_and_predict(model: GPT, tokens: Tensor, caches: list[KVCache],
                       chunk: int | None) -> Tensor:
    """Run tokens (B, T) through the model, appending their keys and values to the caches,
    ``chunk`` tokens per forward (all at once for None) -> the logits after the last, (B, V):
    the prefill of a prompt, and each decode step's one new token."""
    chunk = tokens.shape[1] if chunk is None else chunk
    for start in range(0, tokens.shape[1], chunk):
        logits = model(tokens[:, start:start + chunk], caches=caches, last_only=True)  # (B, 1, V)
    return logits[:, -1]


def generate(model: GPT, idx: Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None,
             use_cache: bool = True, prefill_chunk: int | None = None, rolling: bool = False,
             sinks: int = 0) -> Tensor:
    """Extend idx (B, T) by ``max_new_tokens`` sampled tokens -> (B, T + max_new_tokens).

    Each new token is drawn from softmax(logits / temperature) of the model's last position,
    restricted to the ``top_k`` most likely tokens when given; ``temperature == 0`` is greedy
    (always the most likely token). ``generator`` must live on idx's device. The model sees the
    last ``seq_len`` tokens at most.

    ``use_cache=True``: the prompt is run once (the prefill, ``prefill_chunk`` tokens per forward
    when given), its keys and values kept in one ``KVCache`` per layer, and then each step runs
    only the newest token. Once the sequence outgrows ``seq_len``, every token's position shifts
    at each step, so nothing cached stays valid: each step then prefills the last ``seq_len``
    tokens afresh. ``use_cache=False`` runs the whole sequence at every step. Both give the same
    logits, up to float rounding, so greedy decoding gives the same tokens.

    ``rolling=True`` (a model with a ``window``): one ``RollingKVCache`` per layer, keeping the
    last ``window`` tokens and the first ``sinks`` (attention sinks). The whole prompt is
    prefilled and nothing restarts: every token stays at its own position, memory stays fixed,
    and with RoPE the sequence may grow past ``seq_len`` (learned positions: ValueError). With
    ``sinks=0`` this gives the tokens of the full cache with the window mask.
    """
    check_non_negative_ints(max_new_tokens=max_new_tokens)
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if top_k is not None:
        check_positive_ints(top_k=top_k)
    if prefill_chunk is not None:
        check_positive_ints(prefill_chunk=prefill_chunk)
    check_non_negative_ints(sinks=sinks)
    if sinks and not rolling:
        raise ValueError(f"sinks={sinks} are kept by a rolling cache: pass rolling=True too")
    if rolling and not use_cache:
        raise ValueError("rolling=True asks for a rolling KV cache, but use_cache=False")
    if rolling:
        if model.config.window is None:
            raise ValueError("rolling=True needs a model with a window (config.window); this "
                             "one attends to every earlier token")
        end = idx.shape[1] + max_new_tokens - 1
        if model.config.position == "learned" and end > model.config.seq_len:
            raise ValueError(f"learned positions stop at seq_len={model.config.seq_len}, but "
                             f"rolling=True keeps every token at its own position, up to "
                             f"{end - 1}: use position='rope', or rolling=False")
    # inference mode: no autograd bookkeeping at all, which is most of a small decode step's
    # cost; the clone makes the result an ordinary tensor, usable in training afterwards
    with torch.inference_mode():
        out = _generate(model, idx, max_new_tokens, temperature, top_k, generator, use_cache,
                        prefill_chunk, sinks if rolling else None)
    return out.clone()


def _generate(model, idx, max_new_tokens, temperature, top_k, generator, use_cache,
              prefill_chunk, rolling_sinks) -> Tensor:
    """``generate``'s loop, its arguments checked; ``rolling_sinks`` is None for full caches."""
    context = model.config.seq_len
    if not use_cache:
        for _ in range(max_new_tokens):
            logits = model(idx[:, -context:], last_only=True)[:, -1, :]        # (B, V)
            idx = torch.cat([idx, _sample(logits, temperature, top_k, generator)], dim=1)
        return idx
    if max_new_tokens == 0:
        return idx
    if rolling_sinks is not None:         # fixed memory, every token at its own position
        caches = model.new_rolling_caches(idx.shape[0], sinks=rolling_sinks, device=idx.device)
        pending = idx
    else:
        capacity = min(idx.shape[1] + max_new_tokens - 1, context)
        caches = model.new_caches(idx.shape[0], capacity, device=idx.device)
        pending = idx[:, -context:]                   # tokens whose keys are not cached yet
    for _ in range(max_new_tokens):
        if rolling_sinks is None and len(caches[0]) + pending.shape[1] > context:
            # the model's context slides: start afresh
            for cache in caches:
                cache.reset()
            pending = idx[:, -context:]
        logits = _cache_and_predict(model, pending, caches, prefill_chunk)     # (B, V)
        pending = _sample(logits, temperature, top_k, generator)                # (B, 1)
        idx = torch.cat([idx, pending], dim=1)
    return idx

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
``generate(..., compile=True)`` runs each decode step through ``torch.compile`` with a
``StaticKVCache`` per layer (``model.new_static_caches``): gpt-fast's recipe.
"""

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .arguments import check_non_negative_ints, check_positive_ints
from .kv_cache import KVCache, RollingKVCache, StaticKVCache, is_kv_cache
from .multihead import MultiHeadAttention

__all__ = ["GPT", "GPTConfig", "GenerationConfig", "generate", "queries_keys_values"]


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
                cache: KVCache | RollingKVCache | None = None, return_weights: bool = False,
                attn_mask: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """x: (B, T, C) -> (x: (B, T, C), attention weights (B, H, T, S) or None).

        ``positions`` (T,): where the tokens sit, for RoPE. ``cache``: this layer's KV cache
        (then S = the cached length after x's tokens are added, else S = T). ``attn_mask``:
        broadcastable to (B, H, T, S), True where a query may attend (besides the causal rule)."""
        attended = self.attn(self.attn_norm(x), is_causal=True, positions=positions,
                             cache=cache, return_weights=return_weights, attn_mask=attn_mask)
        attended, weights = attended if return_weights else (attended, None)
        x = x + attended
        if self.mlp is not None:
            x = x + self.mlp(self.mlp_norm(x))
        return x, weights


@dataclass(frozen=True)
class GenerationConfig:
    """What ``generate`` reads from a model when not told: the tokens that end a sequence
    (``eos_token_id``, none for the course's own models) and the one that pads a finished row
    (``pad_token_id``; None: the first end token, as transformers). ``load_pretrained`` reads
    them from a checkpoint's ``generation_config.json`` (or its ``config.json``)."""

    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None


class GPT(nn.Module):
    """A decoder-only transformer: token ids (B, T) -> next-token logits (B, T, V)."""

    generation_config = GenerationConfig()
    # what generate does once a sequence outgrows config.seq_len: "slide" (the course's models:
    # keep the last seq_len tokens and read them afresh), "extend" (RoPE positions run on past
    # it, as transformers' do), "refuse" (learned positions end there: transformers raises)
    past_seq_len = "slide"

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

    def new_static_caches(self, batch_size: int, max_seq_len: int | None = None, *,
                          dtype: torch.dtype | None = None, device=None) -> list[StaticKVCache]:
        """One empty ``StaticKVCache`` per layer, each (B, Hkv, max_seq_len, D) for keys and
        values: the caches of a compiled decode step. Defaults as ``new_caches``."""
        max_seq_len = self.config.seq_len if max_seq_len is None else max_seq_len
        caches = []
        for block in self.blocks:
            attn, weight = block.attn, block.attn.k_proj.weight
            caches.append(StaticKVCache(batch_size, attn.n_kv_heads, max_seq_len, attn.head_dim,
                                        dtype=weight.dtype if dtype is None else dtype,
                                        device=weight.device if device is None else device))
        return caches

    def generate(self, idx: Tensor, max_new_tokens: int, **options) -> Tensor:
        """``generate(self, idx, max_new_tokens, **options)``, as transformers' method."""
        return generate(self, idx, max_new_tokens, **options)

    def forward(self, idx: Tensor, *, caches: list[KVCache | RollingKVCache] | None = None,
                return_attention: bool = False, last_only: bool = False,
                attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                head: Tensor | None = None) -> Tensor | tuple[Tensor, list[Tensor]]:
        """idx: (B, T) long -> logits (B, T, V); with ``return_attention`` also, for each layer,
        its attention weights (B, H, T, S). ``last_only``: the logits of the last position only,
        (B, 1, V), all that generation reads (the output layer is the largest product of a
        small model's step: a prefill of T tokens would pay it T times).

        ``attention_mask`` (B, S) bool or 0/1, as transformers': False/0 for a key to ignore
        (left padding), for every token cached and new. ``position_ids`` (B, T): the positions
        of learned position embeddings, when they are not the slots (left padding); RoPE reads
        the slots, as only differences of positions reach its scores. ``head`` (C, V): the
        LM head's weight, transposed, to use in place of ``lm_head`` (``generate`` passes one
        laid out for speed).

        ``caches`` (one ``KVCache`` per layer, from ``new_caches``): idx holds the next T tokens
        of sequences whose first len(caches[0]) tokens are cached; they sit at positions
        len .. len + T - 1, their keys and values are appended, and S = len + T. Rolling caches
        (``new_rolling_caches``) work the same way, S being then what they hold, and so do
        static ones (``new_static_caches``: S is their max_seq_len, attention_mask may be given
        for the first len + T slots only). Without caches, S = T and the tokens sit at
        0 .. T - 1.
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
        if position_ids is not None and (not isinstance(position_ids, Tensor)
                                         or position_ids.shape != idx.shape):
            raise ValueError(f"position_ids must be a tensor of idx's shape {tuple(idx.shape)}")
        if (self.position_embedding is not None and position_ids is None
                and start + t > self.config.seq_len):
            cached = (f" after {start} cached tokens, at positions up to {start + t - 1},"
                      if start else "")
            raise ValueError(f"sequence length T={t}{cached} must be in [1, seq_len="
                             f"{self.config.seq_len}] (learned positions stop at seq_len)")
        positions = torch.arange(start, start + t, device=idx.device)
        keys = None
        if attention_mask is not None:
            if (not isinstance(attention_mask, Tensor)
                    or attention_mask.shape != (idx.shape[0], start + t)):
                raise ValueError(f"attention_mask must be (B, S) = ({idx.shape[0]}, {start + t})"
                                 " for every cached and new token, got " + (
                                     str(tuple(attention_mask.shape))
                                     if isinstance(attention_mask, Tensor)
                                     else type(attention_mask).__name__))
            keys = attention_mask.bool()[:, None, None, :]                 # (B, 1, 1, S)
        # positions from the cache were checked above; given ones are read here (not on the meta
        # device, which holds no values: FLOP counts run the model there)
        if (self.position_embedding is not None and position_ids is not None
                and not position_ids.is_meta and int(position_ids.max()) >= self.config.seq_len):
            raise ValueError(f"position {int(position_ids.max())} is past seq_len="
                             f"{self.config.seq_len} (learned positions stop at seq_len)")
        return self._run(idx, positions, caches, keys, position_ids, last_only=last_only,
                         return_attention=return_attention, head=head)

    def _run(self, idx: Tensor, positions: Tensor, caches: list | None, keys: Tensor | None,
             position_ids: Tensor | None, *, last_only: bool = False,
             return_attention: bool = False,
             head: Tensor | None = None) -> Tensor | tuple[Tensor, list[Tensor]]:
        """``forward``'s computation, its arguments checked: idx (B, T) at ``positions`` (T,)
        (a tensor: a compiled step reads them from its static caches), ``keys`` (B, 1, 1, S)
        bool or None, ``position_ids`` (B, T) or None. No Python value in here depends on the
        position, so that ``torch.compile`` traces a decode step once (which calls this, not
        the module: forward hooks do not see a compiled step). ``head``: as ``forward``'s."""
        x = self.token_embedding(idx)                                        # (B, T, C)
        if self.position_embedding is not None:
            x = x + self.position_embedding(positions if position_ids is None else position_ids)
        attention = []
        for i, block in enumerate(self.blocks):
            x, weights = block(x, positions=positions, return_weights=return_attention,
                               cache=None if caches is None else caches[i], attn_mask=keys)
            attention.append(weights)
        if last_only:
            x = x[:, -1:]
        x = self.final_norm(x)
        logits = self.lm_head(x) if head is None else x @ head               # (B, T, V)
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


def _next_token(logits: Tensor, do_sample: bool, temperature: float, top_k: int | None,
                top_p: float | None, generator: torch.Generator | None) -> Tensor:
    """The next token of each row, logits (B, V) -> (B, 1): the argmax (greedy), or with
    ``do_sample`` a draw from softmax(logits / temperature) restricted to the ``top_k`` largest
    and then to the smallest set whose probability reaches ``top_p``: transformers' logits
    warpers, in their order, in float32."""
    if not do_sample or temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    scores = logits.float()
    if temperature != 1.0:
        scores = scores / temperature
    if top_k is not None:
        kth = torch.topk(scores, min(top_k, scores.shape[-1])).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ascending, order = torch.sort(scores)
        dropped = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        dropped[:, -1] = False                                      # the most likely stays
        scores = scores.masked_fill(dropped.scatter(1, order, dropped), float("-inf"))
    return torch.multinomial(F.softmax(scores, dim=-1), 1, generator=generator)


def _cache_and_predict(model: GPT, tokens: Tensor, caches: list, chunk: int | None,
                       mask: Tensor | None, positions: Tensor | None,
                       head: Tensor | None) -> Tensor:
    """Run tokens (B, T) through the model, appending their keys and values to the caches,
    ``chunk`` tokens per forward (all at once for None) -> the logits after the last, (B, V):
    the prefill of a prompt, and each eager decode step's one new token. ``mask`` (B, S): which
    of the cached and new tokens are real (None: all); ``positions`` (B, T): learned positions;
    ``head``: ``_decode_head``'s."""
    chunk = tokens.shape[1] if chunk is None else chunk
    cached = len(caches[0])
    for start in range(0, tokens.shape[1], chunk):
        end = min(start + chunk, tokens.shape[1])
        logits = model(tokens[:, start:end], caches=caches, last_only=True,    # (B, 1, V)
                       attention_mask=None if mask is None else mask[:, :cached + end],
                       position_ids=None if positions is None else positions[:, start:end],
                       head=head)
    return logits[:, -1]


def _decode_head(model: GPT) -> Tensor | None:
    """The LM head's weight transposed and made contiguous, (C, V), for generate; None to keep
    ``lm_head`` (a bias, or not float32 on the CPU).

    One token's logits are a (1, C) x (C, V) product that reads all V·C weights; on the CPU in
    float32, MKL does it 2.6x faster from a (C, V) weight than from nn.Linear's (V, C) (measured,
    one thread, V = 32000, C = 384: 1.9 ms against 4.9 ms, a third of a 20M Llama's decode
    step), while in float16 it is 6.7x slower and in bfloat16 no faster. The copy (V·C, once
    per generate) is made for float32 on the CPU only."""
    weight = model.lm_head.weight
    if (type(model.lm_head) is not nn.Linear or model.lm_head.bias is not None
            or weight.device.type != "cpu" or weight.dtype != torch.float32):
        return None
    return weight.t().contiguous()


def _decode_step(model: GPT, token: Tensor, caches: list[StaticKVCache], keys: Tensor | None,
                 positions: Tensor | None, head: Tensor | None) -> Tensor:
    """One decode step on static caches, what ``generate(compile=True)`` compiles: token (B, 1)
    -> logits (B, V), its keys and values written at the caches' next position. ``keys``
    (B, 1, 1, S) bool: the real tokens among the S slots (None: all); ``positions`` (B, 1):
    learned positions (None: the slots')."""
    return model._run(token, caches[0].positions(1), caches, keys, positions, last_only=True,
                      head=head)[:, -1]


_compiled_step = None


def compiled_decode_step():
    """``_decode_step`` through ``torch.compile`` (Inductor), made once per process:
    ``fullgraph=True``, so a graph break is an error, never a silent split, and
    ``dynamic=False``, so each model and shape (batch, cache length) compiles its own step, once
    for every position (the position is a tensor; nothing in the step reads it as an int).
    Dynamo keeps at most ``torch._dynamo.config.recompile_limit`` (8) of them; with fullgraph,
    one more is an error, never a fall back to eager."""
    global _compiled_step
    if _compiled_step is None:
        _compiled_step = torch.compile(_decode_step, fullgraph=True, dynamic=False)
    return _compiled_step


STATIC_CACHE_BLOCK = 128   # a compiled step's cache length is rounded up to a multiple of this


def _rope_table(model: GPT) -> int | None:
    """The positions every layer's RoPE table covers (None: no RoPE): a compiled step reads the
    table without checking the range (a check would read the position back as an int)."""
    tables = [block.attn.rotary.max_seq_len for block in model.blocks
              if block.attn.rotary is not None]
    return min(tables) if tables else None


def _token_ids(value, name: str) -> tuple[int, ...]:
    ids = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    if (not isinstance(ids, (tuple, list)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
        raise ValueError(f"{name} must be a token id, a list of them or (), got {value!r}")
    return tuple(ids)


def _check_prompt(idx, attention_mask) -> Tensor | None:
    """ValueError (one line) unless idx is (B, T) long and attention_mask None or its (B, T)
    left padding; the mask as bool, None when it pads nothing."""
    if not isinstance(idx, Tensor):
        raise ValueError(f"idx must be a (B, T) torch.long tensor of token ids, got a "
                         f"{type(idx).__name__}: torch.tensor([ids]) makes a batch of one")
    if idx.dim() != 2 or idx.dtype != torch.long or idx.shape[1] == 0:
        hint = ": idx[None] makes a batch of one" if idx.dim() == 1 else ""
        raise ValueError(f"idx must be a (B, T) torch.long tensor of token ids with T >= 1, got "
                         f"shape {tuple(idx.shape)} dtype {idx.dtype}{hint}")
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor) or attention_mask.shape != idx.shape:
        got = (tuple(attention_mask.shape) if isinstance(attention_mask, Tensor)
               else type(attention_mask).__name__)
        raise ValueError(f"attention_mask must have idx's shape {tuple(idx.shape)}, got {got}")
    mask = attention_mask.to(idx.device).bool()
    if not ((attention_mask == 0) | (attention_mask == 1)).all() or not mask[:, -1].all():
        raise ValueError("attention_mask must be 1 for tokens and 0 for padding, padded on the "
                         "left (tokenizer.padding_side = 'left'), as transformers' generate needs")
    if not torch.equal(mask, mask.int().cummax(dim=1).values.bool()):
        raise ValueError("attention_mask pads a row between tokens or on the right: generate "
                         "needs left padding (tokenizer.padding_side = 'left')")
    return None if mask.all() else mask


def check_sampling(do_sample, temperature, top_k, top_p, seeded: bool, greedy_note: str,
                   stacklevel: int) -> None:
    """The sampling options of ``generate`` (and of ``serve.Engine.generate``) checked: a
    ValueError in one line for a bad one; a warning, ``greedy_note`` first, when options that
    only sampling reads are given without ``do_sample`` (``seeded``: a generator was given).
    ``stacklevel`` points the warning at the caller of the public function (counted from
    this function: 1 is here)."""
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample must be True or False, got {do_sample!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if top_k is not None:
        check_positive_ints(top_k=top_k)
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if not do_sample and (temperature not in (0, 1) or top_k not in (None, 1)
                          or top_p not in (None, 1) or seeded):
        warnings.warn(f"{greedy_note}: temperature, top_k, top_p and generator are not used",
                      stacklevel=stacklevel)


def generate(model: GPT, idx: Tensor, max_new_tokens: int, *, do_sample: bool = False,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             generator: torch.Generator | None = None, eos_token_id=None,
             pad_token_id: int | None = None, attention_mask: Tensor | None = None,
             use_cache: bool = True, prefill_chunk: int | None = None, rolling: bool = False,
             sinks: int = 0, compile: bool = False) -> Tensor:
    """Extend idx (B, T) by at most ``max_new_tokens`` tokens -> (B, T + n), n <= max_new_tokens.

    Transformers' conventions, under its names: greedy (the most likely token) unless
    ``do_sample=True``; then each token is drawn from softmax(logits / temperature), restricted
    to the ``top_k`` most likely tokens when given, then to the smallest set of them whose
    probability reaches ``top_p`` when given (transformers' order, in float32). ``generator``
    (on idx's device) seeds the draws; None draws from torch's global generator, as transformers
    does. ``temperature=0`` is greedy too (the course's older spelling). Unlike transformers,
    a checkpoint's ``generation_config.json`` sets no sampling: only its end and pad tokens, and
    ``top_k`` has no default (transformers' is 50). Sampling options without ``do_sample``
    are not used, with a warning (transformers warns too).

    ``eos_token_id`` (an id or a list; None: ``model.generation_config``'s, () for none): a row
    that generates one is finished; the batch goes on for the others, a finished row gets
    ``pad_token_id`` (None: the model's, else the first end token), and generation stops once
    every row is finished. ``attention_mask`` (B, T), 1 for tokens and 0 for padding: a batch of
    prompts of different lengths, padded on the left; the padding is never attended to, and each
    row's tokens equal those of its prompt alone, as transformers' (a model that slides past
    ``seq_len``, below, refuses a padded batch that would outgrow it).

    ``use_cache=True``: the prompt is run once (the prefill, ``prefill_chunk`` tokens per forward
    when given), its keys and values kept in one ``KVCache`` per layer, and then each step runs
    only the newest token. ``use_cache=False`` runs the whole sequence at every step. Both give
    the same logits, up to float rounding, so greedy decoding gives the same tokens.

    Past ``config.seq_len`` (``model.past_seq_len``): the course's own models slide, seeing the
    last ``seq_len`` tokens, read afresh (every token's position shifts at each step, so nothing
    cached stays valid); a checkpoint with RoPE goes on with positions past its
    max_position_embeddings, as transformers' does; one with learned positions (GPT-2) is refused
    before anything runs (transformers raises an IndexError).

    ``rolling=True`` (a model with a ``window``): one ``RollingKVCache`` per layer, keeping the
    last ``window`` tokens and the first ``sinks`` (attention sinks). The whole prompt is
    prefilled and nothing restarts: every token stays at its own position, memory stays fixed,
    and with RoPE the sequence may grow past ``seq_len`` (learned positions: ValueError). With
    ``sinks=0`` this gives the tokens of the full cache with the window mask.

    ``compile=True`` (gpt-fast's recipe): one ``StaticKVCache`` per layer, its length the
    prompt's and the new tokens' rounded up to ``STATIC_CACHE_BLOCK``; the prompt is prefilled
    eagerly, then every decode step runs ``compiled_decode_step()``, which ``torch.compile``
    traces once per model and shape (the first call takes seconds; later calls of the same
    shapes reuse it), with no graph break. The tokens are the eager ones (up to float
    rounding). It needs the cache (not ``use_cache=False`` or ``rolling``) and the whole
    sequence within ``seq_len`` for the course's own models (they slide past it) and within
    the RoPE table for checkpoints: ValueError otherwise.
    """
    mask = _check_prompt(idx, attention_mask)
    check_non_negative_ints(max_new_tokens=max_new_tokens)
    check_sampling(do_sample, temperature, top_k, top_p, generator is not None,
                   "generate is greedy unless do_sample=True (as transformers' generate)",
                   stacklevel=3)
    config = getattr(model, "generation_config", GenerationConfig())
    eos = config.eos_token_id if eos_token_id is None else _token_ids(eos_token_id,
                                                                      "eos_token_id")
    pad = config.pad_token_id if pad_token_id is None else pad_token_id
    if pad is None and eos:
        pad = eos[0]
    if eos:
        check_non_negative_ints(pad_token_id=pad)
    if prefill_chunk is not None:
        check_positive_ints(prefill_chunk=prefill_chunk)
    check_non_negative_ints(sinks=sinks)
    if sinks and not rolling:
        raise ValueError(f"sinks={sinks} are kept by a rolling cache: pass rolling=True too")
    if rolling and not use_cache:
        raise ValueError("rolling=True asks for a rolling KV cache, but use_cache=False")
    if compile:
        _check_compile(model, idx.shape[1] + max_new_tokens - 1, use_cache, rolling)
    if rolling and mask is not None:
        raise ValueError("rolling=True keeps no padding mask: generate padded prompts with "
                         "rolling=False, or one prompt at a time")
    if rolling:
        if model.config.window is None:
            raise ValueError("rolling=True needs a model with a window (config.window); this "
                             "one attends to every earlier token")
        end = idx.shape[1] + max_new_tokens - 1
        if model.config.position == "learned" and end > model.config.seq_len:
            raise ValueError(f"learned positions stop at seq_len={model.config.seq_len}, but "
                             f"rolling=True keeps every token at its own position, up to "
                             f"{end - 1}: use position='rope', or rolling=False")
    if (mask is not None and model.past_seq_len == "slide"
            and idx.shape[1] + max_new_tokens - 1 > model.config.seq_len):
        raise ValueError(f"a padded batch of {idx.shape[1]} + {max_new_tokens} tokens outgrows "
                         f"seq_len={model.config.seq_len}, where this model slides its window, "
                         "which would hold fewer tokens of a padded row: generate the rows one "
                         "at a time")
    if model.past_seq_len == "refuse" and max_new_tokens:
        real = idx.shape[1] if mask is None else int(mask.sum(dim=1).max())
        last = real + max_new_tokens - 2              # the last position the model reads
        if last >= model.config.seq_len:
            raise ValueError(f"a prompt of {real} tokens and max_new_tokens={max_new_tokens} "
                             f"reach position {last}, past the model's {model.config.seq_len} "
                             "learned positions (transformers raises too): shorten either")
    # inference mode: no autograd bookkeeping at all, which is most of a small decode step's
    # cost; the clone makes the result an ordinary tensor, usable in training afterwards
    with torch.inference_mode():
        out = _generate(model, idx, max_new_tokens, _Sampling(
            do_sample, temperature, top_k, top_p, generator), eos, pad, mask, use_cache,
            prefill_chunk, sinks if rolling else None, compile)
    return out.clone()


def _check_compile(model: GPT, length: int, use_cache: bool, rolling: bool) -> None:
    """ValueError (one line) unless ``generate(compile=True)`` can hold a sequence of
    ``length`` tokens (the prompt and every new token but the last) in static caches."""
    if not use_cache or rolling:
        raise ValueError("compile=True compiles the decode step of a static KV cache: it needs "
                         "use_cache=True and rolling=False")
    if model.past_seq_len == "slide" and length > model.config.seq_len:
        raise ValueError(f"compile=True keeps the whole sequence, {length} tokens, but this "
                         f"model slides its window past seq_len={model.config.seq_len}: "
                         "generate fewer tokens, or compile=False")
    table = _rope_table(model)
    if table is not None and length > table:
        raise ValueError(f"compile=True reads RoPE's table of {table} positions without a "
                         f"check, but the sequence reaches position {length - 1}: generate "
                         "fewer tokens, or compile=False")


@dataclass(frozen=True)
class _Sampling:
    """``_next_token``'s options, checked."""

    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    generator: torch.Generator | None

    def __call__(self, logits: Tensor) -> Tensor:
        return _next_token(logits, self.do_sample, self.temperature, self.top_k, self.top_p,
                           self.generator)


def _learned_positions(mask: Tensor | None, model: GPT) -> Tensor | None:
    """Each token's position among its row's real tokens (B, T), pads at 1 (transformers'
    rule), for learned position embeddings; None when the slots are the positions."""
    if mask is None or model.position_embedding is None:
        return None
    return (mask.long().cumsum(dim=1) - 1).masked_fill(~mask, 1)


def _generate(model, idx, max_new_tokens, sample, eos, pad, mask, use_cache, prefill_chunk,
              rolling_sinks, compiled) -> Tensor:
    """``generate``'s loop, its arguments checked; ``rolling_sinks`` is None for full caches,
    ``mask`` (B, T) None without padding, ``compiled``: static caches and the compiled step."""
    head = _decode_head(model)
    # a window slides over the last seq_len tokens, unless a rolling cache keeps every token
    # at its own position (fixed memory, past seq_len for ever)
    context = model.config.seq_len if model.past_seq_len == "slide" and rolling_sinks is None \
        and not compiled else None      # (compile=True was refused a sequence past seq_len)
    if eos:                          # which rows have ended; nothing to track without an end
        end_ids = torch.tensor(eos, dtype=torch.long, device=idx.device)
        finished = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
    if mask is not None:             # grown with the tokens, each step
        mask = torch.cat([mask, mask.new_ones(idx.shape[0], max_new_tokens)], dim=1)

    def window(t: int) -> slice:     # the tokens the model sees when the sequence is t long
        return slice(0 if context is None else max(0, t - context), t)

    def append(idx: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
        nonlocal finished
        token = sample(logits)                                                   # (B, 1)
        if eos:
            token = token.masked_fill(finished[:, None], pad)
            finished = finished | torch.isin(token[:, 0], end_ids)
        return torch.cat([idx, token], dim=1), token

    if not use_cache:
        for _ in range(max_new_tokens):
            seen = window(idx.shape[1])
            part = None if mask is None else mask[:, seen]
            logits = model(idx[:, seen], last_only=True, attention_mask=part,
                           position_ids=_learned_positions(part, model),
                           head=head)[:, -1]                                       # (B, V)
            idx, _ = append(idx, logits)
            if eos and finished.all():
                break
        return idx
    if max_new_tokens == 0:
        return idx
    b = idx.shape[0]
    if rolling_sinks is not None:         # fixed memory, every token at its own position
        caches = model.new_rolling_caches(b, sinks=rolling_sinks, device=idx.device)
    elif compiled:
        length = idx.shape[1] + max_new_tokens - 1
        slots = -(-length // STATIC_CACHE_BLOCK) * STATIC_CACHE_BLOCK
        caches = model.new_static_caches(b, slots, device=idx.device)
        step = compiled_decode_step()
        keys = None if mask is None else F.pad(mask[:, :idx.shape[1]], (
            0, slots - idx.shape[1]), value=True)[:, None, None, :]        # (B, 1, 1, slots)
    else:
        capacity = idx.shape[1] + max_new_tokens - 1
        caches = model.new_caches(b, capacity if context is None else min(capacity, context),
                                  device=idx.device)
    start = window(idx.shape[1]).start        # where the cached tokens begin in idx
    pending = idx[:, start:]                  # tokens whose keys are not cached yet
    positions = _learned_positions(None if mask is None else mask[:, start:idx.shape[1]], model)
    for i in range(max_new_tokens):
        if context is not None and len(caches[0]) + pending.shape[1] > context:
            for cache in caches:              # the model's context slides: start afresh (never
                cache.reset()                 # with a padded batch: generate refuses it)
            start = window(idx.shape[1]).start
            pending = idx[:, start:]
        if compiled and i:                    # a decode step (the prefill runs eagerly)
            logits = step(model, pending, caches, keys, positions, head)          # (B, V)
        else:
            logits = _cache_and_predict(model, pending, caches, prefill_chunk,
                                        None if mask is None else mask[:, start:],
                                        positions, head)                           # (B, V)
        if positions is not None:
            positions = positions[:, -1:] + 1             # the next token's, after the last
        idx, pending = append(idx, logits)
        if eos and finished.all():
            break
    return idx

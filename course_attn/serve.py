"""Serving many requests at once: a continuous-batching engine on the paged KV cache.

    requests ──> waiting ──admit while blocks last──> running ──finished──> blocks freed
                    ^                                    │
                    └──────── preempted (blocks freed, recomputed later) ┘

Every step runs ONE forward for every running request: a newly admitted one feeds its prompt
(the prefill), the others their last token (a decode step), all packed into one batch of tokens,
each at its own position (Orca's iteration-level scheduling, Yu et al., 2022, §3). A request
that finishes frees its blocks at once, and a waiting one joins at the next step. Requests may
arrive over time (``arrivals``: the step at which each joins the queue); each step is timed, and
``request_latencies`` reads every request's time to first token and time per output token from
the steps.

Chunked prefill (Sarathi-Serve, Agrawal et al., 2024; vLLM's ``max_num_batched_tokens``): a step
feeds at most ``max_num_batched_tokens`` tokens, the decode tokens first (one per running
request, in admission order), then the prompts still being prefilled, then newcomers; a prompt
that does not fit is fed in chunks over several steps, and ``long_prefill_token_threshold`` caps
one request's chunk (vLLM's name), so a long prompt leaves room beside it for short ones. A
request samples its first token in the step that feeds the last of its prompt. When a running
request needs a block and none is free, the request admitted last is preempted: its blocks are
freed and it waits again, with the tokens it generated, to be recomputed later (vLLM's
recomputation, Kwon et al., 2023, §4.5). A request whose prompt starts like a running request's
shares the blocks of that common prefix and runs only the rest (prefix sharing). With
``prefix_cache=True`` the full blocks of every request stay in the pool's prefix cache after it
ends (``paged.py``: a chained hash per block, LRU eviction), and a newcomer whose prompt starts
with blocks found there takes them instead of recomputing them. A ``watermark`` share of the
pool is kept free at admission, so that a request just admitted is not preempted at once for
the decode slots of the others (vLLM's watermark); requests are admitted first come, first
served, so a request that does not fit holds back those behind it (head-of-line blocking).

Each request is decoded with ``generate``'s arguments (``model.py``, transformers' conventions):
greedy unless ``do_sample=True``, then temperature, ``top_k``, ``top_p`` and a seeded
``torch.Generator`` of its own; a request that emits an end token (``eos_token_id``) finishes
at that step and its blocks go back to the pool, while the others go on. Each request gets the
tokens ``generate`` gives it alone in exact arithmetic (in float32, up to near-ties); in
bfloat16 batched kernels are not batch-invariant, so a near-tie may go the other way
(``Engine``'s docstring has the count).

The engine reads the model's own modules, so a ``GPT`` (``model.py``) and a checkpoint loaded by
``load_pretrained`` run alike: ``token_embedding``, ``position_embedding`` (or None),
``blocks`` (each with ``attn_norm``, ``attn`` a ``MultiHeadAttention``, ``mlp_norm`` and
``mlp`` or None), ``final_norm``, ``lm_head`` and ``config.seq_len``. It does not go through
``GPT.forward``, which gives a whole batch one start position (every row's tokens at
len(cache) .. len(cache) + T - 1): a ragged batch needs a position per token.
"""

import functools
import math
import numbers
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .arguments import check_non_negative_ints, check_positive_ints
from .model import GenerationConfig, _next_token, _token_ids, check_sampling
from .multihead import merge_heads
from .paged import BlockTable, PagedKVCache, PoolExhausted, block_tables_tensor, paged_attention
from .timing import time_call_ms

__all__ = ["Engine", "Latency", "StepRecord", "request_latencies"]

MODEL_PARTS = ("token_embedding", "position_embedding", "blocks", "final_norm", "lm_head", "config")
BLOCK_PARTS = ("attn_norm", "attn", "mlp_norm", "mlp")


def _check_model(model) -> None:
    """ValueError naming what the engine reads and the model lacks (module docstring)."""
    missing = [name for name in MODEL_PARTS if not hasattr(model, name)]
    blocks = getattr(model, "blocks", None) or []
    missing += [f"blocks[{i}].{name}" for i, block in enumerate(blocks) for name in BLOCK_PARTS
                if not hasattr(block, name) and not (name == "mlp_norm"
                                                     and getattr(block, "mlp", 1) is None)]
    if not blocks:
        missing.append("blocks (at least one)")
    if missing:
        raise ValueError(f"the engine runs a GPT-like model (course_attn.model.GPT or "
                         f"load_pretrained's), but {type(model).__name__} has no "
                         f"{', '.join(missing)}")


def _token_list(prompt, i: int, vocab: int) -> list[int]:
    """Prompt i (a list of ints, NumPy's included, or a 1-D integer tensor or array) -> a list
    of ints; ValueError naming what is wrong with it."""
    what = f"prompt {i} must be a non-empty list of token ids in [0, vocab_size={vocab})"
    if isinstance(prompt, Tensor) or hasattr(prompt, "__array__"):
        array = torch.as_tensor(prompt)
        if array.dim() != 1 or array.dtype == torch.bool or array.is_floating_point() \
                or array.is_complex():
            raise ValueError(f"{what} or a 1-D integer tensor, got a {type(prompt).__name__} of "
                             f"shape {tuple(array.shape)} dtype {array.dtype}")
        prompt = array.tolist()
    elif not isinstance(prompt, (list, tuple)):
        raise ValueError(f"{what}, got {type(prompt).__name__} {prompt!r}")
    if not prompt:
        raise ValueError(f"{what}, got an empty {type(prompt).__name__}")
    for t in prompt:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):       # NumPy bool_ too
            raise ValueError(f"{what}, got {t!r} ({type(t).__name__}) among them")
        if not 0 <= t < vocab:
            raise ValueError(f"{what}, got {t!r} among them")
    return [int(t) for t in prompt]


@dataclass
class _Request:
    """One request: its tokens so far (prompt, then generated), its table, and what is cached."""

    index: int
    tokens: list[int]
    prompt_len: int
    table: BlockTable
    limit: int                  # new tokens to generate, at most
    generator: torch.Generator | None = None   # its draws, when sampling
    arrival: int = 0            # the step at which it joins the queue
    keys: list[int] = field(default_factory=list)   # chained hashes of its full blocks
    registered: int = 0         # full blocks of its table filed in the prefix cache
    new: int = 0                # tokens fed in the current step
    slots: Tensor | None = None   # (new,) their flat slots in the pool

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def unfed(self) -> int:
        """Tokens not yet in the cache: 1 when decoding, more while its prompt is prefilled."""
        return len(self.tokens) - len(self.table)


@dataclass
class StepRecord:
    """What one engine step did: the requests it ran (by index, admitted ones included), those
    that arrived in the queue, were admitted, sampled a token, finished and were
    preempted, how many tokens it fed (prefill and decode together), how many prompt tokens it
    did not feed thanks to a shared prefix (``cache_hit_tokens`` of them found in the prefix
    cache), the pool's state after it (``cached_tokens``: held by
    the requests still running; ``blocks_used``) and its time (``course_attn.timing``'s clock:
    processor time on a CPU running one thread, wall time elsewhere). A step in which nothing
    runs (the queue empty until a later arrival) runs no forward and takes 0 ms."""

    running: list[int]
    arrived: list[int] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    fed_tokens: int = 0
    shared_tokens: int = 0
    cache_hit_tokens: int = 0
    cached_tokens: int = 0
    blocks_used: int = 0
    time_ms: float = 0.0


@dataclass
class Latency:
    """One request's latencies: ``ttft`` the time to its first token, from the start of the step
    it arrived in to the end of the step that sampled it; ``tpot`` the time per output token
    after the first, (end of its last token's step - end of its first's) / (tokens - 1), None
    for a request of one token. ``*_steps`` in engine steps, ``*_ms`` in milliseconds."""

    ttft_steps: int
    ttft_ms: float
    tpot_steps: float | None
    tpot_ms: float | None


def request_latencies(steps: list[StepRecord]) -> dict[int, Latency]:
    """Every request that sampled a token, read from an engine's ``steps`` -> {request: its
    ``Latency``}."""
    end_ms = [0.0]                                  # end_ms[t + 1]: when step t ended
    for step in steps:
        end_ms.append(end_ms[-1] + step.time_ms)
    arrived, sampled = {}, {}
    for t, step in enumerate(steps):
        arrived.update((i, t) for i in step.arrived)
        for i in step.sampled:
            sampled.setdefault(i, []).append(t)
    out = {}
    for i, ts in sampled.items():
        first, last, n = ts[0], ts[-1], len(ts)
        out[i] = Latency(ttft_steps=first + 1 - arrived[i],
                         ttft_ms=end_ms[first + 1] - end_ms[arrived[i]],
                         tpot_steps=(last - first) / (n - 1) if n > 1 else None,
                         tpot_ms=(end_ms[last + 1] - end_ms[first + 1]) / (n - 1) if n > 1
                         else None)
    return out


class Engine:
    """Generation for many requests at once, on a paged KV cache of ``num_blocks`` blocks of
    ``block_size`` tokens per layer.

    ``engine.generate(prompts, max_new_tokens, **options)`` -> the new tokens of each request,
    in request order: for each, the tokens ``generate(model, prompt, max_new_tokens, **options)``
    gives it alone (``model.py``; greedy by default, an end token included, no padding after
    it). ``max_new_tokens`` may be one limit per request, ``arrivals`` the step at which each
    request joins the queue (default: all at step 0). ``max_batch`` caps the requests running
    at once (None: as many as the blocks hold); ``share_prefixes`` turns prefix sharing on or
    off; ``max_num_batched_tokens`` caps the tokens one step feeds (None: no cap) and
    ``long_prefill_token_threshold`` one request's prefill chunk (None: the step's cap), which
    turns on chunked prefill; ``prefix_cache`` keeps finished requests' full blocks for later
    ones; ``watermark`` is the share of blocks kept free at admission (module docstring).
    ``engine.steps`` records every step of the
    last call (a ``StepRecord`` each, timed), ``engine.pool`` is the block pool.

    Equal in exact arithmetic: the engine computes each request's logits from the same numbers
    as ``generate``, but packed beside other requests, and batched kernels are not
    batch-invariant (a row's sums may be taken in another order). In float32 the difference
    (at most 3e-6 in the logits of tests/test_serve.py's models) decides no token unless two
    logits nearly tie; bfloat16 keeps 8 significant bits to float32's 24, so its differences
    are far larger and near-ties do flip, after which the request goes its own way. Measured
    (CPU, torch 2.13, a default-initialised GPT: d_model 64, 2 layers, GQA 4:2, RoPE, vocab
    256; 10 requests of 3-30 tokens, 32 greedy tokens each, seeds 0-4): float32 50/50 requests
    equal, bfloat16 49/50 (9/10 on seed 0).
    """

    def __init__(self, model, *, block_size: int, num_blocks: int, max_batch: int | None = None,
                 share_prefixes: bool = True, max_num_batched_tokens: int | None = None,
                 long_prefill_token_threshold: int | None = None, prefix_cache: bool = False,
                 watermark: float = 0.0):
        check_positive_ints(block_size=block_size, num_blocks=num_blocks)
        for name, n in (("max_batch", max_batch), ("max_num_batched_tokens", max_num_batched_tokens),
                        ("long_prefill_token_threshold", long_prefill_token_threshold)):
            if n is not None:
                check_positive_ints(**{name: n})
        if isinstance(watermark, bool) or not isinstance(watermark, numbers.Real) \
                or not 0 <= watermark < 1:
            raise ValueError(f"watermark must be a share of the blocks in [0, 1), got {watermark!r}")
        _check_model(model)
        attn = model.blocks[0].attn
        weight = attn.k_proj.weight
        self.model, self.max_batch, self.share_prefixes = model, max_batch, share_prefixes
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.prefix_cache = prefix_cache
        self.watermark_blocks = int(watermark * num_blocks)
        self.device = weight.device
        self.pool = PagedKVCache(len(model.blocks), num_blocks, block_size, attn.n_kv_heads,
                                 attn.head_dim, dtype=weight.dtype, device=weight.device)
        self.steps: list[StepRecord] = []

    def _check(self, prompts, max_new_tokens, arrivals
               ) -> tuple[list[list[int]], list[int], list[int]]:
        """Every request's prompt as a list of ints, its limit of new tokens and its arrival
        step, its arguments checked (ValueError naming them)."""
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a list of token lists, got {type(prompts).__name__}")
        per_request = {}
        for name, what, given in (("max_new_tokens", "limits", max_new_tokens),
                                  ("arrivals", "steps", 0 if arrivals is None else arrivals)):
            per_request[name] = (list(given) if isinstance(given, (list, tuple))
                                 else [given] * len(prompts))
            if len(per_request[name]) != len(prompts):
                raise ValueError(f"{name} has {len(per_request[name])} {what} for "
                                 f"{len(prompts)} prompts")
            check_non_negative_ints(**{f"{name}[{i}]": n
                                       for i, n in enumerate(per_request[name])})
        limits = per_request["max_new_tokens"]
        vocab, seq_len = self.model.config.vocab_size, self.model.config.seq_len
        bs, n = self.pool.block_size, self.pool.num_blocks
        prompts = [_token_list(prompt, i, vocab) for i, prompt in enumerate(prompts)]
        for i, (prompt, max_new) in enumerate(zip(prompts, limits)):
            longest = len(prompt) + max_new - 1
            if longest > seq_len:
                raise ValueError(f"prompt {i} ({len(prompt)} tokens) and max_new_tokens="
                                 f"{max_new} reach {longest} positions, past the model's "
                                 f"seq_len={seq_len}")
            if -(-longest // bs) > n:
                raise ValueError(f"prompt {i} needs {-(-longest // bs)} blocks of {bs} tokens "
                                 f"for {longest} positions (its {len(prompt)} tokens and "
                                 f"max_new_tokens={max_new} less the last, never fed), but the "
                                 f"pool has num_blocks={n}")
        return prompts, limits, per_request["arrivals"]

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int], *,
                 arrivals: list[int] | None = None,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None,
                 generator: list[torch.Generator | None] | None = None,
                 eos_token_id=None) -> list[list[int]]:
        """Continue every prompt -> the new tokens of each request, in order: at most
        max_new_tokens of them (an int for all, or a list with one limit per request).

        ``arrivals``: the engine step at which each request joins the queue (None: all at step
        0); a step in which nothing runs waits for the next arrival (``StepRecord``).
        ``generate``'s options, with its meaning: greedy unless ``do_sample=True``, then drawn
        from softmax(logits / temperature) cut to ``top_k`` and ``top_p``. ``generator``: one
        ``torch.Generator`` (or None) per request, on the model's device; each request draws
        from its own only, in its own order, so it gets the tokens ``generate`` gives its prompt
        alone with a generator seeded alike, whatever else runs beside it (None: torch's global
        generator, drawn in the order the rows run). ``eos_token_id`` (an id or a list; None:
        ``model.generation_config``'s): a request that emits one finishes with it, and its
        blocks are freed in that step.
        """
        prompts, limits, arrivals = self._check(prompts, max_new_tokens, arrivals)
        generators = self._check_sampling(len(prompts), do_sample, temperature, top_k, top_p,
                                          generator)
        config = getattr(self.model, "generation_config", GenerationConfig())
        eos = set(config.eos_token_id if eos_token_id is None
                  else _token_ids(eos_token_id, "eos_token_id"))
        sample = (do_sample and temperature != 0, temperature, top_k, top_p)
        self.steps = []
        done = {i: [] for i, n in enumerate(limits) if n == 0}
        arriving = sorted((_Request(i, list(p), len(p), self.pool.new_table(), limit=limits[i],
                                    generator=generators[i], arrival=arrivals[i])
                           for i, p in enumerate(prompts) if limits[i] > 0),
                          key=lambda r: r.arrival)
        waiting: list[_Request] = []
        running: list[_Request] = []
        while arriving or waiting or running:
            record = StepRecord(running=[])
            while arriving and arriving[0].arrival <= len(self.steps):
                waiting.append(arriving.pop(0))
                record.arrived.append(waiting[-1].index)
            if waiting or running:
                record.time_ms = time_call_ms(
                    functools.partial(self._step, running, waiting, record, sample, eos, done),
                    self.device)
            self.steps.append(record)
        return [done[i] for i in range(len(prompts))]

    def _step(self, running: list[_Request], waiting: list[_Request], record: StepRecord,
              sample: tuple, eos: set[int], done: dict[int, list[int]]) -> None:
        """One step: schedule (running requests first, then newcomers, within the token budget),
        one forward, then each request that fed its last token samples its next."""
        budget = (math.inf if self.max_num_batched_tokens is None
                  else self.max_num_batched_tokens)
        budget = self._schedule_running(running, waiting, record, budget)
        if not record.preempted or not running:
            self._admit(running, waiting, record, budget)
        fed = [r for r in running if r.new]
        record.running = [r.index for r in fed]
        record.fed_tokens = sum(r.new for r in fed)
        logits = self._forward(fed)                                            # (B, V)
        if self.prefix_cache:
            for request in fed:
                self._register_full_blocks(request)
        sampling, temperature, top_k, top_p = sample
        for b, request in enumerate(fed):
            if request.unfed:                       # a prompt's chunk, more of it to come
                continue
            row = logits[b:b + 1]
            token = (int(_next_token(row, True, temperature, top_k, top_p, request.generator))
                     if sampling else int(row.argmax(dim=-1)))
            request.tokens.append(token)
            record.sampled.append(request.index)
            if len(request.generated) == request.limit or token in eos:
                done[request.index] = request.generated
                request.table.free()
                running.remove(request)
                record.finished.append(request.index)
        record.cached_tokens = sum(len(r.table) for r in running)
        record.blocks_used = self.pool.num_used

    def _check_sampling(self, n: int, do_sample, temperature, top_k, top_p,
                        generator) -> list[torch.Generator | None]:
        """``generate``'s sampling options checked as it checks them (ValueError, one line) ->
        each request's generator."""
        if generator is None:
            generator = [None] * n
        if isinstance(generator, torch.Generator) or not isinstance(generator, (list, tuple)):
            raise ValueError(f"generator must be a list with one torch.Generator (or None) per "
                             f"request, got a {type(generator).__name__}: a generator shared by "
                             f"the requests would draw in the batch's order")
        if len(generator) != n:
            raise ValueError(f"generator has {len(generator)} generators for {n} prompts")
        for i, g in enumerate(generator):
            if g is not None and (not isinstance(g, torch.Generator)
                                  or g.device.type != self.device.type):
                raise ValueError(f"generator[{i}] must be a torch.Generator on the model's "
                                 f"device ({self.device}) or None, got {g!r}")
        check_sampling(do_sample, temperature, top_k, top_p,
                       any(g is not None for g in generator),
                       "Engine.generate is greedy unless do_sample=True (as generate)",
                       stacklevel=5)
        return list(generator)

    def _chunk(self, request: _Request, budget: float) -> int:
        """Tokens ``request`` feeds this step: what it has not fed, within the step's budget and
        the cap on one prefill chunk (a decode step's one token is never capped)."""
        n = min(request.unfed, budget)
        if self.long_prefill_token_threshold is not None and n > 1:
            n = min(n, self.long_prefill_token_threshold)
        return int(n)

    def _schedule_running(self, running: list[_Request], waiting: list[_Request],
                          record: StepRecord, budget: float) -> float:
        """Slots for the running requests, decodes first then the prompts being prefilled, in
        admission order, within ``budget`` tokens -> the budget left. When the pool is short the
        latest admitted is preempted (the earliest admitted always goes on, so every request
        finishes)."""
        for request in sorted(running, key=lambda r: r.unfed > 1):
            request.new = 0
            if request not in running:              # preempted to make room for an earlier one
                continue
            n = self._chunk(request, budget)
            while n:
                try:
                    request.slots = request.table.reserve(n)
                    request.new = n
                    budget -= n
                    break
                except PoolExhausted:
                    victim = running.pop()
                    victim.table.free()
                    victim.new = 0
                    waiting.insert(0, victim)
                    record.preempted.append(victim.index)
                    if victim is request:
                        break
        return budget

    def _admit(self, running: list[_Request], waiting: list[_Request], record: StepRecord,
               budget: float) -> None:
        """Admit waiting requests, in order, while the pool holds their tokens and the step's
        budget lasts: every token not shared with a running request is fed, in chunks when the
        budget says so (a preempted request's prompt and the tokens it generated, all
        recomputed)."""
        while (waiting and budget >= 1
               and (self.max_batch is None or len(running) < self.max_batch)):
            request = waiting[0]
            hit = self._cached_prefix(request) if self.prefix_cache else []
            bs = self.pool.block_size
            shared = self._share_prefix(request, running, longer_than=len(hit) * bs)
            if not shared and hit:
                request.table.start_on(hit)
                shared = len(hit) * bs
                record.cache_hit_tokens += shared
            n = self._chunk(request, budget)
            if running and (self.pool.num_free - request.table.blocks_needed(n)
                            < self.watermark_blocks):
                request.table.free()
                return
            try:
                request.slots = request.table.reserve(n)
            except PoolExhausted:
                request.table.free()
                return
            request.new = n
            request.registered = 0
            budget -= n
            running.append(waiting.pop(0))
            record.admitted.append(request.index)
            record.shared_tokens += shared

    def _keys(self, request: _Request, n: int) -> list[int]:
        """The chained hashes of the first n full blocks of ``request``'s tokens: block i's key
        hashes its tokens and block i - 1's key (nano-vllm's), so equal keys mean equal
        prefixes."""
        bs = self.pool.block_size
        while len(request.keys) < n:
            i = len(request.keys)
            chunk = tuple(request.tokens[i * bs:(i + 1) * bs])
            request.keys.append(hash((request.keys[-1] if i else None, chunk)))
        return request.keys[:n]

    def _cached_prefix(self, request: _Request) -> list[int]:
        """The blocks of the prefix cache that hold ``request``'s first full blocks, as far as
        they are found; the last token is always fed (its logits give the next token)."""
        bs, blocks = self.pool.block_size, []
        for i, key in enumerate(self._keys(request, (len(request.tokens) - 1) // bs)):
            block = self.pool.cached(key, request.tokens[i * bs:(i + 1) * bs])
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _register_full_blocks(self, request: _Request) -> None:
        """File every full block of ``request``'s table in the prefix cache, once."""
        bs, full = self.pool.block_size, len(request.table) // self.pool.block_size
        for i, key in enumerate(self._keys(request, full)[request.registered:],
                                request.registered):
            self.pool.register(request.table.blocks[i], key,
                               tuple(request.tokens[i * bs:(i + 1) * bs]))
        request.registered = full

    def _share_prefix(self, request: _Request, running: list[_Request],
                      longer_than: int = 0) -> int:
        """Share the blocks of the longest prefix ``request`` has in common with a running
        request, if longer than ``longer_than`` tokens -> the number of tokens shared (0: none).
        A block being written in this step is shared only when full: the copy-on-write copy of
        a partly filled block is taken before it."""
        if not self.share_prefixes:
            return 0
        bs, best, donor = self.pool.block_size, longer_than, None
        for other in running:
            common = 0
            for a, b in zip(request.tokens[:-1], other.tokens[:len(other.table)]):
                if a != b:
                    break
                common += 1
            written_before = len(other.table) - other.new
            if common > written_before:             # keys computed in this step's forward
                common = max(written_before, common // bs * bs)
            if common > best:
                best, donor = common, other
        if donor is None:
            return 0
        request.table.share_prefix(donor.table, best)
        return best

    def _forward(self, running: list[_Request]) -> Tensor:
        """One forward of every running request's new tokens, packed -> the logits of the next
        token of each, (B, V). The new keys and values of each layer are written to the pool
        before its queries attend, so a request reads the prefix another writes in this step."""
        model, device = self.model, self.device
        tokens = torch.tensor([t for r in running for t in r.tokens[len(r.table) - r.new:
                                                                     len(r.table)]],
                              dtype=torch.long, device=device)                 # (N,)
        positions = torch.cat([torch.arange(len(r.table) - r.new, len(r.table))
                               for r in running]).to(device)                  # (N,)
        slots = torch.cat([r.slots for r in running]).to(device)              # (N,)
        query_lens = torch.tensor([r.new for r in running], device=device)    # (B,)
        context_lens = torch.tensor([len(r.table) for r in running], device=device)
        tables = block_tables_tensor([r.table for r in running], device=device)
        # packed token n is query (row[n], col[n]) of the padded (B, Tq) batch
        row = torch.repeat_interleave(torch.arange(len(running), device=device), query_lens)
        col = torch.arange(len(tokens), device=device) - (torch.cumsum(query_lens, 0)
                                                          - query_lens)[row]
        tq = int(query_lens.max())

        x = model.token_embedding(tokens)[None]                                # (1, N, C)
        if model.position_embedding is not None:
            x = x + model.position_embedding(positions)
        for layer, block in enumerate(model.blocks):
            attn = block.attn
            q, k, v = attn.project(block.attn_norm(x), positions=positions)    # (1, H, N, D)
            self.pool.write(layer, slots, k[0], v[0])
            padded = q.new_zeros(len(running), q.shape[1], tq, q.shape[3])     # (B, H, Tq, D)
            padded[row, :, col] = q[0].transpose(0, 1)
            out = paged_attention(padded, self.pool.k[layer], self.pool.v[layer], tables,
                                  context_lens, query_lens, scale=attn.scale,
                                  window=attn.window, backend=attn.backend)   # (B, H, Tq, Dv)
            out = out[row, :, col].transpose(0, 1)[None]                       # (1, H, N, Dv)
            x = x + attn.out_proj(merge_heads(out))
            if block.mlp is not None:
                x = x + block.mlp(block.mlp_norm(x))
        last = torch.cumsum(query_lens, 0) - 1                                 # (B,)
        return model.lm_head(model.final_norm(x[0, last]))                     # (B, V)

"""serve.py: the continuous-batching Engine gives every request the tokens that ``generate``
gives it alone with the same arguments (greedy, or sampled with a seeded generator per request;
stopped at an end token), whatever the arrival order, block size, GQA ratio, preemptions and
shared prefixes, on the course's GPT and on loaded checkpoints; it frees blocks as requests end
and refuses what it cannot serve, saying why.

Greedy tokens compared exactly are only a fair test where no step is a near-tie (batched and
one-at-a-time runs round differently): ``reference`` also checks that every reference step's
winner leads the runner-up by at least ``MARGIN`` in the logits, 30 times the largest difference
between the engine's logits and the model's own forward measured on these models (3e-6), so the
models and seeds here have no near-ties and equal tokens mean equal computations.
"""

import functools
import itertools
import random

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from course_attn.model import GenerationConfig, generate
from course_attn.serve import Engine, Latency, StepRecord, request_latencies
from helpers import gpt

MARGIN = 1e-4
MODELS = {
    "MHA, learned positions": dict(),
    "GQA 4:2, RoPE": dict(n_kv_heads=2, position="rope"),
    "MQA 4:1": dict(n_kv_heads=1),
    "GQA, RoPE, QK-norm, window 5": dict(n_kv_heads=2, position="rope", qk_norm=True, window=5),
}


def model_of(name, seed=0):
    return gpt(seed, seq_len=32, **MODELS[name])


def prompts_of(seed, n=7, vocab=13, shared=(0, 1)):
    """n prompts of 1 to 11 tokens; the last two start like the first two (shared prefixes)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 11))] for _ in range(n)]
    for i in shared:
        prompts.append(prompts[i][:rng.randint(1, len(prompts[i]))] + [rng.randrange(vocab)])
    return prompts


def reference(model, prompts, max_new_tokens):
    """Each prompt's greedy tokens from ``generate``, alone; checks that no step is a near-tie."""
    limits = (max_new_tokens if isinstance(max_new_tokens, list)
              else [max_new_tokens] * len(prompts))
    out = []
    for prompt, n in zip(prompts, limits):
        idx = generate(model, torch.tensor([prompt]), n, temperature=0)
        with torch.no_grad():
            logits = model(idx[:, :-1])[0, len(prompt) - 1:]                  # (n, V)
        top2 = logits.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > MARGIN, "a near-tie: pick another seed"
        out.append(idx[0, len(prompt):].tolist())
    return out


def held_blocks_at_end(engine):
    return engine.pool.num_used, sum(engine.pool.refcount)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("name", MODELS)
def test_every_request_gets_its_one_at_a_time_greedy_tokens(name, block_size, device):
    model = model_of(name).to(device)
    prompts = prompts_of(seed=3)
    engine = Engine(model, block_size=block_size, num_blocks=64 * 16 // block_size)
    assert engine.pool.k[0].device == model.lm_head.weight.device
    assert engine.generate(prompts, 6) == reference(model, prompts, 6)
    assert max(len(step.running) for step in engine.steps) == len(prompts)   # all together
    assert held_blocks_at_end(engine) == (0, 0)


def test_any_arrival_order_gives_the_same_tokens():
    model = model_of("GQA 4:2, RoPE")
    prompts = prompts_of(seed=5, n=5)
    expected = reference(model, prompts, 5)
    engine = Engine(model, block_size=4, num_blocks=12)         # a pool that preempts, too
    for order in itertools.islice(itertools.permutations(range(len(prompts))), 0, 120, 17):
        out = engine.generate([prompts[i] for i in order], 5)
        assert [out[order.index(i)] for i in range(len(prompts))] == expected


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("name", ["MHA, learned positions", "MQA 4:1"])
def test_a_pool_for_one_request_at_a_time_preempts_and_recomputes(name, block_size):
    model = model_of(name, seed=1)
    prompts = prompts_of(seed=7)
    max_new = 8
    lengths = [len(p) + max_new - 1 for p in prompts]
    num_blocks = -(-max(lengths) // block_size)                 # the longest request fits alone
    assert sum(-(-n // block_size) for n in lengths) > num_blocks     # but not all of them
    engine = Engine(model, block_size=block_size, num_blocks=num_blocks, share_prefixes=False)
    assert engine.generate(prompts, max_new) == reference(model, prompts, max_new)
    assert sum(len(step.preempted) for step in engine.steps) > 0
    assert max(step.blocks_used for step in engine.steps) <= num_blocks
    assert held_blocks_at_end(engine) == (0, 0)


def test_a_finished_request_frees_its_blocks_and_a_waiting_one_joins_the_next_step():
    model = model_of("MHA, learned positions")
    prompts = prompts_of(seed=11, n=4, shared=())
    limits = [2, 6, 3, 4]
    engine = Engine(model, block_size=4, num_blocks=32, max_batch=2, share_prefixes=False)
    assert engine.generate(prompts, limits) == reference(model, prompts, limits)
    joined = {i: s for s, step in enumerate(engine.steps) for i in step.admitted}
    left = {i: s for s, step in enumerate(engine.steps) for i in step.finished}
    assert left == {0: 1, 1: 5, 2: 4, 3: 8}
    assert joined == {0: 0, 1: 0, 2: left[0] + 1, 3: left[2] + 1}   # the step after a finish
    for s, step in enumerate(engine.steps):     # the blocks of the requests still running
        still = [i for i in joined if joined[i] <= s < left[i]]
        assert step.blocks_used == sum(-(-(len(prompts[i]) + s - joined[i]) // 4) for i in still)
    assert engine.steps[-1].blocks_used == 0


def test_prompts_with_a_common_prefix_share_blocks_and_copy_on_write():
    model = model_of("GQA 4:2, RoPE")
    rng = random.Random(2)
    system = [rng.randrange(13) for _ in range(10)]             # ends inside a block of 4
    prompts = [system + [rng.randrange(13) for _ in range(rng.randint(1, 4))] for _ in range(5)]
    limits = [3, 9, 4, 5, 6]
    expected = reference(model, prompts, limits)
    alone = Engine(model, block_size=4, num_blocks=40, share_prefixes=False)
    assert alone.generate(prompts, limits) == expected
    engine = Engine(model, block_size=4, num_blocks=40, max_batch=2)
    assert engine.generate(prompts, limits) == expected
    shared = sum(step.shared_tokens for step in engine.steps)
    fed = sum(step.fed_tokens for step in engine.steps)
    assert shared >= 4 * 8                    # every later request shares at least two blocks
    assert fed == sum(step.fed_tokens for step in alone.steps) - shared
    assert engine.pool.copies > 0             # a shared, partly filled block was written
    assert held_blocks_at_end(engine) == (0, 0)


def test_requests_admitted_in_one_step_share_only_full_blocks():
    model = model_of("MHA, learned positions")
    prompts = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 8]]
    engine = Engine(model, block_size=4, num_blocks=16)
    assert engine.generate(prompts, 4) == reference(model, prompts, 4)
    assert engine.steps[0].shared_tokens == 4 and engine.pool.copies == 0


@pytest.mark.parametrize("architecture, options", [
    ("qwen3", {}), ("mistral", dict(sliding_window=5)), ("gpt2", {})])
def test_a_loaded_checkpoint_is_served_too(tmp_path, architecture, options):
    pytest.importorskip("transformers")
    from course_attn.checkpoints import load_pretrained, save_random_checkpoint
    save_random_checkpoint(tmp_path, architecture, **options)
    model = load_pretrained(tmp_path)
    rng = random.Random(0)
    prompts = [[rng.randrange(100) for _ in range(n)] for n in (3, 9, 5, 12)]
    engine = Engine(model, block_size=4, num_blocks=6)
    assert engine.generate(prompts, 6) == reference(model, prompts, 6)
    assert sum(len(step.preempted) for step in engine.steps) > 0


POOL_PROMPTS = prompts_of(seed=13, n=6, shared=(0, 1, 2))
LONGEST_OUTPUT = 7


@functools.cache
def pool_reference(name):
    """Greedy tokens of every prompt of POOL_PROMPTS, LONGEST_OUTPUT of them: a shorter limit's
    tokens are their first ones."""
    return reference(model_of(name), POOL_PROMPTS, LONGEST_OUTPUT)


@given(name=st.sampled_from(["GQA 4:2, RoPE", "MHA, learned positions"]),
       picks=st.lists(st.tuples(st.integers(0, len(POOL_PROMPTS) - 1),
                                st.integers(1, LONGEST_OUTPUT)), min_size=1, max_size=8),
       block_size=st.sampled_from([1, 2, 4, 16]), spare_blocks=st.integers(0, 30),
       max_batch=st.one_of(st.none(), st.integers(1, 4)), share=st.booleans())
def test_any_workload_any_pool_gives_the_greedy_tokens(name, picks, block_size, spare_blocks,
                                                        max_batch, share):
    """Requests drawn from a pool of prompts (repeats and shared prefixes included), each with
    its own limit, on pools from the smallest that serves the longest request upward."""
    prompts = [POOL_PROMPTS[i] for i, _ in picks]
    limits = [n for _, n in picks]
    smallest = max(-(-(len(p) + n - 1) // block_size) for p, n in zip(prompts, limits))
    engine = Engine(model_of(name), block_size=block_size, num_blocks=smallest + spare_blocks,
                    max_batch=max_batch, share_prefixes=share)
    expected = [pool_reference(name)[i][:n] for i, n in picks]
    assert engine.generate(prompts, limits) == expected
    assert max(step.blocks_used for step in engine.steps) <= smallest + spare_blocks
    assert held_blocks_at_end(engine) == (0, 0)


def test_a_model_without_the_parts_the_engine_reads_is_refused():
    with pytest.raises(ValueError, match="but Linear has no token_embedding, position_embedding"):
        Engine(torch.nn.Linear(2, 2), block_size=4, num_blocks=4)


def test_nothing_to_generate():
    engine = Engine(model_of("MQA 4:1"), block_size=4, num_blocks=4)
    assert engine.generate([[1, 2], [3]], 0) == [[], []]
    assert engine.generate([], 3) == []


def test_prompts_of_numpy_integers_and_of_tensors_are_served_as_lists():
    model = model_of("MHA, learned positions")
    prompts = prompts_of(seed=3, n=4, shared=())
    engine = Engine(model, block_size=4, num_blocks=32)
    expected = engine.generate(prompts, 4)
    assert engine.generate([np.array(p) for p in prompts], 4) == expected
    assert engine.generate([list(np.array(p, dtype=np.int32)) for p in prompts], 4) == expected
    assert engine.generate([[np.int64(t) for t in p] for p in prompts], 4) == expected
    assert engine.generate([torch.tensor(p) for p in prompts], 4) == expected
    assert engine.generate(tuple(torch.tensor(p, dtype=torch.int32) for p in prompts),
                           4) == expected


@pytest.mark.parametrize("prompts, max_new, message", [
    ([[1, 2], []], 3, r"prompt 1 must be a non-empty list of token ids in \[0, vocab_size=13\)"),
    ([[1, 13]], 3, r"prompt 0 must be a non-empty list of token ids"),
    ([[1] * 30], 4, "prompt 0 .30 tokens. and max_new_tokens=4 reach 33 positions, past the "
                    "model's seq_len=32"),
    ([[1] * 20], 4, r"prompt 0 needs 6 blocks of 4 tokens for 23 positions \(its 20 tokens and "
                    r"max_new_tokens=4 less the last, never fed\), but the pool has num_blocks=4"),
    ([[1, True]], 2, r"prompt 0 must be a non-empty list of token ids in \[0, vocab_size=13\), "
                     r"got True \(bool\) among them"),
    ([[2], np.array([1, 0], dtype=bool)], 2,
     r"prompt 1 must be .* or a 1-D integer tensor, got a ndarray of shape \(2,\) dtype "
     "torch.bool"),
    ([torch.tensor([[1, 2]])], 2, r"or a 1-D integer tensor, got a Tensor of shape \(1, 2\)"),
    ([[1.0, 2]], 2, r"got 1.0 \(float\) among them"),
    ([3, [1]], 2, r"prompt 0 must be a non-empty list of token ids .*, got int 3"),
    ([[1]], [2, 3], "max_new_tokens has 2 limits for 1 prompts"),
    ([[1]], -1, "max_new_tokens"),
    ("1 2 3", 2, "prompts must be a list of token lists, got str"),
])
def test_bad_requests_are_refused_by_name(prompts, max_new, message):
    engine = Engine(model_of("MHA, learned positions"), block_size=4, num_blocks=4)
    with pytest.raises(ValueError, match=message):
        engine.generate(prompts, max_new)


def alone(model, prompts, max_new_tokens, seeds=None, **options):
    """Each prompt's new tokens from ``generate``, one prompt at a time, with ``options`` (and a
    generator seeded ``seeds[i]`` for prompt i when seeds are given)."""
    out = []
    for i, prompt in enumerate(prompts):
        if seeds is not None:
            options["generator"] = torch.Generator().manual_seed(seeds[i])
        idx = generate(model, torch.tensor([prompt]), max_new_tokens, **options)
        out.append(idx[0, len(prompt):].tolist())
    return out


def generators(seeds):
    return [torch.Generator().manual_seed(seed) for seed in seeds]


@pytest.mark.parametrize("name", ["GQA 4:2, RoPE", "MHA, learned positions"])
def test_a_request_that_emits_its_end_token_finishes_there_and_frees_its_blocks(name):
    model = model_of(name)
    prompts = prompts_of(seed=3, shared=())
    greedy = reference(model, prompts, 9)
    # an end token that some requests emit before their 9th token, and some never do
    end = next(t for t in greedy[0][:-1] if 2 <= sum(t in g[:-1] for g in greedy) < len(greedy))
    expected = alone(model, prompts, 9, eos_token_id=end)
    assert expected[0] == greedy[0][:greedy[0].index(end) + 1]
    assert 2 <= sum(len(tokens) < 9 for tokens in expected) < len(prompts)
    engine = Engine(model, block_size=4, num_blocks=64, share_prefixes=False)
    assert engine.generate(prompts, 9, eos_token_id=end) == expected
    # all run from step 0; request i holds len(prompt) + s tokens after step s, until the step
    # of its last token, len(expected[i]) - 1, which frees its blocks
    last = [len(tokens) - 1 for tokens in expected]
    for s, step in enumerate(engine.steps):
        assert step.finished == [i for i in range(len(prompts)) if last[i] == s]
        assert step.blocks_used == sum(-(-(len(p) + s) // 4)
                                       for p, t in zip(prompts, last) if t > s)
    assert held_blocks_at_end(engine) == (0, 0)


def test_the_end_tokens_default_to_the_models_generation_config():
    model = model_of("MQA 4:1")
    prompts = prompts_of(seed=3, n=4, shared=())
    greedy = reference(model, prompts, 6)
    end = greedy[1][1]
    model.generation_config = GenerationConfig(eos_token_id=(end, 99))
    expected = alone(model, prompts, 6)
    assert len(expected[1]) == 2
    assert Engine(model, block_size=4, num_blocks=32).generate(prompts, 6) == expected
    assert Engine(model, block_size=4, num_blocks=32).generate(
        prompts, 6, eos_token_id=[]) == greedy                              # [] for none


SAMPLING = {     # each on one of the two position schemes
    "temperature": ("GQA 4:2, RoPE", dict(temperature=0.7)),
    "top_k": ("MHA, learned positions", dict(top_k=4)),
    "top_p": ("GQA 4:2, RoPE", dict(top_p=0.8, temperature=1.3)),
    "all, with an end token": ("MHA, learned positions",
                               dict(temperature=0.9, top_k=6, top_p=0.9, eos_token_id=3)),
}


@pytest.mark.parametrize("block_size, num_blocks", [(4, 64), (2, 9)])      # (2, 9) preempts
@pytest.mark.parametrize("name, options", SAMPLING.values(), ids=list(SAMPLING))
def test_each_request_samples_from_its_own_generator_as_generate_does_alone(
        name, options, block_size, num_blocks):
    model = model_of(name)
    prompts = prompts_of(seed=5)
    seeds = [100 + i for i in range(len(prompts))]
    expected = alone(model, prompts, 8, seeds, do_sample=True, **options)
    greedy = alone(model, prompts, 8, eos_token_id=options.get("eos_token_id", ()))
    assert expected != greedy                                                  # it samples
    if "eos_token_id" in options:
        assert any(len(tokens) < 8 for tokens in expected)                 # and some end
    engine = Engine(model, block_size=block_size, num_blocks=num_blocks)
    out = engine.generate(prompts, 8, do_sample=True, generator=generators(seeds), **options)
    assert out == expected
    assert (sum(len(step.preempted) for step in engine.steps) > 0) == (num_blocks == 9)
    assert held_blocks_at_end(engine) == (0, 0)


def test_one_request_alone_samples_token_for_token_as_generate_even_on_the_global_generator():
    model = model_of("GQA, RoPE, QK-norm, window 5")
    prompt = [3, 1, 4, 1, 5]
    torch.manual_seed(7)
    expected = alone(model, [prompt], 20, do_sample=True, top_k=5)
    torch.manual_seed(7)
    engine = Engine(model, block_size=4, num_blocks=8)
    assert engine.generate([prompt], 20, do_sample=True, top_k=5) == expected
    assert engine.generate([prompt], 20, do_sample=True, top_k=5,
                           generator=generators([7])) == expected   # seeded alike


SAMPLED_OUTPUT = 6


@functools.cache
def workload_reference(name, prompt, limit, seed, end, do_sample):
    """``generate``'s new tokens for POOL_PROMPTS[prompt] alone."""
    return alone(model_of(name), [POOL_PROMPTS[prompt]], limit, None if seed is None else [seed],
                 do_sample=do_sample, top_k=5 if do_sample else None,
                 eos_token_id=() if end is None else end)[0]


@given(name=st.sampled_from(["GQA 4:2, RoPE", "MHA, learned positions"]),
       picks=st.lists(st.tuples(st.integers(0, len(POOL_PROMPTS) - 1),
                                st.integers(1, SAMPLED_OUTPUT), st.integers(0, 3)),
                      min_size=1, max_size=8),
       end=st.one_of(st.none(), st.integers(0, 12)), do_sample=st.booleans(),
       block_size=st.sampled_from([1, 2, 4, 16]), spare_blocks=st.integers(0, 30),
       max_batch=st.one_of(st.none(), st.integers(1, 4)), share=st.booleans())
def test_any_workload_with_end_tokens_and_sampling_gives_generates_tokens(
        name, picks, end, do_sample, block_size, spare_blocks, max_batch, share):
    """Requests drawn from a pool of prompts, each with its own limit and generator seed (two
    requests may hold equal seeds: each draws from its own generator), an end token or none."""
    prompts = [POOL_PROMPTS[i] for i, _, _ in picks]
    limits = [n for _, n, _ in picks]
    smallest = max(-(-(len(p) + n - 1) // block_size) for p, n in zip(prompts, limits))
    engine = Engine(model_of(name), block_size=block_size, num_blocks=smallest + spare_blocks,
                    max_batch=max_batch, share_prefixes=share)
    expected = [workload_reference(name, i, n, seed if do_sample else None, end, do_sample)
                for i, n, seed in picks]
    out = engine.generate(prompts, limits, do_sample=do_sample, top_k=5 if do_sample else None,
                          eos_token_id=() if end is None else end,
                          generator=generators([seed for _, _, seed in picks]) if do_sample
                          else None)
    assert out == expected
    assert held_blocks_at_end(engine) == (0, 0)


@pytest.mark.parametrize("options, message", [
    (dict(do_sample=1), "do_sample must be True or False, got 1"),
    (dict(do_sample=True, temperature=-1), "temperature must be a number >= 0, got -1"),
    (dict(do_sample=True, top_k=0), "top_k must be a positive int"),
    (dict(do_sample=True, top_p=1.5), r"top_p must be a number in \(0, 1\], got 1.5"),
    (dict(do_sample=True, generator=torch.Generator()),
     "generator must be a list with one torch.Generator .or None. per request, got a Generator"),
    (dict(do_sample=True, generator=[None]), "generator has 1 generators for 2 prompts"),
    (dict(do_sample=True, generator=[None, 3]), r"generator\[1\] must be a torch.Generator"),
    (dict(eos_token_id=True), "eos_token_id must be a token id, a list of them or ()"),
])
def test_bad_generation_options_are_refused_by_name(options, message):
    engine = Engine(model_of("MQA 4:1"), block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match=message):
        engine.generate([[1, 2], [3]], 2, **options)


def test_sampling_options_without_do_sample_warn_and_stay_greedy():
    model = model_of("MQA 4:1")
    prompts = [[1, 2], [3]]
    engine = Engine(model, block_size=4, num_blocks=8)
    with pytest.warns(UserWarning, match="greedy unless do_sample=True") as caught:
        out = engine.generate(prompts, 4, top_k=2, generator=generators([0, 1]))
    assert caught[0].filename == __file__                        # points at the caller
    assert out == reference(model, prompts, 4)


# ---------------------------------------------------------------- arrivals and chunked prefill

@given(name=st.sampled_from(["GQA 4:2, RoPE", "MHA, learned positions"]),
       picks=st.lists(st.tuples(st.integers(0, len(POOL_PROMPTS) - 1),
                                st.integers(1, LONGEST_OUTPUT), st.integers(0, 12)),
                      min_size=1, max_size=8),
       block_size=st.sampled_from([1, 2, 4]), spare_blocks=st.integers(0, 20),
       budget=st.one_of(st.none(), st.integers(1, 12)),
       threshold=st.one_of(st.none(), st.integers(1, 6)),
       max_batch=st.one_of(st.none(), st.integers(1, 4)), share=st.booleans(),
       cache=st.booleans(), watermark=st.sampled_from([0.0, 0.2]))
def test_requests_arriving_over_time_with_chunked_prefill_get_the_greedy_tokens(
        name, picks, block_size, spare_blocks, budget, threshold, max_batch, share, cache,
        watermark):
    """Requests from a pool of prompts, each arriving at its own step, served with a token
    budget per step (chunked prefill) or none, with the prefix cache or not, a watermark or
    none, on pools that preempt or not."""
    prompts = [POOL_PROMPTS[i] for i, _, _ in picks]
    limits = [n for _, n, _ in picks]
    arrivals = [a for _, _, a in picks]
    smallest = max(-(-(len(p) + n - 1) // block_size) for p, n in zip(prompts, limits))
    engine = Engine(model_of(name), block_size=block_size, num_blocks=smallest + spare_blocks,
                    max_batch=max_batch, share_prefixes=share, max_num_batched_tokens=budget,
                    long_prefill_token_threshold=threshold, prefix_cache=cache,
                    watermark=watermark)
    out = engine.generate(prompts, limits, arrivals=arrivals)
    assert out == [pool_reference(name)[i][:n] for i, n, _ in picks]
    arrived = {i: t for t, step in enumerate(engine.steps) for i in step.arrived}
    admitted = {i: t for t, step in enumerate(engine.steps) for i in reversed(step.admitted)}
    assert arrived == dict(enumerate(arrivals))
    assert all(admitted[i] >= arrivals[i] for i in admitted)
    if budget is not None:
        assert max(step.fed_tokens for step in engine.steps) <= budget
    assert held_blocks_at_end(engine) == (0, 0)
    assert cache or engine.pool.num_cached_free == 0


def test_a_long_prompt_is_fed_in_chunks_beside_the_decode_tokens():
    model = model_of("GQA 4:2, RoPE")
    short, long = [3, 1, 4], [5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4]
    engine = Engine(model, block_size=4, num_blocks=32, max_num_batched_tokens=6,
                    long_prefill_token_threshold=4)
    prompts = [short, long, [2, 7, 1]]
    out = engine.generate(prompts, [12, 3, 2], arrivals=[0, 2, 3])
    assert out == reference(model, prompts, [12, 3, 2])
    fed = [step.fed_tokens for step in engine.steps]
    # step 0: the first short prompt; 1: its decode; from 2 its decode first, then the long
    # prompt's 20 tokens in chunks of 4 (the threshold), then the second short prompt, which
    # arrives at step 3 and gets what is left of the budget of 6: one token a step
    assert fed[:7] == [3, 1, 1 + 4, 1 + 4 + 1, 1 + 4 + 1, 1 + 1 + 4, 1 + 1 + 4]
    assert all(0 in step.running for step in engine.steps[:12])   # a decode every step
    first = {i: t for t, step in reversed(list(enumerate(engine.steps))) for i in step.sampled}
    assert first == {0: 0, 1: 6, 2: 5}


def test_without_a_budget_the_long_prompt_runs_in_one_step():
    model = model_of("GQA 4:2, RoPE")
    prompts = [[3, 1, 4], list(range(12)) * 2]
    engine = Engine(model, block_size=4, num_blocks=32)
    assert engine.generate(prompts, [6, 2], arrivals=[0, 2]) == reference(model, prompts, [6, 2])
    assert [step.fed_tokens for step in engine.steps[:4]] == [3, 1, 1 + 24, 2]


def test_a_step_with_nothing_to_run_waits_for_the_next_arrival():
    model = model_of("MHA, learned positions")
    engine = Engine(model, block_size=4, num_blocks=8)
    assert engine.generate([[1, 2], [3]], [2, 1], arrivals=[4, 1]) == reference(
        model, [[1, 2], [3]], [2, 1])
    assert [step.running for step in engine.steps] == [[], [1], [], [], [0], [0]]
    assert [step.arrived for step in engine.steps] == [[], [1], [], [], [0], []]
    assert all(step.time_ms == 0 for t, step in enumerate(engine.steps) if t in (0, 2, 3))
    assert all(step.time_ms > 0 for t, step in enumerate(engine.steps) if t in (1, 4, 5))


def test_latencies_are_read_from_the_steps():
    steps = [StepRecord(running=[], arrived=[0], time_ms=0.0),
             StepRecord(running=[0], arrived=[1], sampled=[], time_ms=10.0),     # a chunk
             StepRecord(running=[0, 1], sampled=[0, 1], time_ms=20.0),
             StepRecord(running=[0, 1], sampled=[0], time_ms=5.0),
             StepRecord(running=[0], sampled=[0], finished=[0], time_ms=1.0)]
    steps[1].sampled = []
    lat = request_latencies(steps)
    assert lat[0] == Latency(ttft_steps=3, ttft_ms=30.0, tpot_steps=1.0, tpot_ms=3.0)
    assert lat[1] == Latency(ttft_steps=2, ttft_ms=30.0, tpot_steps=None, tpot_ms=None)


def test_the_engines_latencies_count_every_token_once_even_when_preempted():
    model = model_of("MQA 4:1", seed=1)
    prompts = prompts_of(seed=7)
    engine = Engine(model, block_size=2, num_blocks=9, share_prefixes=False)
    out = engine.generate(prompts, 8, arrivals=list(range(len(prompts))))
    assert sum(len(step.preempted) for step in engine.steps) > 0
    sampled = [i for step in engine.steps for i in step.sampled]
    assert [sampled.count(i) for i in range(len(prompts))] == [len(o) for o in out]
    lat = request_latencies(engine.steps)
    assert all(lat[i].ttft_steps >= 1 and lat[i].tpot_steps >= 1 for i in lat)


@pytest.mark.parametrize("options, message", [
    (dict(arrivals=[0]), "arrivals has 1 steps for 2 prompts"),
    (dict(arrivals=[0, -1]), r"arrivals\[1\] must be"),
])
def test_bad_arrivals_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        Engine(model_of("MQA 4:1"), block_size=4, num_blocks=8).generate([[1], [2]], 2, **options)


@pytest.mark.parametrize("option", ["max_num_batched_tokens", "long_prefill_token_threshold"])
def test_a_budget_below_one_token_is_refused(option):
    with pytest.raises(ValueError, match=option):
        Engine(model_of("MQA 4:1"), block_size=4, num_blocks=8, **{option: 0})


# ---------------------------------------------------------------- prefix cache, admission

def test_the_prefix_cache_serves_a_system_prompt_to_requests_that_come_after_it_ended():
    model = model_of("GQA 4:2, RoPE")
    rng = random.Random(4)
    system = [rng.randrange(13) for _ in range(10)]             # 2 full blocks of 4, and 2
    prompts = [system + [rng.randrange(13) for _ in range(rng.randint(1, 3))] for _ in range(4)]
    expected = reference(model, prompts, 3)
    engine = Engine(model, block_size=4, num_blocks=16, max_batch=1, prefix_cache=True)
    assert engine.generate(prompts, 3) == expected
    # one request at a time: nothing running to share with, every later one finds 2 blocks
    assert [step.cache_hit_tokens for step in engine.steps if step.admitted] == [0, 8, 8, 8]
    assert engine.pool.num_used == 0 and engine.pool.num_cached_free > 0
    again = engine.generate(prompts[:1], 3)                    # a second call finds them too
    assert again == expected[:1] and engine.steps[0].cache_hit_tokens == 8
    off = Engine(model, block_size=4, num_blocks=16, max_batch=1)
    assert off.generate(prompts, 3) == expected
    assert sum(step.cache_hit_tokens for step in off.steps) == 0


def test_a_cached_block_is_evicted_only_when_no_other_block_is_free():
    model = model_of("MHA, learned positions")
    first, other = [1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]
    engine = Engine(model, block_size=4, num_blocks=4, prefix_cache=True)
    assert engine.generate([first], 2) == reference(model, [first], 2)
    assert engine.pool.num_cached_free == 2                     # blocks [1 2 3 4], [5 6 7 8]
    assert engine.generate([other], 2) == reference(model, [other], 2)   # needs 3 blocks of 4
    assert engine.pool.evictions == 1                          # the 2 never cached, then 1 LRU
    engine.generate([first], 2)
    assert engine.steps[0].cache_hit_tokens == 4               # the later block survived


def test_the_watermark_keeps_blocks_free_at_admission():
    model = model_of("MHA, learned positions")
    prompts = [[1] * 9, [2] * 13]                               # 3 and 4 blocks of 4
    expected = reference(model, prompts, 2)
    plain = Engine(model, block_size=4, num_blocks=8)
    assert plain.generate(prompts, 2) == expected
    assert plain.steps[0].admitted == [0, 1]                    # 7 of 8 blocks
    held = Engine(model, block_size=4, num_blocks=8, watermark=0.25)      # 2 blocks kept free
    assert held.generate(prompts, 2) == expected
    assert held.steps[0].admitted == [0]


def test_first_come_first_served_holds_a_small_request_behind_a_large_one():
    model = model_of("MHA, learned positions")
    prompts = [[1] * 9, [2] * 21, [3]]                          # 3, 6 and 1 blocks of 4
    engine = Engine(model, block_size=4, num_blocks=8)
    assert engine.generate(prompts, [4, 2, 2]) == reference(model, prompts, [4, 2, 2])
    admitted = {i: t for t, step in enumerate(engine.steps) for i in step.admitted}
    assert admitted[0] == 0 and admitted[1] > 0                 # 6 blocks wait for 0 to end
    assert admitted[2] == admitted[1]                           # 1 block would fit, yet waits


@pytest.mark.parametrize("watermark", [-0.1, 1.0, True, "0.1"])
def test_a_watermark_outside_zero_to_one_is_refused(watermark):
    with pytest.raises(ValueError, match="watermark must be a share"):
        Engine(model_of("MQA 4:1"), block_size=4, num_blocks=8, watermark=watermark)

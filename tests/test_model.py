"""The tiny GPT and its options, its synthetic task and its training.

MultiHeadAttention itself is tested in test_multihead.py."""

import copy
import math
import time

import pytest
import torch
import torch.nn.functional as F

from course_attn.data import IGNORE_INDEX, InductionTask, induction_targets, token_labels
from course_attn.model import GPT, GPTConfig, generate, queries_keys_values
from course_attn.multihead import repeat_kv
from course_attn.train import (accuracy, induction_head_scores, ov_circuit, previous_token_scores,
                               train, train_induction_model)


# ---------------------------------------------------------------- GPT

def small_gpt(mlp=True, backend="math", seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=11, seq_len=12, d_model=32, n_heads=4, n_layers=2, mlp=mlp,
                         backend=backend))


@pytest.mark.parametrize("mlp", [True, False])
def test_gpt_shapes(mlp):
    model = small_gpt(mlp)
    idx = torch.randint(11, (3, 10))
    assert model(idx).shape == (3, 10, 11)
    logits, attention_maps = model(idx, return_attention=True)
    assert logits.shape == (3, 10, 11)
    assert len(attention_maps) == 2
    assert all(w.shape == (3, 4, 10, 10) for w in attention_maps)
    assert (model.blocks[0].mlp is not None) == mlp


@pytest.mark.parametrize("mlp", [True, False])
def test_gpt_is_causal(mlp):
    model = small_gpt(mlp)
    idx = torch.randint(11, (2, 12))
    changed = idx.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 11
    before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :7], after[:, :7], rtol=0, atol=0)
    assert not torch.allclose(before[:, 7:], after[:, 7:])


def test_gpt_backends_agree():
    idx = torch.randint(11, (2, 12))
    torch.testing.assert_close(small_gpt(backend="sdpa")(idx), small_gpt(backend="math")(idx))


def test_gpt_input_errors():
    model = small_gpt()
    with pytest.raises(ValueError, match="T=13"):
        model(torch.zeros(1, 13, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(B, T\) torch.long.*shape \(5,\)"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="torch.float32"):
        model(torch.zeros(1, 5))
    with pytest.raises(ValueError, match="torch.int32"):
        model(torch.zeros(1, 5, dtype=torch.int32))


# ---------------------------------------------------------------- GPT options (chapters 5, 6, 11)

def modern_gpt(seed=0, **options):
    torch.manual_seed(seed)
    config = dict(vocab_size=11, seq_len=8, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
                  position="rope", qk_norm=True)
    config.update(options)
    return GPT(GPTConfig(**config)).eval()


def test_gpt_config_options_reach_every_attention_layer():
    model = modern_gpt(rope_base=500.0, qk_norm_order="after_rope", window=3, dropout=0.25)
    assert model.position_embedding is None
    for block in model.blocks:
        attn = block.attn
        assert attn.rotary.base == 500.0 and attn.rotary.max_seq_len == 8
        assert attn.q_norm is not None and attn.qk_norm_order == "after_rope"
        assert attn.window == 3 and attn.dropout == 0.25 and attn.n_kv_heads == 2
    learned = small_gpt()
    assert learned.position_embedding.weight.shape == (12, 32)
    assert all(b.attn.rotary is None and b.attn.q_norm is None for b in learned.blocks)


@pytest.mark.parametrize("kwargs, message", [
    (dict(position="absolute"), "position must be 'learned' or 'rope', got 'absolute'"),
    (dict(position=None), "position must be 'learned' or 'rope', got None"),
    (dict(seq_len=0), "seq_len must be a positive int, got 0"),
    (dict(n_layers=2.0), "n_layers must be a positive int, got 2.0"),
])
def test_gpt_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**{**dict(vocab_size=11, seq_len=8), **kwargs})


@pytest.mark.parametrize("kwargs, message", [
    (dict(d_model=30, n_heads=4), "d_model=30 is not divisible by n_heads=4"),
    (dict(n_kv_heads=3), "n_heads=4 is not a multiple of n_kv_heads=3"),
    (dict(d_model=12, n_heads=4, position="rope"), "12 / 4 = 3 is odd"),
    (dict(qk_norm_order="sideways"), "qk_norm_order must be"),
    (dict(window=0), "window must be None or an int >= 1, got 0"),
    (dict(dropout=1.0), r"dropout must be a probability in \[0, 1\), got 1.0"),
    (dict(position="rope", rope_base=0.5), "base must be a number > 1, got 0.5"),
])
def test_gpt_rejects_attention_options_it_cannot_build(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPT(GPTConfig(**{**dict(vocab_size=11, seq_len=8), **kwargs}))


def test_a_rope_gpt_runs_past_seq_len_and_a_learned_one_refuses(device):
    model = modern_gpt().to(device)
    idx = torch.randint(11, (2, 20), generator=torch.Generator().manual_seed(0)).to(device)
    logits = model(idx)                                          # seq_len = 8: RoPE has no end
    assert logits.shape == (2, 20, 11) and torch.isfinite(logits).all()
    torch.testing.assert_close(logits[:, :8], model(idx[:, :8]))  # causal: a prefix is a prefix
    longer_cache = GPT(GPTConfig(**{**model.config.__dict__, "seq_len": 32})).to(device).eval()
    longer_cache.load_state_dict(model.state_dict())
    torch.testing.assert_close(logits, longer_cache(idx))       # the cache length changes nothing
    learned = GPT(GPTConfig(vocab_size=11, seq_len=8, d_model=32, n_heads=4)).to(device)
    with pytest.raises(ValueError, match=r"T=20 must be in \[1, seq_len=8\]"):
        learned(idx)


def test_a_rope_gpt_is_causal_and_blind_to_absolute_position():
    model = modern_gpt(qk_norm=False, mlp=False, n_layers=1)
    idx = torch.randint(11, (2, 8))
    changed = idx.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 11
    torch.testing.assert_close(model(idx)[:, :5], model(changed)[:, :5], rtol=0, atol=0)
    # No position embedding: a run of one token gives the same logits at every position, as
    # every query sees keys and values that are all alike (RoPE moves scores, not values).
    same = torch.full((1, 6), 3)
    logits = model(same)
    torch.testing.assert_close(logits, logits[:, :1].expand_as(logits), rtol=1e-5, atol=1e-5)


def test_gpt_dropout_only_in_training(device):
    model = modern_gpt(dropout=0.3).to(device)
    plain = modern_gpt(dropout=0.0).to(device)
    idx = torch.randint(11, (2, 8), generator=torch.Generator().manual_seed(0)).to(device)
    torch.testing.assert_close(model.eval()(idx), plain.eval()(idx))
    model.train()
    torch.manual_seed(1)
    first = model(idx)
    torch.manual_seed(1)
    assert torch.equal(model(idx), first)
    assert not torch.allclose(first, plain(idx))


def test_generate_with_a_rope_gpt():
    model = modern_gpt()
    out = generate(model, torch.zeros(1, 3, dtype=torch.long), 12, temperature=0)
    assert out.shape == (1, 15)


@pytest.mark.parametrize("options", [
    dict(position="rope"),
    dict(position="rope", qk_norm=True, qk_norm_order="before_rope"),
    dict(position="rope", qk_norm=True, qk_norm_order="after_rope", window=3),
    dict(position="learned", qk_norm=True),
], ids=["rope", "rope+qk_norm", "rope+qk_norm_after+window", "learned+qk_norm"])
def test_queries_keys_values_of_a_modern_model_reproduce_its_attention(device, options):
    model = modern_gpt(**{"qk_norm": False, **options}).to(device)
    with torch.no_grad():                  # gains that are not all ones, so QK-norm shows
        for block in model.blocks:
            if block.attn.q_norm is not None:
                block.attn.q_norm.weight.uniform_(0.5, 2.0)
                block.attn.k_norm.weight.uniform_(0.5, 2.0)
    idx = torch.randint(11, (2, 8), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        _, weights = model(idx, return_attention=True)
        by_layer = queries_keys_values(model, idx)
    window = options.get("window")
    i = torch.arange(8, device=device)
    allowed = (i[:, None] >= i[None, :])
    if window is not None:
        allowed &= i[:, None] - i[None, :] < window
    for (q, k, v), w in zip(by_layer, weights):
        assert q.shape == (2, 4, 8, 8) and k.shape == v.shape == (2, 2, 8, 8)
        scores = q @ repeat_kv(k, 2).transpose(-2, -1) / math.sqrt(8)
        expected = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        torch.testing.assert_close(expected, w)
    if options.get("qk_norm_order") == "after_rope":          # the last step: q / gain has RMS 1
        for block, (q, k, _) in zip(model.blocks, by_layer):
            rms = (q / block.attn.q_norm.weight).square().mean(-1)
            torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-3, atol=1e-3)   # eps


def test_generate_length_and_greedy_determinism():
    model = small_gpt()
    prompt = torch.randint(11, (2, 4))
    out = generate(model, prompt, 20, temperature=0)             # runs past seq_len = 12
    assert out.shape == (2, 24)
    assert torch.equal(out[:, :4], prompt)
    assert torch.equal(out, generate(model, prompt, 20, temperature=0))
    assert torch.equal(out[:, 4], model(prompt)[:, -1].argmax(-1))   # greedy = argmax
    assert torch.equal(generate(model, prompt, 20), out)              # greedy by default
    assert torch.equal(model.generate(prompt, 20), out)               # and as a method
    assert torch.equal(generate(model, prompt, 20, do_sample=True, top_k=1), out)   # top-1
    assert generate(model, prompt, 0).shape == (2, 4)


def test_generate_sampling_follows_the_generator():
    model = small_gpt()
    prompt = torch.randint(11, (4, 3))
    first = generate(model, prompt, 8, do_sample=True, generator=torch.Generator().manual_seed(1))
    again = generate(model, prompt, 8, do_sample=True, generator=torch.Generator().manual_seed(1))
    assert torch.equal(first, again)
    assert ((first >= 0) & (first < 11)).all()
    assert not torch.equal(first, generate(model, prompt, 8))         # it did sample


def test_top_p_keeps_the_smallest_set_reaching_p():
    """Probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.75 keeps the first two (0.8 >= 0.75),
    top_p=0.5 the first alone; top_k=3 drops the last."""
    from course_attn.model import _next_token
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(4000, 4)
    def drawn(**options):
        tokens = _next_token(logits, True, 1.0, options.get("top_k"), options.get("top_p"),
                             torch.Generator().manual_seed(0))
        return set(tokens.flatten().tolist())
    assert drawn(top_p=0.75) == {0, 1}
    assert drawn(top_p=0.5) == {0}
    assert drawn(top_k=3) == {0, 1, 2}
    assert drawn() == {0, 1, 2, 3}


def test_sampling_options_without_do_sample_warn_and_stay_greedy():
    model, prompt = small_gpt(), torch.randint(11, (2, 3))
    with pytest.warns(UserWarning, match="greedy unless do_sample=True"):
        out = generate(model, prompt, 6, temperature=0.7)
    assert torch.equal(out, generate(model, prompt, 6))


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_left_padded_batch_gives_each_prompt_its_own_tokens(use_cache):
    """The course's GPT (learned positions: each row's own, counted from its first token),
    within seq_len = 12; past it, where the model slides, a padded batch is refused."""
    model = small_gpt()
    rows = [torch.randint(11, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 2)]
    ids = torch.zeros(2, 5, dtype=torch.long)
    mask = torch.zeros(2, 5, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, 5 - len(row):], mask[i, 5 - len(row):] = row, 1
    out = generate(model, ids, 6, attention_mask=mask, use_cache=use_cache)
    for i, row in enumerate(rows):
        assert torch.equal(out[i, 5:], generate(model, row[None], 6)[0, len(row):])
    with pytest.raises(ValueError, match="outgrows seq_len=12, where this model slides"):
        generate(model, ids, 9, attention_mask=mask, use_cache=use_cache)


def test_eos_ends_a_row_and_pads_it():
    """The course's GPT has no end token of its own; given one, a finished row is padded and
    generation stops once every row has ended."""
    model = small_gpt()
    prompt = torch.randint(11, (2, 3), generator=torch.Generator().manual_seed(2))
    greedy = generate(model, prompt, 8)
    eos = int(greedy[0, 5])
    out = generate(model, prompt, 8, eos_token_id=eos, pad_token_id=10)
    end = greedy[0, 3:].tolist().index(eos) + 3
    assert torch.equal(out[0, :end + 1], greedy[0, :end + 1])
    assert (out[0, end + 1:] == 10).all()
    row = greedy[1, 3:].tolist()
    assert out.shape[1] == (8 + 3 if eos not in row else max(end, row.index(eos) + 3) + 1)


def test_generate_errors():
    model, prompt = small_gpt(), torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="max_new_tokens must be a non-negative int, got -1"):
        generate(model, prompt, -1)
    with pytest.raises(ValueError, match="max_new_tokens must be a non-negative int, got True"):
        generate(model, prompt, True)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, prompt, 1, temperature=-0.5)
    with pytest.raises(ValueError, match="top_k must be a positive int, got 0"):
        generate(model, prompt, 1, top_k=0)
    with pytest.raises(ValueError, match=r"top_p must be a number in \(0, 1\], got 1.5"):
        generate(model, prompt, 1, top_p=1.5)
    with pytest.raises(ValueError, match=r"got shape \(2,\) dtype torch.int64: idx\[None\] "
                                         "makes a batch of one"):
        generate(model, prompt[0], 1)
    with pytest.raises(ValueError, match=r"got a list: torch.tensor\(\[ids\]\)"):
        generate(model, [1, 2], 1)
    with pytest.raises(ValueError, match="eos_token_id must be a token id"):
        generate(model, prompt, 1, eos_token_id="2")
    with pytest.raises(ValueError, match="padded on the left"):
        generate(model, prompt, 1, attention_mask=torch.tensor([[1, 0]]))
    with pytest.raises(ValueError, match="1 for tokens and 0 for padding"):
        generate(model, prompt, 1, attention_mask=torch.tensor([[2, 1]]))
    with pytest.raises(ValueError, match="between tokens or on the right"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), 1,
                 attention_mask=torch.tensor([[1, 0, 1]]))
    with pytest.raises(ValueError, match="attention_mask must have idx's shape"):
        generate(model, prompt, 1, attention_mask=torch.ones(1, 3))


# ---------------------------------------------------------------- compiled decode

def test_compiled_decode_gives_the_eager_tokens_and_compiles_once():
    """generate(compile=True): static caches and a decode step that torch.compile (Inductor)
    traces once, with no graph break, for every step and for a second prompt of the same
    shapes, giving the eager tokens. A RoPE model with GQA, QK-norm and a window shorter than
    the sequence on SDPA (a checkpoint's setting); then the course's GPT (learned positions,
    "math") with a left-padded batch and an end token: its own compile, once."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = modern_gpt(seq_len=32, n_layers=1, window=5, backend="sdpa")
    for seed in (0, 1):
        prompt = torch.randint(11, (2, 4), generator=torch.Generator().manual_seed(seed))
        assert torch.equal(generate(model, prompt, 12, compile=True), generate(model, prompt, 12))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]

    model = small_gpt()
    ids = torch.randint(11, (2, 5), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    eager = generate(model, ids, 6, attention_mask=mask)
    options = dict(attention_mask=mask, eos_token_id=int(eager[0, 7]), pad_token_id=10)
    assert torch.equal(generate(model, ids, 6, compile=True, **options),
                       generate(model, ids, 6, **options))
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]


def test_compiled_decode_refuses_what_a_static_cache_cannot_hold():
    """Refused before anything is compiled: no cache, a rolling one, a sequence past seq_len
    where the course's model slides, past the RoPE table a compiled step reads unchecked."""
    prompt = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="needs use_cache=True and rolling=False"):
        generate(small_gpt(), prompt, 2, compile=True, use_cache=False)
    with pytest.raises(ValueError, match="needs use_cache=True and rolling=False"):
        generate(modern_gpt(window=3), prompt, 2, compile=True, rolling=True)
    with pytest.raises(ValueError, match="keeps the whole sequence, 13 tokens, but this model "
                                         "slides its window past seq_len=12"):
        generate(small_gpt(), prompt, 10, compile=True)
    model = modern_gpt()
    model.past_seq_len = "extend"                  # as a checkpoint's: RoPE past seq_len
    with pytest.raises(ValueError, match="reads RoPE's table of 8 positions without a check, "
                                         "but the sequence reaches position 8"):
        generate(model, prompt, 6, compile=True)


# ---------------------------------------------------------------- data

def test_induction_task_batches():
    task = InductionTask()
    inputs, targets = task.sample(16, generator=torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (16, task.seq_len)
    assert inputs.dtype == targets.dtype == torch.long
    assert ((inputs >= 0) & (inputs < task.vocab_size)).all()
    again, _ = task.sample(16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(inputs, again)
    scored = targets != IGNORE_INDEX
    assert scored.any() and (~scored).any()
    # Each scored target is the next input, and is what an induction head would copy.
    assert torch.equal(targets[:, :-1][scored[:, :-1]], inputs[:, 1:][scored[:, :-1]])
    where = induction_targets(inputs)
    assert (where[scored] >= 0).all()
    assert torch.equal(inputs.gather(1, where.clamp(min=0))[scored], targets[scored])
    # Unscored positions are exactly the first sight of each token.
    assert torch.equal(scored, where >= 0)


def test_induction_task_fixed_pattern_len_and_errors():
    task = InductionTask(vocab_size=26, seq_len=32)
    inputs, targets = task.sample(4, pattern_len=16)
    assert torch.equal(inputs[:, :16], inputs[:, 16:])
    assert (targets[:, :16] == IGNORE_INDEX).all() and (targets[:, 16:] != IGNORE_INDEX).all()
    with pytest.raises(ValueError, match="pattern_len"):
        task.sample(2, pattern_len=0)
    with pytest.raises(ValueError, match="batch_size"):
        task.sample(0)
    with pytest.raises(ValueError, match="vocab_size=8 is smaller"):
        InductionTask(vocab_size=8, seq_len=32)
    with pytest.raises(ValueError, match="min_pattern_len"):
        InductionTask(seq_len=32, min_pattern_len=20)


def test_induction_targets_by_hand():
    #            A  B  C  A  B  D  A
    seq = torch.tensor([[0, 1, 2, 0, 1, 3, 0]])
    assert induction_targets(seq).tolist() == [[-1, -1, -1, 1, 2, -1, 4]]
    with pytest.raises(ValueError, match="integer"):
        induction_targets(seq.float())


def test_token_labels():
    assert token_labels(torch.tensor([0, 1, 25])) == ["A", "B", "Z"]
    assert token_labels([26, 27, 51, 52]) == ["AA", "AB", "AZ", "BA"]
    assert InductionTask.token_labels([2]) == ["C"]
    with pytest.raises(ValueError, match="one sequence"):
        token_labels(torch.zeros(2, 3, dtype=torch.long))


# ---------------------------------------------------------------- training

def test_train_is_deterministic_and_learns():
    task = InductionTask()
    config = GPTConfig(task.vocab_size, task.seq_len, d_model=32, n_heads=2, n_layers=2, mlp=False)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(train(GPT(config), task, steps=30, batch_size=16, lr=3e-3, progress=False))
    assert runs[0] == runs[1] and len(runs[0]) == 30
    assert sum(runs[0][-5:]) < sum(runs[0][:5])
    with pytest.raises(ValueError, match="steps"):
        train(GPT(config), task, steps=0, batch_size=16, lr=1e-3)


def test_train_calls_on_step_after_every_step_without_changing_the_run():
    task = InductionTask()
    config = GPTConfig(task.vocab_size, task.seq_len, d_model=32, n_heads=2, n_layers=2, mlp=False)
    seen, runs = [], []
    for on_step in (None, lambda step, model: seen.append((step, model.training))):
        torch.manual_seed(0)
        runs.append(train(GPT(config), task, steps=6, batch_size=8, lr=3e-3, progress=False,
                          on_step=on_step))
    assert runs[0] == runs[1]
    assert seen == [(step, True) for step in range(1, 7)]


def test_train_without_progress_writes_nothing(capfd):
    """``progress=False`` is how the book trains: no progress bar, nothing on stdout or stderr."""
    task = InductionTask()
    config = GPTConfig(task.vocab_size, task.seq_len, d_model=16, n_heads=2, n_layers=1, mlp=False)
    train(GPT(config), task, steps=3, batch_size=4, lr=1e-3, progress=False)
    assert capfd.readouterr() == ("", "")
    train(GPT(config), task, steps=3, batch_size=4, lr=1e-3, progress=True)
    assert "training" in capfd.readouterr().err                  # the bar, when asked for


def test_train_induction_model_solves_the_task_with_an_induction_head():
    start = time.perf_counter()
    result = train_induction_model(seed=0, progress=False)
    elapsed = time.perf_counter() - start
    assert result.accuracy > 0.9, f"accuracy {result.accuracy:.3f}"
    assert result.losses[-1] < 0.1 < result.losses[0]
    scores = induction_head_scores(result.model, result.task,
                                   generator=torch.Generator().manual_seed(0))
    assert scores.shape == (2, 2)
    assert scores.max() > 0.8, f"scores {scores.tolist()}"
    assert scores[0].max() < 0.3                                  # layer 0 cannot do induction
    fresh = accuracy(result.model, result.task, generator=torch.Generator().manual_seed(1))
    assert fresh > 0.9
    print(f"train_induction_model: {elapsed:.1f} s, accuracy {result.accuracy:.4f}, "
          f"head scores {scores.tolist()}")

    # The history: measured before training and every 5 steps on one fixed batch (seed + 20_000).
    assert result.steps == list(range(0, 301, 5))
    assert result.induction_history.shape == result.previous_token_history.shape == (61, 2, 2)
    batch = torch.Generator().manual_seed(20_000)
    torch.testing.assert_close(result.induction_history[-1],
                               induction_head_scores(result.model, result.task, generator=batch))
    batch = torch.Generator().manual_seed(20_000)
    torch.testing.assert_close(result.previous_token_history[-1],
                               previous_token_scores(result.model, result.task, generator=batch))
    # The induction head forms during training: near the even-spread value at first, near 1 after.
    assert result.induction_history[0].max() < 0.1 and result.induction_history[-1, 1].min() > 0.9
    # The initial model is the untrained model: the same weights as a fresh GPT with this seed.
    torch.manual_seed(0)
    fresh_model = GPT(result.model.config)
    for (name, p), (_, p0) in zip(fresh_model.named_parameters(),
                                  result.initial_model.named_parameters()):
        assert torch.equal(p, p0), name
    assert not torch.equal(result.model.blocks[1].attn.q_proj.weight,
                           result.initial_model.blocks[1].attn.q_proj.weight)


def test_train_induction_model_records_without_changing_the_run():
    """Measuring the heads while training changes nothing: a coarser record, the same losses."""
    task = InductionTask()
    config = GPTConfig(task.vocab_size, task.seq_len, d_model=32, n_heads=2, n_layers=2,
                       mlp=False, backend="sdpa")
    torch.manual_seed(3)
    plain = train(GPT(config), task, steps=4, batch_size=8, lr=3e-3, seed=3, progress=False)
    calls = []

    def measure(step, model):
        calls.append(step)
        induction_head_scores(model, task, generator=torch.Generator().manual_seed(5))
        previous_token_scores(model, task, generator=torch.Generator().manual_seed(5))

    torch.manual_seed(3)
    measured = train(GPT(config), task, steps=4, batch_size=8, lr=3e-3, seed=3,
                     progress=False, on_step=measure)
    assert measured == plain and calls == list(range(1, 5))
    with pytest.raises(ValueError, match="record_every"):
        train_induction_model(record_every=0)


def test_queries_keys_values_are_what_the_model_attends_with():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=11, seq_len=9, d_model=24, n_heads=4, n_kv_heads=2, n_layers=3)
    model = GPT(config).eval()
    idx = torch.randint(0, 11, (2, 9))
    with torch.no_grad():
        logits, weights = model(idx, return_attention=True)
        by_layer = queries_keys_values(model, idx)
        again = model(idx)
    assert len(by_layer) == 3
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    for (q, k, v), w in zip(by_layer, weights):
        assert q.shape == (2, 4, 9, 6) and k.shape == v.shape == (2, 2, 9, 6)
        scores = q @ repeat_kv(k, 2).transpose(-2, -1) / math.sqrt(6)
        expected = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        torch.testing.assert_close(expected, w)
    torch.testing.assert_close(again, logits)                     # no hook is left behind
    assert all(not block.attn._forward_pre_hooks for block in model.blocks)


def test_previous_token_scores_of_a_perfect_head_and_an_even_one():
    task = InductionTask()
    t = task.seq_len

    class FixedHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.unused = torch.nn.Parameter(torch.zeros(1))

        def forward(self, idx, return_attention=False):
            b = idx.shape[0]
            previous = F.one_hot((torch.arange(t) - 1).clamp(min=0), t).float()     # (T, T)
            even = torch.ones(t, t).tril() / torch.arange(1, t + 1)[:, None]
            weights = torch.stack([previous, even]).expand(b, 2, t, t)
            return torch.zeros(b, t, task.vocab_size), [weights]

    scores = previous_token_scores(FixedHeads(), task)
    assert scores.shape == (1, 2)
    torch.testing.assert_close(scores[0, 0], torch.tensor(1.0))
    expected_even = torch.tensor([1 / (i + 1) for i in range(1, t)]).mean()
    torch.testing.assert_close(scores[0, 1], expected_even)


def test_ov_circuit_is_one_heads_path_from_embedding_to_logits():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=7, seq_len=5, d_model=12, n_heads=3, n_layers=2, mlp=False)
    model = GPT(config).eval()
    d = 4
    for layer in range(2):
        for head in range(3):
            # The same path, another way: silence every other head's block of W_O.
            only = copy.deepcopy(model)
            with torch.no_grad():
                out = only.blocks[layer].attn.out_proj.weight
                keep = out[:, head * d:(head + 1) * d].clone()
                out.zero_()
                out[:, head * d:(head + 1) * d] = keep
                attn, norm = only.blocks[layer].attn, only.blocks[layer].attn_norm
                written = attn.out_proj(attn.v_proj(norm(only.token_embedding.weight)))
                expected = only.lm_head(only.final_norm(written))
            torch.testing.assert_close(ov_circuit(model, layer, head), expected)
    with pytest.raises(ValueError, match="head"):
        ov_circuit(model, 0, 3)
    with pytest.raises(ValueError, match="layer"):
        ov_circuit(model, 2, 0)


def test_a_copying_head_has_its_largest_logit_on_the_diagonal():
    """Hand-built: embeddings one-hot, W_V and W_O identity, LM head = embeddings: it copies."""
    config = GPTConfig(vocab_size=4, seq_len=3, d_model=4, n_heads=1, n_layers=1, mlp=False)
    model = GPT(config).eval()
    with torch.no_grad():
        model.token_embedding.weight.copy_(torch.eye(4))
        model.blocks[0].attn.v_proj.weight.copy_(torch.eye(4))
        model.blocks[0].attn.out_proj.weight.copy_(torch.eye(4))
        model.lm_head.weight.copy_(torch.eye(4))
    table = ov_circuit(model, 0, 0)
    assert torch.equal(table.argmax(dim=-1), torch.arange(4))


def test_induction_head_scores_of_a_perfect_head():
    """A stand-in model whose only head attends exactly to the induction target scores 1."""
    task = InductionTask()

    class PerfectInductionHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.unused = torch.nn.Parameter(torch.zeros(1))

        def forward(self, idx, return_attention=False):
            b, t = idx.shape
            where = induction_targets(idx)
            weights = F.one_hot(torch.where(where >= 0, where, torch.arange(t)), t).float()
            return torch.zeros(b, t, task.vocab_size), [weights[:, None]]

    scores = induction_head_scores(PerfectInductionHead(), task)
    assert scores.shape == (1, 1)
    torch.testing.assert_close(scores, torch.ones(1, 1))


def test_last_only_gives_the_last_positions_logits_and_runs_the_output_layer_once_a_row():
    """Generation reads the last position's logits only: ``last_only`` equals the full forward's
    last row, with and without caches, and the output layer then multiplies one row, not T."""
    from torch.utils.flop_counter import FlopCounterMode
    model = small_gpt().eval()
    idx = torch.randint(0, 11, (2, 7), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(idx, last_only=True), model(idx)[:, -1:])
    caches = model.new_caches(2, 12)
    model(idx[:, :4], caches=caches)
    last = model(idx[:, 4:], caches=caches, last_only=True)
    torch.testing.assert_close(last, model(idx)[:, -1:], rtol=1e-5, atol=1e-5)
    flops = {}
    for last_only in (False, True):
        with FlopCounterMode(display=False) as counter:
            model(idx, last_only=last_only)
        flops[last_only] = counter.get_total_flops()
    row = 2 * model.lm_head.in_features * model.lm_head.out_features       # 2 FLOPs a MAC
    assert flops[False] - flops[True] == idx.shape[0] * (idx.shape[1] - 1) * row

"""Multi-head attention, the tiny GPT, its synthetic task and its training."""

import copy
import math
import time

import pytest
import torch
import torch.nn.functional as F

from course_attn import attention
from course_attn.data import IGNORE_INDEX, InductionTask, induction_targets, token_labels
from course_attn.device import available_devices
from course_attn.model import GPT, GPTConfig, generate, queries_keys_values
from course_attn.multihead import MultiHeadAttention, merge_heads, repeat_kv, split_heads
from course_attn.train import (accuracy, induction_head_scores, ov_circuit, previous_token_scores,
                               train, train_induction_model)

DEVICES = available_devices()


def explicit_attention(mha: MultiHeadAttention, x, *, mask=None):
    """MultiHeadAttention written out with plain tensor ops, one head at a time."""
    b, t, _ = x.shape
    d = mha.head_dim
    q, k, v = mha.q_proj(x), mha.k_proj(x), mha.v_proj(x)
    group = mha.n_heads // mha.n_kv_heads
    outputs, all_weights = [], []
    for h in range(mha.n_heads):
        kv = h // group
        qh = q[..., h * d:(h + 1) * d]                          # (B, T, D)
        kh, vh = k[..., kv * d:(kv + 1) * d], v[..., kv * d:(kv + 1) * d]
        scores = qh @ kh.transpose(1, 2) / math.sqrt(d)         # (B, T, T)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        all_weights.append(weights)
        outputs.append(weights @ vh)
    return mha.out_proj(torch.cat(outputs, dim=-1)), torch.stack(all_weights, dim=1)


# ---------------------------------------------------------------- heads

def test_split_and_merge_heads_are_inverse():
    x = torch.randn(2, 5, 12)
    heads = split_heads(x, 3)
    assert heads.shape == (2, 3, 5, 4)
    assert torch.equal(heads[:, 1], x[..., 4:8])                # head 1 owns channels 4..7
    assert torch.equal(merge_heads(heads), x)


def test_split_merge_heads_reject_bad_shapes():
    with pytest.raises(ValueError, match="into 5 heads"):
        split_heads(torch.randn(2, 5, 12), 5)
    with pytest.raises(ValueError, match=r"\(B, T, H·D\)"):
        split_heads(torch.randn(5, 12), 3)
    with pytest.raises(ValueError, match=r"\(B, H, T, D\)"):
        merge_heads(torch.randn(2, 5, 12))


def test_repeat_kv_is_re_exported_not_copied():
    assert repeat_kv is attention.repeat_kv


# ---------------------------------------------------------------- MultiHeadAttention

@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_mha_equals_explicit_computation(device, n_kv_heads):
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4, n_kv_heads=n_kv_heads).to(device)
    x = torch.randn(2, 7, 32, device=device)
    out, weights = mha(x, return_weights=True)
    causal = torch.ones(7, 7, dtype=torch.bool, device=device).tril()
    expected_out, expected_weights = explicit_attention(mha, x, mask=causal)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(weights, expected_weights)
    assert weights.shape == (2, 4, 7, 7)


def test_mha_bidirectional_and_with_a_mask():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2)
    x = torch.randn(3, 6, 16)
    torch.testing.assert_close(mha(x, is_causal=False), explicit_attention(mha, x)[0])
    keep = torch.rand(3, 1, 6, 6) > 0.3
    keep[..., 0] = True                                          # no query row left empty
    torch.testing.assert_close(mha(x, attn_mask=keep, is_causal=False),
                               explicit_attention(mha, x, mask=keep[:, 0])[0])


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_mha_sdpa_and_math_backends_agree(device, n_kv_heads):
    torch.manual_seed(0)
    math_mha = MultiHeadAttention(32, 4, n_kv_heads=n_kv_heads, backend="math").to(device)
    sdpa_mha = MultiHeadAttention(32, 4, n_kv_heads=n_kv_heads, backend="sdpa").to(device)
    sdpa_mha.load_state_dict(math_mha.state_dict())
    x = torch.randn(2, 9, 32, device=device, requires_grad=True)
    for causal in (True, False):
        torch.testing.assert_close(sdpa_mha(x, is_causal=causal), math_mha(x, is_causal=causal))
    grad_math, = torch.autograd.grad(math_mha(x).square().sum(), x)
    grad_sdpa, = torch.autograd.grad(sdpa_mha(x).square().sum(), x)
    torch.testing.assert_close(grad_sdpa, grad_math)


def test_mha_gqa_shapes():
    mha = MultiHeadAttention(64, 8, n_kv_heads=2, bias=True)
    assert mha.head_dim == 8
    assert mha.q_proj.weight.shape == (64, 64)
    assert mha.k_proj.weight.shape == mha.v_proj.weight.shape == (16, 64)   # 2 heads × 8
    out, weights = mha(torch.randn(3, 5, 64), return_weights=True)
    assert out.shape == (3, 5, 64) and weights.shape == (3, 8, 5, 5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 8, 5))
    assert (weights.triu(1) == 0).all()                          # causal: no future key


def test_mha_dtype_flows_through():
    mha = MultiHeadAttention(16, 2).to(torch.float64)
    out, weights = mha(torch.randn(1, 4, 16, dtype=torch.float64), return_weights=True)
    assert out.dtype == weights.dtype == torch.float64


def test_mha_errors():
    with pytest.raises(ValueError, match="not divisible"):
        MultiHeadAttention(30, 4)
    with pytest.raises(ValueError, match="not a multiple"):
        MultiHeadAttention(32, 4, n_kv_heads=3)
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        MultiHeadAttention(32, 4, backend="nope")
    with pytest.raises(ValueError, match="n_heads must be a positive int"):
        MultiHeadAttention(32, 0)
    with pytest.raises(ValueError, match=r"\(B, T, C=32\)"):
        MultiHeadAttention(32, 4)(torch.randn(2, 5, 16))


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


def test_generate_length_and_greedy_determinism():
    model = small_gpt()
    prompt = torch.randint(11, (2, 4))
    out = generate(model, prompt, 20, temperature=0)             # runs past seq_len = 12
    assert out.shape == (2, 24)
    assert torch.equal(out[:, :4], prompt)
    assert torch.equal(out, generate(model, prompt, 20, temperature=0))
    assert torch.equal(out[:, 4], model(prompt)[:, -1].argmax(-1))   # greedy = argmax
    assert torch.equal(generate(model, prompt, 20, top_k=1), out)   # top-1 sampling is greedy
    assert generate(model, prompt, 0).shape == (2, 4)


def test_generate_sampling_follows_the_generator():
    model = small_gpt()
    prompt = torch.randint(11, (4, 3))
    first = generate(model, prompt, 8, generator=torch.Generator().manual_seed(1))
    again = generate(model, prompt, 8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(first, again)
    assert ((first >= 0) & (first < 11)).all()


def test_generate_errors():
    model, prompt = small_gpt(), torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, prompt, -1)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, prompt, 1, temperature=-0.5)
    with pytest.raises(ValueError, match="top_k"):
        generate(model, prompt, 1, top_k=0)


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

"""load_pretrained: Hugging Face checkpoints in the course's modules, equal to transformers.

Every checkpoint is a tiny random one, written here by transformers' ``save_pretrained`` (no
hub): the course's model must give transformers' logits (float32, max abs <= 1e-4), its greedy
tokens with the course's KV cache, and stay within bfloat16's rounding. Each mistake a reader
could meet with a checkpoint is a one-line error that names it.
"""

import json
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch

import course_attn
from course_attn.checkpoints import (
    CheckpointError, compare_with_transformers, interleave_rows, load_pretrained, read_tensors,
    save_random_checkpoint,
)
from course_attn.model import generate
from course_attn.rope import RotaryEmbedding
from course_attn.timing import torch_threads

pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402  (after the skip)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
               "rope_theta": 500000.0}
WINDOW = 8
CHECKPOINTS = {                 # name -> (architecture, config.json options)
    "llama": ("llama", dict(rope_parameters=LLAMA3_ROPE)),
    "llama-tied-bias": ("llama", dict(tie_word_embeddings=True, attention_bias=True,
                                      mlp_bias=True, rope_parameters={
                                          "rope_type": "linear", "factor": 2.0,
                                          "rope_theta": 10000.0})),
    "gpt2": ("gpt2", {}),
    "qwen3": ("qwen3", dict(head_dim=32)),          # H·D = 128, not hidden_size = 64
    "mistral": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2": ("qwen2", {}),                         # biases on q, k and v, not o
    "phi3": ("phi3", dict(sliding_window=WINDOW)),  # fused qkv and gate-up
    "olmo2": ("olmo2", {}),                         # QK-norm over all heads, norms after
    "gemma3": ("gemma3", dict(                      # local and global layers, 2 RoPE bases
        num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}
LARGE_LLAMA = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=2, vocab_size=32000)
PROMPT_LEN = 20                 # > WINDOW: Mistral's window cuts into every prompt
ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread, and lose much on a busy machine."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (folder, the transformers model saved there), made once for the module."""
    made = {}
    for seed, (name, (architecture, options)) in enumerate(CHECKPOINTS.items()):
        folder = tmp_path_factory.mktemp(name)
        made[name] = folder, save_random_checkpoint(folder, architecture, seed=seed, **options)
    return made


@pytest.fixture(scope="module")
def reference_tokens(checkpoints):
    """name -> transformers' 32 greedy tokens after ``prompts(batch=2)``, generated once."""
    made = {}

    def tokens(name):
        if name not in made:
            hf_model, idx = checkpoints[name][1], prompts(batch=2)
            made[name] = hf_model.generate(idx, attention_mask=torch.ones_like(idx),
                                           max_new_tokens=32, do_sample=False)
        return made[name]
    return tokens


def prompts(batch=3, length=PROMPT_LEN, seed=0):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def reference_logits(hf_model, idx):
    with torch.no_grad():
        return hf_model(idx).logits


def course_logits(model, idx):
    with torch.no_grad():
        return model(idx)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_logits_equal_transformers(checkpoints, name):
    folder, hf_model = checkpoints[name]
    idx = prompts()
    reference = reference_logits(hf_model, idx)
    ours = course_logits(load_pretrained(folder), idx)
    assert ours.shape == reference.shape == (3, PROMPT_LEN, 128)
    assert (ours - reference).abs().max() <= ATOL


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral", "phi3", "olmo2",
                                  "gemma3"])
def test_interleaved_layout_gives_the_same_logits(checkpoints, name):
    """Meta's layout: Wq and Wk rows permuted back, pairs (2i, 2i+1) rotated; the same model.
    Qwen2's q and k biases are permuted with their rows."""
    folder, hf_model = checkpoints[name]
    idx = prompts()
    model = load_pretrained(folder, rope_layout="interleaved")
    assert model.blocks[0].attn.rope_interleaved
    half = load_pretrained(folder)
    assert not torch.equal(model.blocks[0].attn.q_proj.weight, half.blocks[0].attn.q_proj.weight)
    assert (course_logits(model, idx) - reference_logits(hf_model, idx)).abs().max() <= ATOL


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_checkpoints_have_random_norm_gains_and_biases(checkpoints, name):
    """Gains of 1 and biases of 0 would hide a norm applied in the wrong order or place."""
    hf_model = checkpoints[name][1]
    vectors = [(n, p) for n, p in hf_model.named_parameters() if p.dim() == 1]
    assert vectors
    for parameter_name, p in vectors:
        assert len(set(p.tolist())) == p.numel(), parameter_name


def test_compare_with_transformers_reports_the_gap_and_the_tokens(checkpoints):
    """The appendix's helper: transformers' own numbers for a right model, a gap past the
    tolerance and fewer than 32 equal tokens for a wrong one."""
    folder, hf_model = checkpoints["llama"]
    idx = prompts(batch=2)
    right = compare_with_transformers(load_pretrained(folder), hf_model, idx)
    assert right.logit_gap <= ATOL and right.same_tokens and right.tokens == 32
    assert str(right).endswith(", 32 of 32 greedy tokens the same")
    model = load_pretrained(folder)
    _no_rope_scaling(model)
    wrong = compare_with_transformers(model, hf_model, idx)
    assert wrong.logit_gap > 10 * ATOL and not wrong.same_tokens


class _Replay:
    """A stand-in for a transformers model: given logits, and tokens for generate."""

    def __init__(self, logits, tokens):
        self.logits, self.tokens = logits, tokens

    def __call__(self, idx):
        return types.SimpleNamespace(logits=self.logits)

    def generate(self, idx, **options):
        return self.tokens


def test_compare_with_transformers_counts_the_tokens_before_the_first_difference(checkpoints):
    """tokens: the row whose first difference comes first decides; a difference after it does
    not count; a reference that stopped early (an end token) is shorter, never equal."""
    model = load_pretrained(checkpoints["llama"][0])
    idx = prompts(batch=2)
    with torch.no_grad():
        logits = model(idx)
    ours = model.generate(idx, 8)
    theirs = ours.clone()
    theirs[1, PROMPT_LEN + 5] += 1                      # row 1 differs at its 6th new token
    theirs[0, PROMPT_LEN + 7] += 1                      # row 0 at its 8th
    agreement = compare_with_transformers(model, _Replay(logits + 0.5, theirs), idx, 8)
    assert agreement.logit_gap == pytest.approx(0.5)
    assert (agreement.tokens, agreement.same_tokens) == (5, False)
    agreement = compare_with_transformers(model, _Replay(logits, ours[:, :PROMPT_LEN + 3]),
                                          idx, 8)
    assert (agreement.logit_gap, agreement.tokens) == (0.0, 3)


def test_interleave_rows_is_the_inverse_of_the_hf_conversion():
    """transformers' convert_llama_weights_to_hf permutes Meta's rows with
    view(H, D/2, 2, C).transpose(1, 2); interleave_rows undoes it."""
    h, d, c = 3, 8, 5
    meta = torch.randn(h * d, c, generator=torch.Generator().manual_seed(0))
    hf = meta.view(h, d // 2, 2, c).transpose(1, 2).reshape(h * d, c)
    assert torch.equal(interleave_rows(hf, h), meta)


def _wrong_rope_layout(model):
    for block in model.blocks:
        block.attn.rope_interleaved = True          # the rows were not permuted


def _no_rope_scaling(model):
    for block in model.blocks:
        attn = block.attn
        attn.rotary = RotaryEmbedding(attn.head_dim, attn.rotary.max_seq_len, attn.rotary.base)


def _no_window(model):
    for block in model.blocks:
        block.attn.window = None


def _exact_gelu(model):
    for block in model.blocks:
        block.mlp.approximate = "none"


def _no_qk_norm_eps(model):
    for block in model.blocks:
        block.attn.q_norm.eps = block.attn.k_norm.eps = 0.5


def _qk_norm_after_rope(model):
    for block in model.blocks:
        block.attn.qk_norm_order = "after_rope"


def _gate_and_up_swapped(model):
    for block in model.blocks:
        block.mlp.gate, block.mlp.up = block.mlp.up, block.mlp.gate


def _no_query_bias(model):
    with torch.no_grad():
        for block in model.blocks:
            block.attn.q_proj.bias.zero_()


def _qk_norm_per_head(model):
    """OLMo 2's QK-norm taken over each head apart, as Qwen3's, not over the projection."""
    from course_attn.norm import rms_norm
    for block in model.blocks:
        attn = block.attn
        for proj, heads in ((attn.q_proj, attn.n_heads), (attn.k_proj, attn.n_kv_heads)):
            proj.forward = lambda x, proj=proj, heads=heads: rms_norm(
                torch.nn.functional.linear(x, proj.weight, proj.bias).unflatten(-1, (heads, -1)),
                eps=proj.norm.eps).flatten(-2) * proj.norm.weight


def _norms_before(model):
    """OLMo 2's norms applied to each sub-block's input (pre-norm), not to its output."""
    import types

    from course_attn.model import Block
    for block in model.blocks:
        block.attn_norm, block.mlp_norm = block.post_attn_norm, block.post_mlp_norm
        block.forward = types.MethodType(Block.forward, block)


def _gains_not_offset(model):
    """Gemma's norms read as Llama's: gains w instead of 1 + w."""
    from course_attn.checkpoints import GemmaRMSNorm
    from course_attn.norm import RMSNorm
    for module in model.modules():
        if isinstance(module, GemmaRMSNorm):
            module.__class__ = RMSNorm


def _one_rope_base(model):
    """Gemma 3's local layers rotated with the global layers' table."""
    for block in model.blocks:
        block.attn.rotary = model.blocks[2].attn.rotary


def _no_embedding_scale(model):
    model.token_embedding.scale = 1.0


def _default_attention_scale(model):
    for block in model.blocks:
        block.attn.scale = None


def _window_everywhere(model):
    for block in model.blocks:
        block.attn.window = WINDOW


def _norms_swapped(model):
    for block in model.blocks:
        block.attn_norm, block.mlp_norm = block.mlp_norm, block.attn_norm


@pytest.mark.parametrize("name, bug", [
    ("llama", _wrong_rope_layout), ("llama", _no_rope_scaling),
    ("llama-tied-bias", _no_rope_scaling), ("mistral", _no_window), ("gpt2", _exact_gelu),
    ("qwen3", _no_qk_norm_eps), ("qwen3", _qk_norm_after_rope), ("llama", _norms_swapped),
    ("gpt2", _norms_swapped), ("phi3", _gate_and_up_swapped), ("phi3", _no_window),
    ("qwen2", _no_query_bias), ("olmo2", _qk_norm_per_head), ("olmo2", _norms_before),
    ("gemma3", _gains_not_offset), ("gemma3", _one_rope_base), ("gemma3", _no_embedding_scale),
    ("gemma3", _default_attention_scale), ("gemma3", _window_everywhere),
    ("gemma3", _no_window), ("gemma3", _qk_norm_after_rope),
])
def test_the_tolerance_catches_a_plausible_bug(checkpoints, name, bug):
    """Each option the loader reads matters on these checkpoints: getting it wrong moves the
    logits past ten times the tolerance."""
    folder, hf_model = checkpoints[name]
    model = load_pretrained(folder)
    bug(model)
    idx = prompts()
    error = float((course_logits(model, idx) - reference_logits(hf_model, idx)).abs().max())
    assert error > 10 * ATOL


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_greedy_tokens_equal_transformers_generate(checkpoints, reference_tokens, name):
    """Greedy by default, as transformers' generate; temperature=0 (the course's older
    spelling) is greedy too; model.generate is the function."""
    folder = checkpoints[name][0]
    idx = prompts(batch=2)
    theirs = reference_tokens(name)
    model = load_pretrained(folder)
    ours = model.generate(idx, 32)
    assert theirs.shape == (2, PROMPT_LEN + 32)
    assert torch.equal(ours, theirs)
    assert torch.equal(course_attn.generate(model, idx, 32, temperature=0), theirs)


@pytest.mark.parametrize("architecture, options", [
    ("llama", dict(rope_parameters=LLAMA3_ROPE)), ("qwen3", {}),
    ("mistral", dict(sliding_window=WINDOW))])
def test_rope_generation_goes_on_past_max_position_embeddings(tmp_path, architecture, options):
    """Trained on 24 positions, asked for 20 + 32: transformers goes on with positions 24, 25,
    ... (RoPE computes any position); so does the course, token for token."""
    hf_model = save_random_checkpoint(tmp_path, architecture, seed=3, max_position_embeddings=24,
                                      **options)
    idx = prompts(batch=2)
    theirs = hf_model.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=32,
                               do_sample=False)
    model = load_pretrained(tmp_path)
    assert model.config.seq_len == 24
    assert torch.equal(model.generate(idx, 32), theirs)
    assert torch.equal(course_attn.generate(model, idx, 32, use_cache=False), theirs)


def test_gpt2_past_n_positions_is_refused_as_transformers_refuses(tmp_path):
    hf_model = save_random_checkpoint(tmp_path, "gpt2", seed=4, n_positions=32)
    idx = prompts(batch=1)                               # 20 tokens: 20 + 13 - 1 > 32
    with pytest.raises(IndexError):
        hf_model.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=14,
                          do_sample=False)
    model = load_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"reach position 32, past the model's 32 learned "
                                         r"positions \(transformers raises too\)"):
        model.generate(idx, 14)
    theirs = hf_model.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=13,
                               do_sample=False)
    assert torch.equal(model.generate(idx, 13), theirs)  # up to the last position, as theirs


def _with_generation_config(checkpoints, name, tmp_path, **fields):
    folder = _copy(checkpoints, name, tmp_path)
    (folder / "generation_config.json").write_text(json.dumps(fields))
    return folder


def _transformers(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_generation_stops_at_eos_as_transformers(checkpoints, reference_tokens, tmp_path, name):
    """generation_config.json's end token stops a row; the other row goes on, the finished one
    padded with pad_token_id; a batch whose rows all ended stops."""
    greedy = reference_tokens(name)                     # without an end token
    # an end token row 0 generates early, and row 1 not in its first 12 tokens
    eos = next(t for t in greedy[0, PROMPT_LEN + 2:PROMPT_LEN + 10].tolist()
               if t not in greedy[1, PROMPT_LEN:PROMPT_LEN + 12].tolist())
    folder = _with_generation_config(checkpoints, name, tmp_path, eos_token_id=[eos, 127],
                                     pad_token_id=0)
    model = load_pretrained(folder)
    assert model.generation_config.eos_token_id == (eos, 127)
    idx = prompts(batch=2)
    theirs = _transformers(folder).generate(idx, attention_mask=torch.ones_like(idx),
                                             max_new_tokens=32, do_sample=False)
    ours = model.generate(idx, 32)
    assert torch.equal(ours, theirs)
    first = ours[0, PROMPT_LEN:].tolist().index(eos)
    assert first < 10 and set(ours[0, PROMPT_LEN + first + 1:].tolist()) <= {0}
    assert ours.shape[1] > PROMPT_LEN + first + 2           # row 1 went on
    alone = model.generate(idx[:1], 32)                   # one row: it stops at its end token
    assert torch.equal(alone, ours[:1, :PROMPT_LEN + first + 1])
    assert model.generate(idx[:1], 32, eos_token_id=()).shape == (1, PROMPT_LEN + 32)


def _transformers_sampling(folder):
    """transformers' sampling settings for the checkpoint in folder: what its generation config
    says, its defaults for what it leaves out (None), as generate fills them in."""
    from transformers import GenerationConfig
    config = _transformers(folder).generation_config
    defaults = GenerationConfig._get_default_generation_params()
    return {key: defaults[key] if getattr(config, key) is None else getattr(config, key)
            for key in ("do_sample", "temperature", "top_k", "top_p")}


@pytest.mark.parametrize("fields, file", [
    (dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95), "generation_config.json"),
    (dict(do_sample=True, temperature=0.7, top_p=None), "generation_config.json"),  # null
    (dict(temperature=0.7, top_k=0), "config.json"),       # 0: no top-k; no generation config
    ({}, "generation_config.json"),                           # transformers' defaults
], ids=["qwen3-like", "null-top-p", "in-config-json", "defaults"])
def test_sampling_settings_are_read_as_transformers_reads_them(checkpoints, tmp_path, fields,
                                                               file):
    """generation_config.json's do_sample, temperature, top_k and top_p are kept on the model,
    with transformers' defaults for what it leaves out; without the file, config.json's, as
    transformers reads them. generate does not use them (yet): greedy unless asked."""
    folder = _copy(checkpoints, "llama", tmp_path)
    if file == "config.json":
        (folder / "generation_config.json").unlink()
        _edit_config(folder, **fields)
    else:
        (folder / file).write_text(json.dumps(fields))
    config = load_pretrained(folder).generation_config
    ours = {key: getattr(config, key) for key in ("do_sample", "temperature", "top_k", "top_p")}
    theirs = _transformers_sampling(folder)
    if theirs["top_k"] == 0:
        theirs["top_k"] = None                          # the course's spelling of no top-k
    assert ours == theirs


@pytest.mark.parametrize("fields, message", [
    (dict(temperature="hot"), "temperature must be a number >= 0, got 'hot'"),
    (dict(do_sample="yes"), "do_sample must be True or False, got 'yes'"),
    (dict(top_p=1.5), "top_p must be a number in (0, 1], got 1.5"),
    (dict(top_k=-3), "top_k"),
])
def test_bad_sampling_settings_name_the_file(checkpoints, tmp_path, fields, message):
    folder = _with_generation_config(checkpoints, "llama", tmp_path, **fields)
    error = _load_error(folder)
    assert error.startswith(f"{folder / 'generation_config.json'}: ") and message in error


def left_padded(lengths, pad=0, seed=1):
    """Prompts of these lengths, padded on the left to the longest: ids (B, T), mask (B, T)."""
    rows = [prompts(batch=1, length=n, seed=seed + i)[0] for i, n in enumerate(lengths)]
    width = max(lengths)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = row
        mask[i, width - len(row):] = 1
    return ids, mask, rows


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_left_padded_batch_equals_transformers_and_each_prompt_alone(checkpoints, name):
    """Prompts of 20, 11 and 6 tokens (Mistral's window is 8), padded on the left: each row's
    32 greedy tokens are transformers' for the same batch, and the course's for that prompt
    alone."""
    folder, hf_model = checkpoints[name]
    ids, mask, rows = left_padded([PROMPT_LEN, 11, 6])
    theirs = hf_model.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                               pad_token_id=0)
    model = load_pretrained(folder)
    ours = model.generate(ids, 32, attention_mask=mask)
    assert torch.equal(ours, theirs)
    for i, row in enumerate(rows):
        assert torch.equal(ours[i, PROMPT_LEN:], model.generate(row[None], 32)[0, len(row):])
    assert torch.equal(course_attn.generate(model, ids, 5, attention_mask=mask, use_cache=False),
                       ours[:, :PROMPT_LEN + 5])


@pytest.mark.parametrize("options", [dict(temperature=0.7, top_k=20, top_p=0.9),
                                     dict(top_p=0.8), dict(top_k=5), dict(temperature=1.3)],
                         ids=["t0.7-k20-p0.9", "p0.8", "k5", "t1.3"])
def test_seeded_sampling_draws_transformers_tokens(checkpoints, options):
    """With the global generator seeded alike, do_sample=True draws transformers' tokens: the
    same warpers (temperature, top-k, top-p, in that order, in float32) and one torch.multinomial
    per step over the batch. top_k is given: transformers' default is 50, the course's none."""
    folder, hf_model = checkpoints["llama"]
    idx = prompts(batch=2)
    options = {"top_k": None, **options}
    torch.manual_seed(123)
    theirs = hf_model.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=32,
                               do_sample=True, **options)
    torch.manual_seed(123)
    ours = load_pretrained(folder).generate(idx, 32, do_sample=True, **options)
    assert torch.equal(ours, theirs)
    greedy = load_pretrained(folder).generate(idx, 32)
    assert not torch.equal(ours, greedy)                  # it did sample


def test_mistral_rolling_cache_gives_transformers_tokens(checkpoints, reference_tokens):
    """The rolling cache keeps only the last WINDOW keys, however long the prompt and the
    generation (20 + 32 tokens, window 8)."""
    folder = checkpoints["mistral"][0]
    idx = prompts(batch=2)
    theirs = reference_tokens("mistral")
    model = load_pretrained(folder)
    assert all(block.attn.window == WINDOW for block in model.blocks)
    caches = model.new_rolling_caches(2)
    assert caches[0].k.shape == (2, 2, WINDOW, 16)
    assert torch.equal(generate(model, idx, 32, temperature=0, rolling=True), theirs)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_bfloat16_within_dtype_scaled_tolerance(checkpoints, name):
    """In bfloat16 the course's logits are as close to float32's as transformers' own bfloat16
    run (within 2x), and within 16 rounding units of bfloat16 at the logits' scale."""
    folder, hf_model = checkpoints[name]
    idx = prompts()
    reference = reference_logits(hf_model, idx)
    ours = course_logits(load_pretrained(folder, dtype=torch.bfloat16), idx)
    assert ours.dtype == torch.bfloat16
    theirs = reference_logits(_bf16_copy(folder), idx)
    ours_error = (ours.float() - reference).abs().max()
    their_error = (theirs.float() - reference).abs().max()
    scale = torch.finfo(torch.bfloat16).eps * reference.abs().max()
    assert ours_error <= 16 * scale
    assert ours_error <= 2 * their_error


def _bf16_copy(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()


def test_rope_scaling_survives_a_cast(checkpoints):
    """Llama 3.1's frequencies, not the plain ones, after .to(bfloat16) (RotaryEmbedding
    recomputes its table when cast), in the one table every layer shares."""
    from course_attn.rope import scaled_rope_frequencies

    model = load_pretrained(checkpoints["llama"][0], dtype=torch.bfloat16)
    rotary = model.blocks[0].attn.rotary
    assert all(block.attn.rotary is rotary for block in model.blocks)
    expected = scaled_rope_frequencies(16, 500000.0, kind="llama3", factor=8.0,
                                       original_max_len=32)
    assert rotary.inv_freq.dtype == torch.float32
    assert torch.equal(rotary.inv_freq, expected)


@pytest.mark.parametrize("options", [
    dict(scale_attn_by_inverse_layer_idx=True), dict(scale_attn_weights=False),
    dict(activation_function="gelu"),
])
def test_gpt2_options(tmp_path, options):
    hf_model = save_random_checkpoint(tmp_path, "gpt2", seed=11, **options)
    idx = prompts()
    ours = course_logits(load_pretrained(tmp_path), idx)
    assert (ours - reference_logits(hf_model, idx)).abs().max() <= ATOL


def test_config_without_architectures_uses_model_type(checkpoints, tmp_path):
    folder = _copy(checkpoints, "qwen3", tmp_path)
    _edit_config(folder, architectures=None)
    assert load_pretrained(folder).config.architecture == "qwen3"


def test_sharded_checkpoint_loads(tmp_path):
    hf_model = save_random_checkpoint(tmp_path, "llama", seed=7, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    idx = prompts()
    ours = course_logits(load_pretrained(tmp_path), idx)
    assert (ours - reference_logits(hf_model, idx)).abs().max() <= ATOL


def test_hub_style_names_load(checkpoints, tmp_path):
    """The hub's GPT-2 names its tensors without "transformer." and carries the causal-mask
    buffers (h.N.attn.bias); older Llamas carry rotary_emb.inv_freq. The course computes both."""
    folder = _copy(checkpoints, "gpt2", tmp_path)

    def hub_style(tensors):
        for name in list(tensors):
            tensors[name.removeprefix("transformer.")] = tensors.pop(name)
        for i in range(2):
            tensors[f"h.{i}.attn.bias"] = torch.ones(1, 1, 128, 128).tril()
    _edit_tensors(folder, hub_style)
    idx = prompts()
    ours = course_logits(load_pretrained(folder), idx)
    assert (ours - reference_logits(checkpoints["gpt2"][1], idx)).abs().max() <= ATOL
    folder = _copy(checkpoints, "llama", tmp_path)
    _edit_tensors(folder, lambda t: t.update(
        {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    ours = course_logits(load_pretrained(folder), idx)
    assert (ours - reference_logits(checkpoints["llama"][1], idx)).abs().max() <= ATOL


PEAK_MEMORY = """
import sys, torch
from course_attn.checkpoints import load_pretrained

def peak():      # VmHWM: this process's peak resident memory (ru_maxrss keeps the parent's)
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024

def load_and_run(folder):
    model = load_pretrained(folder)
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))
    return model

load_and_run(sys.argv[1])                 # torch's code paths warmed up on a tiny checkpoint
before = peak()
model = load_and_run(sys.argv[2])
print(peak() - before, sum(p.nbytes for p in set(model.parameters())))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's VmHWM")
def test_loading_holds_the_weights_once(tmp_path):
    """A 45M-parameter bfloat16 Llama: the process's peak resident memory grows by at most 1.3x
    the weights' bytes from before load_pretrained to after a forward pass (which reads every
    weight), in a fresh process. A model drawn at random first, then overwritten and cast, held
    3.3x."""
    small, large = tmp_path / "small", tmp_path / "large"
    save_random_checkpoint(small, "llama", dtype=torch.bfloat16)
    save_random_checkpoint(large, "llama", dtype=torch.bfloat16, init_std=0.02,
                           **LARGE_LLAMA)
    out = subprocess.run([sys.executable, "-c", PEAK_MEMORY, str(small), str(large)],
                         capture_output=True, text=True, check=True, timeout=300)
    peak, weights = map(int, out.stdout.split())
    assert weights > 50 * 2**20                   # large enough that the measure is the weights
    assert peak <= 1.3 * weights, f"peak {peak / 2**20:.0f} MiB for {weights / 2**20:.0f} MiB"


def test_exported_at_top_level():
    assert course_attn.load_pretrained is load_pretrained
    assert course_attn.generate is generate


# ----------------------------------------------------------------- what a reader can get wrong

def _copy(checkpoints, name, tmp_path):
    folder = tmp_path / name
    shutil.copytree(checkpoints[name][0], folder)
    return folder


def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _edit_tensors(folder, edit):
    tensors = read_tensors(folder)
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _load_error(folder) -> str:
    with pytest.raises(CheckpointError) as error:
        load_pretrained(folder)
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("name, changes, message", [
    ("llama", dict(architectures=["BertForMaskedLM"]), "architecture BertForMaskedLM"),
    ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
     "rope_scaling type 'yarn'"),
    ("llama", dict(rope_parameters=None, rope_theta=1e4,
                   rope_scaling={"type": "dynamic", "factor": 2.0}),
     "rope_scaling type 'dynamic'"),
    ("llama", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("qwen3", dict(use_sliding_window=True, sliding_window=4), "use_sliding_window=True"),
    ("gpt2", dict(add_cross_attention=True), "add_cross_attention=True"),
    ("gpt2", dict(reorder_and_upcast_attn=True), "reorder_and_upcast_attn=True"),
    # what another architecture relabelled as one the course loads would carry
    ("llama", dict(embedding_multiplier=12.0, residual_multiplier=0.22),
     "embedding_multiplier=12.0"),                                          # Granite
    ("llama", dict(logits_scaling=8.0), "logits_scaling=8.0"),              # Granite
    ("qwen3", dict(attention_multiplier=0.0078125), "attention_multiplier=0.0078125"),
    ("llama", dict(no_rope_layers=[1, 1, 1, 0]), "no_rope_layers=[1, 1, 1, 0]"),   # SmolLM3
    ("llama", dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),  # Gemma 2
    ("llama", dict(sliding_window=4), "sliding_window=4"),                  # a Mistral
    ("gpt2", dict(use_parallel_residual=True), "use_parallel_residual=True"),       # GPT-NeoX
    # a Qwen2 read as a Llama, which has no biases: they are not dropped silently
    ("qwen2", dict(architectures=["LlamaForCausalLM"], model_type="llama"),
     "has tensor 'model.layers.0.self_attn.k_proj.bias' in model.safetensors (and 5 more"),
])
def test_unsupported_config_is_one_line_naming_it(checkpoints, tmp_path, name, changes, message):
    folder = _copy(checkpoints, name, tmp_path)
    _edit_config(folder, **changes)
    assert message in _load_error(folder)


def test_config_keys_at_their_neutral_value_load(checkpoints, tmp_path):
    """A Llama that spells out SmolLM3's or Granite's keys at values that change nothing."""
    folder = _copy(checkpoints, "llama", tmp_path)
    _edit_config(folder, no_rope_layers=[1, 1], embedding_multiplier=1.0, sliding_window=None)
    idx = prompts()
    ours = course_logits(load_pretrained(folder), idx)
    assert (ours - reference_logits(checkpoints["llama"][1], idx)).abs().max() <= ATOL


@pytest.mark.parametrize("name", ["olmo2", "gemma3"])
def test_the_serving_engine_refuses_a_block_with_norms_after(checkpoints, name):
    """serve.Engine runs pre-norm blocks (attn_norm, mlp_norm); a block whose norms sit after
    attention and the MLP lacks those names, so the engine refuses it instead of skipping its
    norms."""
    from course_attn.serve import Engine

    with pytest.raises(ValueError, match=r"has no blocks\[0\].attn_norm, blocks\[0\].mlp_norm"):
        Engine(load_pretrained(checkpoints[name][0]), block_size=4, num_blocks=8)


def test_gemma3_config_as_the_hub_writes_it(checkpoints, tmp_path):
    """The hub's Gemma 3 configs predate rope_parameters per layer kind and layer_types:
    rope_theta, rope_scaling and rope_local_base_freq, and a sliding_window_pattern."""
    folder = _copy(checkpoints, "gemma3", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config["rope_parameters"], config["layer_types"]
    config.update(rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 2.0},
                  rope_local_base_freq=1e4, sliding_window_pattern=3)   # local, local, global
    (folder / "config.json").write_text(json.dumps(config))
    idx = prompts()
    ours = course_logits(load_pretrained(folder), idx)
    assert (ours - reference_logits(checkpoints["gemma3"][1], idx)).abs().max() <= ATOL


def test_swish_is_silu(checkpoints, tmp_path):
    folder = _copy(checkpoints, "llama", tmp_path)
    _edit_config(folder, hidden_act="swish")
    idx = prompts()
    ours = course_logits(load_pretrained(folder), idx)
    assert (ours - reference_logits(checkpoints["llama"][1], idx)).abs().max() <= ATOL


def test_gpt2_with_its_own_lm_head_loads_it(tmp_path):
    hf_model = save_random_checkpoint(tmp_path, "gpt2", seed=12, tie_word_embeddings=False)
    model = load_pretrained(tmp_path)
    assert model.lm_head.weight is not model.token_embedding.weight
    idx = prompts()
    assert (course_logits(model, idx) - reference_logits(hf_model, idx)).abs().max() <= ATOL


def test_a_stray_safetensors_file_is_ignored_as_transformers_does(checkpoints, tmp_path):
    """transformers reads model.safetensors (or the index's shards), nothing else; a folder
    with weights under another name is refused naming the file."""
    folder = _copy(checkpoints, "llama", tmp_path)
    save_file({"lora_A.weight": torch.zeros(2, 2)}, folder / "adapter.safetensors")
    idx = prompts()
    ours = course_logits(load_pretrained(folder), idx)
    assert (ours - reference_logits(checkpoints["llama"][1], idx)).abs().max() <= ATOL
    (folder / "model.safetensors").rename(folder / "weights.safetensors")
    message = _load_error(folder)
    assert "has adapter.safetensors, weights.safetensors but no model.safetensors" in message
    assert "rename the model's weights to model.safetensors" in message


def test_malformed_config_and_corrupt_weights_name_the_file(checkpoints, tmp_path):
    folder = _copy(checkpoints, "llama", tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])                   # a download cut short
    message = _load_error(folder)
    assert message.startswith(f"{weights} is not a readable safetensors file (")
    assert message.endswith("download it again")
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    message = _load_error(folder)
    assert message.startswith(f"{folder / 'config.json'} is not valid JSON (")


def test_dtype_by_name(checkpoints):
    folder = checkpoints["llama"][0]
    assert load_pretrained(folder, dtype="bfloat16").lm_head.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"^dtype must be a floating torch.dtype or its name "
                                         r"\(torch.bfloat16 or 'bfloat16'\), got 'int8'$"):
        load_pretrained(folder, dtype="int8")


def test_a_hub_id_loads_from_huggingface_hubs_cache_or_says_not_downloaded(
        checkpoints, tmp_path, monkeypatch):
    """Nothing is downloaded: a hub id is found in huggingface_hub's cache (its layout:
    models--owner--name/snapshots/<commit>, refs/main naming the commit), or refused."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    message = _load_error("someone/tiny-llama")
    assert "not downloaded" in message and "someone/tiny-llama" in message
    repo = tmp_path / "hub" / "models--someone--tiny-llama"
    commit = "0" * 40
    shutil.copytree(checkpoints["llama"][0], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    idx = prompts()
    ours = course_logits(load_pretrained("someone/tiny-llama"), idx)
    assert (ours - reference_logits(checkpoints["llama"][1], idx)).abs().max() <= ATOL


def test_missing_tensor_is_named(checkpoints, tmp_path):
    folder = _copy(checkpoints, "llama", tmp_path)
    _edit_tensors(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    assert "lacks tensor 'model.layers.1.mlp.up_proj.weight'" in _load_error(folder)


def test_unexpected_tensor_is_named(checkpoints, tmp_path):
    folder = _copy(checkpoints, "qwen3", tmp_path)
    _edit_tensors(folder, lambda t: t.update({"model.layers.0.self_attn.gate.weight":
                                              torch.zeros(4)}))
    assert ("has tensor 'model.layers.0.self_attn.gate.weight' in model.safetensors"
            in _load_error(folder))


def test_shape_mismatch_is_named(checkpoints, tmp_path):
    folder = _copy(checkpoints, "llama", tmp_path)
    _edit_config(folder, intermediate_size=80)
    message = _load_error(folder)
    assert "'model.layers.0.mlp.gate_proj.weight' has shape (96, 64)" in message
    assert "implies (80, 64)" in message


def test_gpt2_shape_mismatch_is_named(checkpoints, tmp_path):
    folder = _copy(checkpoints, "gpt2", tmp_path)
    _edit_config(folder, n_embd=32)
    assert "'transformer.h.0.attn.c_attn.weight' has shape (64, 192)" in _load_error(folder)


def test_not_a_checkpoint_folder(checkpoints, tmp_path):
    assert "no config.json" in _load_error(tmp_path)
    folder = _copy(checkpoints, "llama", tmp_path)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    message = _load_error(folder)
    assert "holds its weights in pytorch_model.bin, which the course does not read" in message
    assert "AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder)" in message
    _edit_config(folder, num_attention_heads=None)
    del_config = json.loads((folder / "config.json").read_text())
    del del_config["num_attention_heads"]
    (folder / "config.json").write_text(json.dumps(del_config))
    assert "config.json lacks 'num_attention_heads'" in _load_error(folder)


def test_import_does_not_load_transformers():
    """transformers takes seconds to import: the package leaves it to the functions that need
    it."""
    code = "import sys, course_attn; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

"""The table of published configurations: well formed, and consistent with the arithmetic the
chapters do with it (a typo in a figure breaks one of these identities)."""

import math

import pytest

from course_attn import published
from course_attn.published import FACTS, config, value


def test_every_fact_names_its_source_once():
    keys = [(f.model, f.field) for f in FACTS]
    assert len(keys) == len(set(keys)), "a (model, field) appears twice"
    for fact in FACTS:
        assert fact.source.strip(), fact
        assert ("config.json" in fact.source or "section" in fact.source
                or "table" in fact.source), f"{fact}: name the section, table or config file"


def test_lookups_refuse_what_the_table_does_not_hold():
    with pytest.raises(KeyError, match="no published configuration"):
        config("GPT-5")
    with pytest.raises(KeyError, match="has no 'window'"):
        value("Llama 3 8B", "window")
    assert "table 1" in published.source("Mistral 7B", "sliding_window")


@pytest.mark.parametrize("model", ["Llama 2 7B", "Llama 3 8B", "Mistral 7B"])
def test_head_size_is_hidden_over_heads(model):
    c = config(model)
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    assert head_dim * c["num_attention_heads"] == c["hidden_size"] and head_dim == 128
    assert c.get("head_dim", head_dim) == head_dim


def test_falcon_heads_are_64_wide():
    c = config("Falcon-7B")
    assert c["hidden_size"] == 64 * c["n_head"] and c["multi_query"]


def test_gpt2_small_heads_and_parameter_count():
    c = config("GPT-2 small")
    width = c["n_embd"]
    assert width == 64 * c["n_head"]
    # tied embeddings; per layer: c_attn (3C² + 3C), c_proj (C² + C), MLP (8C² + 5C), 2 LayerNorms
    per_layer = 4 * width**2 + 4 * width + 8 * width**2 + 5 * width + 4 * width
    total = (c["n_layer"] * per_layer + c["vocab_size"] * width + c["n_positions"] * width
             + 2 * width)
    assert round(total / 1e6) == 124                                   # "GPT-2 124M"


def test_llama_parameter_counts_match_their_names():
    for model, lo, hi in [("Llama 2 7B", 6.5e9, 7.0e9), ("Llama 3 8B", 8.0e9, 8.1e9)]:
        c = config(model)
        C, H, Hkv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        D = C // H
        attention = 2 * C * H * D + 2 * C * Hkv * D
        mlp = 3 * C * c["intermediate_size"]
        params = 2 * c["vocab_size"] * C + c["num_hidden_layers"] * (attention + mlp + 2 * C) + C
        assert lo < params < hi, (model, params)


def test_kv_cache_ratios_the_chapters_print():
    def per_token(model):
        c = config(model)
        layers = c.get("num_hidden_layers", c.get("n_layer"))
        kv_heads = 1 if c.get("multi_query") else c["num_key_value_heads"]
        heads = c.get("num_attention_heads", c.get("n_head"))
        return 2 * layers * kv_heads * (c["hidden_size"] // heads)

    assert per_token("Llama 2 7B") == 4 * per_token("Llama 3 8B") == 4 * per_token("Mistral 7B")
    assert per_token("Llama 2 7B") == 64 * per_token("Falcon-7B")
    ds = config("DeepSeek-V2")
    # DeepSeek-V2, section 2.1.4 (table 1): the cache of GQA with 2.25 groups, d_c + d_h^R = 4.5 d_h
    assert ds["kv_lora_rank"] + ds["qk_rope_head_dim"] == 4.5 * ds["qk_nope_head_dim"]


def test_context_extensions():
    # Llama 3.1 rescales the frequencies of Llama 3 (trained at 8K) and serves 128K: the factor
    # alone would stretch 8K to 64K, so the rescaling is not the whole story (it was trained on)
    c = config("Llama 3.1 8B")
    assert c["rope_scaling.original_max_position_embeddings"] == value(
        "Llama 3 8B", "max_position_embeddings")
    assert c["rope_scaling.factor"] * c["rope_scaling.original_max_position_embeddings"] == \
        c["max_position_embeddings"] // 2
    assert c["rope_theta"] == value("Llama 3 8B", "rope_theta")
    # Mistral's paper: with W = 4096 and 32 layers the span is about 131K tokens (section 2)
    span = value("Mistral 7B", "sliding_window") * value("Mistral 7B", "num_hidden_layers")
    assert math.isclose(span, 131_000, rel_tol=0.01)
    # Gemma: local windows fit inside the context they serve
    for model in ["Gemma 2", "Gemma 3"]:
        context = config(model).get("max_position_embeddings") or value(model, "context_length")
        assert value(model, "sliding_window") < context


def test_gqa_uptraining_is_a_small_fraction():
    # Ainslie et al. uptrain a converted checkpoint for a fraction alpha of its pre-training
    assert 0 < value("GQA", "uptraining_fraction") < 0.1


def test_vllm_shares_are_fractions_and_paging_beats_the_best_earlier_system():
    # Kwon et al.: earlier systems kept 20.4%-38.2% of KV memory for tokens, vLLM wastes < 4%
    low = value("vLLM", "existing_systems_token_share_low")
    high = value("vLLM", "existing_systems_token_share_high")
    waste = value("vLLM", "paged_waste_below")
    assert 0 < low < high < 1 - waste < 1
    assert f"{low:.1%}" in published.source("vLLM", "paged_waste_below")
    assert f"{high:.1%}" in published.source("vLLM", "paged_waste_below")


@pytest.mark.parametrize("gpu", ["H100 SXM", "H200 SXM"])
def test_a_gpu_figure_is_the_one_its_source_prints(gpu):
    """The dense BF16 peak is a figure NVIDIA prints (the H100 whitepaper's 989.4), not half of
    the datasheet's rounded sparse 1,979 (989.5); the bandwidth is the datasheet's."""
    for field in ("bf16_dense_tflops", "hbm_bandwidth_tb_s"):
        figure = f"{value(gpu, field):g}"
        assert figure in published.source(gpu, field), (gpu, field, figure)
    assert value(gpu, "bf16_dense_tflops") != 1979 / 2


def test_serving_capacity_the_chapter_computes():
    # Llama 3 8B in bfloat16: 128 KiB of keys and values per token, 1 GiB for 8K tokens; its
    # weights (16 GB) fit on both GPUs with room for dozens of such sequences (chapter 12)
    c = config("Llama 3 8B")
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    per_token = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2
    assert per_token == 128 * 1024
    assert per_token * c["max_position_embeddings"] == 2**30
    for gpu, lo, hi in [("H100 SXM", 55, 65), ("H200 SXM", 110, 125)]:
        free = value(gpu, "memory_gb") * 1e9 - 8.03e9 * 2
        assert lo < free / 2**30 < hi, gpu
        assert value(gpu, "pcie_gb_s_both_ways") == 128

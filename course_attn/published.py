"""Published models' configurations: every real-model figure the book quotes, in one table.

GPUs are rows too (their datasheet peak and memory bandwidth), so that a roofline reads them
from here (``course_attn.roofline``).

Each row is one fact: (model, field, value, source). The source names where the figure is
published: a paper's section or table, or the model's ``config.json`` on the Hugging Face Hub.
The chapters read these values instead of typing them (``published.value("Llama 3 8B",
"num_key_value_heads")``), and ``tests/test_published.py`` checks the table against the
arithmetic that uses it (head sizes, parameter counts, cache ratios).

Field names follow the Hugging Face ``config.json`` of the model where it has one; a figure
that only a paper gives has the paper's name for it.

    >>> value("Llama 3 8B", "rope_theta")
    500000.0
    >>> config("Falcon-7B")["n_head"]
    71
"""

from typing import NamedTuple

__all__ = ["Fact", "FACTS", "config", "models", "source", "value"]


class Fact(NamedTuple):
    model: str
    field: str
    value: object
    source: str


_LLAMA2 = "meta-llama/Llama-2-7b-hf config.json; Touvron et al. 2023, table 1"
_LLAMA3 = "meta-llama/Meta-Llama-3-8B config.json; Grattafiori et al. 2024, table 3"
_LLAMA31 = "meta-llama/Llama-3.1-8B config.json (rope_scaling); Grattafiori et al. 2024"
_MISTRAL = "Jiang et al. 2023, table 1; mistralai/Mistral-7B-v0.1 config.json"
_FALCON = "tiiuae/falcon-7b config.json; Almazrouei et al. 2023"
_DEEPSEEK = "deepseek-ai/DeepSeek-V2 config.json; DeepSeek-AI 2024, section 3.1.2"
_GEMMA2 = "google/gemma-2-9b config.json; Gemma Team 2024 (Gemma 2), table 1 and section 2"
_GEMMA3 = "Gemma Team 2025 (Gemma 3), section 2; google/gemma-3-4b-pt config.json"
_STREAMING = "Xiao et al. 2024 (StreamingLLM), section 3.3"
_GPT2 = "openai-community/gpt2 config.json"
_GQA = "Ainslie et al. 2023 (GQA), section 3.1 (uptraining: alpha = 0.05 of pre-training steps)"
# NVIDIA's datasheets give the tensor-core figures "with sparsity" (2:4 structured), rounded:
# 1,979 TFLOPS in BF16. The dense peak, the most that ordinary matmuls can reach, is the
# architecture whitepaper's figure, 989.4 TFLOP/s (1,978.9 with sparsity): half of the unrounded
# sparse figure, not of the datasheet's 1,979 (which would give 989.5).
_H100 = ("NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022), table of H100 SXM5 "
         "specifications: Peak BF16 Tensor TFLOPS with FP32 Accumulate 989.4 (1,978.9 with "
         "sparsity); NVIDIA H100 Tensor Core GPU datasheet, specifications table, H100 SXM "
         "column: GPU memory bandwidth 3.35 TB/s")
# Figure 2 of the paper (from the experiment of its section 6.2) draws each system's KV-cache
# memory as token states, reservation and fragmentation; section 1 quotes the token states' share.
_VLLM = ("Kwon et al. 2023 (PagedAttention, SOSP 2023), section 1 and figure 2: existing systems "
         "used 20.4%-38.2% of their KV-cache memory for token states; vLLM wastes under 4%")
# The H200 SXM has the H100 SXM's chip and tensor cores (the datasheet's BF16 figure is the same
# 1,979 with sparsity) and faster memory: the dense peak is the H100 whitepaper's 989.4.
_H200 = ("NVIDIA H200 Tensor Core GPU datasheet, specifications table, H200 SXM column "
         "(BF16 Tensor Core 1,979 TFLOPS with sparsity, as the H100 SXM's, whose dense figure "
         "is 989.4 in the H100 whitepaper's table; GPU memory bandwidth 4.8 TB/s)")

# Memory and the host link, from the same datasheets' specifications tables. PCIe Gen5 x16 is
# 128 GB/s counting both directions: a copy one way (a swap out, or in) has half of it.
_H100_MEMORY = ("NVIDIA H100 Tensor Core GPU datasheet, specifications table, H100 SXM column: "
                "GPU memory 80GB; interconnect PCIe Gen5: 128GB/s")
_H200_MEMORY = ("NVIDIA H200 Tensor Core GPU datasheet, specifications table, H200 SXM column: "
                "GPU memory 141GB; interconnect PCIe Gen5: 128GB/s")

FACTS: tuple[Fact, ...] = (
    # Llama 2 7B: multi-head attention, RoPE at base 10000
    Fact("Llama 2 7B", "hidden_size", 4096, _LLAMA2),
    Fact("Llama 2 7B", "num_attention_heads", 32, _LLAMA2),
    Fact("Llama 2 7B", "num_key_value_heads", 32, _LLAMA2),
    Fact("Llama 2 7B", "num_hidden_layers", 32, _LLAMA2),
    Fact("Llama 2 7B", "intermediate_size", 11008, _LLAMA2),
    Fact("Llama 2 7B", "vocab_size", 32000, _LLAMA2),
    Fact("Llama 2 7B", "max_position_embeddings", 4096, _LLAMA2),
    Fact("Llama 2 7B", "rope_theta", 10000.0, _LLAMA2),
    # Llama 3 8B: grouped-query attention with 8 KV heads, RoPE at base 500000
    Fact("Llama 3 8B", "hidden_size", 4096, _LLAMA3),
    Fact("Llama 3 8B", "num_attention_heads", 32, _LLAMA3),
    Fact("Llama 3 8B", "num_key_value_heads", 8, _LLAMA3),
    Fact("Llama 3 8B", "num_hidden_layers", 32, _LLAMA3),
    Fact("Llama 3 8B", "intermediate_size", 14336, _LLAMA3),
    Fact("Llama 3 8B", "vocab_size", 128256, _LLAMA3),
    Fact("Llama 3 8B", "max_position_embeddings", 8192, _LLAMA3),
    Fact("Llama 3 8B", "rope_theta", 500000.0, _LLAMA3),
    Fact("Llama 3 8B", "tie_word_embeddings", False, _LLAMA3),
    # Llama 3.1 8B: Llama 3 8B's shape, stretched from 8K to 128K by a frequency rescaling
    Fact("Llama 3.1 8B", "rope_theta", 500000.0, _LLAMA31),
    Fact("Llama 3.1 8B", "max_position_embeddings", 131072, _LLAMA31),
    Fact("Llama 3.1 8B", "rope_scaling.factor", 8.0, _LLAMA31),
    Fact("Llama 3.1 8B", "rope_scaling.low_freq_factor", 1.0, _LLAMA31),
    Fact("Llama 3.1 8B", "rope_scaling.high_freq_factor", 4.0, _LLAMA31),
    Fact("Llama 3.1 8B", "rope_scaling.original_max_position_embeddings", 8192, _LLAMA31),
    # Mistral 7B: GQA, and a sliding window in every layer
    Fact("Mistral 7B", "hidden_size", 4096, _MISTRAL),
    Fact("Mistral 7B", "num_attention_heads", 32, _MISTRAL),
    Fact("Mistral 7B", "num_key_value_heads", 8, _MISTRAL),
    Fact("Mistral 7B", "num_hidden_layers", 32, _MISTRAL),
    Fact("Mistral 7B", "head_dim", 128, _MISTRAL),
    Fact("Mistral 7B", "sliding_window", 4096, _MISTRAL),
    Fact("Mistral 7B", "context_len", 8192, _MISTRAL),
    # Falcon-7B: multi-query attention (one KV head), 71 query heads of 64
    Fact("Falcon-7B", "hidden_size", 4544, _FALCON),
    Fact("Falcon-7B", "n_head", 71, _FALCON),
    Fact("Falcon-7B", "n_layer", 32, _FALCON),
    Fact("Falcon-7B", "multi_query", True, _FALCON),
    # GQA's recipe: a multi-head checkpoint mean-pooled to fewer KV heads, then uptrained
    Fact("GQA", "uptraining_fraction", 0.05, _GQA),
    # DeepSeek-V2: multi-head latent attention
    Fact("DeepSeek-V2", "num_hidden_layers", 60, _DEEPSEEK),
    Fact("DeepSeek-V2", "num_attention_heads", 128, _DEEPSEEK),
    Fact("DeepSeek-V2", "qk_nope_head_dim", 128, _DEEPSEEK),
    Fact("DeepSeek-V2", "v_head_dim", 128, _DEEPSEEK),
    Fact("DeepSeek-V2", "kv_lora_rank", 512, _DEEPSEEK),
    Fact("DeepSeek-V2", "qk_rope_head_dim", 64, _DEEPSEEK),
    # Gemma 2 9B: soft-capped logits, head size 256, local layers alternating with global ones
    Fact("Gemma 2", "head_dim", 256, _GEMMA2),
    Fact("Gemma 2", "attn_logit_softcapping", 50.0, _GEMMA2),
    Fact("Gemma 2", "final_logit_softcapping", 30.0, _GEMMA2),
    Fact("Gemma 2", "sliding_window", 4096, _GEMMA2),
    Fact("Gemma 2", "local_layers_per_global", 1, _GEMMA2),
    Fact("Gemma 2", "max_position_embeddings", 8192, _GEMMA2),
    # Gemma 3: QK-norm instead of soft-capping, five local layers for each global one
    Fact("Gemma 3", "sliding_window", 1024, _GEMMA3),
    Fact("Gemma 3", "local_layers_per_global", 5, _GEMMA3),
    Fact("Gemma 3", "context_length", 131072, _GEMMA3),
    Fact("Gemma 3 1B", "context_length", 32768, _GEMMA3),
    # StreamingLLM: the attention sinks kept at the start of the cache
    Fact("StreamingLLM", "sink_tokens", 4, _STREAMING),
    # GPT-2 small (124M): multi-head attention, 12 heads of 64, learned positions up to 1024
    Fact("GPT-2 small", "n_embd", 768, _GPT2),
    Fact("GPT-2 small", "n_head", 12, _GPT2),
    Fact("GPT-2 small", "n_layer", 12, _GPT2),
    Fact("GPT-2 small", "n_positions", 1024, _GPT2),
    Fact("GPT-2 small", "vocab_size", 50257, _GPT2),
    # vLLM: the share of KV-cache memory that holds tokens, before and with paging
    Fact("vLLM", "existing_systems_token_share_low", 0.204, _VLLM),
    Fact("vLLM", "existing_systems_token_share_high", 0.382, _VLLM),
    Fact("vLLM", "paged_waste_below", 0.04, _VLLM),
    # GPUs: dense BF16 tensor-core peak and HBM bandwidth, the two ends of a roofline
    Fact("H100 SXM", "bf16_dense_tflops", 989.4, _H100),
    Fact("H100 SXM", "hbm_bandwidth_tb_s", 3.35, _H100),
    Fact("H200 SXM", "bf16_dense_tflops", 989.4, _H200),
    Fact("H200 SXM", "hbm_bandwidth_tb_s", 4.8, _H200),
    # GPUs: memory (decimal GB, as the datasheets give it) and the PCIe link to the host
    Fact("H100 SXM", "memory_gb", 80, _H100_MEMORY),
    Fact("H100 SXM", "pcie_gb_s_both_ways", 128, _H100_MEMORY),
    Fact("H200 SXM", "memory_gb", 141, _H200_MEMORY),
    Fact("H200 SXM", "pcie_gb_s_both_ways", 128, _H200_MEMORY),
)


def models() -> list[str]:
    """The models of the table, in the order they first appear."""
    return list(dict.fromkeys(fact.model for fact in FACTS))


def config(model: str) -> dict:
    """Every field the table holds for ``model``, as {field: value}."""
    found = {fact.field: fact.value for fact in FACTS if fact.model == model}
    if not found:
        raise KeyError(f"no published configuration for {model!r}; the table has {models()}")
    return found


def value(model: str, field: str):
    """One published figure, e.g. ``value("Gemma 2", "final_logit_softcapping")`` is 30.0."""
    fields = config(model)
    if field not in fields:
        raise KeyError(f"the table has no {field!r} for {model!r}; it has {sorted(fields)}")
    return fields[field]


def source(model: str, field: str) -> str:
    """Where ``value(model, field)`` is published."""
    value(model, field)
    return next(f.source for f in FACTS if f.model == model and f.field == field)

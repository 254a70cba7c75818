"""course_attn: the companion package of "Attention, from scratch to flash"."""

from .attention import attention_weights, repeat_kv, scaled_dot_product_attention, softmax
from .backends import BACKENDS, get_backend, register
from .checkpoints import load_pretrained
from .device import available_devices, default_device, seed_everything
from .flash import flash_attention, merge_attention_states, online_softmax
from .kv_cache import KVCache, RollingKVCache
from .linear import linear_attention
from .local import local_attention
from .mla import MultiHeadLatentAttention
from .model import generate
from .multihead import MultiHeadAttention
from .norm import RMSNorm, rms_norm
from .paged import PagedKVCache, paged_attention
from .rope import RotaryEmbedding, apply_rotary_emb
from .serve import Engine
from .masks import (
    attention_mask, causal_mask, combine_masks, padding_mask, sliding_window_mask, to_additive,
)

__version__ = "0.1.0"

__all__ = [
    "BACKENDS", "KVCache", "MultiHeadAttention", "MultiHeadLatentAttention", "RMSNorm",
    "Engine", "PagedKVCache", "paged_attention",
    "RollingKVCache", "RotaryEmbedding", "apply_rotary_emb", "attention_mask", "attention_weights",
    "available_devices", "causal_mask", "combine_masks", "default_device", "flash_attention",
    "generate", "get_backend", "linear_attention", "load_pretrained", "local_attention",
    "merge_attention_states",
    "online_softmax", "padding_mask", "register", "repeat_kv", "rms_norm",
    "scaled_dot_product_attention", "seed_everything", "sliding_window_mask", "softmax",
    "to_additive",
]

"""Real checkpoints in the course's own modules: ``load_pretrained(folder)``.

A Hugging Face checkpoint folder holds ``config.json`` (the sizes and options) and the weights in
``*.safetensors`` (one file, or shards listed by ``model.safetensors.index.json``). The loader reads
both and builds the course's ``GPT`` (``model.py``) with its blocks made of the course's modules:

    architecture   attention (MultiHeadAttention)              norm      MLP       positions
    Llama          GQA, RoPE (half-split), Llama 3.1 scaling   RMSNorm   SwiGLU    rotary
    Mistral        the same, plus a sliding ``window``         RMSNorm   SwiGLU    rotary
    Qwen2          GQA, RoPE, biases on q, k, v (not o)        RMSNorm   SwiGLU    rotary
    Qwen3          GQA, RoPE, per-head QK-norm, head_dim       RMSNorm   SwiGLU    rotary
    Phi-3          fused qkv, optional sliding ``window``      RMSNorm   SwiGLU,   rotary
                                                                         fused gate-up
    OLMo 2         GQA, RoPE, QK-norm over all heads at once   RMSNorm   SwiGLU    rotary
                   (``NormedProjection``); norms after attention and MLP (``PostNormBlock``)
    Gemma 3        GQA, QK-norm, local (window) and global     RMSNorm   GeGLU     rotary,
                   layers with a RoPE table each, scores       (1 + w),            two bases
                   scaled by query_pre_attn_scalar^-1/2,       before
                   embeddings scaled by sqrt(C)                and after
    GPT-2          biases, fused qkv in Conv1D layout          LayerNorm GELU-tanh learned

so ``model(idx)``, its KV caches and ``generate`` are the ones the chapters built. Each tensor of
the checkpoint is renamed (and, where the layouts differ, cut or transposed) into the course's
names; a missing tensor, an unexpected one, a wrong shape, an unknown architecture or a config
option the course does not implement is a ``CheckpointError`` (a ``ValueError``) of one line that
names it, never a silently different model.

RoPE's layout: Hugging Face's Llama pairs channel i with i + D/2 of each head (half-split, the
course's default); Meta's original weights pair 2i with 2i + 1 (interleaved), and Hugging Face's
conversion script permuted the rows of Wq and Wk to move from one to the other.
``rope_layout="interleaved"`` undoes that permutation (``interleave_rows``) and rotates
interleaved pairs: the same model, the same logits.

transformers is not imported here: safetensors reads the tensors (memory-mapped, handed to a
model built on the meta device: the weights are held once), ``json`` the config and
``generation_config.json`` (the end and pad tokens ``generate`` reads, the sampling settings it
keeps on the model), huggingface_hub finds a
hub id in its cache. Past max_position_embeddings a RoPE model generates on, as transformers';
config keys that would change the maths of the architecture named are refused by name.
"""

import dataclasses
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .model import GPT, Block, GenerationConfig, check_sampling
from .multihead import MultiHeadAttention
from .norm import RMSNorm, rms_norm
from .rope import RotaryEmbedding

__all__ = ["ARCHITECTURES", "Agreement", "CheckpointConfig", "CheckpointError",
           "CheckpointGenerationConfig", "PretrainedGPT", "checkpoint_folder",
           "compare_with_transformers", "interleave_rows", "load_pretrained", "read_config",
           "read_generation_config", "read_tensors", "save_random_checkpoint"]

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "Phi3ForCausalLM": "phi3", "Olmo2ForCausalLM": "olmo2",
                 "Gemma3ForCausalLM": "gemma3", "GPT2LMHeadModel": "gpt2"}
ARCHITECTURE_OF_MODEL_TYPE = {"gemma3_text": "gemma3"}   # where config.json's model_type
                                                        # is not the course's name
ROPE_SCALINGS = ("default", "linear", "llama3")          # rope_type values the course implements
GATED_ACTIVATIONS = ("silu", "swish")                   # two names of one function
# positions whose cos and sin are tabulated; later ones (up to max_position_embeddings, 128K for
# Llama 3.1) are computed when met, so that the table is not hundreds of MB
ROPE_TABLE = 4096
GPT2_ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}


# config.json keys that change a model's maths, with the value at which they change nothing:
# architectures the course does not load (Granite's multipliers, SmolLM3's and Llama 4's layers
# without RoPE, Gemma's soft-capping, Cohere's logit scale, GPT-NeoX's parallel residual, ...),
# which a checkpoint relabelled as Llama or Qwen3 would carry, read by nobody
MATHS_KEYS = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0,
              "attention_multiplier": None, "logits_scaling": 1.0, "logit_scale": 1.0,
              "final_logit_softcapping": None, "attn_logit_softcapping": None,
              "query_pre_attn_scalar": None, "no_rope_layer_interval": None,
              "attn_temperature_tuning": False, "use_qk_norm": False, "qk_layernorm": False,
              "use_parallel_residual": False, "parallel_attn": False, "alibi": False,
              "rotary_pct": 1.0, "layer_norm_type": None, "clip_qkv": None,
              "use_bidirectional_attention": False}
# the files a checkpoint's weights may come in, besides *.safetensors: read by torch.load only
PICKLED = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")


class CheckpointError(ValueError):
    """A checkpoint the course cannot load as it is: the message says what and where."""


@dataclass(frozen=True)
class CheckpointConfig:
    """What ``config.json`` says, in the course's words. C = d_model, H = n_heads, D = head_dim.

    ``seq_len`` (max_position_embeddings) and ``position`` ("rope" or "learned") and ``window``
    are the fields ``GPT.forward`` and ``generate`` read, as in ``GPTConfig``."""

    architecture: str               # a value of ARCHITECTURES
    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp_hidden: int
    position: str                   # "rope" or "learned"
    norm: str                       # "rms", "layer" or "gemma" (RMSNorm by 1 + w)
    norm_eps: float
    attention_bias: bool = False    # on q, k and v
    output_bias: bool = False       # on the output projection
    mlp_bias: bool = False
    gelu_approximate: str | None = None   # GPT-2's MLP; None: SwiGLU
    rope_base: float = 10000.0
    rope_scaling: tuple = ()        # scaled_rope_frequencies' keyword arguments, as pairs
    qk_norm: bool = False           # per head (Qwen3)
    qk_norm_projection: bool = False  # over the whole projection, every head at once (OLMo 2)
    norm_after: bool = False        # x + norm(attn(x)), x + norm(mlp(x)) (OLMo 2)
    norm_before_and_after: bool = False   # x + norm(attn(norm(x))), ... (Gemma 3)
    sliding_layers: tuple = ()      # per layer, whether it has the window (): all of them
    local_rope_base: float | None = None  # the RoPE base of the windowed layers, when their own
    attention_scale: float | None = None  # the scores' factor; None: 1/sqrt(head_dim)
    embedding_scale: float = 1.0    # the token embedding's factor (Gemma: sqrt(C))
    gated_activation: str = "silu"  # the gate's function in SwiGLU ("gelu_tanh": GeGLU)
    window: int | None = None
    scale_by_sqrt_d: bool = True    # scores / sqrt(D); GPT-2's scale_attn_weights may say no
    scale_by_layer: bool = False    # and / (layer + 1): its scale_attn_by_inverse_layer_idx
    tie_embeddings: bool = False


def _unsupported(option: str, value, architecture: str) -> CheckpointError:
    return CheckpointError(f"config.json sets {option}={value!r}, which the course's "
                           f"{architecture} does not implement")


def _rope_options(raw: dict, architecture: str) -> tuple[float, tuple]:
    """(base, scaling) from ``rope_parameters`` (transformers 5) or ``rope_theta`` and
    ``rope_scaling`` (older config files, as most checkpoints on the hub have them)."""
    params = raw.get("rope_parameters") or {**(raw.get("rope_scaling") or {}),
                                              "rope_theta": raw.get("rope_theta", 10000.0)}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_SCALINGS:
        raise CheckpointError(f"config.json asks for rope_scaling type {kind!r}; the course "
                              f"implements {sorted(ROPE_SCALINGS)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise _unsupported("partial_rotary_factor", params["partial_rotary_factor"], architecture)
    scaling = ()
    if kind == "linear":
        scaling = (("kind", "linear"), ("factor", float(params["factor"])))
    elif kind == "llama3":
        scaling = (("kind", "llama3"), ("factor", float(params["factor"])),
                   ("original_max_len", int(params["original_max_position_embeddings"])),
                   ("low_freq_factor", float(params["low_freq_factor"])),
                   ("high_freq_factor", float(params["high_freq_factor"])))
    return float(params["rope_theta"]), scaling


def _architecture(raw: dict) -> str:
    model_type = ARCHITECTURE_OF_MODEL_TYPE.get(raw.get("model_type"), raw.get("model_type"))
    if not raw.get("architectures") and model_type in ARCHITECTURES.values():
        return model_type
    names = raw.get("architectures") or [raw.get("model_type")]
    if len(names) != 1 or names[0] not in ARCHITECTURES:
        raise CheckpointError(f"config.json names architecture {', '.join(map(str, names))}; "
                              f"the course loads {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[names[0]]


def _check_maths_keys(raw: dict, architecture: str) -> None:
    """CheckpointError naming the first key of config.json that changes the maths in a way the
    course's ``architecture`` does not implement."""
    for key, neutral in MATHS_KEYS.items():
        if architecture == "gemma3" and key == "query_pre_attn_scalar":
            continue                      # the course's Gemma 3 reads it
        if raw.get(key, neutral) != neutral:
            raise _unsupported(key, raw[key], architecture)
    if not all(raw.get("no_rope_layers") or [1]):
        raise _unsupported("no_rope_layers", raw["no_rope_layers"], architecture)
    if architecture in ("llama", "gpt2") and raw.get("sliding_window") is not None:
        raise _unsupported("sliding_window", raw["sliding_window"], architecture)


def _gpt2_config(raw: dict) -> CheckpointConfig:
    for option in ("add_cross_attention", "reorder_and_upcast_attn"):
        if raw.get(option):
            raise _unsupported(option, raw[option], "GPT-2")
    activation = raw.get("activation_function", "gelu_new")
    if activation not in GPT2_ACTIVATIONS:
        raise _unsupported("activation_function", activation, "GPT-2")
    c, h = raw["n_embd"], raw["n_head"]
    return CheckpointConfig(
        "gpt2", vocab_size=raw["vocab_size"], seq_len=raw["n_positions"], d_model=c,
        n_layers=raw["n_layer"], n_heads=h, n_kv_heads=h, head_dim=c // h,
        mlp_hidden=raw.get("n_inner") or 4 * c, position="learned", norm="layer",
        norm_eps=raw.get("layer_norm_epsilon", 1e-5), attention_bias=True, output_bias=True,
        mlp_bias=True,
        gelu_approximate=GPT2_ACTIVATIONS[activation],
        scale_by_sqrt_d=bool(raw.get("scale_attn_weights", True)),
        scale_by_layer=bool(raw.get("scale_attn_by_inverse_layer_idx", False)),
        tie_embeddings=raw.get("tie_word_embeddings", True))


def _gemma3_config(raw: dict) -> CheckpointConfig:
    activation = raw.get("hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise _unsupported("hidden_activation", activation, "Gemma 3")
    n = raw["num_hidden_layers"]
    pattern = raw.get("sliding_window_pattern", 6)
    kinds = raw.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else
                                       "full_attention" for i in range(n)]
    if len(kinds) != n or set(kinds) - {"sliding_attention", "full_attention"}:
        raise _unsupported("layer_types", kinds, "Gemma 3")
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params:                        # transformers 5: one per kind
        base, scaling = _rope_options({"rope_parameters": params["full_attention"]}, "Gemma 3")
        local, local_scaling = _rope_options({"rope_parameters": params["sliding_attention"]},
                                             "Gemma 3")
    else:                                                 # the hub's: the global layers', and
        base, scaling = _rope_options({"rope_theta": 1e6, **raw}, "Gemma 3")   # a local base
        local, local_scaling = float(raw.get("rope_local_base_freq", 1e4)), ()
    if local_scaling:
        raise _unsupported("rope_parameters['sliding_attention']", params["sliding_attention"],
                           "Gemma 3")
    config = _rotary_config({**raw, "hidden_act": "silu", "rope_parameters": None,
                             "rope_theta": base, "rope_scaling": None,
                             "head_dim": raw.get("head_dim", 256)}, "gemma3")
    return dataclasses.replace(
        config, norm="gemma", rope_scaling=scaling, qk_norm=True, norm_before_and_after=True,
        window=raw.get("sliding_window"),
        sliding_layers=tuple(kind == "sliding_attention" for kind in kinds),
        local_rope_base=local, attention_scale=raw.get("query_pre_attn_scalar", 256) ** -0.5,
        embedding_scale=config.d_model ** 0.5, gated_activation="gelu_tanh",
        tie_embeddings=raw.get("tie_word_embeddings", True))


def _rotary_config(raw: dict, architecture: str) -> CheckpointConfig:
    activation = raw.get("hidden_act", "silu")
    if activation not in GATED_ACTIVATIONS:
        raise _unsupported("hidden_act", activation, architecture)
    window = None
    if architecture in ("mistral", "phi3"):
        window = raw.get("sliding_window")
    elif architecture in ("qwen2", "qwen3") and (raw.get("use_sliding_window") or any(
            kind != "full_attention" for kind in raw.get("layer_types") or [])):
        raise _unsupported("use_sliding_window", True, architecture)
    c, h = raw["hidden_size"], raw["num_attention_heads"]
    base, scaling = _rope_options(raw, architecture)
    return CheckpointConfig(
        architecture, vocab_size=raw["vocab_size"], seq_len=raw["max_position_embeddings"],
        d_model=c, n_layers=raw["num_hidden_layers"], n_heads=h,
        n_kv_heads=raw.get("num_key_value_heads") or h, head_dim=raw.get("head_dim") or c // h,
        mlp_hidden=raw["intermediate_size"], position="rope", norm="rms",
        norm_eps=raw.get("rms_norm_eps", 1e-6),
        attention_bias=architecture == "qwen2" or raw.get("attention_bias", False),
        output_bias=architecture != "qwen2" and raw.get("attention_bias", False),
        mlp_bias=raw.get("mlp_bias", False), rope_base=base, rope_scaling=scaling,
        qk_norm=architecture == "qwen3", qk_norm_projection=architecture == "olmo2",
        norm_after=architecture == "olmo2", window=window,
        tie_embeddings=raw.get("tie_word_embeddings", False))


def _read_json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON ({str(error).splitlines()[0]}): "
                              "restore it from the checkpoint's source") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} holds a {type(raw).__name__}, not a JSON object")
    return raw


def read_config(folder) -> CheckpointConfig:
    """The ``CheckpointConfig`` of the checkpoint in ``folder`` (its ``config.json``)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json: not a Hugging Face checkpoint folder")
    raw = _read_json(path)
    architecture = _architecture(raw)
    _check_maths_keys(raw, architecture)
    try:
        if architecture == "gemma3":
            return _gemma3_config(raw)
        return _gpt2_config(raw) if architecture == "gpt2" else _rotary_config(raw, architecture)
    except KeyError as missing:
        raise CheckpointError(f"config.json lacks {missing.args[0]!r}, which a {architecture} "
                              "needs") from None


def _special_ids(raw: dict, key: str, path: Path) -> tuple[int, ...]:
    value = raw.get(key)
    ids = () if value is None else (value,) if isinstance(value, int) else value
    if not isinstance(ids, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(f"{path} sets {key}={value!r}: expected a token id or a list")
    return tuple(ids)


# transformers' values for the sampling settings a generation_config.json leaves out (or null)
SAMPLING_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}


@dataclass(frozen=True)
class CheckpointGenerationConfig(GenerationConfig):
    """A checkpoint's ``GenerationConfig``: the end and pad tokens, which ``generate`` reads, and
    the sampling settings that transformers' ``generate`` uses when not told, which the course's
    ``generate`` does not read: ``do_sample`` (a checkpoint that samples by default says True),
    ``temperature``, ``top_k`` (None: no top-k, transformers' 0) and ``top_p`` (1: none).
    Transformers' defaults (greedy, 1.0, 50, 1.0) where the file says nothing."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float = 1.0


def _sampling(raw: dict, path: Path) -> dict:
    """``SAMPLING_DEFAULTS``' settings as ``raw`` (read from ``path``) sets them, checked as
    ``generate`` checks its own: CheckpointError naming the file for a bad one."""
    values = {key: default if raw.get(key) is None else raw[key]
              for key, default in SAMPLING_DEFAULTS.items()}
    if values["top_k"] == 0 and not isinstance(values["top_k"], bool):
        values["top_k"] = None                           # transformers: 0 is no top-k
    # a greedy checkpoint that names a temperature for whoever samples is no caller's mistake:
    # check_sampling's warning about it is for calls of generate
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            check_sampling(values["do_sample"], values["temperature"], values["top_k"],
                           values["top_p"], seeded=False, greedy_note="", stacklevel=2)
        except ValueError as error:
            raise CheckpointError(f"{path}: {error}") from None
    return values


def read_generation_config(folder) -> CheckpointGenerationConfig:
    """The end and pad tokens ``generate`` uses, and the sampling settings (kept on the model,
    ``CheckpointGenerationConfig``): from ``generation_config.json`` when the folder has one,
    else from ``config.json`` (transformers reads them the same way)."""
    folder = Path(folder)
    path = folder / "generation_config.json"
    if not path.is_file():
        path = folder / "config.json"
    raw = _read_json(path)
    pad = _special_ids(raw, "pad_token_id", path)
    return CheckpointGenerationConfig(eos_token_id=_special_ids(raw, "eos_token_id", path),
                                      pad_token_id=pad[0] if pad else None,
                                      **_sampling(raw, path))


# ----------------------------------------------------------------- the model, course modules

class SwiGLU(nn.Module):
    """Llama's MLP: (B, T, C) -> (B, T, C), down(silu(gate(x)) · up(x)) through ``hidden``;
    ``activation="gelu_tanh"``: GELU's tanh approximation instead of SiLU (GeGLU, Gemma)."""

    def __init__(self, d_model: int, hidden: int, bias: bool = False,
                 activation: str = "silu"):
        super().__init__()
        self.activation = activation
        self.gate = nn.Linear(d_model, hidden, bias=bias)
        self.up = nn.Linear(d_model, hidden, bias=bias)
        self.down = nn.Linear(hidden, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        gate = self.gate(x)
        gate = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.down(gate * self.up(x))


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: (..., D) -> (..., D), the gains stored as w and applied as 1 + w (in
    float32), so that a gain of 1 is stored as 0."""

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, 1.0 + self.weight.float(), self.eps)


class ScaledEmbedding(nn.Embedding):
    """An embedding whose vectors are multiplied by ``scale`` (Gemma: sqrt(C)), the factor
    rounded to the weights' dtype first, as transformers does; the LM head tied to it reads the
    weights unscaled."""

    def __init__(self, vocab_size: int, d_model: int, scale: float):
        super().__init__(vocab_size, d_model)
        self.scale = scale

    def forward(self, idx: Tensor) -> Tensor:
        return super().forward(idx) * torch.tensor(self.scale, dtype=self.weight.dtype)


class GeluMLP(nn.Module):
    """GPT-2's MLP: (B, T, C) -> (B, T, C), down(gelu(up(x))), GELU's tanh approximation."""

    def __init__(self, d_model: int, hidden: int, approximate: str = "tanh"):
        super().__init__()
        self.approximate = approximate
        self.up = nn.Linear(d_model, hidden)
        self.down = nn.Linear(hidden, d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x), approximate=self.approximate))


def _norm(config: CheckpointConfig, dim: int | None = None) -> nn.Module:
    dim = config.d_model if dim is None else dim
    if config.norm == "gemma":
        return GemmaRMSNorm(dim, eps=config.norm_eps)
    if config.norm == "rms":
        return RMSNorm(dim, eps=config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps)


class NormedProjection(nn.Linear):
    """A ``Linear`` whose output (..., out) is RMS-normalised over all its channels: OLMo 2's
    q and k projections, whose QK-norm spans every head at once, not each head apart."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, eps: float):
        super().__init__(d_in, d_out, bias=bias)
        self.norm = RMSNorm(d_out, eps=eps)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(super().forward(x))


class PretrainedBlock(Block):
    """``model.Block`` (pre-norm attention, then pre-norm MLP, each added to x) with the norms,
    attention options and MLP of a checkpoint's architecture; ``layer`` counts from 0;
    ``rotary``: the model's one RoPE table (None without RoPE), which every layer reads."""

    def __init__(self, config: CheckpointConfig, layer: int, *, backend: str,
                 rope_layout: str, rotary: RotaryEmbedding | None):
        nn.Module.__init__(self)          # Block.__init__ builds from a GPTConfig
        scale = config.attention_scale    # None: 1/sqrt(D)
        if config.scale_by_layer or not config.scale_by_sqrt_d:
            scale = ((config.head_dim ** -0.5 if config.scale_by_sqrt_d else 1.0)
                     / (layer + 1 if config.scale_by_layer else 1))
        self.attn_norm = _norm(config)
        self.attn = MultiHeadAttention(
            config.d_model, config.n_heads, n_kv_heads=config.n_kv_heads,
            head_dim=config.head_dim, bias=config.attention_bias, backend=backend,
            rope_interleaved=rope_layout == "interleaved", qk_norm=config.qk_norm,
            window=config.window if not config.sliding_layers or config.sliding_layers[layer]
            else None, scale=scale)
        self.attn.rotary = rotary         # shared: built once by the model, not once a layer
        if config.attention_bias and not config.output_bias:
            self.attn.out_proj.register_parameter("bias", None)     # Qwen2: q, k, v only
        if config.qk_norm:
            self.attn.q_norm = _norm(config, config.head_dim)
            self.attn.k_norm = _norm(config, config.head_dim)
        if config.qk_norm_projection:
            attn = self.attn
            attn.q_proj, attn.k_proj = (
                NormedProjection(config.d_model, n * config.head_dim, bias=config.attention_bias,
                                 eps=config.norm_eps) for n in (attn.n_heads, attn.n_kv_heads))
        self.mlp_norm = _norm(config)
        if config.gelu_approximate is None:
            self.mlp = SwiGLU(config.d_model, config.mlp_hidden, bias=config.mlp_bias,
                              activation=config.gated_activation)
        else:
            self.mlp = GeluMLP(config.d_model, config.mlp_hidden, config.gelu_approximate)


class PostNormBlock(PretrainedBlock):
    """A block with norms on what attention and the MLP add (``post_attn_norm``,
    ``post_mlp_norm``): OLMo 2's x + norm(attn(x)), then x + norm(mlp(x)), none on the input;
    with ``config.norm_before_and_after`` Gemma 3's x + norm(attn(norm(x))), the same for the
    MLP (a "sandwich"; ``pre_attn_norm``, ``pre_mlp_norm``). It has no ``attn_norm`` or
    ``mlp_norm``: code that reads those assumes a pre-norm block, and fails here by name."""

    def __init__(self, config: CheckpointConfig, layer: int, **options):
        super().__init__(config, layer, **options)
        self.post_attn_norm, self.post_mlp_norm = _norm(config), _norm(config)
        if config.norm_before_and_after:
            self.pre_attn_norm, self.pre_mlp_norm = self.attn_norm, self.mlp_norm
        del self.attn_norm, self.mlp_norm

    def forward(self, x: Tensor, *, positions: Tensor | None = None, cache=None,
                return_weights: bool = False, attn_mask: Tensor | None = None
                ) -> tuple[Tensor, Tensor | None]:
        """As ``Block.forward``: x (B, T, C) -> (x, attention weights or None)."""
        before = "pre_attn_norm" in self._modules
        attended = self.attn(self.pre_attn_norm(x) if before else x, is_causal=True,
                             positions=positions, cache=cache, return_weights=return_weights,
                             attn_mask=attn_mask)
        attended, weights = attended if return_weights else (attended, None)
        x = x + self.post_attn_norm(attended)
        return x + self.post_mlp_norm(self.mlp(self.pre_mlp_norm(x) if before else x)), weights


class PretrainedGPT(GPT):
    """The course's ``GPT`` with a checkpoint's blocks: token ids (B, T) -> logits (B, T, V).

    ``forward``, ``new_caches``, ``new_rolling_caches`` and ``generate`` are ``GPT``'s; past
    max_position_embeddings, ``generate`` does what transformers does (``past_seq_len``)."""

    @property
    def past_seq_len(self) -> str:
        return "extend" if self.config.position == "rope" else "refuse"

    def __init__(self, config: CheckpointConfig, *, backend: str = "sdpa",
                 rope_layout: str = "half"):
        nn.Module.__init__(self)          # GPT.__init__ builds from a GPTConfig, randomly
        if rope_layout not in ("half", "interleaved"):
            raise ValueError(f"rope_layout must be 'half' or 'interleaved', got {rope_layout!r}")
        self.config, self.rope_layout = config, rope_layout
        self.token_embedding = (
            nn.Embedding(config.vocab_size, config.d_model) if config.embedding_scale == 1.0
            else ScaledEmbedding(config.vocab_size, config.d_model, config.embedding_scale))
        self.position_embedding = (nn.Embedding(config.seq_len, config.d_model)
                                   if config.position == "learned" else None)
        rotary = local = None             # one table of cos and sin for every layer (two for
        if config.position == "rope":     # Gemma 3: its windowed layers have their own base)
            scaling = dict(config.rope_scaling) if config.rope_scaling else None
            length = min(config.seq_len, ROPE_TABLE)
            with torch.device("cpu"):     # computed, never loaded: real even when the weights
                rotary = RotaryEmbedding(  # are built on the meta device (load_pretrained)
                    config.head_dim, length, config.rope_base,
                    scaling=scaling)
                if config.local_rope_base is not None:
                    local = RotaryEmbedding(config.head_dim, length, config.local_rope_base)
        block = (PostNormBlock if config.norm_after or config.norm_before_and_after
                 else PretrainedBlock)
        self.blocks = nn.ModuleList(
            block(config, i, backend=backend, rope_layout=rope_layout,
                  rotary=local if local is not None and config.sliding_layers[i] else rotary)
            for i in range(config.n_layers))
        self.final_norm = _norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.token_embedding.weight


# ----------------------------------------------------------------- names and layouts

def interleave_rows(w: Tensor, n_heads: int) -> Tensor:
    """Rows of Wq or Wk (H·D, ...) from the half-split layout to the interleaved one.

    Within each head, half-split row i + s·D/2 (s = 0, 1: pair i's two channels) becomes row
    2i + s; Hugging Face's Llama conversion made the opposite move. Works on biases (H·D,) and
    QK-norm gains (D,) too (``n_heads=1``)."""
    d = w.shape[0] // n_heads
    perm = torch.arange(d).view(2, d // 2).t().reshape(d)          # [0, D/2, 1, D/2 + 1, ...]
    return w.view(n_heads, d, *w.shape[1:])[:, perm].reshape(w.shape)


def _rotary_names(config: CheckpointConfig) -> dict[str, str]:
    """course name -> checkpoint name, for Llama, Mistral and Qwen3."""
    names = {"token_embedding.weight": "model.embed_tokens.weight",
             "final_norm.weight": "model.norm.weight"}
    if not config.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    parts = {"attn_norm.weight": "input_layernorm.weight",
             "mlp_norm.weight": "post_attention_layernorm.weight",
             "mlp.gate.weight": "mlp.gate_proj.weight", "mlp.up.weight": "mlp.up_proj.weight",
             "mlp.down.weight": "mlp.down_proj.weight"}
    if config.norm_after or config.norm_before_and_after:
        del parts["attn_norm.weight"], parts["mlp_norm.weight"]
    if config.norm_before_and_after:
        parts["pre_attn_norm.weight"] = "input_layernorm.weight"
        parts["pre_mlp_norm.weight"] = "pre_feedforward_layernorm.weight"
    if config.norm_after or config.norm_before_and_after:
        parts["post_attn_norm.weight"] = "post_attention_layernorm.weight"
        parts["post_mlp_norm.weight"] = "post_feedforward_layernorm.weight"
    projections = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj",
                   "out_proj": "o_proj"}
    for ours, theirs in projections.items():
        parts[f"attn.{ours}.weight"] = f"self_attn.{theirs}.weight"
        if config.output_bias if ours == "out_proj" else config.attention_bias:
            parts[f"attn.{ours}.bias"] = f"self_attn.{theirs}.bias"
    if config.mlp_bias:
        for ours in ("gate", "up", "down"):
            parts[f"mlp.{ours}.bias"] = f"mlp.{ours}_proj.bias"
    if config.qk_norm or config.qk_norm_projection:
        norms = "proj.norm" if config.qk_norm_projection else "norm"
        parts[f"attn.q_{norms}.weight"] = "self_attn.q_norm.weight"
        parts[f"attn.k_{norms}.weight"] = "self_attn.k_norm.weight"
    for i in range(config.n_layers):
        names.update({f"blocks.{i}.{ours}": f"model.layers.{i}.{theirs}"
                      for ours, theirs in parts.items()})
    return names


def _phi3_tensors(config: CheckpointConfig, get, expected: dict) -> dict[str, Tensor]:
    """The course's tensors from Phi-3's: qkv_proj holds Wq, Wk and Wv stacked by rows
    (H·D + 2·Hkv·D, C), gate_up_proj the gate's rows, then the up projection's (2·hidden, C)."""
    fused = {"attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight",
             "mlp.gate.weight", "mlp.up.weight"}
    out = {ours: get(theirs, expected[ours]) for ours, theirs in _rotary_names(config).items()
           if ours.split(".", 2)[-1] not in fused}
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    c, hidden = config.d_model, config.mlp_hidden
    for i in range(config.n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        qkv = get(theirs + "self_attn.qkv_proj.weight", (q + 2 * kv, c))
        out[ours + "attn.q_proj.weight"] = qkv[:q]
        out[ours + "attn.k_proj.weight"] = qkv[q:q + kv]
        out[ours + "attn.v_proj.weight"] = qkv[q + kv:]
        gate_up = get(theirs + "mlp.gate_up_proj.weight", (2 * hidden, c))
        out[ours + "mlp.gate.weight"] = gate_up[:hidden]
        out[ours + "mlp.up.weight"] = gate_up[hidden:]
    return out


def _gpt2_tensors(config: CheckpointConfig, get) -> dict[str, Tensor]:
    """The course's tensors from GPT-2's: Conv1D stores W as (in, out), the transpose of a
    Linear's, and c_attn holds Wq, Wk and Wv side by side, (C, 3C)."""
    c = config.d_model
    out = {"token_embedding.weight": get("wte.weight"),
           "position_embedding.weight": get("wpe.weight"),
           "final_norm.weight": get("ln_f.weight"), "final_norm.bias": get("ln_f.bias")}
    for i in range(config.n_layers):
        ours, theirs = f"blocks.{i}.", f"h.{i}."
        qkv_w = get(theirs + "attn.c_attn.weight", (c, 3 * c)).t()                  # (3C, C)
        qkv_b = get(theirs + "attn.c_attn.bias", (3 * c,))
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
            out[f"{ours}attn.{name}.weight"] = qkv_w[j * c:(j + 1) * c]
            out[f"{ours}attn.{name}.bias"] = qkv_b[j * c:(j + 1) * c]
        for conv, linear in (("attn.c_proj", "attn.out_proj"), ("mlp.c_fc", "mlp.up"),
                             ("mlp.c_proj", "mlp.down")):
            out[f"{ours}{linear}.weight"] = get(f"{theirs}{conv}.weight", transpose=True)
            out[f"{ours}{linear}.bias"] = get(f"{theirs}{conv}.bias")
        for ln, norm in (("ln_1", "attn_norm"), ("ln_2", "mlp_norm")):
            out[f"{ours}{norm}.weight"] = get(f"{theirs}{ln}.weight")
            out[f"{ours}{norm}.bias"] = get(f"{theirs}{ln}.bias")
    if not config.tie_embeddings:          # its own head, outside "transformer."
        out["lm_head.weight"] = get("lm_head.weight", prefixed=False)
    return out


# buffers that some checkpoints carry and that the course computes instead: GPT-2's causal mask
# (attn.bias, attn.masked_bias) and RoPE's inverse frequencies
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def _safetensors_files(folder: Path) -> list[Path]:
    """The files transformers reads: the shards that ``model.safetensors.index.json`` lists, else
    ``model.safetensors`` (any other *.safetensors beside them is not the model's, as for
    transformers)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map: restore it from the checkpoint's "
                                  "source")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CheckpointError(f"{folder} lacks shard {missing[0]}, listed in {index.name}")
        return [folder / s for s in shards]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    others = sorted(p.name for p in folder.glob("*.safetensors"))
    if others:
        raise CheckpointError(f"{folder} has {', '.join(others)} but no model.safetensors (or "
                              "model.safetensors.index.json), the file transformers reads: "
                              "rename the model's weights to model.safetensors")
    pickled = sorted(p.name for pattern in PICKLED for p in folder.glob(pattern))
    if pickled:
        raise CheckpointError(
            f"{folder} holds its weights in {pickled[0]}, which the course does not read (only "
            "safetensors, which cannot run code when loaded): convert it once with "
            "transformers, AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder)")
    raise CheckpointError(f"{folder} has no model.safetensors: no weights to load")


def _read_files(folder: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Every tensor of the checkpoint's files, memory-mapped, by name; and each one's file."""
    from safetensors.torch import load_file
    tensors: dict[str, Tensor] = {}
    files: dict[str, str] = {}
    for path in _safetensors_files(folder):
        try:
            found = load_file(path)
        except Exception as error:       # safetensors' own SafetensorError, OSError, ...
            raise CheckpointError(f"{path} is not a readable safetensors file "
                                  f"({str(error).splitlines()[0] if str(error) else error!r}): "
                                  "download it again") from None
        tensors.update(found)
        files.update(dict.fromkeys(found, path.name))
    return tensors, files


def read_tensors(folder) -> dict[str, Tensor]:
    """Every tensor of the checkpoint's safetensors files (sharded or not), by name,
    memory-mapped (read from the file when first used)."""
    return _read_files(Path(folder))[0]


def _course_state(config: CheckpointConfig, model: PretrainedGPT, tensors: dict[str, Tensor],
                  files: dict[str, str] | None = None) -> dict[str, Tensor]:
    """The checkpoint's tensors under the course's names and in its layouts, every one checked:
    none missing, none left over, each of the shape the course's module has. ``files``: each
    tensor's file, named in the errors."""
    files = files or {}
    prefix = "transformer." if config.architecture == "gpt2" else ""
    if prefix and not any(k.startswith(prefix) for k in tensors):
        prefix = ""                      # the hub's GPT-2 names its tensors without the prefix
    used: set[str] = set()
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}

    def get(name: str, shape: tuple | None = None, transpose: bool = False,
            prefixed: bool = True) -> Tensor:
        full = prefix + name if prefixed else name
        if full not in tensors:
            raise CheckpointError(f"the checkpoint lacks tensor {full!r}, which a "
                                  f"{config.architecture} of this config.json needs")
        used.add(full)
        t = tensors[full]
        if shape is not None and tuple(t.shape) != shape:
            raise CheckpointError(f"tensor {full!r} has shape {tuple(t.shape)}, but config.json "
                                  f"implies {shape}")
        return t.t() if transpose else t

    if config.architecture == "gpt2":
        state = _gpt2_tensors(config, get)
    elif config.architecture == "phi3":
        state = _phi3_tensors(config, get, expected)
    else:
        state = {ours: get(theirs, expected[ours])
                 for ours, theirs in _rotary_names(config).items()}
    if config.tie_embeddings:             # one parameter: the embedding is the LM head
        state["lm_head.weight"] = state["token_embedding.weight"]
        if "lm_head.weight" in tensors:
            used.add("lm_head.weight")        # saved anyway by some exporters: the same tensor
    left = sorted(k for k in tensors if k not in used and not k.endswith(IGNORED_SUFFIXES))
    if left:
        where = f" in {files[left[0]]}" if left[0] in files else ""
        raise CheckpointError(f"the checkpoint has tensor {left[0]!r}{where} (and {len(left) - 1}"
                              f" more unused), which the course's {config.architecture} does "
                              "not use")
    for name, t in state.items():
        want = expected.get(name)
        if tuple(t.shape) != want:
            raise CheckpointError(f"tensor for {name} has shape {tuple(t.shape)}, but config.json "
                                  f"implies {want}")
    if model.rope_layout == "interleaved":
        for name in list(state):
            if name.endswith(("attn.q_proj.weight", "attn.q_proj.bias", "q_proj.norm.weight")):
                state[name] = interleave_rows(state[name], config.n_heads)
            elif name.endswith(("attn.k_proj.weight", "attn.k_proj.bias", "k_proj.norm.weight")):
                state[name] = interleave_rows(state[name], config.n_kv_heads)
            elif name.endswith(("attn.q_norm.weight", "attn.k_norm.weight")):
                state[name] = interleave_rows(state[name], 1)
    return state


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def checkpoint_folder(name) -> Path:
    """``name`` as a folder: itself when it is a folder; a hub id ("owner/name") in
    huggingface_hub's cache when it is there (nothing is downloaded); else CheckpointError."""
    path = Path(name)
    if path.is_dir() or path.exists() or not HUB_ID.fullmatch(str(name)):
        return path
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(str(name), local_files_only=True))
    except ImportError:
        pass
    except Exception:                     # not in the cache (LocalEntryNotFoundError), ...
        pass
    raise CheckpointError(f"{name} is no folder, and no hub id that huggingface_hub has "
                          "downloaded: not downloaded (python -m course_attn.chat "
                          f"{name} --prompt hi downloads it)")


def load_pretrained(folder, *, dtype: torch.dtype | None = None, device=None,
                    backend: str = "sdpa", rope_layout: str = "half") -> PretrainedGPT:
    """The model in a Hugging Face checkpoint ``folder`` (or a hub id already downloaded by
    huggingface_hub, ``checkpoint_folder``), built from the course's modules.

    ``dtype``: None keeps the checkpoint's (as stored), else a torch.dtype or its name
    ("bfloat16"); ``device``: default the CPU;
    ``backend``: the attention function of every layer (all give the same numbers);
    ``rope_layout``: "half" (as stored by Hugging Face) or "interleaved" (Meta's layout, the
    rows of Wq and Wk permuted back; the same logits). Returned in eval mode, with the end and
    pad tokens of ``generation_config.json`` as its ``generation_config``, which ``generate``
    reads, and its sampling settings (``CheckpointGenerationConfig``), which it does not.
    The weights are held once: the checkpoint's tensors, memory-mapped, become the parameters
    (a copy only for a ``dtype`` other than the stored one).
    ``CheckpointError`` (one line) for anything the course cannot load as it is.
    """
    folder = checkpoint_folder(folder)
    dtype = _dtype(dtype)
    config = read_config(folder)
    generation = read_generation_config(folder)
    tensors, files = _read_files(folder)      # memory-mapped: read from the file when used
    if dtype is None:
        dtype = next(t.dtype for t in tensors.values() if t.dtype.is_floating_point)
    # built on the meta device (shapes, no memory), then handed the checkpoint's own tensors:
    # the weights are held once, in their dtype, never first drawn at random and then copied
    with torch.device("meta"):
        model = PretrainedGPT(config, backend=backend, rope_layout=rope_layout)
    state = _course_state(config, model, tensors, files)
    del tensors
    cast: dict[int, Tensor] = {}              # by id: a tied embedding stays one tensor
    for name, t in state.items():
        if id(t) not in cast:
            cast[id(t)] = t.to(dtype)         # the same tensor when it has that dtype already
        state[name] = cast[id(t)]
    model.load_state_dict(state, assign=True)
    if config.tie_embeddings:                 # assign made two parameters of the one tensor
        model.lm_head.weight = model.token_embedding.weight
    model.generation_config = generation
    return model.to(device=device).eval()


def _dtype(dtype) -> torch.dtype | None:
    """``dtype`` as a torch.dtype: None, a floating torch.dtype or its name ("bfloat16")."""
    named = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if named is not None and not (isinstance(named, torch.dtype) and named.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype or its name (torch.bfloat16 or "
                         f"'bfloat16'), got {dtype!r}")
    return named


# ---------------------------------- random checkpoints and the comparison with transformers

TINY_SIZES = {
    "llama": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=128),
}
for _name in ("mistral", "qwen2", "qwen3", "phi3", "olmo2"):
    TINY_SIZES[_name] = TINY_SIZES["llama"]
TINY_SIZES["gemma3"] = dict(TINY_SIZES["llama"], head_dim=16)
MODEL_TYPES = {name: name for name in TINY_SIZES}
MODEL_TYPES["gemma3"] = "gemma3_text"


def save_random_checkpoint(folder, architecture: str = "llama", *, seed: int = 0,
                           init_std: float = 0.2, max_shard_size: str | None = None,
                           dtype: torch.dtype = torch.float32, **options):
    """A randomly initialised transformers model saved to ``folder`` by ``save_pretrained``;
    returns that model (eval mode, in ``dtype``, as saved), the reference to compare the
    course's with.

    Tiny by default (hidden 64, 2 layers, 4 heads, 2 key/value heads, vocab 128, 128 positions);
    every norm gain is drawn from U(0.5, 1.5) and every bias from N(0, init_std), not left at
    transformers' 1 and 0, under which a norm in the wrong place can give the same numbers;
    ``options`` are config.json's fields (``hidden_size=``, ``rope_parameters=``,
    ``sliding_window=``, ...). Weights are drawn with std ``init_std`` (transformers'
    ``initializer_range``), large enough that attention is far from uniform. No token ends a
    generation (no eos), so both generate the length asked. ``max_shard_size`` (e.g. "40KB")
    splits the weights into shards with an index, as large checkpoints are saved.
    """
    from transformers import AutoConfig, AutoModelForCausalLM   # slow to import: only here

    if architecture not in MODEL_TYPES:
        raise ValueError(f"architecture must be one of {sorted(MODEL_TYPES)}, got "
                         f"{architecture!r}")
    fields = dict(vocab_size=128, max_position_embeddings=128, initializer_range=init_std,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if architecture == "gpt2":
        fields.pop("max_position_embeddings")
    fields.update(TINY_SIZES[architecture])
    fields.update(options)
    config = AutoConfig.for_model(MODEL_TYPES[architecture], **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():    # transformers starts norm gains at 1 and biases at 0, which hide
        for name, param in model.named_parameters():        # a norm applied in the wrong order
            if param.dim() == 1 and name.endswith("bias"):
                param.normal_(0.0, init_std)
            elif param.dim() == 1:                             # a norm's gain
                param.uniform_(0.5, 1.5)
    model.generation_config.eos_token_id = model.generation_config.bos_token_id = None
    model.to(dtype)
    kwargs = {} if max_shard_size is None else dict(max_shard_size=max_shard_size)
    model.save_pretrained(folder, **kwargs)
    return model


@dataclass(frozen=True)
class Agreement:
    """How closely the course's model follows transformers' on one batch of prompts:
    ``logit_gap``, the largest |difference| of their logits (B, T, V); ``tokens``, how many of
    the ``new_tokens`` greedy tokens equal transformers' before the first that differs, in the
    row where that comes first."""

    logit_gap: float
    tokens: int
    new_tokens: int

    @property
    def same_tokens(self) -> bool:
        return self.tokens == self.new_tokens

    def __str__(self) -> str:
        return (f"logits within {self.logit_gap:.1e} of transformers', {self.tokens} of "
                f"{self.new_tokens} greedy tokens the same")


def compare_with_transformers(model: GPT, reference, idx: Tensor,
                              max_new_tokens: int = 32) -> Agreement:
    """The course's ``model`` against the transformers model ``reference`` (the same weights),
    on prompts idx (B, T) on the models' device: their logits, and their greedy generations of
    ``max_new_tokens`` (transformers' ``generate(do_sample=False)``, the course's through its KV
    cache; neither stops early when the checkpoint names no end token)."""
    with torch.no_grad():
        gap = (model(idx).float() - reference(idx).logits.float()).abs().max().item()
    ours = model.generate(idx, max_new_tokens)[:, idx.shape[1]:]
    theirs = reference.generate(idx, attention_mask=torch.ones_like(idx), do_sample=False,
                                max_new_tokens=max_new_tokens)[:, idx.shape[1]:]
    n = min(ours.shape[1], theirs.shape[1])   # shorter where one stopped at an end token
    equal_so_far = (ours[:, :n] != theirs[:, :n]).cumsum(dim=1) == 0           # (B, n)
    return Agreement(gap, int(equal_so_far.sum(dim=1).min()), max_new_tokens)

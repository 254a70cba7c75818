"""Talk to a real model through the course's attention: ``python -m course_attn.chat MODEL``.

    python -m course_attn.chat HuggingFaceTB/SmolLM2-135M --prompt "The attention mechanism"
    python -m course_attn.chat ./my-checkpoint --prompt "Hello" --max-new-tokens 40

MODEL is a checkpoint folder (``config.json``, ``*.safetensors`` and the tokenizer's files) or a
hub id, downloaded once with ``huggingface_hub`` into its usual cache. The prompt is tokenised by
the checkpoint's own tokenizer (through its chat template when it has one, unless ``--raw``), the
model is ``load_pretrained``'s (the course's modules) and the tokens come from the course's
``generate`` with its KV cache, greedy unless ``--temperature`` is above 0, stopping at the
checkpoint's end-of-sequence token (``generation_config.json``, else the tokenizer's); the
completion is printed without it. Anything that stops it (offline, no tokenizer, a checkpoint
the course cannot load) is one line on stderr and exit status 2.
"""

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from .timing import DTYPES

PROG = "python -m course_attn.chat"
# what the course reads from a hub repository: config, weights, tokenizer (never *.bin, *.pt)
FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class ChatError(Exception):
    """Why the command stopped, in one line."""


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def checkpoint_folder(model: str) -> Path:
    """``model`` as a folder: itself when it is one, else a hub id downloaded (or found in the
    cache) by ``huggingface_hub.snapshot_download``."""
    path = Path(model)
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/", "~")):
        raise ChatError(f"{model} is not a checkpoint folder")
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(model, allow_patterns=FILES))
    except Exception as error:          # offline, unknown id, gated repository, ...
        raise ChatError(f"could not get {model!r} from the Hugging Face hub ({_first_line(error)});"
                        f" offline, pass a checkpoint folder instead") from None


def prompt_ids(tokenizer, prompt: str, raw: bool) -> torch.Tensor:
    """The prompt's token ids (1, T), through the tokenizer's chat template unless ``raw``."""
    if not raw and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise ChatError("the prompt gives no tokens")
    return torch.tensor([ids], dtype=torch.long)


def completion(tokenizer, new_ids: Sequence[int], eos: Sequence[int] | None = None) -> str:
    """The generated tokens as text, up to (not including) the first end-of-sequence token:
    one of ``eos``, or the tokenizer's when None."""
    new_ids = list(new_ids)
    if eos is None:
        eos = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    ends = [i for i, token in enumerate(new_ids) if token in eos]
    return tokenizer.decode(new_ids[:ends[0]] if ends else new_ids, skip_special_tokens=True)


def chat(model: str, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.0,
         top_k: int | None = None, seed: int = 0, dtype: str | None = None,
         raw: bool = False) -> str:
    """The completion of ``prompt`` by the checkpoint ``model`` (a folder or a hub id)."""
    from .checkpoints import CheckpointError, load_pretrained
    from .model import generate

    folder = checkpoint_folder(model)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ChatError(f"{folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    from transformers import AutoTokenizer      # slow to import: only once a folder is there
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as error:
        raise ChatError(f"{folder} has no tokenizer that transformers can read "
                        f"({_first_line(error)})") from None
    try:
        lm = load_pretrained(folder, dtype=None if dtype is None else DTYPES[dtype])
    except CheckpointError as error:
        raise ChatError(str(error)) from None
    ids = prompt_ids(tokenizer, prompt, raw)
    generator = torch.Generator().manual_seed(seed)      # used when sampling
    # the checkpoint's end tokens (generation_config.json), else the tokenizer's: generation
    # stops there, as transformers' does, instead of running on to max_new_tokens
    eos = lm.generation_config.eos_token_id or (
        () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,))
    sampling = dict(do_sample=True, temperature=temperature, top_k=top_k,
                    generator=generator) if temperature > 0 else {}
    out = generate(lm, ids, max_new_tokens, eos_token_id=eos, **sampling)
    return completion(tokenizer, out[0, ids.shape[1]:].tolist(), eos)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a checkpoint folder or a Hugging Face hub id")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (default); above 0: sampled at that temperature")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default: the checkpoint's")
    parser.add_argument("--raw", action="store_true",
                        help="tokenise the prompt as it is, without the chat template")
    args = parser.parse_args(argv)
    try:
        text = chat(args.model, args.prompt, max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                    dtype=args.dtype, raw=args.raw)
    except (ChatError, ValueError) as error:
        print(f"{PROG}: error: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

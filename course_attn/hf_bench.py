"""The course's generation against transformers' on one checkpoint:
``python -m course_attn.bench --hf FOLDER``.

Both models are the checkpoint in FOLDER, in the same dtype, on the same CPU threads, in one
process: the course's is ``load_pretrained``'s (its attention, RoPE, norms and KV cache), driven by
``model.generate`` (greedy, the prompt prefilled once, then one token per step with the cache);
transformers' is ``AutoModelForCausalLM``'s, driven by its ``generate(do_sample=False)`` (eager
PyTorch, its dynamic cache). Each generates ``new_tokens`` tokens after the same random prompt.
They are timed with ``timing.measure``: warmed up, then once per round in turns, the order
rotating; the ratio is taken in each round (transformers' time over the course's: above 1, the
course is faster) and reported as the median over rounds, or withheld when the rounds do not
agree (``timing.rounds_agree``). With one thread (the default) the clock is the process's
processor time, which a busy machine inflates far less than the wall clock.

``--compile`` adds two more to the same rounds: the course's ``generate(compile=True)`` (static
caches, its decode step compiled by Inductor) and transformers' ``generate`` with its static
cache and its decode step compiled (``cache_implementation="static"`` and a ``CompileConfig``,
gpt-fast's recipe, which transformers applies by itself on a GPU but not on a CPU). Each is
reported against transformers' eager generate, and the two compiled ones against each other.
Their first generation (the warm-up) compiles, which takes minutes on a busy CPU.

``--make-llama`` first writes a random Llama of about 21M parameters to FOLDER (hidden 384,
6 layers, 6 heads of 64, 2 key/value heads, SwiGLU 1024, vocabulary 32000, tied embeddings),
the size the issue asks the ratio for.
"""

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from .arguments import check_positive_ints
from .timing import DTYPES, MAX_WARMUP, hardware, measure, spread, withheld_ratio

PROG = "python -m course_attn.bench --hf"
COURSE, TRANSFORMERS = "course", "transformers"
COURSE_COMPILED, TRANSFORMERS_COMPILED = "course compiled", "transformers static-compiled"
HF_CACHES = ("dynamic", "static", "static-compiled")
LLAMA_20M = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                 num_attention_heads=6, num_key_value_heads=2, vocab_size=32000,
                 max_position_embeddings=2048, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def make_llama(folder) -> int:
    """Write the random ~21M-parameter Llama of ``LLAMA_20M`` to ``folder``; its parameter
    count."""
    from .checkpoints import save_random_checkpoint
    model = save_random_checkpoint(folder, "llama", seed=0, init_std=0.02, **LLAMA_20M)
    return sum(p.numel() for p in model.parameters())


def run_hf_bench(folder, *, new_tokens: int = 256, prompt_len: int = 16, batch: int = 1,
                 dtype: str = "float32", threads: int | None = 1, repeats: int = 5,
                 max_warmup: int = 2, hf_cache: str = "dynamic", compile: bool = False,
                 progress: Callable[[str], None] | None = None) -> dict:
    """Tokens per second of the course's cached generation and of transformers' ``generate``
    on the checkpoint in ``folder``; returns a dict (see ``format_report``). ``hf_cache``:
    transformers' cache: "dynamic" (its default), "static" (preallocated, as the course's) or
    "static-compiled" (and its decode step compiled by ``torch.compile``, gpt-fast's recipe,
    which transformers does by itself on a GPU but not on a CPU). ``compile``: also the
    course's compiled decode (``COURSE_COMPILED``) and transformers' static-compiled one
    (``TRANSFORMERS_COMPILED``, beside the ``hf_cache`` one), in the same rounds.
    ``progress``: called with a line of text as the run goes (loading, then each generation
    done)."""
    say = progress or (lambda line: None)
    check_positive_ints(new_tokens=new_tokens, prompt_len=prompt_len, batch=batch,
                        repeats=repeats, max_warmup=max_warmup)
    if hf_cache not in HF_CACHES:
        raise ValueError(f"hf_cache must be one of {HF_CACHES}, got {hf_cache!r}")
    if compile and hf_cache == "static-compiled":
        raise ValueError("compile=True times transformers' static-compiled generate already: "
                         "give it with hf_cache='dynamic' or 'static'")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    from transformers import AutoModelForCausalLM, CompileConfig, GenerationConfig  # slow

    from .checkpoints import load_pretrained
    from .model import generate

    torch_dtype = DTYPES[dtype]
    ours = load_pretrained(folder, dtype=torch_dtype)
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype).eval()
    say(f"loaded {folder} twice, the course's model and transformers'")

    def greedy(cache: str) -> GenerationConfig:
        # every token counts: no end-of-sequence token stops transformers early
        config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0,
                                  cache_implementation=None if cache == "dynamic" else "static")
        if cache == "static-compiled":
            config.compile_config = CompileConfig()
            config.compile_config._compile_all_devices = True  # transformers' switch for a CPU
        return config

    prompt = torch.randint(0, ours.config.vocab_size, (batch, prompt_len),
                           generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(prompt)
    outputs = {}

    def course(name, **options):
        def run():
            outputs[name] = generate(ours, prompt, new_tokens, eos_token_id=(), **options)
        return run

    def hf(name, cache):
        config = greedy(cache)

        def run():
            with torch.inference_mode():
                outputs[name] = theirs.generate(prompt, attention_mask=mask,
                                                generation_config=config)
        return run

    calls = {COURSE: course(COURSE), TRANSFORMERS: hf(TRANSFORMERS, hf_cache)}
    if compile:
        calls[COURSE_COMPILED] = course(COURSE_COMPILED, compile=True)
        calls[TRANSFORMERS_COMPILED] = hf(TRANSFORMERS_COMPILED, "static-compiled")
    done = dict.fromkeys(calls, 0)
    start = time.perf_counter()

    def reported(name, call):
        def run():
            call()
            done[name] += 1
            say(f"  {name}: generation {done[name]} of {new_tokens} tokens done "
                f"({time.perf_counter() - start:.0f} s in; warm-up first, then {repeats} "
                "timed rounds)")
        return run

    say(f"generating {new_tokens} tokens with each, warm-up then {repeats} rounds")
    results = measure({name: reported(name, call) for name, call in calls.items()},
                      torch.device("cpu"), repeats, max_warmup, baseline=TRANSFORMERS,
                      threads=threads)
    failed = {name: r for name, r in results.items() if isinstance(r, str)}
    if failed:
        raise RuntimeError("; ".join(f"{name}: {why}" for name, why in failed.items()))
    tokens = batch * new_tokens
    # round_ratios: each one's time over transformers' eager in each round; speed the inverse
    speedups = {name: [1 / r for r in results[name].round_ratios] for name in calls}
    different = {name: why_tokens_differ(ours, outputs[name], outputs[TRANSFORMERS], prompt_len)
                 for name in (COURSE, COURSE_COMPILED) if name in calls
                 and not torch.equal(outputs[name], outputs[TRANSFORMERS])}
    if compile and not torch.equal(outputs[TRANSFORMERS_COMPILED], outputs[TRANSFORMERS]):
        different[TRANSFORMERS_COMPILED] = "other tokens than transformers' eager generate"
    compiled = {}
    if compile:          # the course's compiled over transformers' compiled, round by round
        rounds = [a / b for a, b in zip(speedups[COURSE_COMPILED],
                                        speedups[TRANSFORMERS_COMPILED])]
        compiled = {"compiled_round_speedups": rounds,
                    "compiled_speedup": withheld_ratio(rounds)[0]}
    return {
        "folder": str(folder), "parameters": sum(p.numel() for p in ours.parameters()),
        "architecture": ours.config.architecture, "dtype": dtype, "batch": batch,
        "prompt_len": prompt_len, "new_tokens": new_tokens, "repeats": repeats,
        "hf_cache": hf_cache, "compile": compile,
        "threads": threads if threads is not None else torch.get_num_threads(),
        "clock": results[COURSE].clock,
        "tokens_per_s": {name: tokens / (results[name].time_ms / 1000) for name in results},
        "round_speedups": speedups[COURSE],
        "speedup": withheld_ratio(speedups[COURSE])[0],
        "speedup_spread": spread(speedups[COURSE]),
        "speedups": {name: withheld_ratio(speedups[name])[0] for name in calls
                     if name != TRANSFORMERS},
        "all_round_speedups": {name: speedups[name] for name in calls if name != TRANSFORMERS},
        **compiled,
        "same_tokens": not different,
        "why_tokens_differ": "; ".join(f"{name}: {why}" for name, why in different.items())
                             or None,
        "hardware": hardware("cpu"),
    }


def why_tokens_differ(model, ours: Tensor, theirs: Tensor, prompt_len: int) -> str:
    """Where two greedy generations (B, T) first part, and whether the course's logits there
    are a near tie between the two tokens (float rounding decides) or far apart (the models
    differ)."""
    if ours.shape != theirs.shape:
        return f"the course made {ours.shape[1]} tokens, transformers {theirs.shape[1]}"
    row, col = (ours != theirs).nonzero()[0].tolist()
    with torch.inference_mode():
        logits = model(ours[row:row + 1, :col], last_only=True)[0, -1].float()
    a, b = int(ours[row, col]), int(theirs[row, col])
    gap = float(logits[a] - logits[b])
    scale = float(logits.abs().max())
    kind = ("a near tie, which float rounding decides"
            if abs(gap) <= 1e-3 * max(scale, 1.0) else "far apart: the two models differ")
    return (f"row {row}, new token {col - prompt_len}: the course chose {a}, transformers {b}; "
            f"the course's logits for the two differ by {abs(gap):.2g} ({kind})")


def format_report(report: dict) -> str:
    """The report as a few lines of text."""
    tps = report["tokens_per_s"]
    labels = {COURSE: "course (load_pretrained + generate, KV cache)",
              COURSE_COMPILED: "course generate(compile=True), static cache",
              TRANSFORMERS: f"transformers generate ({report['hf_cache']} cache)",
              TRANSFORMERS_COMPILED: "transformers generate (static cache, compiled)"}
    lines = [
        f"{report['architecture']} checkpoint {report['folder']}: "
        f"{report['parameters'] / 1e6:.1f}M parameters, {report['dtype']}, batch "
        f"{report['batch']}, prompt {report['prompt_len']}, {report['new_tokens']} new tokens, "
        f"{report['threads']} thread(s), {report['repeats']} rounds ({report['clock']} time)",
        *(f"  {labels[name]:<50}{tps[name]:8.1f} tokens/s" for name in labels if name in tps)]

    def ratio(what: str, median: float | None, rounds: list[float]) -> str:
        each = ", ".join(f"{s:.2f}" for s in rounds)
        if median is None:
            return f"  ratio {what}: withheld, the rounds did not agree ({each})"
        return f"  ratio {what}: {median:.2f}x tokens/s (per round: {each})"

    lines.append(ratio("course / transformers", report["speedup"], report["round_speedups"]))
    if report.get("compile"):
        lines.append(ratio("course compiled / transformers", report["speedups"][COURSE_COMPILED],
                           report["all_round_speedups"][COURSE_COMPILED]))
        lines.append(ratio("transformers static-compiled / transformers",
                           report["speedups"][TRANSFORMERS_COMPILED],
                           report["all_round_speedups"][TRANSFORMERS_COMPILED]))
        lines.append(ratio("course compiled / transformers static-compiled",
                           report["compiled_speedup"], report["compiled_round_speedups"]))
    lines.append(f"  same greedy tokens: {'yes' if report['same_tokens'] else 'NO'}"
                 + ("" if report["same_tokens"] else f" ({report['why_tokens_differ']})"))
    hw = report["hardware"]
    lines.append(f"  on {hw['cpu']}, {hw['cpu_count']} cores, torch {hw['torch']}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m course_attn.bench", description=__doc__.split(
        "\n\n")[0].replace("\n", " "))
    p.add_argument("--hf", required=True, metavar="FOLDER",
                   help="a Hugging Face checkpoint folder (config.json + *.safetensors)")
    p.add_argument("--make-llama", action="store_true",
                   help="first write a random ~21M-parameter Llama to FOLDER")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for both (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, metavar="N", help="timed rounds")
    p.add_argument("--hf-cache", choices=HF_CACHES, default="dynamic",
                   help="transformers' KV cache, and whether its decode step is compiled "
                        "(default: %(default)s)")
    p.add_argument("--compile", action="store_true",
                   help="also the course's generate(compile=True) and transformers' static "
                        "cache with its decode step compiled, in the same rounds (each "
                        "compiles in its first generation: minutes on a busy CPU)")
    p.add_argument("--max-warmup", type=int, default=2, metavar="N",
                   help=f"warm-up generations at most, each (at most {MAX_WARMUP})")
    p.add_argument("--quiet", action="store_true",
                   help="no progress lines on stderr while it runs")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    folder = Path(args.hf)
    if args.quiet:
        from transformers.utils.logging import disable_progress_bar   # its loading bars
        disable_progress_bar()
    try:
        if args.make_llama and not (folder / "config.json").is_file():
            print(f"writing a random Llama of {make_llama(folder) / 1e6:.1f}M parameters to "
                  f"{folder}", file=sys.stderr)
        report = run_hf_bench(folder, new_tokens=args.new_tokens, prompt_len=args.prompt_len,
                              batch=args.batch, dtype=args.dtype, threads=args.threads,
                              repeats=args.repeats, max_warmup=min(args.max_warmup, MAX_WARMUP),
                              hf_cache=args.hf_cache, compile=args.compile,
                              progress=None if args.quiet else (
                                  lambda line: print(line, file=sys.stderr, flush=True)))
    except (ValueError, RuntimeError) as error:
        print(f"{PROG}: error: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    print(format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""python -m course_attn.bench --hf FOLDER: the course's cached generation against transformers'
generate on one checkpoint, in one run, as a ratio. Times are never asserted: what is checked is
that both ran, on the same tokens, and that the report says what was measured."""

import pytest

from course_attn import bench, hf_bench
from course_attn.checkpoints import save_random_checkpoint

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    save_random_checkpoint(folder, "llama", seed=5)
    return folder


def test_report_compares_the_same_generation(folder):
    report = hf_bench.run_hf_bench(folder, new_tokens=8, prompt_len=4, repeats=3)
    assert report["same_tokens"]                  # both generated the same greedy tokens
    assert report["architecture"] == "llama" and report["threads"] == 1
    assert set(report["tokens_per_s"]) == {"course", "transformers"}
    assert len(report["round_speedups"]) == 3
    assert all(s > 0 for s in report["round_speedups"])
    assert report["speedup"] is None or min(report["round_speedups"]) <= report["speedup"] \
        <= max(report["round_speedups"])
    text = hf_bench.format_report(report)
    assert "ratio course / transformers" in text and "same greedy tokens: yes" in text


def test_bench_command_dispatches_to_the_checkpoint_bench(folder, capsys):
    assert bench.main(["--hf", str(folder), "--new-tokens", "4", "--prompt-len", "3",
                       "--repeats", "3"]) == 0
    captured = capsys.readouterr()
    assert "4 new tokens" in captured.out and "tokens/s" in captured.out
    progress = captured.err.splitlines()               # a long run says where it is
    assert any(line.startswith(f"loaded {folder}") for line in progress)
    assert sum("course: generation" in line for line in progress) >= 3
    assert sum("transformers: generation" in line for line in progress) >= 3
    assert bench.main(["--hf", str(folder), "--new-tokens", "2", "--prompt-len", "3",
                       "--repeats", "3", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_bench_help_mentions_the_checkpoint_bench(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    out = capsys.readouterr().out
    assert "With --hf FOLDER" in out and "python -m course_attn.bench --hf FOLDER --help" in out


def test_bad_folder_is_one_line(tmp_path, capsys):
    assert bench.main(["--hf", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no config.json" in err[0]


def test_make_llama_is_about_20m_parameters():
    """The checkpoint the issue reports the ratio for; its size from the config alone (made on
    the meta device, no weights drawn)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **hf_bench.LLAMA_20M)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert 19e6 < sum(p.numel() for p in model.parameters()) < 23e6


def test_transformers_static_cache_is_an_option(folder):
    report = hf_bench.run_hf_bench(folder, new_tokens=4, prompt_len=3, repeats=3,
                                   hf_cache="static")
    assert report["same_tokens"] and report["hf_cache"] == "static"
    assert "transformers generate (static cache)" in hf_bench.format_report(report)
    with pytest.raises(ValueError, match="hf_cache must be one of"):
        hf_bench.run_hf_bench(folder, hf_cache="paged")


def test_compiled_decodes_run_in_the_same_rounds(folder):
    """--compile: the course's compiled decode and transformers' static-compiled generate beside
    the eager ones, in the same rounds, the same greedy tokens from all four, and each ratio
    (course compiled against both of transformers') said."""
    report = hf_bench.run_hf_bench(folder, new_tokens=4, prompt_len=3, repeats=3, compile=True)
    assert set(report["tokens_per_s"]) == {"course", "transformers", "course compiled",
                                           "transformers static-compiled"}
    assert report["same_tokens"] and report["compile"]
    rounds = report["all_round_speedups"]
    assert set(rounds) == {"course", "course compiled", "transformers static-compiled"}
    assert all(len(r) == 3 and min(r) > 0 for r in rounds.values())
    assert report["compiled_round_speedups"] == pytest.approx(
        [a / b for a, b in zip(rounds["course compiled"], rounds["transformers static-compiled"])])
    text = hf_bench.format_report(report)
    for line in ("course generate(compile=True), static cache",
                 "transformers generate (static cache, compiled)",
                 "ratio course compiled / transformers:",
                 "ratio course compiled / transformers static-compiled:"):
        assert line in text, text
    with pytest.raises(ValueError, match="static-compiled generate already"):
        hf_bench.run_hf_bench(folder, compile=True, hf_cache="static-compiled")


def test_a_difference_in_tokens_is_explained(folder):
    """Where the two generations part, and whether the course's logits there are a near tie
    (rounding) or far apart (the models differ)."""
    import torch

    from course_attn.checkpoints import load_pretrained

    model = load_pretrained(folder)
    prompt = torch.randint(0, 128, (2, 4), generator=torch.Generator().manual_seed(0))
    ours = model.generate(prompt, 6)
    theirs = ours.clone()
    logits = model(ours[1:, :6], last_only=True)[0, -1]
    theirs[1, 6] = int(logits.argmin())                  # the least likely token instead
    why = hf_bench.why_tokens_differ(model, ours, theirs, 4)
    assert why.startswith(f"row 1, new token 2: the course chose {int(ours[1, 6])}, "
                          f"transformers {int(logits.argmin())}")
    assert "far apart: the two models differ" in why
    report = {"same_tokens": False, "why_tokens_differ": why}
    assert "the course made 10 tokens, transformers 8" == hf_bench.why_tokens_differ(
        model, ours, ours[:, :8], 4)
    assert report["why_tokens_differ"] in hf_bench.format_report({
        **hf_bench.run_hf_bench(folder, new_tokens=2, prompt_len=2, repeats=3), **report})

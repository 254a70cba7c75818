"""python -m course_attn.chat: a checkpoint folder's own tokenizer, the course's model and
generate, the same completion as transformers'; offline, one line."""

import os
import subprocess
import sys

import pytest
import torch

from course_attn import chat
from course_attn.checkpoints import save_random_checkpoint

pytest.importorskip("transformers")

WORDS = [f"w{i}" for i in range(127)]          # ids 1 .. 127; 0 is the unknown token


@pytest.fixture(scope="module")
def folder_and_reference(tmp_path_factory):
    """A tiny Llama checkpoint with a word-level tokenizer of its 128 ids, and the transformers
    model saved there."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("chat")
    vocab = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(folder)
    return folder, save_random_checkpoint(folder, "llama", seed=3)


def test_chat_prints_transformers_greedy_completion(folder_and_reference, capsys):
    from transformers import AutoTokenizer

    folder, reference = folder_and_reference
    prompt = "w5 w17 w3 w99 w42"
    assert chat.main([str(folder), "--prompt", prompt, "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out.strip()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    assert ids.tolist() == [[6, 18, 4, 100, 43]]
    theirs = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                do_sample=False)
    expected = tokenizer.decode(theirs[0, ids.shape[1]:], skip_special_tokens=True)
    assert len(expected.split()) >= 10             # a few <unk> (id 0) are skipped
    assert printed == expected


def test_chat_stops_generating_at_the_checkpoints_end_token(folder_and_reference, tmp_path,
                                                             capsys, monkeypatch):
    """generation_config.json's end token stops the course's generate, as transformers': the
    text is transformers' and no token is computed past the end."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import course_attn.model

    source, _ = folder_and_reference
    folder = tmp_path / "with-eos"
    shutil.copytree(source, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = "w5 w17 w3 w99 w42"
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    greedy = AutoModelForCausalLM.from_pretrained(folder).generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    eos = int(greedy[0, ids.shape[1] + 3])                   # its 4th new token
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    theirs = AutoModelForCausalLM.from_pretrained(folder).generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert theirs.shape[1] <= ids.shape[1] + 4
    lengths = []

    def recorded(*args, **kwargs):
        out = generate(*args, **kwargs)
        lengths.append(out.shape[1])
        return out
    generate = course_attn.model.generate
    monkeypatch.setattr(course_attn.model, "generate", recorded)
    assert chat.main([str(folder), "--prompt", prompt, "--max-new-tokens", "12"]) == 0
    assert lengths == [theirs.shape[1]]
    expected = tokenizer.decode(theirs[0, ids.shape[1]:-1], skip_special_tokens=True)
    assert theirs[0, -1] == eos and len(expected.split()) >= 2
    assert capsys.readouterr().out.strip() == expected


def test_completion_stops_at_end_of_sequence():
    class Words:
        eos_token_id = 2

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    assert chat.completion(Words(), [5, 7, 2, 9]) == "5 7"
    assert chat.completion(Words(), [5, 7, 9]) == "5 7 9"
    assert chat.completion(Words(), [5, 7, 9, 2], eos=(9, 4)) == "5 7"


def _run_chat(*args, env_extra):
    env = {**os.environ, **env_extra}
    return subprocess.run([sys.executable, "-m", "course_attn.chat", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_offline_hub_id_is_one_line(tmp_path):
    result = _run_chat("HuggingFaceTB/SmolLM2-135M", "--prompt", "hi",
                       env_extra={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)})
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "could not get 'HuggingFaceTB/SmolLM2-135M' from the Hugging Face hub" in lines[0]
    assert "offline" in lines[0]


def test_folder_without_tokenizer_is_one_line(tmp_path, capsys):
    save_random_checkpoint(tmp_path, "gpt2", seed=1)
    capsys.readouterr()                        # save_pretrained's progress bar
    assert chat.main([str(tmp_path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no tokenizer" in err[0]


def test_not_a_folder_is_one_line(tmp_path, capsys):
    assert chat.main([str(tmp_path / "missing"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"python -m course_attn.chat: error: {tmp_path / 'missing'} is not a "
                   "checkpoint folder"]

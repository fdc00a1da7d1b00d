"""The model that ships with mempath: loads in transformers and mempath alike, and
writes something better than chance."""
import json
import re
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from mempath import LLM, SamplingParams
from mempath.assets import ASSETS, DRAFT_MODEL, default_model_path
from mempath.cli import main as cli_main

PROMPTS = ["def read_config(path):", "import os\nimport sys\n\n", "class Scheduler:\n    def __init__(self",
           "    for line in lines:\n"]


@pytest.fixture(scope="module")
def llm():
    return LLM(show_progress=False)  # no model argument: the built-in one


@pytest.mark.parametrize("model_name", ["mempath-tiny", DRAFT_MODEL])
def test_greedy_matches_transformers_for_64_tokens(model_name):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = str(ASSETS / model_name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    llm = LLM(path, dtype="float32", show_progress=False)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tokenizer(prompt, return_tensors="pt")
        ref = hf.generate(**ids, max_new_tokens=64, min_new_tokens=64, do_sample=False,
                          pad_token_id=tokenizer.pad_token_id)[0, ids["input_ids"].shape[1]:].tolist()
        assert out.token_ids == ref
        assert out.text == tokenizer.decode(ref, skip_special_tokens=True)


def test_continuation_beats_unigram_baseline(llm):
    """Per-token log-likelihood of held-out lines under the model beats the unigram model."""
    unigram = json.loads((ASSETS / "unigram_counts.json").read_text())
    counts, total, vocab = unigram["counts"], unigram["total"], unigram["vocab_size"]
    lines = [l for l in (ASSETS / "heldout.txt").read_text().splitlines() if len(l.strip()) > 20][:40]
    model_ll = unigram_ll = 0.0
    n = misses = 0
    # Teacher-forced: the model's logprob of each actual next token. A token outside the
    # returned top-20 is scored as log(1e-6), a floor that can only make the model look worse.
    for line in lines:
        ids = llm.tokenizer.encode(line)  # starts with <|bos|>
        prompts = [ids[:cut] for cut in range(1, len(ids))]
        outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=20), use_tqdm=False)
        for out, target in zip(outs, ids[1:]):
            model_ll += out.logprobs[0].get(target, math.log(1e-6))
            misses += target not in out.logprobs[0]
            unigram_ll += math.log((counts[target] + 1) / (total + vocab))
            n += 1
    assert n > 200
    assert llm.stats()["kv_blocks_used"] == 0
    print(f"held-out tokens {n}: model {model_ll / n:.3f} nats/token, unigram {unigram_ll / n:.3f}, "
          f"{misses} outside the top 20")
    assert model_ll / n > unigram_ll / n + 0.5


def test_generation_is_not_a_repetition_loop(llm):
    out = llm.generate("def read_config(path):", SamplingParams(max_tokens=64, temperature=0))[0]
    most_common = Counter(out.token_ids).most_common(1)[0][1]
    assert len(out.token_ids) >= 16
    assert most_common < 0.5 * len(out.token_ids)
    assert "\n" in out.text


def test_chat_template_renders(llm):
    out = llm.chat([{"role": "system", "content": "You write Python."},
                    {"role": "user", "content": "Open a file."}], SamplingParams(max_tokens=8, temperature=0))[0]
    assert "<|user|>" in out.prompt and out.prompt.rstrip().endswith("<|assistant|>")


def test_cli_generate_uses_the_built_in_model(llm, capsys):
    """No model argument: the CLI prints the prompt and the built-in model's own greedy
    continuation of exactly --max-tokens tokens (not the draft model's, not the default length)."""
    prompt = "def read_config(path):"
    expected = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0))[0]
    assert len(expected.token_ids) == 12 and expected.text.strip()
    assert cli_main(["generate", prompt, "--max-tokens", "12", "--quiet"]) == 0
    assert capsys.readouterr().out == prompt + expected.text + "\n"
    draft = LLM(str(ASSETS / DRAFT_MODEL), show_progress=False).generate(
        prompt, SamplingParams(max_tokens=12, temperature=0))[0]
    assert draft.text != expected.text  # the comparison tells the two shipped models apart


def test_default_model_path_exists():
    assert Path(default_model_path(), "model.safetensors").exists()


def test_chat_takes_vllms_tools_continue_final_message_and_template_kwargs():
    """LLM.chat raised "unexpected keyword argument 'tools'"; vLLM's chat passes these to the template."""
    from mempath import LLM, SamplingParams
    llm = LLM(show_progress=False)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    params = SamplingParams(max_tokens=2, temperature=0.0)
    [out] = llm.chat([{"role": "user", "content": "hi"}], params, tools=[tool])
    assert out.error is None and "get_weather" in out.prompt and "<tools>" in out.prompt
    [out] = llm.chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}], params,
                     add_generation_prompt=False, continue_final_message=True)
    assert out.prompt.endswith("<|assistant|>\nHel"), out.prompt
    template = "{{ greeting }} {{ messages[0].content }}"
    [out] = llm.chat([{"role": "user", "content": "hi"}], params, chat_template=template,
                     chat_template_kwargs={"greeting": "Hello"})
    assert out.prompt == "Hello hi"
    [out] = llm.chat([{"role": "user", "content": "hi"}], params, chat_template_kwargs={"add_generation_prompt": False})
    assert not out.prompt.endswith("<|assistant|>\n"), out.prompt  # applied last, as vLLM applies it


@pytest.mark.parametrize("options, says", [
    (dict(continue_final_message=True), "continue_final_message and add_generation_prompt cannot both be true: "
                                        "pass add_generation_prompt=False to continue the last message"),
    (dict(tools={"name": "x"}), "tools must be a list of tool dicts (OpenAI's format), got dict"),
    (dict(chat_template_kwargs=["x"]), "chat_template_kwargs must be a dict of template variables, got list"),
    (dict(chat_template_kwargs={"tokenize": True}), "chat_template_kwargs cannot set tokenize: LLM.chat passes it to "
                                                    "the template itself; leave it out"),
    (dict(tools=["x"]), "tools must be a list of tool dicts (OpenAI's format), got a list holding str"),
    (dict(continue_final_message="yes", add_generation_prompt=False),
     "continue_final_message must be true or false, got 'yes'"),
])
def test_chat_template_options_are_checked_in_one_line(options, says):
    from mempath import LLM, SamplingParams
    llm = LLM(show_progress=False)
    with pytest.raises(ValueError, match=re.escape(says)):
        llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), **options)


def test_a_prompt_past_the_limit_is_one_line_without_transformers_warning_first(capfd):
    """transformers warned "Token indices sequence length is longer than ..." above the engine's own line."""
    llm = LLM(show_progress=False)
    capfd.readouterr()
    with pytest.raises(ValueError, match="more than max_model_len 1024"):
        llm.generate("word " * 3000, SamplingParams(max_tokens=2))
    assert "Token indices sequence length" not in capfd.readouterr().err

"""LLM.pipeline: one model's answer, through a template, is another's prompt (mempath/multi/pipeline.py)."""
import pytest
import torch

from mempath import LLM, SamplingParams
from mempath.multi.pipeline import SecondModelError, Template, count_device_reads, same_vocabulary

FIRST = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SECOND = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
TEMPLATE = "Summary: {output}\nAnswer:"


@pytest.fixture(scope="module")
def same_tokenizer(model_factory):
    """A Llama and a Mistral saved with the same tokenizer (conftest's, 320 tokens)."""
    (llama, _), (mistral, _) = model_factory("llama"), model_factory("mistral", seed=2)
    return LLM([f"a={llama}", f"b={mistral}"], dtype="float32", show_progress=False, num_gpu_blocks_override=32)


@pytest.fixture(scope="module")
def other_tokenizers(model_factory):
    """A Llama (a BPE of 320 tokens) and a Qwen3 (one of 384, trained apart: other merges and ids)."""
    (llama, _), (qwen3, _) = model_factory("llama"), model_factory("qwen3", vocab_size=384, seed=1)
    return LLM([f"a={llama}", f"b={qwen3}"], dtype="float32", show_progress=False, num_gpu_blocks_override=32)


def test_same_tokenizer_hands_token_ids_on(same_tokenizer):
    llm = same_tokenizer
    a, b = llm.engines["a"], llm.engines["b"]
    assert same_vocabulary(a.tokenizer, b.tokenizer)
    prompt = [5, 17, 33, 9, 101, 7, 64]
    answer = llm.generate(prompt, FIRST, use_tqdm=False, model="a")[0].outputs[0].token_ids
    tok = b.tokenizer
    handed = (tok.encode("Summary: ", add_special_tokens=False) + answer
              + tok.encode("\nAnswer:", add_special_tokens=False))
    expected = llm.generate(handed, SECOND, use_tqdm=False, model="b")[0]
    out = llm.pipeline([prompt, prompt], "a", "b", TEMPLATE, FIRST, SECOND)
    assert [o.first.outputs[0].token_ids for o in out] == [answer, answer]
    assert [o.second.prompt_token_ids for o in out] == [handed, handed]  # A's ids as they were, not re-tokenized
    assert [o.second.outputs[0].token_ids for o in out] == [expected.outputs[0].token_ids] * 2
    assert out[0].text == expected.outputs[0].text
    assert llm.engine.num_handoff_device_reads == 0
    assert llm.engine.pool.pages.num_used == 0


def test_other_tokenizer_equals_retokenizing_the_text(other_tokenizers):
    llm = other_tokenizers
    a, b = llm.engines["a"], llm.engines["b"]
    assert not same_vocabulary(a.tokenizer, b.tokenizer)
    prompt = "def read_config(path):"
    first = llm.generate(prompt, FIRST, use_tqdm=False, model="a")[0]
    text = f"Question: {prompt}\nSummary: {first.outputs[0].text}\nAnswer:"
    expected = llm.generate(text, SECOND, use_tqdm=False, model="b")[0]
    out = llm.pipeline(prompt, "a", "b", "Question: {prompt}\nSummary: {output}\nAnswer:", FIRST, SECOND)[0]
    assert out.second.prompt_token_ids == b.tokenizer.encode(text) == expected.prompt_token_ids
    assert out.second.outputs[0].token_ids == expected.outputs[0].token_ids
    assert llm.engine.num_handoff_device_reads == 0


def test_abort_in_the_middle_of_a_pipeline_leaks_nothing(same_tokenizer):
    engine = same_tokenizer.engine
    long_first = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine.add_pipeline([5, 6, 7], FIRST, "p0", "a", "b", TEMPLATE, SECOND)  # hands off after 6 tokens
    engine.add_pipeline([8, 9, 10], long_first, "p1", "a", "b", TEMPLATE, SECOND)  # still in a
    for _ in range(8):
        engine.step()
    assert engine.owner["p0"] is engine.engines["b"] and engine.owner["p1"] is engine.engines["a"]
    assert engine.abort_request("p0").outputs[0].finish_reason == "abort"
    aborted = engine.abort_request("p1")  # in a: nothing of a's answer, which is not the pipeline's
    assert aborted.outputs[0].finish_reason == "abort" and aborted.outputs[0].token_ids == [] and aborted.text == ""
    assert not engine.has_unfinished_requests() and not engine.pipelines and not engine.owner
    assert engine.pool.pages.num_used == 0
    assert engine.step() == []


def test_templates_and_the_read_counter():
    assert Template.parse("a {prompt} b {output}").pieces == (
        ("literal", "a "), ("field", "prompt"), ("literal", " b "), ("field", "output"))
    with pytest.raises(ValueError, match="no {output}"):
        Template.parse("just {prompt}")
    with pytest.raises(ValueError, match="{answer} is no field"):
        Template.parse("{answer}")
    with count_device_reads() as reads:  # on the CPU a scalar read is what a device read would be
        torch.ones(2).sum().item()
        int(torch.tensor(3))
    assert reads.count == 2


def test_bad_pipeline_requests(same_tokenizer):
    llm = same_tokenizer
    with pytest.raises(ValueError, match="this server serves 'a', 'b'"):
        llm.pipeline([1, 2], "a", "c", TEMPLATE, FIRST, SECOND)
    with pytest.raises(ValueError, match="n=1"):
        llm.pipeline([1, 2], "a", "b", TEMPLATE, SamplingParams(n=2, max_tokens=2), SECOND)
    with pytest.raises(TypeError, match=r"sampling_params must be one SamplingParams .*got dict: use SamplingParams"):
        llm.pipeline([1, 2], "a", "b", TEMPLATE, {"max_tokens": 2}, SECOND)
    with pytest.raises(TypeError, match=r"second_sampling_params must be one SamplingParams .*got list"):
        llm.pipeline([1, 2], "a", "b", TEMPLATE, FIRST, [SECOND])
    with pytest.raises(ValueError, match="template must be a string holding {output}, got int"):
        llm.pipeline([1, 2], "a", "b", 5, FIRST, SECOND)
    with pytest.raises(ValueError, match="prompts must be a string"):
        llm.pipeline(None, "a", "b", TEMPLATE, FIRST, SECOND)
    with pytest.raises(ValueError, match="the model '\\['a'\\]' does not exist"):
        llm.generate([1, 2], FIRST, model=["a"])
    assert not llm.engine.has_unfinished_requests()


def test_second_model_refusals_come_before_the_first_model_runs(same_tokenizer):
    llm = same_tokenizer
    engine = llm.engine
    before = engine.engines["a"].num_prompt_tokens
    with pytest.raises(SecondModelError, match="logprobs must be in") as refused:
        llm.pipeline([[1, 2], [3, 4]], "a", "b", TEMPLATE, FIRST, SamplingParams(max_tokens=2, logprobs=100))
    assert refused.value.reason.startswith("logprobs") and refused.value.model == "b"
    with pytest.raises(SecondModelError, match="more than max_model_len"):  # the template with the prompt alone
        llm.pipeline([1, 2], "a", "b", "x " * 600 + "{output}", FIRST, SECOND)
    with pytest.raises(SecondModelError, match="logit_bias token id"):
        llm.pipeline([1, 2], "a", "b", TEMPLATE, FIRST, SamplingParams(max_tokens=2, logit_bias={10**6: 1.0}))
    assert not engine.has_unfinished_requests() and not engine.pipelines and not engine.owner
    assert engine.engines["a"].num_prompt_tokens == before


def test_a_hand_off_that_fails_answers_nothing_of_the_first_model(same_tokenizer):
    llm = same_tokenizer
    b = llm.engines["b"]
    literal = len(b.tokenizer.encode("x", add_special_tokens=False))
    prompt = [5 + i % 50 for i in range(b.max_model_len - literal)]  # fits b until a's answer joins it
    out = llm.pipeline(prompt, "a", "b", "x{prompt}{output}", SamplingParams(max_tokens=1, ignore_eos=True),
                       SamplingParams(max_tokens=2, logprobs=2))[0]
    assert out.first.outputs[0].token_ids and out.first.finish_reason == "length"
    assert out.second.finish_reason == "error" and "max_model_len" in out.second.error
    assert out.second.error_param == "max_tokens"  # the answer's length is the client's to lower
    assert out.second.outputs[0].token_ids == [] and out.second.text == "" and out.second.logprobs is None
    assert not llm.engine.pipelines and not llm.engine.owner and llm.engine.pool.pages.num_used == 0


@pytest.mark.parametrize("llm_name", ["same_tokenizer", "other_tokenizers"])
def test_the_default_template_runs_where_the_second_tokenizer_adds_no_bos(llm_name, request):
    """The pre-check made the second prompt with an empty answer: with "{output}" and no BOS that prompt was
    empty, and every pipeline with the default template was refused before it ran."""
    llm = request.getfixturevalue(llm_name)
    assert not llm.engines["b"].tokenizer.encode("", add_special_tokens=True)  # no BOS
    prompt = [5, 17, 33, 9, 101, 7, 64]
    out = llm.pipeline(prompt, "a", "b", sampling_params=FIRST, second_sampling_params=SECOND)[0]
    answer = out.first.outputs[0]
    handed = answer.token_ids if llm_name == "same_tokenizer" else answer.text
    expected = llm.generate(handed, SECOND, use_tqdm=False, model="b")[0]
    assert out.second.outputs[0].token_ids == expected.outputs[0].token_ids

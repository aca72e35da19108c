"""The OpenAI-compatible endpoint (aligner.rollout.agent.openai_server) driven by the real `openai` client.

The engine is aligner's TorchEngine on a small Llama whose weights make it a bigram model
(tests/toolkit/agent.py): after the chat template's generation prompt it writes a Hermes calculator
call token by token, so a conversation with tool calls happens for real. Every test compares what the endpoint recorded with what the
engine's generate returned (a spy around the engine) and the training sample with a full forward.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from aligner.envs.tools import get_tool
from aligner.rollout.agent.openai_server import OpenAIEndpoint
from aligner.rollout.agent.record import build_samples
from tests.toolkit.agent import CALL_HEAD, CALL_TAIL, MAX_SEQ_LEN, SpyEngine, agent_tokenizer, bigram_engine

openai = pytest.importorskip("openai", reason="the openai client is not installed (pip install openai; it is in aligner[test])")

TOKEN = "test-token-123"
MODEL = "aligner-policy"
CALCULATOR = get_tool("calculator").spec()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return agent_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def engine(tok):
    return bigram_engine(tok)


@pytest.fixture()
def endpoint(engine, tok):
    ep = OpenAIEndpoint(SpyEngine(engine), tok, max_seq_len=MAX_SEQ_LEN, token=TOKEN, model_name=MODEL, default_max_tokens=16)
    with ep:
        yield ep


def client(ep, episode="ep-1"):
    headers = {"X-Episode-Id": episode} if episode else {}
    return openai.OpenAI(base_url=ep.url, api_key=TOKEN, default_headers=headers, max_retries=0, timeout=60)


def full_forward_log_probs(engine, ids: list[int]) -> torch.Tensor:
    """[T-1] log p(ids[t] | ids[:t]) for t >= 1, from one forward of the whole sequence (fp32)."""
    with torch.no_grad():
        logits = engine.model(torch.tensor([ids]))
        logits = logits if torch.is_tensor(logits) else logits[0]
        return torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def assert_recorded_equals_sampled(ep: OpenAIEndpoint, episode: str, first_call: int = 0):
    """Every record of `episode` equals the engine's own prompt, tokens, log-probs and version, in order."""
    recs = ep.recorder.records(episode)
    sampled = [(p, g) for prompts, gens, _ in ep.engine.calls[first_call:] for p, g in zip(prompts, gens)]
    assert len(recs) == len(sampled)
    for r, (p, g) in zip(recs, sampled):
        assert r.prompt_ids == p
        assert r.completion_ids == g.token_ids
        assert r.log_probs == g.rollout_log_probs  # the engine's floats, unchanged
        assert r.weight_version == g.weight_version
    return recs


def test_a_tool_calling_conversation_records_exactly_what_the_engine_sampled(endpoint, engine, tok):
    c = client(endpoint)
    messages = [{"role": "user", "content": "12+39="}]
    tool = get_tool("calculator")
    for _ in range(2):  # the model calls the calculator, the agent answers, twice
        r = c.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR], temperature=0, logprobs=True)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "12+39"}
        messages.append(choice.message)  # the client's own message object, sent back as agents do
        messages.append({"role": "tool", "tool_call_id": call.id, "content": tool.call(json.loads(call.function.arguments))})
        assert r.usage.completion_tokens == len(choice.logprobs.content) == 8  # 7 tokens of the call + eos
    r = c.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR], temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length"

    recs = assert_recorded_equals_sampled(endpoint, "ep-1")
    assert [(r.call, r.parent, r.break_reason) for r in recs] == [(0, None, ""), (1, 0, ""), (2, 1, "")]
    # each prompt is the previous prompt + completion, as sampled, then the agent's additions
    for prev, nxt in zip(recs, recs[1:]):
        assert nxt.prompt_ids[: len(prev.context_ids)] == prev.context_ids
        added = tok.decode(nxt.prompt_ids[len(prev.context_ids) :], skip_special_tokens=False)
        assert added == "<|user|>\n<tool_response>\n51\n</tool_response>\n<|assistant|>\n"

    (sample,) = endpoint.take_samples("ep-1")
    g = sample.generation
    assert sample.prompt_ids == recs[0].prompt_ids
    assert sample.prompt_ids + g.token_ids == recs[2].context_ids
    own = [i for i, m in enumerate(g.own_mask) if m]
    n0, n1 = len(recs[0].completion_ids), len(recs[1].completion_ids)
    a1 = len(recs[1].prompt_ids) - len(recs[0].context_ids)
    a2 = len(recs[2].prompt_ids) - len(recs[1].context_ids)
    want_own = list(range(n0)) + list(range(n0 + a1, n0 + a1 + n1)) + list(range(n0 + a1 + n1 + a2, len(g.token_ids)))
    assert own == want_own and g.extra["added_tokens"] == a1 + a2
    assert all(lp == 0.0 for lp, m in zip(g.rollout_log_probs, g.own_mask) if not m)
    # the recorded log-probs are the policy's on the sample's own tokens (one forward of the whole sequence)
    full = full_forward_log_probs(engine, sample.prompt_ids + g.token_ids)[len(sample.prompt_ids) - 1 :]
    got = torch.tensor(g.rollout_log_probs)[own]
    torch.testing.assert_close(got, full[own], atol=1e-4, rtol=0)
    assert got[:7].max() > -0.1  # the bigram's chain (margin 8 nats over 95 others: p = 0.97)
    assert endpoint.recorder.records("ep-1") == []  # taken


def test_sampled_choices_and_seeds(endpoint, tok):
    c = client(endpoint, "ep-s")
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "7+8="}], temperature=1.0, n=3, seed=11, max_tokens=10)
    a = c.chat.completions.create(**kw)
    b = c.chat.completions.create(**kw)
    assert [x.message.content for x in a.choices] == [x.message.content for x in b.choices]  # a seed is honored
    recs = assert_recorded_equals_sampled(endpoint, "ep-s")
    assert len(recs) == 6 and [r.choice for r in recs] == [0, 1, 2, 0, 1, 2]
    assert endpoint.engine.calls[0][2] == [11, 12, 13]  # seed + choice index
    # the second call's prompt is the same messages: it extends no earlier completion, a new segment each
    assert all(r.parent is None for r in recs) and all("does not extend" in r.break_reason for r in recs[3:])
    assert len(build_samples(recs)) == 6


def test_an_edited_history_starts_a_new_segment(endpoint, tok):
    c = client(endpoint, "ep-d")
    messages = [{"role": "user", "content": "12+39="}]
    r = c.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR], temperature=0)
    call = r.choices[0].message.tool_calls[0]
    # the agent rewrites the model's call (other JSON spacing): its prompt no longer extends what was sampled
    edited = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call.id, "type": "function", "function": {"name": "calculator", "arguments": '{"expression":"12 + 39"}'}}],
    }
    messages += [edited, {"role": "tool", "tool_call_id": call.id, "content": "51"}]
    c.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR], temperature=0, max_tokens=2)
    recs = assert_recorded_equals_sampled(endpoint, "ep-d")
    assert recs[1].parent is None and recs[1].break_reason.startswith("the prompt does not extend")
    samples = endpoint.take_samples("ep-d")
    assert [s.prompt_ids for s in samples] == [recs[0].prompt_ids, recs[1].prompt_ids]
    assert all(all(s.generation.own_mask) for s in samples)  # each sample: one completion, all the model's


def test_completions_with_text_and_token_ids(endpoint, tok):
    c = client(endpoint, "ep-c")
    prompt = "<bos><|user|>\n1+1=\n<|assistant|>\n"
    r = c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=9, logprobs=0)
    assert r.choices[0].text == CALL_HEAD + "12+39" + CALL_TAIL and r.choices[0].finish_reason == "stop"
    first = endpoint.recorder.records("ep-c")[0]
    # a token-id prompt that continues the first call token for token
    more = first.context_ids + tok.encode("\n<|assistant|>\n", add_special_tokens=False)
    c.completions.create(model=MODEL, prompt=more, temperature=0, max_tokens=2)
    recs = assert_recorded_equals_sampled(endpoint, "ep-c")
    assert recs[0].prompt_ids == tok.encode(prompt, add_special_tokens=True)
    assert recs[1].prompt_ids == more and recs[1].parent == 0
    assert r.choices[0].logprobs.token_logprobs == recs[0].log_probs


def test_stop_strings(endpoint, tok):
    c = client(endpoint, "ep-stop")
    one = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "1"}], temperature=0, stop=["+"])
    many = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "2"}], temperature=0, stop=["2+3"])
    assert one.choices[0].message.content == CALL_HEAD + "12" and one.choices[0].finish_reason == "stop"
    assert many.choices[0].message.content == CALL_HEAD + "12+3" and many.choices[0].finish_reason == "stop"
    recs = endpoint.recorder.records("ep-stop")
    plus = tok.convert_tokens_to_ids("+")
    assert endpoint.engine.calls[0][1][0].token_ids[-1] == plus  # a one-token stop: the engine stopped there
    # a longer stop string: the completion is cut after the token completing it (the engine's tokens are its prefix)
    assert recs[1].completion_ids == endpoint.engine.calls[1][1][0].token_ids[: len(recs[1].completion_ids)]
    assert tok.decode(recs[1].completion_ids).endswith("3")


def test_bad_requests_get_openai_errors(endpoint):
    c = client(endpoint)
    msgs = [{"role": "user", "content": "1+1="}]
    with pytest.raises(openai.BadRequestError, match="no episode id"):
        client(endpoint, episode=None).chat.completions.create(model=MODEL, messages=msgs)
    with pytest.raises(openai.NotFoundError, match="does not exist here"):
        c.chat.completions.create(model="gpt-4o", messages=msgs)
    with pytest.raises(openai.AuthenticationError, match="token"):
        openai.OpenAI(base_url=endpoint.url, api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError, match="stream=true is not supported"):
        c.chat.completions.create(model=MODEL, messages=msgs, stream=True)
    with pytest.raises(openai.BadRequestError, match="context") as e:
        c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1000)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.chat.completions.create(model=MODEL, messages=msgs, temperature=-1)
    assert [m.id for m in c.models.list().data] == [MODEL]
    assert endpoint.engine.calls == []  # nothing refused reached the engine


def test_calls_wait_while_paused(endpoint):
    c = client(endpoint, "ep-p")
    done = threading.Event()

    def call():
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "1"}], max_tokens=2)
        done.set()

    with endpoint.paused():
        t = threading.Thread(target=call)
        t.start()
        time.sleep(0.5)
        assert not done.is_set()  # held while the engine is paused (e.g. a weight update)
    t.join(timeout=30)
    assert done.is_set()


def test_concurrent_episodes_are_batched_and_kept_apart(endpoint):
    n = 6
    errors = []

    def agent(i):
        try:
            c = client(endpoint, f"ep-{i}")
            c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"{i}+{i}="}], temperature=1.0, seed=i, max_tokens=6
            )
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    sampled = {tuple(p): g for prompts, gens, _ in endpoint.engine.calls for p, g in zip(prompts, gens)}
    for i in range(n):
        (r,) = endpoint.recorder.records(f"ep-{i}")
        assert r.completion_ids == sampled[tuple(r.prompt_ids)].token_ids
    assert sum(len(p) for p, _, _ in endpoint.engine.calls) == n


def test_the_agent_reports_its_reward(endpoint):
    c = client(endpoint)
    assert c.post("/episodes/ep%20x/reward", body={"reward": 0.5}, cast_to=object) == {"episode_id": "ep x", "reward": 0.5}
    assert endpoint.recorder.reward("ep x") == 0.5
    with pytest.raises(openai.BadRequestError, match="finite number"):
        c.post("/episodes/ep-x/reward", body={"reward": "1"}, cast_to=object)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=endpoint.url, api_key="wrong", max_retries=0).post(
            "/episodes/ep-x/reward", body={"reward": 1}, cast_to=object
        )
    assert endpoint.recorder.reward("ep-x") is None


# a ChatML template that defines tool calls as Qwen2.5's does: tools in the system turn, an assistant's
# calls re-serialized by the template (no space after "arguments": not the model's own text), tool results in a user turn
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% elif m['role'] == 'assistant' and m.get('tool_calls') %}<|im_start|>assistant\n{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", \"arguments\":{{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_defines_tool_calls(tmp_path):
    tok = agent_tokenizer(str(tmp_path))
    tok.chat_template = TOOL_TEMPLATE
    tok.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]})
    spy = SpyEngine(bigram_engine(tok))
    with OpenAIEndpoint(spy, tok, max_seq_len=MAX_SEQ_LEN, token=TOKEN, model_name=MODEL, default_max_tokens=16) as ep:
        c = client(ep, "ep-t")
        messages = [{"role": "user", "content": "12+39="}]
        r = c.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR], temperature=0)
        call = r.choices[0].message.tool_calls[0]
        messages += [r.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "51"}]
        c.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR], temperature=0, max_tokens=2)
        recs = assert_recorded_equals_sampled(ep, "ep-t")
        first_prompt = tok.decode(recs[0].prompt_ids, skip_special_tokens=False)
        assert first_prompt.startswith('<|im_start|>system\n{"type": "function", "function": {"name": "calculator"')  # the template's tools
        # the model's call as sampled, although the template would re-serialize it differently
        reserialized = tok.apply_chat_template(
            [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"function": {"name": "calculator", "arguments": {"expression": "12+39"}}}],
                }
            ],
            tokenize=False,
        )
        assert '"arguments":{' in reserialized and CALL_HEAD not in reserialized
        assert recs[1].parent == 0 and recs[1].break_reason == ""
        added = tok.decode(recs[1].prompt_ids[len(recs[0].context_ids) :], skip_special_tokens=False)
        assert added == "\n<|im_start|>user\n<tool_response>\n51\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_tools_untaught_for_a_model_that_knows_the_tags(engine, tok):
    with OpenAIEndpoint(SpyEngine(engine), tok, max_seq_len=MAX_SEQ_LEN, token=TOKEN, model_name=MODEL, teach_tools=False) as ep:
        messages = [{"role": "user", "content": "12+39="}]
        r = client(ep, "ep-u").chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR], temperature=0)
        assert r.choices[0].message.tool_calls[0].function.name == "calculator"  # still parsed
        (rec,) = ep.recorder.records("ep-u")
        # the prompt the in-process tool environment plays (conf=tiny_tools): the messages alone
        want = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
        assert rec.prompt_ids == want

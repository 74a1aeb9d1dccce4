"""No tokenization drift: a multi-turn trajectory is the sampled ids plus the chat template's deltas.

A scripted "model" samples two assistant turns (a tool call with reasoning, then an answer, each
ending with the template's end-of-turn token); the calculator answers in between. For SmolLM2's
template and templates with the structure of Llama-3 and Qwen2.5, the trajectory's ids equal the
template's rendering of the whole conversation, tokenized at once (the observation ids are the
template's own text for that message), and the trainer's batch holds exactly those ids, with the
loss mask on the sampled ones. When the "model" samples a non-canonical tokenization, and with a
template that strips ``<think>`` from past turns, re-tokenizing the conversation would give other
ids (the drift users report): the trajectory keeps the sampled ones.
"""

import pytest
import torch

from hyflow.agent.agent import MultiTurnAgent
from hyflow.agent.chat import ChatFormat
from hyflow.agent.config import MultiTurnConfig
from hyflow.data.dataset import PromptDataset
from hyflow.rl.batch import build_rollout_batch
from hyflow.rollout.config import SamplingConfig
from hyflow.testing.agent import (CHATML_SPECIALS, LLAMA3_SPECIALS, LLAMA3_TEMPLATE, QWEN25_TEMPLATE,
                                  THINK_STRIP_TEMPLATE, ScriptedTurns, chat_tokenizer)

TURN1 = ('<think>\nI should use the tool.\n</think>\n'
         '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>')
TURN2 = "The calculator says 408, so the answer is 408."
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 12 * 34?"}]
TEMPLATES = {"smollm2": (None, ()), "llama3": (LLAMA3_TEMPLATE, LLAMA3_SPECIALS),
             "qwen2.5": (QWEN25_TEMPLATE, CHATML_SPECIALS), "think_strip": (THINK_STRIP_TEMPLATE, CHATML_SPECIALS)}


@pytest.fixture(scope="module")
def tokenizers():
    return {name: chat_tokenizer(t, s) for name, (t, s) in TEMPLATES.items()}


def _run(tok, canonical: bool):
    """One trajectory through the rollout loop: (samples, the two sampled turns' ids, the agent)."""
    cfg = MultiTurnConfig(enable=True, tools=["calculator"], tool_prompt="none", max_turns=3,
                          max_response_tokens=400)
    cfg.validate()
    agent = MultiTurnAgent(cfg, tok)
    end = agent.chat.turn_end_ids()[0]
    turn2 = tok.encode(TURN2) if canonical else [i for ch in TURN2 for i in tok.encode(ch)]  # char by char
    turns = [tok.encode(TURN1) + [end], turn2 + [end]]

    seen: list[int] = []

    def script(context, sample):  # the first call gets the prompt; later ones a longer context
        seen.append(len(context))
        ids = turns[0] if len(context) == seen[0] else turns[1]
        return ids, [-0.25 - 0.01 * i for i in range(len(ids))]

    record = PromptDataset.from_rows([{"prompt": MESSAGES, "data_source": "t", "reward_model": {"ground_truth": "408"}}],
                                     tok, max_prompt_length=512)[0]
    gen = ScriptedTurns(script, stop_ids=[end])
    samples = agent.rollout(gen, [record], 1, seed=3, request_offset=0, sampling=SamplingConfig(max_new_tokens=200),
                            max_seq_len=4096, device=torch.device("cpu"))
    return samples, turns, agent


def _conversation(content1: str):
    return MESSAGES + [{"role": "assistant", "content": content1}, {"role": "tool", "content": "408"},
                       {"role": "assistant", "content": TURN2}]


@pytest.mark.parametrize("name", ["smollm2", "llama3", "qwen2.5"])
def test_trajectory_is_the_templates_rendering_of_the_conversation(tokenizers, name):
    tok = tokenizers[name]
    samples, turns, agent = _run(tok, canonical=True)
    (out,) = samples.to_outputs()
    # the text is the template's rendering of the whole conversation (up to what follows the last turn)
    rendered = tok.apply_chat_template(_conversation(TURN1), add_generation_prompt=False)
    text = tok.decode(out.prompt_ids + out.token_ids, skip_special_tokens=False)
    tail = tok.decode(agent.chat.turn_end_ids()[1:], skip_special_tokens=False)
    assert text + tail == rendered, name
    # the ids: the prompt's, the sampled turns as sampled, the observation's between them
    assert out.prompt_ids == tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True))
    assert out.token_ids[:len(turns[0])] == turns[0] and out.token_ids[-len(turns[1]):] == turns[1]
    obs_ids = out.token_ids[len(turns[0]):-len(turns[1])]
    obs = tok.decode(obs_ids, skip_special_tokens=False)
    assert "408" in obs and rendered.count(obs) == 1  # the tool's result as the template writes it
    assert tok.encode(obs) == obs_ids  # the template's text for it, tokenized after the turn's end token


@pytest.mark.parametrize("name", ["smollm2", "llama3", "qwen2.5", "think_strip"])
def test_sampled_ids_are_kept_where_retokenizing_would_drift(tokenizers, name):
    tok = tokenizers[name]
    samples, turns, agent = _run(tok, canonical=False)
    (out,) = samples.to_outputs()
    trajectory = out.prompt_ids + out.token_ids
    whole = tok.encode(tok.apply_chat_template(_conversation(TURN1), add_generation_prompt=False))
    assert whole[:len(trajectory)] != trajectory  # re-tokenizing the decoded conversation drifts
    assert out.token_ids[:len(turns[0])] == turns[0]  # the <think> turn, as sampled
    assert out.token_ids[-len(turns[1]):] == turns[1]  # the char-by-char turn, as sampled
    obs = out.token_ids[len(turns[0]):-len(turns[1])]
    assert obs == agent.chat.observation_ids([{"role": "tool", "content": "408"}], turns[0][-1])
    if name == "think_strip":  # the template drops the past turn's reasoning: ours keeps the sampled ids
        rendered = tok.apply_chat_template(_conversation(TURN1), add_generation_prompt=False)
        assert "<think>" not in rendered and "<think>" in tok.decode(out.token_ids)
    # the trainer's batch: exactly these ids; the loss mask on the sampled ones, their log-probs
    batch = build_rollout_batch(samples.tokens, samples.logprobs, samples.column("prompt_len"),
                                samples.column("response_len"), samples.column("request"), samples.column("sample"),
                                samples.column("finish") == 2, flat_mask=samples.mask)
    assert batch.tokens[0, :len(trajectory)].tolist() == trajectory
    mask = batch.response_mask[0].tolist()
    p = len(out.prompt_ids)
    sampled = list(range(p, p + len(turns[0]))) + list(range(len(trajectory) - len(turns[1]), len(trajectory)))
    assert [i for i, m in enumerate(mask) if m] == sampled
    lp = batch.rollout_logprobs[0]
    assert lp[p] == pytest.approx(-0.25) and lp[p + len(turns[0])] == 0.0  # the observation: no log-prob


def test_tools_reach_the_model_through_the_template_or_a_system_message(tokenizers):
    schema = [{"type": "function", "function": {"name": "calculator", "description": "math",
                                                "parameters": {"type": "object", "properties": {}}}}]
    qwen = ChatFormat(tokenizers["qwen2.5"], schema, "auto")
    assert qwen.tool_prompt == "template"
    assert '"name": "calculator"' in tokenizers["qwen2.5"].decode(qwen.prompt_ids(MESSAGES[1:]),
                                                                   skip_special_tokens=False)
    smol = ChatFormat(tokenizers["smollm2"], schema, "auto")  # SmolLM2's template ignores `tools`
    assert smol.tool_prompt == "system"
    text = tokenizers["smollm2"].decode(smol.prompt_ids(MESSAGES), skip_special_tokens=False)
    assert "<tools>" in text and "You are a helpful assistant." in text
    with pytest.raises(ValueError, match="ignores its `tools`"):
        ChatFormat(tokenizers["smollm2"], schema, "template")


def test_demonstrations_are_built_like_rollouts(tokenizers):
    """The SFT warm-up's multi-turn demonstration: the same ids a rollout of those turns gives,
    the loss on assistant tokens only."""
    tok = tokenizers["qwen2.5"]
    cfg = MultiTurnConfig(enable=True, tools=["calculator"], tool_prompt="none")
    cfg.validate()
    agent = MultiTurnAgent(cfg, tok)
    row = {"prompt": MESSAGES, "data_source": "t", "reward_model": {"ground_truth": "408"},
           "extra_info": {"demonstration": [{"role": "assistant", "content": TURN1}, {"role": "tool", "content": "408"},
                                            {"role": "assistant", "content": TURN2}]}}
    record = PromptDataset.from_rows([row], tok, max_prompt_length=512)[0]
    ids, mask = agent.demonstration(record)
    whole = tok.encode(tok.apply_chat_template(_conversation(TURN1), add_generation_prompt=False))
    assert whole[:len(ids)] == ids
    trained = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert trained == TURN1 + "<|im_end|>" + TURN2 + "<|im_end|>"
    bad = dict(row, extra_info={"demonstration": [{"role": "tool", "content": "1"}]})
    with pytest.raises(ValueError, match="end with an assistant"):
        agent.demonstration(PromptDataset.from_rows([bad], tok, max_prompt_length=512)[0])


def test_a_template_without_the_observation_role_is_named(tokenizers):
    from hyflow.data.tokenizer import CharTokenizer

    with pytest.raises(ValueError, match="observation_role"):
        ChatFormat(CharTokenizer(), observation_role="tool")
    ChatFormat(CharTokenizer(), observation_role="user")

"""Test helpers for multi-turn rollouts: a scripted generation backend, chat templates with the
structure of Llama-3 / Qwen2.5 / Qwen3-style (``<think>``-stripping) templates, and a tokenizer
to render them with (SmolLM2's when available here, else a byte-level BPE trained on the spot)."""

from __future__ import annotations

import os
import time
from typing import Callable, Optional, Sequence

from hyflow.agent.environment import EnvStep
from hyflow.agent.tools import function_schema
from hyflow.data.tokenizer import HFTokenizer
from hyflow.rollout.request import GenerationRequest, RolloutResult, SampleOutput

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOLLM2_TOKENIZER = os.path.join(REPO, "checkpoints", "smollm2-135m", "tokenizer")

# Llama-3.1 structure: a header per message (tool results as `ipython`), contents trimmed, <|eot_id|>.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

# Qwen2.5 structure: a default system prompt, tools listed in it, consecutive tool results in one
# user turn inside <tool_response> tags.
QWEN25_TEMPLATE = (
    "{%- set sys = messages[0]['content'] if messages[0]['role'] == 'system' else "
    "'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}"
    "{{- '<|im_start|>system\\n' + sys }}"
    "{%- if tools %}{{- '\\n\\n# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}"
    "{%- endfor %}{{- '\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call>"
    " XML tags.' }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# ChatML that strips the reasoning (`<think>...</think>`) from every assistant turn but the last
# message, as Qwen3 / DeepSeek-R1-style templates do with history.
THINK_STRIP_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and not loop.last and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHATML_SPECIALS = ["<|im_start|>", "<|im_end|>"]


def _trained_bpe():
    """A byte-level BPE tokenizer trained on a few sentences (no files, no network)."""
    # optional dependency (transformers, tokenizers): the agent tests' tokenizer only
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = ["What is 12 * 34? The calculator says 408, so the answer is 408.",
            '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>',
            "<think>\nI should use the tool.\n</think>\n", "You are a helpful assistant. <tool_response>\n"] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>"] + CHATML_SPECIALS
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def chat_tokenizer(template: Optional[str] = None, specials: Sequence[str] = ()):
    """A :class:`hyflow.data.tokenizer.HFTokenizer` with ``template`` (None: SmolLM2's own) and
    ``specials`` added as special tokens; the end-of-turn token is the EOS."""
    # optional dependency (transformers, tokenizers): the agent tests' tokenizer only
    from transformers import AutoTokenizer

    if os.path.isdir(SMOLLM2_TOKENIZER):
        tok = AutoTokenizer.from_pretrained(SMOLLM2_TOKENIZER)
    else:
        tok = _trained_bpe()
        tok.chat_template = CHATML_SMOLLM2
    if specials:
        tok.add_special_tokens({"additional_special_tokens": list(specials)})
    if template is not None:
        tok.chat_template = template
    if "<|eot_id|>" in specials:
        tok.eos_token = "<|eot_id|>"
        tok.bos_token = "<|begin_of_text|>"
    return HFTokenizer(tok, name=f"test-{'smollm2' if template is None else 'template'}")


# SmolLM2's template structure, for the trained tokenizer when SmolLM2's is not here.
CHATML_SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


class ScriptedTurns:
    """A replica engine (``generate(requests, on_finish)``, as hyflow's) whose "model" is ``script(context_ids, sample)
    -> (token ids, log-probs)`` (the stop token included when the turn ends by itself). It reports
    each sample through ``on_finish`` as the engine does, ``delay`` seconds apart (the others
    still "decoding"), and records when each call started and ended."""

    def __init__(self, script: Callable[[list[int], int], tuple[list[int], list[float]]], stop_ids: Sequence[int],
                 max_seq_len: int = 4096, delay: float = 0.0) -> None:
        self.script, self.stops, self.max_seq_len, self.delay = script, set(stop_ids), max_seq_len, delay
        self.calls: list[tuple[float, float, int]] = []  # (start, end, requests)

    def generate(self, requests: list[GenerationRequest], on_finish=None) -> RolloutResult:
        start = time.monotonic()
        outs = []
        for i, req in enumerate(requests):
            for j in range(req.sampling.n):
                ids, lps = self.script(list(req.prompt_ids), j)
                ids, lps = list(ids)[:req.sampling.max_new_tokens], list(lps)[:req.sampling.max_new_tokens]
                stop = ids[-1] if ids and ids[-1] in self.stops else None
                out = SampleOutput(i, j, list(req.prompt_ids), ids, lps, "stop" if stop is not None else "length", stop)
                if on_finish is not None:
                    on_finish(out)
                outs.append(out)
                if self.delay:
                    time.sleep(self.delay)
        self.calls.append((start, time.monotonic(), len(requests)))
        return RolloutResult(outs)


class EchoUser:
    """A simulated user for tests (``rollout.multi_turn.environment: hyflow.testing.agent:EchoUser``):
    answers every assistant turn with "again" until ``turns`` turns are done, so trajectories have
    observations whatever the model writes; each turn's reward is its number of distinct characters
    over 10 (it varies inside a group). Deterministic: a resumed run sees the same answers."""

    tools = None

    def __init__(self, turns: int = 3, reply: str = "again") -> None:
        self.turns, self.reply = turns, reply

    def reset(self, record) -> list[dict]:
        return [dict(m) for m in record.messages]

    def step(self, turn):
        reward = len(set(turn.text)) / 10
        if turn.index + 1 >= self.turns:
            return EnvStep(reward=reward, done=True)
        return EnvStep([{"role": "user", "content": self.reply}], reward=reward)

    def close(self) -> None:
        pass


#: a tiny multi-turn RL config for tests: the quickstart's kind of model (char tokenizer), the
#: simulated user above (3 turns), most characters stop a turn (a random model rarely writes EOS)
TINY_MULTI_TURN = """\
job: rl
model: {family: llama, vocab_size: 128, hidden_size: 32, num_layers: 2, num_attention_heads: 4,
        num_query_groups: 2, ffn_hidden_size: 64, max_position_embeddings: 96}
actor:
  layout: {tp: 1, pp: 2}
  optim: {lr: 1.0e-3, clip_grad: 1.0}
  micro_batch_size: 4
  mini_batch_size: 8
rollout:
  layout: {tp: 1, pp: 1}
  n: 2
  max_prompt_length: 16
  max_new_tokens: 6
  stop_token_ids: [%s]
  multi_turn:
    enable: true
    tools: [calculator]
    tool_prompt: none
    observation_role: user
    environment: hyflow.testing.agent:EchoUser
    environment_kwargs: {turns: 3}
    max_turns: 3
    max_response_tokens: 40
    reward: sum
algorithm: {adv_estimator: grpo}
reward: {kind: rule, rule: exact_match}
data: {task: digit_add, task_size: 64, train_batch_size: 4}
trainer: {total_steps: 4, nproc: 2, log_every: 1, loggers: [console]}
""" % ", ".join(str(i) for i in range(7, 90))


class SleepTool:
    """A tool that never returns (fault tests)."""

    def __init__(self, config=None, tool_schema=None) -> None:
        self.schema = tool_schema or function_schema("sleep", "sleeps forever", {}, [])

    def execute(self, arguments):
        time.sleep(3600)


class SpamTool(SleepTool):
    """A tool that returns 10 MB."""

    def __init__(self, config=None, tool_schema=None) -> None:
        self.schema = tool_schema or function_schema("spam", "returns 10 MB", {}, [])

    def execute(self, arguments):
        return "x" * 10_000_000


class BoomTool(SleepTool):
    """A tool that raises."""

    def __init__(self, config=None, tool_schema=None) -> None:
        self.schema = tool_schema or function_schema("boom", "raises", {}, [])

    def execute(self, arguments):
        raise RuntimeError("the tool blew up")


FAULT_TOOLS_YAML = """\
tools:
  - {class_name: "hyflow.testing.agent:SleepTool"}
  - {class_name: "hyflow.testing.agent:SpamTool"}
  - {class_name: "hyflow.testing.agent:BoomTool"}
"""


class FaultyCalls(EchoUser):
    """A "model" that calls every fault at each turn whatever it writes (the environment makes the
    calls itself): the hung, the flooding and the raising tool, and Python code that tries to read
    ``read_path`` and to open a socket. Its observation is their results; ``turns`` turns."""

    def __init__(self, read_path: str = "/etc/hostname", turns: int = 2) -> None:
        super().__init__(turns)
        code = f"print(open({read_path!r}).read())\\nimport socket\\nsocket.socket()"
        self.text = "".join('<tool_call>{"name": "%s", "arguments": {}}</tool_call>' % name
                            for name in ("sleep", "spam", "boom")) + \
            '<tool_call>{"name": "python", "arguments": {"code": "%s"}}</tool_call>' % code.replace('"', '\\"')

    def step(self, turn):
        step = self.tools.answer(self.text, run=not turn.last)
        if turn.index + 1 >= self.turns:
            return EnvStep(done=True, tool_calls=step.tool_calls, tool_errors=step.tool_errors,
                           tool_timeouts=step.tool_timeouts)
        return step

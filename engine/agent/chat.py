"""Token ids of a conversation's pieces from the tokenizer's chat template, without re-tokenizing it.

A trajectory is built from ids only: the prompt's ids (the template's rendering of the first
messages, with the generation prompt), then each assistant turn exactly as sampled, then each
observation as the ids of *the template's delta for that message*. The delta is what the template
writes after an assistant turn's content when the observation follows and the next assistant
turn is prompted: rendered on a fixed stand-in conversation ``[user, assistant <marker>,
*observation]`` with the generation prompt, it is the text after the marker. For ChatML
(SmolLM2, Qwen) that is ``<|im_end|>\\n<|im_start|>tool\\n...<|im_end|>\\n<|im_start|>assistant\\n``;
the sampled turn already ends with its stop token ``<|im_end|>``, so the observation's ids are the
delta's ids after that token. Nothing the sampler produced is decoded and encoded again, so the
trainer scores exactly the sampled ids, whatever the template does to past turns (templates that
strip ``<think>`` from history, normalise whitespace, ...).

Tools reach the model through the template's ``tools`` argument (Qwen2.5, Llama-3.1, ...) or, for
templates that ignore it (SmolLM2), a system message listing their schemas
(``rollout.multi_turn.tool_prompt``).
"""

from __future__ import annotations

import json
from typing import Optional, Sequence

from hyflow.data.tokenizer import Tokenizer

_MARKER = "\u2063HYFLOW-TURN-MARKER\u2063"  # survives trim / strip; never in real text
_USER = "\u2063HYFLOW-USER\u2063"


class ChatTemplateError(ValueError):
    """The chat template cannot render what a multi-turn rollout needs; names the fix."""


def tool_system_text(schemas: Sequence[dict]) -> str:
    """The system text that describes ``schemas`` to a model whose template has no tool support
    (the Hermes convention: schemas inside ``<tools>``, calls as ``<tool_call>`` JSON)."""
    lines = ["You can call tools. Their JSON schemas:", "<tools>"]
    lines += [json.dumps(s, separators=(", ", ": ")) for s in schemas]
    lines += ["</tools>",
              'To call one, write <tool_call>{"name": "<tool name>", "arguments": {<arguments>}}</tool_call>; '
              "its result comes back in the next message."]
    return "\n".join(lines)


class ChatFormat:
    """Renders and tokenizes the pieces of a multi-turn conversation for one tokenizer.

    Args:
        tokenizer: the run's tokenizer (:class:`hyflow.data.tokenizer.Tokenizer`).
        tools: OpenAI-style schemas of the offered tools (empty: none).
        tool_prompt: ``template`` | ``system`` | ``none`` | ``auto`` (see the module docstring).
        observation_role: the chat role tool results are rendered with.
    """

    def __init__(self, tokenizer: Tokenizer, tools: Sequence[dict] = (), tool_prompt: str = "auto",
                 observation_role: str = "tool") -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self.observation_role = observation_role
        if self.tools and tool_prompt == "auto":
            tool_prompt = "template" if self._template_renders_tools() else "system"
        if self.tools and tool_prompt == "template" and not self._template_renders_tools():
            raise ChatTemplateError(
                f"the chat template of {tokenizer.name} ignores its `tools` argument: set "
                "rollout.multi_turn.tool_prompt=system (a system message lists the tools) or none")
        self.tool_prompt = tool_prompt if self.tools else "none"
        self.observation_ids([{"role": observation_role, "content": "x"}], None)  # fails here if it cannot

    # ------------------------------------------------------------------ rendering
    def _render(self, messages: Sequence[dict], add_generation_prompt: bool, tools: bool = False) -> str:
        if tools and self.tool_prompt == "template":
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt, tools=self.tools)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt)

    def _template_renders_tools(self) -> bool:
        probe = [{"role": "user", "content": _USER}]
        try:
            with_tools = self.tokenizer.apply_chat_template(probe, True, tools=self.tools)
        except TypeError:  # an adapter without a `tools` argument
            return False
        return with_tools != self.tokenizer.apply_chat_template(probe, True)

    def prompt_messages(self, messages: Sequence[dict]) -> list[dict]:
        """``messages`` with the tools' system text merged in (``tool_prompt=system``)."""
        messages = [dict(m) for m in messages]
        if self.tool_prompt != "system":
            return messages
        text = tool_system_text(self.tools)
        if messages and messages[0].get("role") == "system":
            messages[0]["content"] = messages[0]["content"].rstrip() + "\n\n" + text
        else:
            messages.insert(0, {"role": "system", "content": text})
        return messages

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """Ids of the first messages with the generation prompt (and the tools, per ``tool_prompt``)."""
        text = self._render(self.prompt_messages(messages), True, tools=True)
        return self.tokenizer.encode_prompt_texts([text])[0]

    def _tail(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        """The text the template writes after an assistant turn's content, up to the end of
        ``messages`` (and the next generation prompt)."""
        convo = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _MARKER}] + list(messages)
        try:
            text = self._render(convo, add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 - jinja errors name no role
            roles = sorted({m.get("role", "?") for m in messages})
            raise ChatTemplateError(
                f"the chat template of {self.tokenizer.name} cannot render a conversation with {roles} messages "
                f"after an assistant turn ({type(exc).__name__}: {exc}); set rollout.multi_turn.observation_role "
                "to a role it knows (e.g. user)") from exc
        if text.count(_MARKER) != 1:
            raise ChatTemplateError(f"the chat template of {self.tokenizer.name} does not render an assistant "
                                    "turn's content verbatim once; multi-turn rollouts need it to")
        return text[text.index(_MARKER) + len(_MARKER):]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ------------------------------------------------------------------ pieces as ids
    def observation_ids(self, messages: Sequence[dict], stop_token: Optional[int]) -> list[int]:
        """Ids appended after an assistant turn that ended with ``stop_token`` (the sampled id that
        stopped it, or None): the end of that turn the sampler did not write, ``messages``, and the
        next assistant turn's generation prompt."""
        ids = self._encode(self._tail(messages, True))
        if stop_token is not None and ids and ids[0] == stop_token:
            return ids[1:]  # the sampler wrote the turn's end token itself
        return ids

    def turn_end_ids(self) -> list[int]:
        """What the template writes after an assistant turn's content when the conversation ends there."""
        return self._encode(self._tail([], False))

    def assistant_ids(self, content: str) -> list[int]:
        """Ids of an assistant turn written by hand (demonstrations for the SFT warm-up): ``content``
        then the template's end-of-turn token, as the sampler would end it."""
        end = self.turn_end_ids()
        return self._encode(content) + end[:1]

    def message(self, content: str) -> dict:
        """An observation message with ``content``."""
        return {"role": self.observation_role, "content": content}

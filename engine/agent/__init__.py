"""Multi-turn, tool-using rollouts (``rollout.multi_turn``).

One module per concept:

* :mod:`~hyflow.agent.config` -- ``rollout.multi_turn`` (light: no torch);
* :mod:`~hyflow.agent.trajectory` -- a trajectory as token ids: prompt, assistant turns (trained
  on), observations (context only), and its wire format for the data plane;
* :mod:`~hyflow.agent.chat` -- observation ids from the chat template's delta (no re-tokenization);
* :mod:`~hyflow.agent.parsers` -- tool calls in the model's text (Hermes / Qwen, pluggable);
* :mod:`~hyflow.agent.tools` -- function tools, OpenAI schemas, verl's tool YAML;
* :mod:`~hyflow.agent.calculator`, :mod:`~hyflow.agent.sandbox` -- the built-in tools;
* :mod:`~hyflow.agent.executor` -- concurrent tool calls with timeouts and output caps;
* :mod:`~hyflow.agent.environment` -- ``reset(record)`` / ``step(turn)`` environments;
* :mod:`~hyflow.agent.rollout` -- the per-replica loop: waves, budgets, retries, dropped groups;
* :mod:`~hyflow.agent.channel` -- the replica leader's results shared with its other ranks;
* :mod:`~hyflow.agent.agent` -- what the RL step calls;
* :mod:`~hyflow.agent.builder`, :mod:`~hyflow.agent.loading` -- tools, parser and environment from the
  config, checked before any rank starts; a user's class from a spec string;
* :mod:`~hyflow.agent.cli` -- ``hyflow generate --multi-turn``;
* :mod:`~hyflow.agent.metrics` -- turns, tool calls, errors, end reasons, token counts.
"""

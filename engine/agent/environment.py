"""Environments: what answers an assistant turn in a multi-turn rollout.

An environment serves one trajectory: ``reset(record)`` gives the first messages (the prompt),
``step(turn)`` answers each assistant turn with an observation (messages the model reads but is
never trained on), a reward and whether the trajectory is done. Games, simulated users and graded
multi-step tasks implement these two methods; rewards may come per turn (summed into the
trajectory's score, ``rollout.multi_turn.reward``) or only at the end.

:class:`ToolEnvironment` is the default: the turn's tool calls are executed and their results
are the observation; a turn without a tool call ends the trajectory (the reward section then
scores its final answer). Subclass it to give a game or task tools too: ``self.run_tools(turn)``.

A step may take at most ``rollout.multi_turn.env_timeout`` seconds; an exception or a timeout
fails the trajectory (it is retried, or its group dropped: ``failure_policy``), never the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hyflow.agent.executor import CallOutcome, ToolRunner
from hyflow.agent.parsers import ToolCallParser


@dataclass
class AssistantTurn:
    """One sampled assistant turn: its decoded ``text`` (special tokens dropped), ``token_ids``
    (as sampled), its 0-based ``index`` in the trajectory; ``last``: no observation will follow it
    (``max_turns`` reached), so only its reward and ``done`` matter."""

    text: str
    token_ids: list[int]
    index: int
    last: bool = False


@dataclass
class EnvStep:
    """An environment's answer to a turn.

    Attributes:
        observation: chat messages appended to the conversation (``{"role", "content"}``; the
            role is usually the tool role or ``user`` for a simulated user); empty when done.
        reward: this turn's reward (summed over the trajectory).
        done: the trajectory ends after this turn.
        tool_calls / tool_errors / tool_timeouts: counters for the metrics.
        failure: set when the environment (or a tool's backend) failed: the trajectory is retried.
    """

    observation: list[dict] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    failure: Optional[str] = None


class Toolbox:
    """A parser and a runner: what environments use to answer tool calls."""

    def __init__(self, parser: ToolCallParser, runner: ToolRunner, observation_role: str = "tool") -> None:
        self.parser, self.runner, self.role = parser, runner, observation_role

    def answer(self, text: str, run: bool = True) -> Optional[EnvStep]:
        """The step answering the calls in ``text``, or None when it makes none. ``run=False``: the
        calls are counted, not executed (nobody would read their results)."""
        calls = self.parser.parse(text)
        if not calls:
            return None
        if not run:
            return EnvStep(tool_calls=len(calls))
        outcomes: list[CallOutcome] = self.runner.run(calls)
        failures = [o.failure for o in outcomes if o.failure]
        return EnvStep(observation=[{"role": self.role, "name": o.name, "content": o.text} for o in outcomes],
                       tool_calls=len(outcomes), tool_errors=sum(o.error for o in outcomes),
                       tool_timeouts=sum(o.timeout for o in outcomes),
                       failure="; ".join(failures) if failures else None)


class Environment:
    """Base environment: ``reset`` returns the record's messages; subclasses define ``step``.

    ``self.tools`` is the run's :class:`Toolbox` (None when no tools are configured), set before
    ``reset``. ``close`` is called once the trajectory ends (release what ``reset`` took).
    """

    tools: Optional[Toolbox] = None

    def reset(self, record: Any) -> list[dict]:
        return [dict(m) for m in record.messages]

    def step(self, turn: AssistantTurn) -> EnvStep:
        raise NotImplementedError

    def close(self) -> None:
        pass


class ToolEnvironment(Environment):
    """Tool calls are answered with their results; a turn without one ends the trajectory."""

    def step(self, turn: AssistantTurn) -> EnvStep:
        return self.run_tools(turn) or EnvStep(done=True)

    def run_tools(self, turn: AssistantTurn) -> Optional[EnvStep]:
        """The step answering the turn's tool calls (None when it makes none, or no tools exist)."""
        return self.tools.answer(turn.text, run=not turn.last) if self.tools is not None else None

"""Runs the tool calls of assistant turns: concurrently, each with a timeout and an output cap.

Every call runs in a thread of its own (at most ``workers`` at once per runner); the caller waits
for it until its deadline and then moves on with a timeout observation. A Python tool that never
returns cannot be stopped from outside (threads cannot be killed): its thread is abandoned and its
worker slot handed back, so a hung tool costs one idle thread, never the step (tools that run code
should run it in a subprocess, as the ``python`` tool does, which is killed at its deadline).

Nothing a call does can crash the rollout: an unknown tool, arguments that do not fit the schema,
a malformed call and an exception inside the tool all become an ``Error: ...`` observation;
:class:`~hyflow.agent.tools.ToolFailure` (the tool's backend is broken) and, with
``timeout_is_failure``, a timeout mark the outcome as a failure for the trajectory's retry policy.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from hyflow.agent.parsers import ToolCall
from hyflow.agent.tools import Tool, ToolFailure, ToolResult, argument_errors, tool_name


@dataclass
class CallOutcome:
    """One executed call: the observation text and what went wrong."""

    name: str
    text: str
    error: bool = False
    timeout: bool = False
    failure: Optional[str] = None
    seconds: float = 0.0


def truncate(text: str, limit: int, side: str = "middle") -> str:
    """``text`` cut to about ``limit`` characters, saying how much was cut (``left`` keeps the
    start, ``right`` the end, ``middle`` both ends)."""
    if len(text) <= limit:
        return text
    cut = len(text) - limit
    note = f"...[{cut} characters cut]..."
    if side == "left":
        return text[:limit] + note
    if side == "right":
        return note + text[-limit:]
    head = (limit + 1) // 2
    return text[:head] + note + text[len(text) - (limit - head):]


class _Call(threading.Thread):
    """One call in a daemon thread; ``done`` is set when it returns (or raises)."""

    def __init__(self, tool: Tool, arguments: dict, slots: threading.BoundedSemaphore) -> None:
        super().__init__(daemon=True, name=f"hyflow-tool-{tool_name(tool)}")
        self.tool, self.arguments, self.slots = tool, arguments, slots
        self.done = threading.Event()
        self.result: Optional[ToolResult] = None
        self.exc: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._holds_slot = False
        self._abandoned = False

    def run(self) -> None:
        self.slots.acquire()
        with self._lock:
            self._holds_slot = not self._abandoned
            if self._abandoned:
                self.slots.release()
                return
        try:
            out = self.tool.execute(self.arguments)
            self.result = out if isinstance(out, ToolResult) else ToolResult(str(out))
        except BaseException as exc:  # noqa: BLE001 - every failure becomes an observation
            self.exc = exc
        finally:
            self.release()
            self.done.set()

    def release(self) -> None:
        with self._lock:
            if self._holds_slot:
                self._holds_slot = False
                self.slots.release()

    def abandon(self) -> None:
        """Give the worker slot back; the thread (if it ever returns) is ignored."""
        with self._lock:
            self._abandoned = True
        self.release()


class ToolRunner:
    """Executes parsed calls against a set of tools (one runner per generation replica, shared by
    all its trajectories' turns; thread-safe).

    Args:
        tools: the offered tools (names unique).
        timeout: seconds a call may take, waiting for a worker slot included.
        max_chars / truncate_side: the observation cap (``max_tool_response_length``).
        workers: calls running at once.
        max_parallel_calls: calls executed per turn; the rest get an error observation.
        timeout_is_failure: a timed-out call fails the trajectory instead of informing the model.
    """

    def __init__(self, tools: Sequence[Tool], timeout: float = 10.0, max_chars: int = 1024,
                 truncate_side: str = "middle", workers: int = 16, max_parallel_calls: int = 4,
                 timeout_is_failure: bool = False) -> None:
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            name = tool_name(tool)
            if name in self.tools:
                raise ValueError(f"two tools are named {name!r}; tool names must be unique")
            self.tools[name] = tool
        self.timeout, self.max_chars, self.side = timeout, max_chars, truncate_side
        self.max_parallel_calls = max_parallel_calls
        self.timeout_is_failure = timeout_is_failure
        self._slots = threading.BoundedSemaphore(workers)

    @property
    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    def run(self, calls: Sequence[ToolCall]) -> list[CallOutcome]:
        """Execute ``calls`` (one turn's) concurrently; one outcome per call, in order."""
        outcomes: list[Optional[CallOutcome]] = [None] * len(calls)
        started: list[tuple[int, _Call, float]] = []
        for i, call in enumerate(calls):
            early = self._refuse(call, i)
            if early is not None:
                outcomes[i] = early
                continue
            thread = _Call(self.tools[call.name], call.arguments, self._slots)
            started.append((i, thread, time.monotonic()))
            thread.start()
        for i, thread, start in started:
            thread.done.wait(max(0.0, start + self.timeout - time.monotonic()))
            outcomes[i] = self._outcome(calls[i].name, thread, time.monotonic() - start)
        return outcomes  # type: ignore[return-value]

    def _refuse(self, call: ToolCall, index: int) -> Optional[CallOutcome]:
        """The outcome of a call that is not executed, or None."""
        if call.error is not None:
            return CallOutcome(call.name or "?", f"Error: {call.error}", error=True)
        if index >= self.max_parallel_calls:
            return CallOutcome(call.name, f"Error: at most {self.max_parallel_calls} tool calls per turn; this "
                                          "one was not run", error=True)
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return CallOutcome(call.name, f"Error: unknown tool {call.name!r} (tools: {known})", error=True)
        problems = argument_errors(tool.schema, call.arguments)
        if problems:
            return CallOutcome(call.name, f"Error: {call.name}: " + "; ".join(problems), error=True)
        return None

    def _outcome(self, name: str, thread: _Call, seconds: float) -> CallOutcome:
        if not thread.done.is_set():
            thread.abandon()
            failure = f"tool {name} timed out after {self.timeout:g} s" if self.timeout_is_failure else None
            return CallOutcome(name, f"Error: {name} timed out after {self.timeout:g} s", error=True, timeout=True,
                               failure=failure, seconds=seconds)
        if thread.exc is not None:
            exc = thread.exc
            if isinstance(exc, ToolFailure):
                return CallOutcome(name, f"Error: {name} failed: {exc}", error=True, failure=f"tool {name}: {exc}",
                                   seconds=seconds)
            text = truncate(f"Error: {name} raised {type(exc).__name__}: {exc}", self.max_chars, self.side)
            return CallOutcome(name, text, error=True, seconds=seconds)
        result = thread.result
        failure = result.failure or (f"tool {name} timed out" if result.timeout and self.timeout_is_failure else None)
        return CallOutcome(name, truncate(result.text, self.max_chars, self.side), error=result.error,
                           timeout=result.timeout, failure=failure, seconds=seconds)

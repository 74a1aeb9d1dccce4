"""The multi-turn rollout loop of one generation replica.

Turns run in waves. A wave generates the next assistant turn of every live trajectory with one
call of the generation backend (continuous batching inside it). As soon as a sample's turn is
finished the backend reports it (``on_finish``) and the replica's leader starts that trajectory's
environment step (its tool calls) in a thread: tools run while the other samples are still
decoding. After the call, the leader waits for the outstanding steps (each bounded by
``env_timeout``, each tool call by ``tool_timeout``), turns their observations into ids
(:class:`~hyflow.agent.chat.ChatFormat`) and shares the outcome with the replica's other ranks
(:class:`~hyflow.agent.channel.ReplicaChannel`); the next wave starts. A trajectory ends when its
environment says done, at ``max_turns``, when its token budget or the context is used up, when a
turn is cut by the per-turn limit, or when its environment fails: failed trajectories are run
again from their prompts (``failure_policy: retry``) or their whole group is (``resample_group``),
up to ``max_retries`` times; a group that still fails is dropped: its rows stay in the batch with
no loss and are counted, so no step trains on a partial group silently and none waits forever.

Random streams are keyed by (step seed, global prompt index, sample, turn, attempt): samples do
not depend on how prompts are split over replicas.
"""

from __future__ import annotations

import inspect
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

from hyflow.agent.channel import ReplicaChannel
from hyflow.agent.chat import ChatFormat
from hyflow.agent.config import END_REASONS, MultiTurnConfig
from hyflow.agent.environment import AssistantTurn, EnvStep, Environment
from hyflow.agent.trajectory import Trajectory
from hyflow.rollout.config import SamplingConfig
from hyflow.rollout.request import GenerationRequest, SampleOutput
from hyflow.rollout.sampler import stream_seed

OnFinish = Callable[[SampleOutput], None]
_CONTINUE = 0


def turn_seed(seed: int, t: Trajectory, turn: int, shared: bool) -> int:
    """The random stream of ``t``'s turn ``turn`` (attempt ``t.attempts``) in a step seeded ``seed``: a
    first turn whose prompt's samples share one request (``shared``) uses the request's stream (sample
    ``j`` draws its sub-stream ``j``), any other turn one of its own."""
    if turn == 0:
        return stream_seed(seed, t.request, 1_000_003 * t.attempts + (0 if shared else t.sample))
    return stream_seed(stream_seed(seed, t.request, t.sample), turn, t.attempts)


class TurnGenerator(Protocol):
    """One generation replica's backend: completes every request (``n`` samples each) and calls
    ``on_finish`` with each sample as soon as it is done (request indices are positions in
    ``requests``). Returns the samples in (request, sample) order."""

    def generate(self, requests: list[GenerationRequest], on_finish: Optional[OnFinish] = None) -> list[SampleOutput]:
        ...


class EngineTurns:
    """:class:`TurnGenerator` over a replica's engine (hyflow's
    :class:`~hyflow.rollout.engine.GenerationEngine`, or another backend's with the same
    ``generate(requests)``); an engine without ``on_finish`` reports nothing early: the environment
    steps then start when its call returns."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.reports = "on_finish" in inspect.signature(engine.generate).parameters

    def generate(self, requests: list[GenerationRequest], on_finish: Optional[OnFinish] = None) -> list[SampleOutput]:
        if self.reports:
            return self.engine.generate(requests, on_finish=on_finish).samples
        return self.engine.generate(requests).samples


class Call(threading.Thread):
    """``fn()`` in a daemon thread, waited for until a deadline (environments cannot be killed)."""

    def __init__(self, fn: Callable[[], Any], timeout: float) -> None:
        super().__init__(daemon=True, name="hyflow-env")
        self.fn, self.deadline = fn, time.monotonic() + timeout
        self.result: Any = None
        self.exc: Optional[BaseException] = None
        self.done = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - an environment's exception fails its trajectory
            self.exc = exc
        finally:
            self.done.set()

    def wait(self) -> tuple[Any, Optional[str]]:
        """``(result, failure)``: the failure names the exception or the timeout."""
        if not self.done.wait(max(0.0, self.deadline - time.monotonic())):
            return None, "timed out"
        if self.exc is not None:
            return None, f"{type(self.exc).__name__}: {self.exc}"
        return self.result, None


@dataclass
class Live:
    """Leader-side state of a trajectory in flight."""

    env: Optional[Environment] = None
    step: Optional[Call] = None


class MultiTurnRollout:
    """Runs the trajectories of one replica's prompts (see the module docstring).

    Args:
        cfg: ``rollout.multi_turn``.
        chat: the tokenizer's chat pieces.
        tokenizer: decodes assistant turns for the environments.
        generator: the replica's backend.
        sampling: the per-turn sampling settings (``max_new_tokens`` is the per-turn limit).
        max_seq_len: the backend's context limit (prompt + everything after it).
        make_env: a fresh environment per trajectory (used on the leader only).
        channel: shares the leader's results with the replica's other ranks.
        log: where failures are reported (the leader's).
    """

    def __init__(self, cfg: MultiTurnConfig, chat: ChatFormat, tokenizer, generator: TurnGenerator,
                 sampling: SamplingConfig, max_seq_len: int, make_env: Callable[[], Environment],
                 channel: Optional[ReplicaChannel] = None, log: Callable[[str], None] = None) -> None:
        self.cfg, self.chat, self.tokenizer, self.generator = cfg, chat, tokenizer, generator
        self.sampling, self.max_seq_len, self.make_env = sampling, max_seq_len, make_env
        self.channel = channel or ReplicaChannel()
        self.log = log or (lambda msg: print(f"[hyflow] multi-turn: {msg}", file=sys.stderr, flush=True))

    @property
    def leader(self) -> bool:
        return self.channel.leader

    # ---------------------------------------------------------------- the whole rollout
    def run(self, records: Sequence[Any], n: int, seed: int, request_offset: int = 0) -> list[Trajectory]:
        """``n`` trajectories of each of ``records`` (global indices from ``request_offset``), in
        (prompt, sample) order."""
        trajs = [Trajectory(request_offset + i, j) for i in range(len(records)) for j in range(n)]
        record_of = {request_offset + i: r for i, r in enumerate(records)}
        todo = trajs
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                for t in todo:
                    t.restart()
            self._attempt(todo, record_of, seed)
            failed = {t.request for t in trajs if t.failure is not None}
            if not failed:
                break
            if self.cfg.failure_policy == "resample_group":
                todo = [t for t in trajs if t.request in failed]
            else:
                todo = [t for t in trajs if t.failure is not None]
        failed = {t.request for t in trajs if t.failure is not None}
        if failed and self.leader:
            self.log(f"dropped {len(failed)} group(s) whose environment or tools kept failing after "
                     f"{self.cfg.max_retries} retries (prompts {sorted(failed)[:8]}); their rows carry no loss")
        for t in trajs:
            t.dropped = t.request in failed
        return trajs

    # ---------------------------------------------------------------- one attempt
    def _attempt(self, trajs: list[Trajectory], record_of: dict, seed: int) -> None:
        live = {id(t): Live() for t in trajs}
        try:
            self.reset(trajs, live, record_of)
            active = [t for t in trajs if t.failure is None]
            for turn in range(self.cfg.max_turns):
                active = [t for t in active if self.room(t)]
                if not active:
                    break
                active = self._wave(active, live, turn, seed)
            for t in active:
                t.end = "max_turns"
        finally:
            if self.leader:
                for state in live.values():
                    if state.env is not None:
                        Call(state.env.close, 1.0)  # never waited for: close must not block the step

    def _starter(self, state, record) -> Callable[[], Any]:
        """A trajectory's environment made and reset (in a :class:`Call`)."""
        def start():
            state.env = self.make_env()  # a constructor that raises fails the trajectory, not the run
            return state.env.reset(record)
        return start

    def reset(self, trajs: list[Trajectory], live: dict, record_of: dict) -> None:
        """Every trajectory's environment and prompt ids (the leader resets; the ids are shared)."""
        ints: list[int] = []
        if self.leader:
            calls = [Call(self._starter(live[id(t)], record_of[t.request]), self.cfg.env_timeout) for t in trajs]
            for t, call in zip(trajs, calls):
                messages, failure = call.wait()
                ids: list[int] = []
                if failure is None:
                    try:
                        ids = self.chat.prompt_ids(messages)
                    except Exception as exc:  # noqa: BLE001 - a bad first message fails the trajectory
                        failure = f"{type(exc).__name__}: {exc}"
                if failure is not None:
                    self.log(f"prompt {t.request} sample {t.sample}: environment reset failed: {failure}")
                ints += [int(failure is not None), len(ids)] + ids
        ints, _ = self.channel.share(ints, [])
        pos = 0
        for t in trajs:
            failed, size = ints[pos], ints[pos + 1]
            t.prompt_ids = ints[pos + 2:pos + 2 + size]
            pos += 2 + size
            if failed:
                t.failure, t.end = "reset failed", "failed"

    def room(self, t: Trajectory) -> bool:
        """Whether ``t`` can sample another token; ends it otherwise."""
        if len(t.response_ids) >= self.cfg.max_response_tokens:
            t.end = "token_budget"
        elif len(t.context) >= self.max_seq_len:
            t.end = "context_limit"
        return not t.end

    def max_new(self, t: Trajectory) -> int:
        return min(self.sampling.max_new_tokens, self.cfg.max_response_tokens - len(t.response_ids),
                   self.max_seq_len - len(t.context))

    def _requests(self, active: list[Trajectory], turn: int, seed: int) -> tuple[list[GenerationRequest], list[list]]:
        """One request per trajectory; on the first turn the samples of a prompt share one request
        (its prefill runs once). Returns the requests and the trajectories of each."""
        groups: dict[tuple, list[Trajectory]] = {}
        for t in active:
            key = (t.request, t.attempts, tuple(t.prompt_ids)) if turn == 0 else (id(t),)
            groups.setdefault(key, []).append(t)
        requests, owners = [], []
        for members in groups.values():
            first = members[0]
            req_seed = turn_seed(seed, first, turn, len(members) > 1)
            params = self.sampling.replace(n=len(members), max_new_tokens=self.max_new(first))
            requests.append(GenerationRequest(list(first.context), sampling=params, seed=req_seed))
            owners.append(members)
        return requests, owners

    def _wave(self, active: list[Trajectory], live: dict, turn: int, seed: int) -> list[Trajectory]:
        """One assistant turn for every trajectory of ``active``; returns those that go on."""
        requests, owners = self._requests(active, turn, seed)
        limits = {id(t): req.sampling.max_new_tokens for req, members in zip(requests, owners) for t in members}

        lock = threading.Lock()

        def on_finish(out: SampleOutput) -> None:  # as soon as a turn is sampled: start its environment step
            t = owners[out.request_index][out.sample_index]
            if out.finish_reason != "stop":
                return  # cut by a length limit: no complete turn to answer
            state = live[id(t)]
            with lock:
                if state.step is None:
                    self.begin_step(t, out, state)

        if self.leader:
            for t in active:
                live[id(t)].step = None
        samples = self.generator.generate(requests, on_finish if self.leader else None)
        by_traj = {}
        for out in samples:
            by_traj[id(owners[out.request_index][out.sample_index])] = out
            if self.leader:
                on_finish(out)  # a backend that reports nothing early: start the remaining steps now
        return self.settle([(t, by_traj[id(t)], live[id(t)], limits[id(t)], turn) for t in active])

    def begin_step(self, t: Trajectory, out: SampleOutput, state: Live) -> None:
        """Leader: start the environment step answering ``t``'s just finished turn ``out`` (in a thread)."""
        turn = AssistantTurn(text=self.tokenizer.decode(out.token_ids), token_ids=list(out.token_ids),
                             index=t.turns, last=t.turns + 1 >= self.cfg.max_turns)
        state.step = Call(lambda env=state.env: env.step(turn), self.cfg.env_timeout)

    def replay(self, t: Trajectory, state: Live, record: Any, stops: Sequence[Optional[int]]) -> Optional[str]:
        """Leader: a fresh environment for ``t`` (a trajectory a checkpoint saved half way), reset and
        fed ``t``'s assistant turns again; ``stops[i]`` is the id that ended turn ``i``. Returns None when
        it answered every turn with the saved observation (it is then where the saved one was), else
        what differs: such an environment cannot be resumed exactly."""
        made = Call(self._starter(state, record), self.cfg.env_timeout)
        messages, failure = made.wait()
        if failure is not None:
            return f"its reset failed: {failure}"
        if self.chat.prompt_ids(messages) != t.prompt_ids:
            return "its reset gave other first messages"
        segments, turn = t.segments, -1
        for i, (kind, start, length) in enumerate(segments):
            if kind != "assistant":
                continue
            turn += 1
            ids = t.response_ids[start:start + length]
            assistant = AssistantTurn(text=self.tokenizer.decode(ids), token_ids=list(ids), index=turn,
                                      last=turn + 1 >= self.cfg.max_turns)
            step, failure = Call(lambda a=assistant: state.env.step(a), self.cfg.env_timeout).wait()
            if failure is not None:
                return f"turn {turn} failed again: {failure}"
            if i + 1 < len(segments):
                _, s2, n2 = segments[i + 1]
                if not isinstance(step, EnvStep) or not step.observation or self.chat.observation_ids(
                        step.observation, stops[turn]) != t.response_ids[s2:s2 + n2]:
                    return f"turn {turn} was answered with another observation"
        return None

    def settle(self, finished: list[tuple[Trajectory, SampleOutput, Live, int, int]]) -> list[Trajectory]:
        """Every rank of the replica, at the same point: each ``(trajectory, its finished turn, its
        leader-side state, the turn's token limit, turn index)`` gets its turn; the leader waits for
        the environment steps (started when the turns finished), and what they answered is shared
        and applied (an observation, or the trajectory's end). Returns the trajectories that go on."""
        ints: list[int] = []
        floats: list[float] = []
        active = [t for t, *_ in finished]
        for t, out, state, limit, turn in finished:
            t.add_turn(out.token_ids, out.logprobs)
            if self.leader:
                code, obs, reward, counts = self._answer(t, out, state, limit, turn)
                ints += [code, *counts, len(obs)] + obs
                floats.append(reward)
        ints, floats = self.channel.share(ints, floats)
        going, pos = [], 0
        for k, t in enumerate(active):
            code, calls, errors, timeouts, tool_turn, size = ints[pos:pos + 6]
            obs = ints[pos + 6:pos + 6 + size]
            pos += 6 + size
            t.tool_calls += calls
            t.tool_errors += errors
            t.tool_timeouts += timeouts
            t.tool_turns += tool_turn
            t.env_reward += floats[k]
            if code == _CONTINUE:
                t.add_observation(obs)
                going.append(t)
            else:
                t.end = END_REASONS[code - 1]
                if t.end == "failed" and t.failure is None:
                    t.failure = "environment failed"
        return going

    def _answer(self, t: Trajectory, out: SampleOutput, state: Live, limit: int,
                turn: int) -> tuple[int, list[int], float, list[int]]:
        """Leader: (code, observation ids, reward, counters) of a finished turn."""
        if out.finish_reason != "stop":
            if limit < self.sampling.max_new_tokens:  # the trajectory's budget or the context set the limit
                reason = "token_budget" if limit == self.cfg.max_response_tokens - (len(t.response_ids) - len(
                    out.token_ids)) else "context_limit"
            else:
                reason = "turn_length"
            return END_REASONS.index(reason) + 1, [], 0.0, [0, 0, 0, 0]
        step, failure = state.step.wait() if state.step is not None else (None, "no environment step")
        if failure is None and not isinstance(step, EnvStep):
            failure = f"step() returned {type(step).__name__}, not an EnvStep"
        if failure is None and step.failure is not None:
            failure = step.failure
        if failure is not None:
            self.log(f"prompt {t.request} sample {t.sample} turn {turn}: {failure}")
            counts = [step.tool_calls, step.tool_errors, step.tool_timeouts, int(step.tool_calls > 0)] \
                if isinstance(step, EnvStep) else [0, 0, 0, 0]
            return END_REASONS.index("failed") + 1, [], 0.0, counts
        counts = [step.tool_calls, step.tool_errors, step.tool_timeouts, int(step.tool_calls > 0)]
        reward = float(step.reward)
        if step.done:
            return END_REASONS.index("done") + 1, [], reward, counts
        if turn + 1 >= self.cfg.max_turns:
            return END_REASONS.index("max_turns") + 1, [], reward, counts
        if not step.observation:  # nothing to answer: the trajectory is over
            return END_REASONS.index("done") + 1, [], reward, counts
        stop = out.stop_token if out.stop_token is not None else (out.token_ids[-1] if out.token_ids else None)
        obs = self.chat.observation_ids(step.observation, stop)
        if len(t.response_ids) + len(obs) >= self.cfg.max_response_tokens:
            return END_REASONS.index("token_budget") + 1, [], reward, counts
        if len(t.context) + len(obs) >= self.max_seq_len:
            return END_REASONS.index("context_limit") + 1, [], reward, counts
        return _CONTINUE, obs, reward, counts

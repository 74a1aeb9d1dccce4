"""``trainer.mode: async`` with ``rollout.multi_turn``: trajectories streamed through a replica's
long-lived scheduler.

:class:`AsyncTrajectories` is the :class:`~hyflow.jobs.fully_async.AsyncGeneration` loop (admission
bound, batch forming, stale drops, weight exchange at token boundaries: all unchanged) whose groups
are ``rollout.n`` multi-turn trajectories of a prompt instead of ``n`` single responses:

* **A turn is a scheduler sequence.** Starting a group resets its ``n`` environments (on the
  replica's leader, shared with its other ranks: :class:`~hyflow.agent.channel.ReplicaChannel`) and
  feeds the first turns (one request of ``n`` samples, its prefill shared). When a turn finishes the
  leader starts its environment step in a thread (the tool calls run while the others decode); the
  step is waited for at the **next token boundary** (or at once when nothing decodes), its answer
  shared, and the trajectory's next turn (context = everything so far) is queued for the scheduler's
  next free slot, or the trajectory ends. The fixed boundary (not "whenever the tool returns") keeps
  every rank of the replica in lockstep (NCCL: they must enter the same broadcasts) and the run a
  function of decode steps, never of wall time, as :mod:`hyflow.jobs.fully_async` requires.
* **Seeds and answers are the colocated loop's** (:class:`~hyflow.agent.rollout.MultiTurnRollout`'s
  :func:`~hyflow.agent.rollout.turn_seed`, keyed by loader step, global prompt index, sample, turn and
  attempt; its ``settle`` applies the environment's answers): with ``max_staleness: 0`` the
  trajectories, and so the run, equal the pooled ``sync`` run's (test). A failed trajectory is run
  again from its prompt at once (``failure_policy: retry``: alone, from its own stream, where the wave
  loop shares one request among the samples of a prompt that failed together; ``resample_group``:
  the whole group, its running turns cancelled), up to ``max_retries``; a group that still fails
  keeps its rows with no loss (``dropped``), as colocated.
* **Token versions.** Every sampled token records the weight version that sampled it (a turn may
  span an exchange: ``trainer.partial_rollout``); an observation's tokens carry the version of the
  turn before them (they were not sampled: no loss, no behaviour log-prob), so a trajectory's oldest
  and newest versions are its sampled tokens'. A group's staleness is its oldest token's, as for
  single responses.

**Checkpoints** (exact resume). An in-flight trajectory's tokens are saved like a half-generated sample,
but its environment cannot be (a game's state, a sandbox, a simulated user: not picklable, not plain
data). So a checkpoint holds each trajectory of every group not sent as plain data (:meth:`_state`:
prompt, turns and observations with masks, log-probs and token versions, counters, the id that ended
each answered turn, and where its current turn stands: running with its tokens so far and its random
stream, queued for a slot or ready to be fed in order, finished and not answered yet, or ended), beside
the base loop's state. On resume (:meth:`_restore`) each unfinished trajectory's environment is
re-created, reset from the prompt's row and fed the saved assistant turns again
(:meth:`~hyflow.agent.rollout.MultiTurnRollout.replay`); every observation it answers must equal the
saved one, else the resume is refused with one error (an environment must be deterministic given its
record and the turns; a random one is resumable when it seeds itself from them). Then running turns
continue from their tokens with their saved streams, queued and ready turns go back in their order,
and a finished turn's environment step starts again, answered at the same token boundary as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from hyflow.agent.channel import ReplicaChannel
from hyflow.agent.rollout import Call, Live, MultiTurnRollout, turn_seed
from hyflow.agent.trajectory import Trajectory, to_sample_tensors
from hyflow.checkpoint.errors import CheckpointError
from hyflow.jobs.fully_async import AsyncGeneration, AsyncInFlight, Group
from hyflow.rl.dispatch import sampling_seed
from hyflow.rollout.dp import SampleTensors
from hyflow.rollout.request import GenerationRequest, SampleOutput


@dataclass
class _Run:
    """One trajectory of a group in flight."""

    traj: Trajectory
    out: SampleOutput  # the group's output for it: the versions of its tokens (the staleness rules read them)
    group: Group
    record: Any
    state: Live = field(default_factory=Live)
    turn: Optional[SampleOutput] = None  # the turn the scheduler runs or ran last
    limit: int = 0  # that turn's token limit
    finished_at: int = -1  # the decode count when that turn finished (-1: running or none)
    seq: Any = None  # that turn's scheduler sequence
    stops: list = field(default_factory=list)  # the id that ended each answered turn (a replay needs them)


class AsyncTrajectories(AsyncGeneration):
    """The async generation loop over multi-turn trajectories (see the module docstring); ``side`` holds
    the agent (:class:`~hyflow.placement.pool_models.GenerationSide` with ``rollout.multi_turn``)."""

    def __init__(self, cfg, side, loader, routes, exchange_control, ckpts=None) -> None:
        super().__init__(cfg, side, loader, routes, exchange_control, ckpts)
        agent, self.mt = side.agent, cfg.rollout.multi_turn
        self.sampling = side.rollout_config.sampling.replace(n=1)
        self.driver = MultiTurnRollout(self.mt, agent.chat, agent.tokenizer, None, self.sampling,
                                       getattr(side.engine, "max_seq_len", None) or side.desc.context_length,
                                       agent.make_env, ReplicaChannel([side.groups.pgs.tp, side.groups.pgs.pp],
                                                                      self.device))
        self.trainer_seed, self.pad_id = cfg.trainer.seed, side.rollout_config.pad_token_id
        self.runs: dict[tuple[int, int], list[_Run]] = {}  # group key -> its trajectories, until sent or dropped
        self.by_turn: dict[int, _Run] = {}  # id(turn output) -> its trajectory, while the turn runs
        self.waiting: list[_Run] = []  # turns finished, not answered yet (in finishing order)
        self.ready: list = []  # next turns' sequences, not fed yet
        self.scheduler = None

    # ------------------------------------------------------------ scheduler hooks
    def _feed(self, scheduler) -> list:
        self.scheduler = scheduler
        if not scheduler.running and not scheduler.queued:
            self._advance(None)  # nothing decodes: answer every finished turn now
        seqs, self.ready = self.ready, []
        if not seqs:
            return super()._feed(scheduler)
        while scheduler.free_slots - scheduler.queued - len(seqs) > 0 and self._may_start():
            seqs += self._start()
        return seqs

    def _on_decode(self, scheduler) -> Optional[int]:
        self.scheduler = scheduler
        self._advance(self.decoded)  # the turns that finished before this boundary's decode step
        return super()._on_decode(scheduler)

    def _finished(self, out) -> None:
        run = self.by_turn.pop(id(out), None)
        if run is None:  # a cancelled turn
            return
        run.finished_at = self.decoded
        self.waiting.append(run)
        if self.driver.leader and out.finish_reason == "stop":  # its tool calls run while the others decode
            self.driver.begin_step(run.traj, out, run.state)

    # ------------------------------------------------------------------ groups
    def _open(self, record, index: int) -> tuple[Group, list]:
        trajs = [Trajectory(index, j) for j in range(self.n)]
        group = Group(self.origin, index, record.uid, [])
        runs = [_Run(t, SampleOutput(request_index=index, sample_index=t.sample, prompt_ids=[]), group, record)
                for t in trajs]
        group.outs = [r.out for r in runs]
        self.runs[group.key] = runs
        return group, self._begin(runs)

    def _begin(self, runs: list[_Run]) -> list:
        """Reset the environments of ``runs`` (fresh trajectories of one group) and return their first
        turns; a trajectory whose reset fails is ended (retried) at once."""
        self.driver.reset([r.traj for r in runs], {id(r.traj): r.state for r in runs},
                          {runs[0].traj.request: runs[0].record})
        seqs = []
        for r in runs:
            r.out.prompt_ids = list(r.traj.prompt_ids)
        live = [r for r in runs if r.traj.failure is None and self.driver.room(r.traj)]
        by_prompt: dict[tuple, list[_Run]] = {}
        for r in live:
            by_prompt.setdefault(tuple(r.traj.prompt_ids), []).append(r)
        for members in by_prompt.values():
            seqs += self._turns(members, 0)
        for r in runs:
            if r not in live:
                seqs += self._end(r)
        return seqs

    def _turns(self, members: list[_Run], turn: int) -> list:
        """The scheduler sequences of ``members``' next turn (one request: a first turn's samples share it)."""
        first = members[0]
        seed = turn_seed(sampling_seed(self.trainer_seed, first.group.origin), first.traj, turn, len(members) > 1)
        limit = self.driver.max_new(first.traj)
        request = GenerationRequest(list(first.traj.context), sampling=self.sampling.replace(
            n=len(members), max_new_tokens=limit), seed=seed)
        seqs, _ = self.side.engine.prepare([request], request_offset=first.traj.request)
        for s, r in zip(seqs, members):
            s.key = (first.group.origin, first.traj.request, turn, first.traj.attempts, r.traj.sample)
            r.turn, r.limit, r.finished_at, r.state.step, r.seq = s.out, limit, -1, None, s
            self.by_turn[id(s.out)] = r
        return seqs

    def _advance(self, before: Optional[int]) -> None:
        """Answer the turns that finished before decode count ``before`` (None: all), in finishing order:
        the environment steps' answers shared and applied, next turns queued, ended trajectories closed."""
        due = [r for r in self.waiting if before is None or r.finished_at < before]
        if not due:
            return
        self.waiting = [r for r in self.waiting if not (before is None or r.finished_at < before)]
        sizes = [(len(r.traj.response_ids), r.traj.attempts) for r in due]
        for r in due:
            r.stops.append(r.turn.stop_token if r.turn.stop_token is not None else
                           (r.turn.token_ids[-1] if r.turn.token_ids else None))
        going = {id(t) for t in self.driver.settle([(r.traj, r.turn, r.state, r.limit, r.traj.turns) for r in due])}
        for r, (size, attempt) in zip(due, sizes):
            if r.traj.attempts != attempt or r.group.key not in self.runs:  # its group started over here
                continue
            versions = list(r.turn.versions) or [self.received] * len(r.turn.token_ids)
            observed = len(r.traj.response_ids) - size - len(r.turn.token_ids)
            r.out.versions += versions + [versions[-1] if versions else self.received] * observed
            if id(r.traj) in going and self.driver.room(r.traj):
                self.ready += self._turns([r], r.traj.turns)
            else:
                self.ready += self._end(r)

    def _end(self, run: _Run) -> list:
        """``run``'s trajectory ended: run it (or its group) again if it failed with retries left (returns
        the new first turns), else close its environment and complete the group when all have ended."""
        t, runs = run.traj, self.runs[run.group.key]
        if t.failure is not None and t.attempts < self.mt.max_retries:
            again = runs if self.mt.failure_policy == "resample_group" else [run]
            self._forget(again)
            for r in again:
                r.traj.restart()
                r.out.versions, r.stops = [], []
            return self._begin(again)
        self._close(run)
        if run.group.done_at < 0 and all(r.traj.end for r in runs):  # the last of its group to end
            failed = any(r.traj.failure is not None for r in runs)
            for r in runs:
                r.traj.dropped = failed
            if failed and self.driver.leader:
                self.driver.log(f"dropped the group of prompt {t.request} of loader batch {run.group.origin}: its "
                                f"environment or tools kept failing after {self.mt.max_retries} retries; its rows "
                                "carry no loss")
            run.group.done_at = self.decoded
            self.completed.append(run.group)
        return []

    def _forget(self, runs: list[_Run]) -> None:
        """Stop ``runs``' running turns, unanswered steps and environments (their group starts over, or is dropped)."""
        turns = [r.turn for r in runs if r.turn is not None and id(r.turn) in self.by_turn]
        if turns and self.scheduler is not None:
            self.scheduler.cancel(turns)
        for o in turns:
            self.by_turn.pop(id(o), None)
        self.waiting = [w for w in self.waiting if w not in runs]
        drop = {id(s.out) for s in self.ready if any(s.out is r.turn for r in runs)}
        self.ready = [s for s in self.ready if id(s.out) not in drop]
        for r in runs:
            self._close(r)

    def _close(self, run: _Run) -> None:
        if self.driver.leader and run.state.env is not None:
            Call(run.state.env.close, 1.0)  # never waited for: close must not block the stream
            run.state.env = None

    def _drop(self, group: Group, t: int) -> None:
        runs = self.runs.pop(group.key, [])
        self._forget(runs)
        for r in runs:
            self.by_out.pop(id(r.out), None)
        super()._drop(group, t)

    def _rows(self, groups: list) -> SampleTensors:
        runs = [r for g in groups for r in self.runs.pop(g.key)]
        for r in runs:
            self.by_out.pop(id(r.out), None)  # the base loop's record of a group's outputs
        samples = to_sample_tensors([r.traj for r in runs], self.device, self.pad_id)
        versions = []
        for r, length in zip(runs, samples.column("response_len").tolist()):
            own = r.out.versions if len(r.out.versions) == length else [self.received] * length  # an empty one's pad
            versions += own
        samples.versions = torch.tensor(versions, dtype=torch.long, device=self.device)
        return samples

    # ------------------------------------------------------------------ resume
    def _state(self, step: int) -> AsyncInFlight:
        """The base loop's state, with every trajectory of its groups as plain data (see the module docstring)."""
        state = super()._state(step)
        queue = [id(o) for o in self.scheduler.queue] if self.scheduler is not None else []
        waiting, ready = [id(r) for r in self.waiting], [id(q.out) for q in self.ready]
        for g in state.groups:
            for r in self.runs[g.key]:
                t, turn = r.traj, r.turn
                status = "ended" if t.end else "waiting" if id(r) in waiting else "ready" if id(turn) in ready \
                    else "running"
                state.trajectories.append({
                    "traj": {"prompt_ids": list(t.prompt_ids), "response_ids": list(t.response_ids),
                             "mask": list(t.mask), "logprobs": list(t.logprobs),
                             "segments": [[k, a, b] for k, a, b in t.segments],
                             "counters": [t.turns, t.tool_calls, t.tool_errors, t.tool_timeouts, t.tool_turns,
                                          t.attempts, int(t.dropped)],
                             "env_reward": float(t.env_reward), "end": t.end, "failure": t.failure or ""},
                    "versions": list(r.out.versions), "stops": [-1 if x is None else int(x) for x in r.stops],
                    "status": status, "finished_at": r.finished_at, "limit": r.limit,
                    "queued": queue.index(id(turn)) if turn is not None and id(turn) in queue else -1,
                    "ready": ready.index(id(turn)) if status == "ready" else -1,
                    "waiting": waiting.index(id(r)) if status == "waiting" else -1,
                    "turn": {} if status == "ended" or turn is None else {
                        "token_ids": list(turn.token_ids), "logprobs": list(turn.logprobs),
                        "versions": list(turn.versions), "finish": turn.finish_reason or "",
                        "stop": -1 if turn.stop_token is None else int(turn.stop_token),
                        "sample": turn.sample_index, "stream": int(r.seq.stream) if r.seq else 0,
                        "max_new": int(r.seq.max_new) if r.seq else 0}})
        return state

    def _restore(self, state: AsyncInFlight) -> list:
        """The base loop's state back, each group's trajectories rebuilt: environments re-created and the
        saved assistant turns replayed into them (an environment that answers otherwise refuses the
        resume), running turns continued from their tokens, queued and ready ones re-queued in order."""
        saved, at = state.trajectories, 0
        self.restored: list = []  # (run, saved dict) of the groups still running, filled by _resume
        self.saved: dict = {}  # group key -> its trajectories' saved dicts
        for g in state.groups:
            runs = []
            self.saved[g.key] = saved[at:at + len(g.outs)]
            for j, o in enumerate(g.outs):
                d = saved[at]
                at += 1
                t = Trajectory(g.index, j, prompt_ids=list(d["traj"]["prompt_ids"]),
                               response_ids=list(d["traj"]["response_ids"]), mask=list(d["traj"]["mask"]),
                               logprobs=list(d["traj"]["logprobs"]),
                               segments=[(k, int(a), int(b)) for k, a, b in d["traj"]["segments"]],
                               env_reward=float(d["traj"]["env_reward"]), end=d["traj"]["end"],
                               failure=d["traj"]["failure"] or None)
                (t.turns, t.tool_calls, t.tool_errors, t.tool_timeouts, t.tool_turns, t.attempts,
                 dropped) = d["traj"]["counters"]
                t.dropped = bool(dropped)
                o.prompt_ids, o.versions = list(t.prompt_ids), list(d["versions"])
                runs.append(_Run(t, o, g, None, limit=int(d["limit"]), finished_at=int(d["finished_at"]),
                                 stops=[None if x < 0 else int(x) for x in d["stops"]]))
            self.runs[g.key] = runs
        todo = super()._restore(state)  # the running groups' runs come back through _resume
        failures: list[int] = []
        for r, d in self.restored:
            failed = 0
            if d["status"] != "ended" and self.driver.leader:
                problem = self.driver.replay(r.traj, r.state, r.record, r.stops)
                if problem is not None:
                    self.driver.log(f"prompt {r.traj.request} sample {r.traj.sample}: {problem}")
                    failed = 1
            failures.append(failed)
        failures, _ = self.driver.channel.share(failures, [])
        if any(failures):
            raise CheckpointError("an environment answered a replayed trajectory otherwise than when it was saved "
                                  "(rollout.multi_turn.environment must be deterministic given its record and "
                                  "the assistant turns for an exact resume of trainer.mode=async): start the run "
                                  "again, or resume it with trainer.mode=one_step_off's checkpoints")
        running, queued, ready = [], [], []
        for r, d in self.restored:
            if d["status"] == "waiting":
                self.waiting.append((int(d["waiting"]), r))
                if self.driver.leader and r.turn.finish_reason == "stop":
                    self.driver.begin_step(r.traj, r.turn, r.state)
            elif d["status"] in ("running", "ready"):
                seq = r.seq
                self.by_turn[id(seq.out)] = r
                if d["status"] == "ready":
                    ready.append((int(d["ready"]), seq))
                elif seq.out.token_ids:
                    running.append(seq)
                else:
                    queued.append((int(d["queued"]), seq))
        # the finishing order of the turns not answered yet: the order _advance answers them in
        self.waiting = [r for _, r in sorted(self.waiting, key=lambda x: x[0])]
        self.saved = {}
        self.ready = [q for _, q in sorted(ready, key=lambda x: x[0])]
        return todo + sorted(running, key=lambda q: q.order) + [q for _, q in sorted(queued, key=lambda x: x[0])]

    def _resume(self, g: Group) -> list:
        """Rebuild running group ``g``'s trajectories' turns (their sequences keep the saved random streams);
        the environments are replayed by :meth:`_restore` once every group is back."""
        record = self.loader.dataset[g.uid]  # the prompt's row (its environment's reset reads it)
        for r, d in zip(self.runs[g.key], self.saved.pop(g.key)):
            r.record = record
            self.restored.append((r, d))
            if d["status"] in ("ended", "") or not d["turn"]:
                continue
            turn = d["turn"]
            request = GenerationRequest(list(r.traj.context), sampling=self.sampling.replace(
                n=1, max_new_tokens=max(1, int(turn["max_new"]) or 1)), seed=0)
            (seq,), _ = self.side.engine.prepare([request], request_offset=r.traj.request)
            seq.stream, seq.max_new = int(turn["stream"]), int(turn["max_new"])
            seq.key = (g.origin, r.traj.request, r.traj.turns, r.traj.attempts, r.traj.sample)
            seq.out.sample_index = int(turn["sample"])
            seq.out.token_ids, seq.out.logprobs = list(turn["token_ids"]), list(turn["logprobs"])
            seq.out.versions = list(turn["versions"])
            seq.out.finish_reason = turn["finish"] or None
            seq.out.stop_token = None if turn["stop"] < 0 else int(turn["stop"])
            r.turn, r.seq = seq.out, seq
        return []

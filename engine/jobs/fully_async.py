"""``trainer.mode: async``: the generation pool streams samples, up to ``k`` weight versions ahead.

The training pool runs :class:`~hyflow.jobs.one_step_off.PooledSteps`: step ``t`` receives batch
``t``, updates, sends the control message and then ``w_t``. Each generation replica runs **one
long-lived scheduler** (:meth:`~hyflow.rollout.engine.GenerationEngine.stream`): whenever cache slots
free up, :class:`AsyncGeneration` feeds it the next prompts (whole GRPO groups, ``rollout.n``
samples each, in the prompt loader's order: this replica's share of loader batch 1, then of 2, ...;
seeds keyed by the loader step and the global prompt index, as the colocated job keys them).

* **Batches stream, earliest deadline first.** A group's *deadline* is the last batch it may land
  in: batch ``t`` trains after ``t - 1`` updates, so ``oldest token's version + k + 1``. Training
  batch ``t`` on a replica is ``B_r`` (its share of ``data.train_batch_size``) completed groups in no
  batch yet, taken by (deadline, completion, loader step, prompt index) -- completion: the decode
  step at which a group's last sample finished, so the batches are a function of decode steps, never
  of wall time. It forms as soon as ``B_r`` groups are complete, unless taking them would leave a
  running group no place before its deadline: for each deadline ``d``, the groups due by ``d``
  (completed or running) share the ``(d - t + 1) B_r`` places of batches ``t..d``, so batch ``t``
  must take at least ``due(d) - (d - t) B_r`` of them; when fewer are complete it waits (for a long
  group whose deadline is ``t``, typically). So a long group does not hold back the batches before
  its deadline (shorter groups fill them), and it is not dropped at its deadline either. A batch's
  rows are sorted by (loader step, prompt index) and renumbered as the batch's prompts; each row
  carries its origin (loader step, prompt index, dataset index: :data:`hyflow.placement.rows.ORIGIN`)
  so the training pool scores it against its own prompt.
* **Admission bound** (AReaL's): a replica starts a group only while ``started - dropped <
  (received + 1 + k) * B_r`` (``received``: weight updates received), and never more than the run
  needs. It is what makes every group fit: a group started now gets a deadline of at least
  ``received + k + 1``, and at most ``(received + k + 1 - formed) B_r`` groups are in no batch.
* **Why wait rather than drop** (the first streaming rule filled batches in completion order and
  dropped a group that missed its deadline): the groups that miss it are the long ones, so dropping
  them trains on a sample biased to short answers and wastes their decode. On
  ``configs/async_length_tail.yaml`` it dropped 9-15% of the samples (groups 1.5x the kept mean length
  already when stopped); the deadline rule drops none at the same samples/s (the reward over 5 seeds
  is within their spread either way: BENCHMARKS.md, "Fully asynchronous").
* **Stale groups are dropped and counted** where no place is left (not reached under the admission
  bound; kept as the guarantee): a completed group whose oldest token is
  more than ``k`` versions behind the update that would train on it is dropped, its samples counted
  in ``fully_async/count/dropped_stale_samples`` of the batch being formed (the training lead's log
  says how many); its prompt is not retried. A running group that is already too stale for the next
  batch to form is stopped at once (its slots go to new prompts), dropped and counted the same way.
* **Weight exchange** (the control message, then the weight sync: collective with the training pool
  and every replica). A replica enters the receive of ``w_v`` only once it has sent batch ``v``
  (else the training pool waits for batch ``v`` while the replica waits for ``w_v``), and sends batch
  ``t`` only once it holds ``w_(t-1)`` (the training pool's order). The exchange becomes *due* at the
  first token boundary where batch ``v`` is sent and the admission bound stops new groups; it is taken
  ``trainer.update_after_tokens`` decode steps later (the running samples are half generated: with
  ``trainer.partial_rollout=continue`` their caches are recomputed with the new weights, with
  ``abort`` they restart), or at once when nothing can run (every started group done). With
  ``update_after_tokens = 0`` it is taken only then: no sample spans two versions.
* **DAPO dynamic sampling** (``algorithm.dynamic_sampling``): a completed group whose rewards are all
  equal enters no batch; it is counted against the next batch to form and its place goes to a new
  group, as a dropped group's (:mod:`hyflow.jobs.async_filter`).

``k = 0`` is the pooled ``sync`` run (only batch ``t``'s groups may start before ``w_(t-1)``, and they
all complete before the exchange). With ``k >= 1`` groups of several loader batches run together, so a
training batch may mix loader batches; the staleness of a batch is at most ``k`` by the deadlines.
Every generated token records the weight version that sampled it
(:mod:`hyflow.rollout.scheduler`): the rollout correction (``actor.rollout_correction``) divides by
each token's own behaviour log-prob, and :func:`version_metrics` reports the staleness, the versions
spread in a sample and the dropped samples.

Why fixed token boundaries and not "whenever the weights arrive" (verl's fully async trainer, AReaL):
a poll would make the run depend on timing (not reproducible, not resumable to the same result),
and NCCL needs every member of the weight sync's groups to enter it; fixed boundaries give both.

A checkpoint (written at an exchange the training lead marks) holds each replica's whole in-flight
state (:class:`AsyncInFlight`): every group started and not sent (tokens, log-probs, versions,
finish, completion step), the formed batches not sent, the loader position, the counters; a resumed
run continues the scheduler from it and equals the straight run.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from hyflow.checkpoint.errors import CheckpointError
from hyflow.placement.inflight import INFLIGHT_DIR, inflight_file, load_inflight_data
from hyflow.placement.rows import send_rows
from hyflow.rollout.dp import META, SampleTensors

ASYNC_FORMAT, ASYNC_VERSION = "hyflow-inflight-async", 3  # 3: the dynamic-sampling filter's counts
_TENSORS = ("meta", "tokens", "logprobs", "versions")
_COUNTERS = ("step", "formed", "started", "dropped", "decoded", "origin", "next_index")


@dataclass
class Group:
    """One prompt's ``n`` samples on a replica, from its start until its batch is sent."""

    origin: int  # the loader step whose batch the prompt is in
    index: int  # the prompt's global index in that batch (its seeds' key)
    uid: int  # the prompt's dataset index
    outs: list  # SampleOutput per sample, filled in place by the scheduler
    done_at: int = -1  # the replica's decode count when its last sample finished (-1: running)
    batch: int = 0  # the training batch it is in (0: none yet)

    @property
    def key(self) -> tuple[int, int]:
        return self.origin, self.index

    def oldest(self, default: int) -> int:
        versions = [v for o in self.outs for v in o.versions]
        return min(versions) if versions else default


@dataclass
class AsyncInFlight:
    """A generation replica's state when the training pool saves after update ``step - 1``."""

    step: int  # the next batch to send (the checkpoint's step + 1)
    loader: dict  # the prompt loader's position before the batch of ``origin`` was drawn
    counters: dict  # formed, started, dropped, decoded, origin, next_index
    groups: list = field(default_factory=list)  # Group, started and not sent (outs as they stand)
    drops: dict = field(default_factory=dict)  # batch -> samples dropped while forming it (not sent yet)
    filtered: list = field(default_factory=list)  # [batch, groups] the dynamic-sampling filter kept out (not sent)
    #: multi-turn: each group's trajectories as plain data (:mod:`hyflow.jobs.async_trajectories`)
    trajectories: list = field(default_factory=list)


def _pack(t: SampleTensors) -> dict:
    return {k: getattr(t, k).detach().cpu() for k in _TENSORS if getattr(t, k) is not None}


def _unpack(d: dict, device) -> SampleTensors:
    return SampleTensors(**{k: d[k].to(device) for k in _TENSORS if k in d})


def write_async_inflight(path: str, rank: int, state: AsyncInFlight, pool: Any, layout: Any) -> None:
    """This generation rank's ``inflight/rank_<rank>.pt``: tensors and plain data only (read with
    ``weights_only=True``), hashed in the checkpoint's manifest like the rest."""
    outs = [o for g in state.groups for o in g.outs]
    data = {"format": ASYNC_FORMAT, "version": ASYNC_VERSION, "step": int(state.step),
            "counters": {k: int(state.counters[k]) for k in _COUNTERS if k != "step"},
            "loader": {str(k): v for k, v in state.loader.items()},
            "pool": [int(pool.start), int(pool.stop)], "layout": [int(layout.tp), int(layout.pp), int(layout.dp)],
            "groups": torch.tensor([[g.origin, g.index, g.uid, g.done_at, g.batch, len(g.outs)] for g in state.groups],
                                   dtype=torch.long, device="cpu").view(-1, 6),  # a file's contents
            "samples": _pack(SampleTensors.from_samples(outs, torch.device("cpu"))),
            "drops": [[int(t), int(c)] for t, c in sorted(state.drops.items())],
            "filtered": [[int(t), int(c)] for t, c in state.filtered]}
    if state.trajectories:
        data["trajectories"] = state.trajectories
    os.makedirs(os.path.join(path, INFLIGHT_DIR), exist_ok=True)
    torch.save(data, inflight_file(path, rank))


def read_async_inflight(path: str, rank: int, pool: Any, layout: Any, device: torch.device) -> AsyncInFlight:
    """What :func:`write_async_inflight` wrote. A wrong file, or one an older hyflow wrote (its
    batches were not streamed), raises one :class:`CheckpointError`."""
    data = load_inflight_data(path, rank, pool, layout, ASYNC_FORMAT, ASYNC_VERSION)
    if int(data["version"]) != ASYNC_VERSION:
        raise CheckpointError(f"{inflight_file(path, rank)} is an async in-flight file of version {data['version']}; "
                              f"this hyflow reads version {ASYNC_VERSION} only: resume it with the hyflow that wrote "
                              "it, or start the run again")
    try:
        outs = _unpack(data["samples"], device).to_outputs()
        groups, at = [], 0
        for origin, index, uid, done_at, batch, n in data["groups"].tolist():
            groups.append(Group(origin, index, uid, outs[at:at + n], done_at, batch))
            at += n
        counters = dict(data["counters"], step=int(data["step"]))
        return AsyncInFlight(step=int(data["step"]), loader=dict(data["loader"]), counters=counters,
                             groups=groups, drops={int(t): int(c) for t, c in data["drops"]},
                             filtered=[[int(t), int(c)] for t, c in data["filtered"]],
                             trajectories=list(data.get("trajectories", [])))
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{inflight_file(path, rank)} is not an async in-flight file this hyflow reads "
                              f"({type(e).__name__}: {e})") from None


class AsyncGeneration:
    """One generation rank's loop (see the module docstring): the feeder, the token-boundary hook and
    the completion callback of its replica's long-lived scheduler. ``side``: the
    :class:`~hyflow.placement.pool_models.GenerationSide`; ``exchange_control()``: the training lead's
    control message (:func:`hyflow.placement.inflight.control`, collective with it); ``group_filter``:
    DAPO dynamic sampling's :class:`~hyflow.jobs.async_filter.GroupFilter`, or None."""

    filter = None  # the GroupFilter (a class default: forming-only tests build the loop without __init__)

    def __init__(self, cfg, side, loader, routes, exchange_control: Callable, ckpts=None, group_filter=None) -> None:
        t = cfg.trainer
        self.total, self.k, self.after, self.partial = t.total_steps, t.max_staleness, t.update_after_tokens, \
            t.partial_rollout
        self.n, self.max_new = cfg.rollout.n, cfg.rollout.max_new_tokens
        self.side, self.loader, self.routes, self.control = side, loader, routes, exchange_control
        self.ckpts = ckpts  # GenerationCheckpoints: this rank joins the training pool's saves
        self.filter = group_filter
        self.device = side.groups.device
        self.rank = dist.get_rank()
        self.first, stop = side.share(cfg.data.train_batch_size)
        self.share = stop - self.first  # B_r: groups per training batch on this replica
        self.received = self.sent = self.formed = 0  # weight updates received; batches sent / formed
        self.started = self.dropped = 0  # groups
        self.decoded = 0  # this replica's decode steps
        self.groups: dict[tuple[int, int], Group] = {}  # started, not sent
        self.by_out: dict[int, Group] = {}  # id(SampleOutput) -> its group, while running
        self.completed: list[Group] = []  # completed since the last batch forming
        self.unbatched: list[Group] = []  # completed, taken in by a forming, in no batch yet
        self.batches: dict[int, list[Group]] = {}  # formed, not sent
        self.drops: dict[int, int] = {}  # batch -> samples dropped while forming it
        self.prompts: deque = deque()  # (index, record) of loader batch ``origin`` not started yet
        self.origin, self.drawn_from = 0, loader.state_dict()
        self.due: Optional[int] = None  # the decode count at which the next exchange became due
        self.stopped = False
        self.waited, self.mark = 0.0, time.perf_counter()  # waits for the training pool since the last send

    # ------------------------------------------------------------------ loop
    def run(self, resumed: Optional[AsyncInFlight] = None) -> None:
        """Stream until the training pool says stop. ``resumed``: the state a checkpoint saved (the
        weights of its step were received just before, as at the save)."""
        todo = self._restore(resumed) if resumed is not None else []
        self._form()
        self._send_ready()
        # groups started and not sent stay under (k + 1) B_r (the admission bound, since received <= sent)
        self.side.engine.stream(self._feed, todo, max_new_tokens=self.max_new, on_finish=self._finished,
                                max_sequences=(self.k + 1) * self.share * self.n,
                                version=self.received, on_decode=self._on_decode, partial=self.partial)
        if not self.stopped:  # the stream ends only when the feeder hears the training pool's stop
            raise RuntimeError(f"rank {self.rank}: the generation stream ended before the training pool's stop")

    def _may_start(self) -> bool:
        return self.started - self.dropped < min(self.received + 1 + self.k, self.total) * self.share

    def _feed(self, scheduler) -> list:
        """New groups while cache slots are free and the admission bound allows; when nothing can run,
        the weight exchange (then new groups, or none: the training pool said stop)."""
        while True:
            seqs = []
            while scheduler.free_slots - scheduler.queued - len(seqs) > 0 and self._may_start():
                seqs += self._start()
            if seqs or scheduler.running or scheduler.queued:
                return seqs
            self._form()  # groups completed at admission since the last token boundary
            self._send_ready()
            if self._may_start() and not self.stopped:  # a drop freed a place
                continue
            if self.stopped or not self._exchange():
                return []
            scheduler.new_weights(self.received)

    def _start(self) -> list:
        if not self.prompts:
            self.origin += 1
            self.drawn_from = self.loader.state_dict()  # a save resumes by drawing this batch again
            records = self.loader.next_batch()
            self.prompts = deque((i, records[i]) for i in range(self.first, self.first + self.share))
        index, record = self.prompts.popleft()
        group, seqs = self._open(record, index)
        self._track(group)
        self.started += 1
        return seqs

    def _open(self, record, index: int) -> tuple[Group, list]:
        """Prompt ``index`` of loader batch ``origin``: its group and the sequences that start it (a
        multi-turn feeder starts first turns: :mod:`hyflow.jobs.async_trajectories`)."""
        seqs = self.side.sequences(record.prompt_ids, self.origin, index, self.n)
        return Group(self.origin, index, record.uid, [s.out for s in seqs]), seqs

    def _track(self, group: Group) -> None:
        self.groups[group.key] = group
        for o in group.outs:
            if o.finish_reason is None:
                self.by_out[id(o)] = group

    def _finished(self, out) -> None:
        group = self.by_out.pop(id(out))
        if not any(id(o) in self.by_out for o in group.outs):
            group.done_at = self.decoded
            self.completed.append(group)

    def _on_decode(self, scheduler) -> Optional[int]:
        """A token boundary: form and send batches; take the exchange when it is due."""
        self.decoded += 1
        self._form()
        self._stop_doomed(scheduler)
        self._send_ready()
        if self.after == 0 or self.stopped:
            return None
        if self.due is None and self.sent > self.received and not self._may_start():
            self.due = self.decoded
        if self.due is None or self.decoded - self.due < self.after:
            return None
        return self.received if self._exchange() else None

    # --------------------------------------------------------------- batches
    def _deadline(self, g: Group) -> Optional[int]:
        """The last batch ``g`` may land in: batch ``t`` trains after ``t - 1`` updates, so at most
        ``k`` versions after its oldest token. None: running with no token yet (its deadline will be
        at least ``received + k + 1``: no batch formed before then can take its place)."""
        if g.done_at < 0 and not any(o.versions for o in g.outs):
            return None
        return g.oldest(self.received) + self.k + 1

    def _form(self) -> None:
        """Completed groups into batches of ``B_r``, earliest deadline first, waiting for running
        groups where taking a later group would leave one without a place (see the module docstring);
        a completed group past its deadline is dropped (counted against the batch being formed)."""
        if self.filter is not None:  # DAPO dynamic sampling
            self._filter()
        for g in sorted(self.completed, key=lambda g: (g.done_at, g.origin, g.index)):
            self.unbatched.append(g)
        self.completed = []
        while self.share:
            t = self.formed + 1
            for g in [g for g in self.unbatched if self._deadline(g) < t]:
                self.unbatched.remove(g)
                self._drop(g, t)
            if len(self.unbatched) < self.share or self._must_wait(t):
                break
            ready = sorted(self.unbatched, key=lambda g: (self._deadline(g), g.done_at, g.origin, g.index))
            batch = sorted(ready[:self.share], key=lambda g: g.key)
            for member in batch:
                member.batch = t
                self.unbatched.remove(member)
            self.batches[t], self.formed = batch, t
        while self.share == 0 and self.formed < self.total:  # a replica with no prompts sends nothing
            self.formed += 1
            self.batches[self.formed] = []

    def _must_wait(self, t: int) -> bool:
        """Whether batch ``t``, formed now from the earliest-deadline completed groups, would leave a
        running group no place: for a deadline ``d``, the groups due by ``d`` (completed or running)
        have ``(d - t + 1) B_r`` places in batches ``t..d``, so batch ``t`` must take at least
        ``due(d) - (d - t) B_r`` of them (``B_r`` at most: beyond that some must be dropped) and it
        takes ``min(B_r, completed ones due by d)``."""
        running = sorted(d for g in self.groups.values() if g.done_at < 0
                         for d in [self._deadline(g)] if d is not None and d >= t)
        done = sorted(self._deadline(g) for g in self.unbatched)
        for d in sorted(set(running)):
            ready = sum(x <= d for x in done)
            need = ready + sum(x <= d for x in running) - (d - t) * self.share
            if min(self.share, ready) < min(self.share, need):
                return True
        return False

    def _stop_doomed(self, scheduler) -> None:
        """Drop (and count) the running groups that can make no batch any more: a group lands at the
        earliest in batch ``formed + 1``, and its oldest token (a sample's first) already makes it more
        than ``k`` versions stale there. Their cache slots go to new prompts at once."""
        for g in [g for g in self.groups.values() if g.done_at < 0]:
            first = [o.versions[0] for o in g.outs if o.versions]
            if first and self.formed - min(first) > self.k:  # its staleness in batch formed + 1
                scheduler.cancel(g.outs)
                for o in g.outs:
                    self.by_out.pop(id(o), None)
                self._drop(g, self.formed + 1)

    def _drop(self, group: Group, t: int) -> None:
        """``group`` is never trained on: its samples are counted against batch ``t``."""
        self.dropped += 1
        self.drops[t] = self.drops.get(t, 0) + len(group.outs)
        del self.groups[group.key]

    def _filter(self) -> None:
        """DAPO dynamic sampling (:mod:`hyflow.jobs.async_filter`): the completed groups without reward
        variance, in completion order, enter no batch; each is counted against the next batch to form
        and its place goes to a new group (the admission bound), as a dropped group's."""
        done = sorted(self.completed, key=lambda g: (g.done_at, g.origin, g.index))
        self.filter.score(done)
        self.completed = []
        for g in done:
            if self.filter.keep(g, self.formed + 1):
                self.completed.append(g)
            else:
                self.dropped += 1
                del self.groups[g.key]

    def _send_ready(self) -> None:
        while not self.stopped and self.sent + 1 in self.batches and self.received >= self.sent:
            t = self.sent + 1
            groups = self.batches.pop(t)
            samples = self._rows(groups)
            samples.meta[:, META.index("request")] = torch.tensor(
                [self.first + j for j, g in enumerate(groups) for _ in g.outs], dtype=torch.long, device=self.device)
            origins = torch.tensor([[g.origin, g.index, g.uid] for g in groups for _ in g.outs],
                                   dtype=torch.long, device=self.device).view(-1, 3)
            oldest = min((g.oldest(self.received) for g in groups), default=self.received)
            start = time.perf_counter()
            with torch.inference_mode(False):
                send_rows(samples, self.routes, self.rank, oldest, max(0.0, start - self.mark - self.waited),
                          wait_seconds=self.waited, origins=origins, dropped=self.drops.pop(t, 0),
                          filtered=self.filter.pop(t) if self.filter is not None else 0)
            self.waited, self.mark = time.perf_counter() - start, start  # a send waits for the training pool
            for g in groups:
                del self.groups[g.key]
            self.sent = t

    def _rows(self, groups: list) -> SampleTensors:
        """The rows of a formed batch's ``groups``, in order (their requests renumbered by the caller)."""
        return SampleTensors.from_samples([o for g in groups for o in g.outs], self.device)

    # -------------------------------------------------------------- exchange
    def _exchange(self) -> bool:
        """Receive the next weight version (the control message first), join a save the training
        pool writes now; then send what may go. False: the training pool said stop."""
        if self.sent <= self.received:  # the training pool would wait for a batch this replica holds
            raise RuntimeError(f"rank {self.rank}: the exchange of w_{self.received + 1} before batch "
                               f"{self.received + 1} was sent (a scheduling bug)")
        start = time.perf_counter()
        # the weight sync writes the model in place: outside the engine's inference mode, so its
        # buffers stay ordinary tensors
        with torch.inference_mode(False), torch.no_grad():
            msg = self.control()
            if msg.go:
                self.side.receive_weights()
            if msg.save:
                self.ckpts.save(msg, self._state(msg.step + 1), write=write_async_inflight)
        self.waited += time.perf_counter() - start
        self.due = None
        if not msg.go:
            self.stopped = True
            return False
        self.received += 1
        self._send_ready()
        return True

    # ---------------------------------------------------------------- resume
    def _state(self, step: int) -> AsyncInFlight:
        counters = {"formed": self.formed, "started": self.started, "dropped": self.dropped,
                    "decoded": self.decoded, "origin": self.origin,
                    "next_index": self.prompts[0][0] if self.prompts else self.first + self.share}
        return AsyncInFlight(step=step, loader=self.drawn_from, counters=counters,
                             groups=sorted(self.groups.values(), key=lambda g: g.key), drops=dict(self.drops),
                             filtered=self.filter.state() if self.filter is not None else [])

    def _restore(self, state: AsyncInFlight) -> list:
        """Take ``state`` back; returns the sequences the scheduler continues (half generated or not
        started, in (loader step, prompt, sample) order: the order a refresh re-feeds them in)."""
        c = state.counters
        self.received = self.sent = state.step - 1
        self.formed, self.started, self.dropped, self.decoded = c["formed"], c["started"], c["dropped"], c["decoded"]
        self.origin, self.drops = c["origin"], dict(state.drops)
        if self.filter is not None:
            self.filter.load(state.filtered)
        self.loader.load_state_dict(state.loader)
        self.drawn_from = state.loader
        if self.origin:
            records = self.loader.next_batch()
            self.prompts = deque((i, records[i]) for i in range(c["next_index"], self.first + self.share))
        todo = []
        for g in state.groups:
            self._track(g)
            if g.batch:
                self.batches.setdefault(g.batch, []).append(g)
            elif g.done_at >= 0:
                self.unbatched.append(g)
            else:
                todo += self._resume(g)
        return todo

    def _resume(self, g: Group) -> list:
        """The sequences that continue running group ``g`` as a checkpoint saved it."""
        seqs = self.side.sequences(g.outs[0].prompt_ids, g.origin, g.index, self.n)
        for s, o in zip(seqs, g.outs):
            s.out = o
        return [s for s in seqs if s.out.finish_reason is None]


def version_metrics(samples: SampleTensors, step: int, max_staleness: int, dp_group,
                    device: torch.device, dropped: int = 0) -> dict:
    """Staleness of the rows a training rank received for ``step`` (per sample: its oldest token's
    version; ``step - 1`` versions are applied before the update), summed over the training
    data-parallel ranks (every rank of a DP rank holds the same rows): the mean, max and histogram of
    the samples' staleness, the tokens' mean staleness, and how many versions a sample spans (verl's
    ``fully_async/partial/*`` and ``fully_async/count/stale_samples_processed`` where it has the name), and
    ``dropped``: the samples the generation replicas dropped as too stale while forming this batch (this
    rank's senders' count; summed over the DP ranks, each replica is counted once: :func:`send_rows`)."""
    lens = samples.column("response_len").tolist()
    parts = [p for p in torch.split(samples.versions, lens) if p.numel()]
    none = torch.zeros(0, dtype=torch.long, device=samples.versions.device)
    oldest = torch.stack([p.min() for p in parts]) if parts else none
    newest = torch.stack([p.max() for p in parts]) if parts else none
    stale = (step - 1) - oldest
    spread = newest - oldest
    token_stale = (step - 1) - samples.versions
    buckets = max_staleness + 1
    hist = torch.bincount(stale.clamp(0, buckets), minlength=buckets + 1)[:buckets + 1]
    sums = torch.tensor([len(parts), float(stale.sum()), float((stale > max_staleness).sum()),
                         float((spread > 0).sum()), float(spread.sum()), token_stale.numel(),
                         float(token_stale.sum()), float(dropped), *hist.tolist()], dtype=torch.float64,
                        device=device)
    highs = torch.tensor([float(stale.max()) if len(parts) else 0.0, float(spread.max()) if len(parts) else 0.0],
                         dtype=torch.float64, device=device)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(sums, group=dp_group)
        dist.all_reduce(highs, op=dist.ReduceOp.MAX, group=dp_group)
    n, stale_sum, over, partial, spread_sum, tokens, token_sum, dropped, *hist = sums.tolist()
    if over:
        raise RuntimeError(f"step {step}: {int(over)} samples are more than trainer.max_staleness={max_staleness} "
                           "weight versions old (the generation pool drops those before sending: a bug)")
    out = {
        "fully_async/staleness/mean": stale_sum / max(n, 1),
        "fully_async/staleness/max": highs[0].item(),
        "fully_async/staleness/token_mean": token_sum / max(tokens, 1),
        "fully_async/count/stale_samples_processed": n - hist[0],  # verl's names where it has them
        "fully_async/partial/total_partial_num": partial,
        "fully_async/partial/partial_ratio": partial / max(n, 1),
        "fully_async/version_spread/mean": spread_sum / max(n, 1),
        "fully_async/partial/max_partial_span": highs[1].item(),
        "fully_async/count/dropped_stale_samples": dropped,
    }
    for j, count in enumerate(hist[:buckets]):
        out[f"fully_async/staleness_hist/{j}"] = count / max(n, 1)
    return out

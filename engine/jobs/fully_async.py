"""``trainer.mode: async``: the generation pool samples ahead, up to ``k`` weight versions.

The training pool runs :class:`~hyflow.jobs.one_step_off.PooledSteps` unchanged: step ``t``
receives batch ``t``, updates, sends the control message and then ``w_t``. The generation pool
runs its own loop over batches ``s = 1, 2, ...`` (the prompt loader's order, seeds keyed by step
and prompt as in the colocated job) and meets the training pool only at two kinds of points:

* **receive** ``w_v`` (the control message, then the weight sync: collective with the training
  pool, which publishes ``w_v`` after update ``v``): while sampling batch ``v + k``, after
  ``trainer.update_after_tokens`` decode steps of this replica (a token boundary: the samples
  running then are half generated; with ``trainer.partial_rollout=continue`` their caches are
  recomputed with the new weights and they go on, with ``abort`` they restart), or at the end of
  that batch when it is shorter, or with ``k = 0`` / ``update_after_tokens = 0``;
* **send** batch ``b`` (its rows to the training ranks that own them,
  :mod:`hyflow.placement.rows`) as soon as it is complete and ``w_(b-1)`` was received (the
  training pool's order: send ``w_(b-1)``, receive batch ``b``).

So batch ``s`` starts with ``w_(s-1-k)`` and ends with ``w_(s-k)``: its oldest token is ``k``
versions behind the update that trains on it, never more: no sample ever needs dropping for
staleness (:func:`version_metrics` raises if one is over the bound: a scheduling bug). ``k = 0`` is the pooled
``sync`` run; ``k = 1`` with ``update_after_tokens = 0`` is ``one_step_off``. While the training
pool updates on batch ``t`` the generation pool samples the rest of ``t + 1`` .. ``t + k``: it
waits only when the training pool is more than ``k`` batches behind, and the training pool waits
only for a batch that is not complete yet (the long tail of batch ``t + 1`` is generated while
batch ``t`` is trained on).

The schedule is a function of the decode steps, not of timing, so a run is reproducible. Every
generated token records the weight version that sampled it (:mod:`hyflow.rollout.scheduler`):
the rollout correction (``actor.rollout_correction``) divides by each token's own behaviour
log-prob, and :func:`version_metrics` reports the staleness and the versions spread in a sample.

Why a fixed token boundary and not "whenever the weights arrive" (verl's fully async trainer, AReaL):
a poll would make the run depend on timing (not reproducible, not resumable to the same result),
and NCCL needs every member of the weight sync's groups to enter it; a fixed boundary gives both,
and the generation pool still never waits for an update it does not need.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from hyflow.checkpoint.errors import CheckpointError
from hyflow.placement.inflight import INFLIGHT_DIR, inflight_file, load_inflight_data
from hyflow.placement.rows import send_rows
from hyflow.rollout.dp import SampleTensors

ASYNC_FORMAT, ASYNC_VERSION = "hyflow-inflight-async", 1
_TENSORS = ("meta", "tokens", "logprobs", "versions")


@dataclass
class AsyncInFlight:
    """A generation rank's state when the training pool saves after update ``step - 1``: the complete
    batches not sent yet, the batch half generated (its samples as they stand: finished, half done
    with their tokens' versions, not started), and the prompt loader's position."""

    step: int  # the next batch to send (the checkpoint's step + 1)
    loader: dict  # the prompt loader's position before ``next_batch``'s prompts
    next_batch: int  # the batch to generate next (the half-generated one when ``partial`` is set)
    queue: dict = field(default_factory=dict)  # step -> (SampleTensors, generation seconds, oldest version)
    partial: Optional[SampleTensors] = None
    waited: float = 0.0


def _pack(t: SampleTensors) -> dict:
    return {k: getattr(t, k).detach().cpu() for k in _TENSORS if getattr(t, k) is not None}


def _unpack(d: dict, device) -> SampleTensors:
    return SampleTensors(**{k: d[k].to(device) for k in _TENSORS if k in d})


def write_async_inflight(path: str, rank: int, state: AsyncInFlight, pool: Any, layout: Any) -> None:
    """This generation rank's ``inflight/rank_<rank>.pt``: tensors and plain data only (read with
    ``weights_only=True``), hashed in the checkpoint's manifest like the rest."""
    data = {"format": ASYNC_FORMAT, "version": ASYNC_VERSION, "step": int(state.step),
            "next_batch": int(state.next_batch), "waited": float(state.waited),
            "loader": {str(k): v for k, v in state.loader.items()},
            "pool": [int(pool.start), int(pool.stop)], "layout": [int(layout.tp), int(layout.pp), int(layout.dp)],
            "queue": [{"step": int(b), "seconds": float(sec), "oldest": int(old), **_pack(t)}
                      for b, (t, sec, old) in sorted(state.queue.items())],
            "partial": _pack(state.partial) if state.partial is not None else None}
    os.makedirs(os.path.join(path, INFLIGHT_DIR), exist_ok=True)
    torch.save(data, inflight_file(path, rank))


def read_async_inflight(path: str, rank: int, pool: Any, layout: Any, device: torch.device) -> AsyncInFlight:
    """What :func:`write_async_inflight` wrote (a wrong file raises :class:`CheckpointError`)."""
    data = load_inflight_data(path, rank, pool, layout, ASYNC_FORMAT, ASYNC_VERSION)
    try:
        queue = {int(b["step"]): (_unpack(b, device), float(b["seconds"]), int(b["oldest"])) for b in data["queue"]}
        partial = _unpack(data["partial"], device) if data["partial"] is not None else None
        return AsyncInFlight(step=int(data["step"]), loader=dict(data["loader"]), next_batch=int(data["next_batch"]),
                             queue=queue, partial=partial, waited=float(data["waited"]))
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{inflight_file(path, rank)} is not an async in-flight file this hyflow reads "
                              f"({type(e).__name__}: {e})") from None


class AsyncGeneration:
    """One generation rank's loop (see the module docstring). ``side``: the
    :class:`~hyflow.placement.pool_models.GenerationSide`; ``exchange_control()``: the training lead's
    control message (:func:`hyflow.placement.inflight.control`, collective with it)."""

    def __init__(self, cfg, side, loader, routes, exchange_control: Callable, ckpts=None) -> None:
        t = cfg.trainer
        self.total, self.k, self.after, self.partial = t.total_steps, t.max_staleness, t.update_after_tokens, \
            t.partial_rollout
        self.n = cfg.rollout.n
        self.side, self.loader, self.routes, self.control = side, loader, routes, exchange_control
        self.ckpts = ckpts  # GenerationCheckpoints: this rank joins the training pool's saves
        self.device = side.groups.device
        self.rank = dist.get_rank()
        self.received = 0  # the newest weight version received (w_0 before the loop)
        self.sent = 0  # the last batch sent
        self.queue: dict[int, tuple[SampleTensors, float, int]] = {}  # complete batches: samples, seconds, oldest
        self.stopped = False
        self.waited = 0.0  # seconds waiting for the training pool since the last send
        self.generated = 0  # the last complete batch

    def run(self, resumed: Optional[AsyncInFlight] = None) -> None:
        """Every batch, then the exchanges due after the last one. ``resumed``: the state a
        checkpoint saved (the weights of its step were received just before, as at the save)."""
        first, partial = 1, None
        if resumed is not None:
            self.received = self.sent = resumed.step - 1
            self.queue, self.waited = dict(resumed.queue), resumed.waited
            first, partial = resumed.next_batch, resumed.partial
            self.generated = first - 1
            self._send_ready()
        for step in range(first, self.total + 1):
            self._batch(step, partial.to_outputs() if partial is not None and step == first else None)
            if self.stopped:
                return
        while not self.stopped:  # the versions due after the last batch, then the stop
            self._exchange()

    def _batch(self, step: int, resume=None) -> None:
        due = step - self.k  # w_due is received while this batch is sampled
        mid = self.after > 0 and self.k > 0 and due >= 1
        # a resumed half-generated batch: its exchange was the save's
        decoded, fired, paused = 0, resume is not None, 0.0

        def on_decode(scheduler) -> Optional[int]:
            nonlocal decoded, fired, paused
            decoded += 1
            if not mid or fired or decoded != self.after or self.stopped:
                return None
            fired = True
            start = time.perf_counter()
            go = self._exchange(scheduler, step)
            paused += time.perf_counter() - start
            return self.received if go else None

        start = time.perf_counter()
        self.drawn_from = self.loader.state_dict()  # a save in this batch resumes drawing it again
        out = self.side.generate(self.loader.next_batch(), step, self.n, version=self.received, on_decode=on_decode,
                                 partial=self.partial, resume=resume)
        seconds = time.perf_counter() - start - paused
        samples = out.samples
        v = samples.versions
        oldest = int(v.min()) if v is not None and v.numel() else self.received
        self.queue[step] = (samples, seconds, oldest)
        self.generated = step
        self._send_ready()
        if due >= 1 and not fired and not self.stopped:
            self._exchange()

    def _exchange(self, scheduler=None, step: int = 0) -> bool:
        """Receive the next weight version (the control message first), join a save the training
        pool writes now; then send what may go. ``scheduler``: the batch ``step`` half generated."""
        start = time.perf_counter()
        # the weight sync writes the model in place: outside the engine's inference mode, so its
        # buffers stay ordinary tensors
        with torch.inference_mode(False), torch.no_grad():
            msg = self.control()
            if msg.go:
                self.side.receive_weights()
            if msg.save:
                half = SampleTensors.from_samples(scheduler.outputs, self.device) if scheduler else None
                state = AsyncInFlight(step=msg.step + 1,
                                      loader=self.drawn_from if scheduler else self.loader.state_dict(),
                                      next_batch=step if scheduler else self.generated + 1,
                                      queue=dict(self.queue), partial=half, waited=self.waited)
                self.ckpts.save(msg, state, write=write_async_inflight)
        self.waited += time.perf_counter() - start
        if not msg.go:
            self.stopped = True
            return False
        self.received += 1
        self._send_ready()
        return True

    def _send_ready(self) -> None:
        while not self.stopped and self.sent + 1 in self.queue and self.received >= self.sent:
            step = self.sent + 1
            samples, seconds, oldest = self.queue.pop(step)
            start = time.perf_counter()
            with torch.inference_mode(False):
                send_rows(samples, self.routes, self.rank, oldest, seconds, wait_seconds=self.waited)
            self.waited = time.perf_counter() - start  # a send waits for the training pool's receive
            self.sent = step


def version_metrics(samples: SampleTensors, step: int, max_staleness: int, dp_group,
                    device: torch.device) -> dict:
    """Staleness of the rows a training rank received for ``step`` (per sample: its oldest token's
    version; ``step - 1`` versions are applied before the update), summed over the training
    data-parallel ranks (every rank of a DP rank holds the same rows): the mean, max and histogram of
    the samples' staleness, the tokens' mean staleness, and how many versions a sample spans (verl's
    ``fully_async/partial/*`` and ``fully_async/count/stale_samples_processed`` where it has the name)."""
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
                         float(token_stale.sum()), *hist.tolist()], dtype=torch.float64, device=device)
    highs = torch.tensor([float(stale.max()) if len(parts) else 0.0, float(spread.max()) if len(parts) else 0.0],
                         dtype=torch.float64, device=device)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(sums, group=dp_group)
        dist.all_reduce(highs, op=dist.ReduceOp.MAX, group=dp_group)
    n, stale_sum, over, partial, spread_sum, tokens, token_sum, *hist = sums.tolist()
    if over:
        raise RuntimeError(f"step {step}: {int(over)} samples are more than trainer.max_staleness={max_staleness} "
                           "weight versions old (the async schedule never samples them: a bug)")
    out = {
        "fully_async/staleness/mean": stale_sum / max(n, 1),
        "fully_async/staleness/max": highs[0].item(),
        "fully_async/staleness/token_mean": token_sum / max(tokens, 1),
        "fully_async/count/stale_samples_processed": n - hist[0],  # verl's names where it has them
        "fully_async/partial/total_partial_num": partial,
        "fully_async/partial/partial_ratio": partial / max(n, 1),
        "fully_async/version_spread/mean": spread_sum / max(n, 1),
        "fully_async/partial/max_partial_span": highs[1].item(),
    }
    for j, count in enumerate(hist[:buckets]):
        out[f"fully_async/staleness_hist/{j}"] = count / max(n, 1)
    return out

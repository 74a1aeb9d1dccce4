"""The data, reward and monitor pieces composed the way the RL trainer uses them, with a fake
policy standing in for generation: config -> tokenizer -> dataset -> loader -> rewards ->
timers -> metrics.jsonl / progress -> plot, including a checkpoint/resume of the data position."""
from __future__ import annotations

import io
import json
import random

import pytest

from hyflow.data import (
    DatasetError,
    PromptLoader,
    build_dataset,
    load_data_tokenizer,
    reference_response_ids,
)
from hyflow.jobs.rl_config import RLJobConfig
from hyflow.monitor import REQUIRED_KEYS, MetricsWriter, PhaseTimers, Progress, plot_metrics, read_metrics
from hyflow.rewards import RewardManager


def _cfg(tmp_path, steps: int) -> RLJobConfig:
    cfg = RLJobConfig()
    cfg.data.task, cfg.data.task_size, cfg.data.train_batch_size = "digits_reverse", 64, 4
    cfg.rollout.n, cfg.rollout.max_prompt_length = 2, 32
    cfg.reward.kind, cfg.reward.rule = "rule", "exact_match"
    cfg.trainer.total_steps, cfg.trainer.output_dir, cfg.trainer.loggers = steps, str(tmp_path), ["console"]
    return cfg


def _run(cfg: RLJobConfig, start: int, stop: int, data_state=None, resume_step=None) -> tuple[dict, list]:
    tok = load_data_tokenizer(cfg.data)
    ds = build_dataset(cfg.data, cfg.rollout, tok)
    loader = PromptLoader(ds, cfg.data.train_batch_size, cfg.data.shuffle, cfg.data.seed)
    if data_state is not None:
        loader.load_state_dict(data_state)
    rewards = RewardManager.from_config(cfg.reward)
    rewards.check_records(ds.records)
    timers = PhaseTimers()
    out = io.StringIO()
    progress = Progress.from_config(cfg.trainer, initial=start, stream=out)
    seen = []
    with MetricsWriter.from_config(cfg.trainer, resume_step=resume_step) as metrics:
        for step in range(start + 1, stop + 1):
            batch = loader.next_batch()
            seen.append([r.uid for r in batch])
            with timers.phase("gen"):        # a fake policy: right with probability step/total
                rng = random.Random(step)
                p = step / cfg.trainer.total_steps
                responses = [r.reference if rng.random() < p else "0" for r in batch for _ in range(cfg.rollout.n)]
            with timers.phase("reward"):
                scored = rewards.score_records(batch, responses)
            row = {"critic/score/mean": sum(scored.scores) / len(scored.scores), "actor/reward_kl_penalty": 0.001 * step, "actor/pg_clipfrac": 0.0, "actor/entropy": 1.0,
                   "actor/grad_norm": 1.0, "response_length/mean": sum(map(len, responses)) / len(responses),
                   "perf/throughput": 100.0, **timers.step_summary()}
            metrics.log(step, row)
            progress.update(step, row)
    return loader.state_dict(), seen


def test_trainer_style_composition_with_resume(tmp_path):
    cfg = _cfg(tmp_path, steps=8)
    _, straight = _run(_cfg(tmp_path / "straight", 8), 0, 8)
    state, first = _run(cfg, 0, 5)
    state = json.loads(json.dumps(state))                       # as stored in a checkpoint
    _, second = _run(cfg, 5, 8, data_state=state, resume_step=5)
    assert first + second == straight                           # same prompts as an uninterrupted run
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(k in rows[0] for k in REQUIRED_KEYS)
    assert rows[-1]["critic/score/mean"] >= rows[0]["critic/score/mean"]
    png = plot_metrics(str(tmp_path))
    import matplotlib.image as mpimg

    assert mpimg.imread(png).shape[:2] == (520, 800)


def test_sft_reference_ids(tmp_path):
    cfg = _cfg(tmp_path, steps=1)
    tok = load_data_tokenizer(cfg.data)
    ds = build_dataset(cfg.data, cfg.rollout, tok)
    rec = ds[0]
    ids = reference_response_ids(rec, tok)
    assert ids[-1] == tok.eos_token_id and tok.decode(ids) == rec.ground_truth == rec.reference
    assert tok.decode(rec.prompt_ids + ids, skip_special_tokens=False) == (
        f"<s><|user|>{rec.messages[0]['content']}<|assistant|>{rec.reference}</s>")
    rec.extra_info.pop("answer")
    with pytest.raises(DatasetError, match=r"task:digits_reverse row 0: no reference answer"):
        reference_response_ids(rec, tok)

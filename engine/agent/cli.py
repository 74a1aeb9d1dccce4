"""``hyflow generate --multi-turn CONFIG``: try a model on multi-turn, tool-using trajectories.

The RL config's ``rollout.multi_turn`` section (tools, environment, turn and token budgets) runs
on the prompts file's rows (the RL data format, e.g. from ``hyflow make-task``) with the command's
sampling settings (``--max-new-tokens`` is the per-turn limit; greedy by default). Rank 0 prints
each trajectory and a summary: the mean score of the final turns by a reward rule or function file (``--reward``), the
share of trajectories that called a tool, turns, tool errors and why trajectories ended.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from hyflow.agent.agent import MultiTurnAgent
from hyflow.agent.config import END_REASONS
from hyflow.agent.trajectory import STATS, final_turns
from hyflow.data.dataset import PromptDataset, read_rows
from hyflow.jobs.registry import load_job_config


def generate_multi_turn(config_path: str, prompts_path: str, engine, groups, tokenizer, n: int, seed: int,
                        reward: Any, output: Optional[str], rank: int) -> dict[str, Any]:
    """Run the trajectories over the ``groups``' data-parallel replicas; rank 0 reports them.
    Returns the summary (every rank)."""
    cfg = load_job_config(config_path, [])
    if not cfg.rollout.multi_turn.enable:
        raise ValueError(f"{config_path}: rollout.multi_turn.enable is false (--multi-turn runs that section)")
    agent = MultiTurnAgent(cfg.rollout.multi_turn, tokenizer)
    records = list(PromptDataset.from_rows(read_rows(prompts_path), tokenizer, source=prompts_path,
                                           max_prompt_length=engine.max_seq_len - 1,
                                           require_ground_truth=reward is not None))
    sampling = engine.config.sampling.replace(n=1, seed=seed)
    samples = agent.rollout(engine, records, n, seed=seed, request_offset=0, sampling=sampling,
                            max_seq_len=engine.max_seq_len, device=groups.device, dp_group=groups.pgs.dp,
                            replica_groups=[groups.pgs.tp, groups.pgs.pp], pad_id=tokenizer.pad_token_id or 0)
    finals = tokenizer.batch_decode(final_turns(samples))
    stats = samples.stats.tolist()
    meta = samples.meta.tolist()
    scores = None
    if reward is not None:  # the final turns, each against its own row (trajectories may be dropped)
        rows = [records[m[0]] for m in meta]
        scores = reward.score(finals, [r.data_source for r in rows],
                              [r.ground_truth for r in rows], [r.extra_info for r in rows],
                              where=[r.where for r in rows]).scores
    col = {name: [row[i] for row in stats] for i, name in enumerate(STATS)}
    count = len(stats)
    ends = [END_REASONS[int(e)] for e in col["end"]]
    summary = {"trajectories": count, "tool_call_rate": sum(c > 0 for c in col["tool_calls"]) / count,
               "turns_mean": sum(col["turns"]) / count, "tool_calls": int(sum(col["tool_calls"])),
               "tool_errors": int(sum(col["tool_errors"])), "tool_timeouts": int(sum(col["tool_timeouts"])),
               "end_reasons": {r: ends.count(r) for r in END_REASONS if r in ends}}
    if scores is not None:
        summary["score_mean"] = sum(scores) / count
        with_tool = [s for s, c in zip(scores, col["tool_calls"]) if c > 0]
        summary["score_mean_with_tool"] = sum(with_tool) / len(with_tool) if with_tool else 0.0
    if rank == 0:
        _report(samples, finals, scores, col, ends, tokenizer, output)
        print(f"[hyflow] multi-turn: {json.dumps(summary)}")
    return summary


def _report(samples, finals, scores, col, ends, tokenizer, output) -> None:
    rows = []
    for k, (out, final) in enumerate(zip(samples.to_outputs(), finals)):
        text = tokenizer.decode(out.token_ids, skip_special_tokens=False)
        head = (f"[{out.request_index}.{out.sample_index}] {ends[k]}, {int(col['turns'][k])} turns, "
                f"{int(col['tool_calls'][k])} tool calls")
        if scores is not None:
            head += f", score {scores[k]:g}"
        print(head)
        print(text)
        print()
        rows.append({"index": out.request_index, "sample": out.sample_index, "trajectory": text, "final": final,
                     "end": ends[k], "turns": int(col["turns"][k]), "tool_calls": int(col["tool_calls"][k]),
                     **({"score": scores[k]} if scores is not None else {})})
    if output:
        with open(output, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")

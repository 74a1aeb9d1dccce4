"""Step metrics of multi-turn rollouts, from the trajectories' counters (``SampleTensors.stats``).

``num_turns/{mean,max,min}`` is verl's name; the rest live under ``multi_turn/``: tool calls per
trajectory and the share of trajectories making one (``tool_call_rate``), tool errors and timeouts,
why trajectories ended (``end_reason/<reason>``, shares), observation vs generated tokens, the mean
length of an assistant turn, retries and dropped groups.
"""

from __future__ import annotations

from hyflow.agent.config import END_REASONS
from hyflow.agent.trajectory import STATS
from hyflow.rl.metrics import BatchStats
from hyflow.rollout.dp import SampleTensors


def trajectory_metrics(stats: BatchStats, samples: SampleTensors, n: int) -> None:
    """Add this rank's trajectories to ``stats`` (reduced over DP with the step's other metrics);
    ``n``: trajectories per prompt (a dropped group is ``n`` dropped trajectories)."""
    s = samples.stats

    def col(name: str):
        return s[:, STATS.index(name)]

    count = float(s.shape[0])
    calls = col("tool_calls")
    stats.distribution("num_turns", col("turns"))
    stats.distribution("multi_turn/tool_calls", calls)
    stats.mean("multi_turn/tool_call_rate", (calls > 0).double().sum(), count)
    stats.mean("multi_turn/tool_turn_share", col("tool_turns").sum(), col("turns").sum())
    stats.add("multi_turn/tool_errors", col("tool_errors").sum())
    stats.add("multi_turn/tool_timeouts", col("tool_timeouts").sum())
    stats.mean("multi_turn/tool_error_rate", col("tool_errors").sum(), calls.sum())
    end = col("end")
    for code, reason in enumerate(END_REASONS):
        stats.mean(f"multi_turn/end_reason/{reason}", (end == code).double().sum(), count)
    stats.distribution("multi_turn/observation_tokens", col("observation_tokens"))
    stats.distribution("multi_turn/generated_tokens", col("generated_tokens"))
    stats.mean("multi_turn/observation_token_share", col("observation_tokens").sum(),
               col("observation_tokens").sum() + col("generated_tokens").sum())
    stats.mean("multi_turn/turn_response_length", col("generated_tokens").sum(), col("turns").sum())
    stats.distribution("multi_turn/env_reward", col("env_reward"))
    stats.add("multi_turn/retries", col("attempts").sum())
    stats.add("multi_turn/dropped_groups", col("dropped").sum() / max(n, 1))

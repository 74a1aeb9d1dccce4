"""``trainer.log_samples: k``: a few of the step's generations on the log, one line each (verl prints
prompt, response, ground truth and score the same way)::

    [hyflow] sample 1/2 of step 10: prompt '3+4=' | response '7' | ground truth '7' | score 1
"""

from __future__ import annotations

from typing import Any, Sequence
MAX_CHARS = 160


def _short(text: Any) -> str:
    text = repr(str(text))
    return text if len(text) <= MAX_CHARS else text[:MAX_CHARS - 4] + "...'"


def sample_lines(step: int, records: Sequence[Any], data: dict, tokenizer: Any, n: int, k: int) -> list[str]:
    """Lines for the first ``k`` responses of this rank's rows (``data``: the RL step's tensors,
    ``records``: the step's prompts, ``n`` responses each)."""
    tokens, mask, scores, rows = data["tokens"], data["response_mask"], data["scores"], data["rows"]
    k = min(k, tokens.shape[0])
    out = []
    for i in range(k):
        record = records[int(rows[i]) // n]
        response = tokens[i][mask[i] > 0].tolist() if mask[i].any() else []
        out.append(f"[hyflow] sample {i + 1}/{k} of step {step}: prompt {_short(record.prompt_text)} | response "
                   f"{_short(tokenizer.decode(response))} | ground truth {_short(record.ground_truth)} | score "
                   f"{float(scores[i]):.4g}")
    return out


def print_samples(progress: Any, trainer: Any, step: int, start: int, records: Sequence[Any], data: dict,
                  tokenizer: Any, n: int) -> None:
    """``trainer.log_samples`` lines through ``progress`` on the run's first step, every
    ``trainer.log_every`` steps and on the last."""
    if step == start + 1 or step == trainer.total_steps or step % max(trainer.log_every, 1) == 0:
        progress.write("\n".join(sample_lines(step, records, data, tokenizer, n, trainer.log_samples)))

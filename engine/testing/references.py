"""Independent references that parity tests compare hyflow against (Hugging Face models, the loss
aggregation written from its formulas)."""
from __future__ import annotations

from typing import Any, Optional

import torch

from hyflow.algorithms.losses import LOSS_AGG_MODES
from hyflow.algorithms.masked import masked_mean, masked_sum


def hf_response_logprobs(hf: Any, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    """Log-probs of ``response`` after ``prompt`` under ``softmax(logits / temperature)`` of the HF
    causal LM ``hf``, from one full forward of prompt + response (no KV cache)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = hf(ids).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    idx = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[idx, torch.tensor(response)].tolist()


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    norm_length: Optional[float] = None,
) -> torch.Tensor:
    r"""Reduce a ``[B, T]`` token loss to a scalar (the reference aggregation). With
    :math:`m_{b,t}` the mask, :math:`S = \{b : \sum_t m_{b,t} > 0\}` the non-empty sequences and
    :math:`L` = ``norm_length``:

    * ``token-mean``: :math:`\sum_{b,t} m_{b,t}\ell_{b,t} / \sum_{b,t} m_{b,t}`
    * ``seq-mean-token-sum``: :math:`\frac{1}{|S|}\sum_{b\in S}\sum_t m_{b,t}\ell_{b,t}`
    * ``seq-mean-token-mean``: :math:`\frac{1}{|S|}\sum_{b\in S}
      \frac{\sum_t m_{b,t}\ell_{b,t}}{\sum_t m_{b,t}}`
    * ``seq-mean-token-sum-norm`` (Dr. GRPO): :math:`\frac{1}{|S|}\sum_{b\in S}
      \frac{1}{L}\sum_t m_{b,t}\ell_{b,t}`

    ``norm_length`` is required by ``seq-mean-token-sum-norm`` and must be a constant of the
    run (the RL job passes ``rollout.max_new_tokens`` or ``actor.loss_scale_factor``): a
    normaliser taken from the padded width of a batch would change the loss scale from step
    to step. Sequences with no valid token (e.g. filler rows) are left out of the sequence
    mean. An all-empty mask gives ``0``. Written from the formulas, apart from the weights the
    step aggregates with (:func:`hyflow.algorithms.losses.aggregation_weights`), which tests
    compare against it.
    """
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {LOSS_AGG_MODES}")
    nonempty = (mask != 0).any(dim=-1)
    if mode == "seq-mean-token-sum":
        per_seq = masked_sum(loss_mat, mask, dim=-1)
    elif mode == "seq-mean-token-mean":
        per_seq = masked_mean(loss_mat, mask, dim=-1)
    else:
        if norm_length is None or norm_length <= 0:
            raise ValueError(f"seq-mean-token-sum-norm needs a positive constant norm_length, got {norm_length}")
        per_seq = masked_sum(loss_mat, mask, dim=-1) / float(norm_length)
    return masked_mean(per_seq, nonempty)

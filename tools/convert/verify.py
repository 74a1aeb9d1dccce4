"""Run a converted checkpoint: full-vocabulary logits and greedy decoding on any layout.

These are rank functions (call them on every rank of a ``tp * pp`` world, more for an expert
layout: :func:`~hyflow.tools.convert.preflight.conversion_world`; e.g.
through :func:`hyflow.tools.convert.launch.run_ranks` or the test harness). The
pipeline is driven by hand: each stage runs its layers on the whole batch and
sends the hidden states to the next stage; the last stage gathers the
vocabulary-parallel logits over TP and drops the padded rows. Greedy decoding
re-runs the full sequence for every new token (no KV cache): simple and exact,
meant for parity checks, not for serving.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from hyflow.parallel.layout import Layout
from hyflow.tools.convert.preflight import conversion_world


def forward_logits(model: torch.nn.Module, tokens: torch.Tensor, vocab_size: int,
                   groups) -> Optional[torch.Tensor]:
    """Logits ``[b, s, vocab_size]`` (float32) on the last stage; None on other stages."""
    pp_group, tp_group = groups.pgs.pp, groups.pgs.tp
    pp, stage = groups.layout.pp, groups.pp_rank
    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    if stage > 0:
        dtype = next(model.parameters()).dtype
        hidden = torch.empty(s, b, model.config.hidden_size, dtype=dtype)
        dist.recv(hidden, src=dist.get_global_rank(pp_group, stage - 1), group=pp_group)
        model.set_input_tensor(hidden)
    with torch.no_grad():
        out = model(tokens, positions, None)
    if stage < pp - 1:
        dist.send(out.contiguous(), dst=dist.get_global_rank(pp_group, stage + 1), group=pp_group)
        return None
    shards = [torch.empty_like(out) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(shards, out.contiguous(), group=tp_group)
    return torch.cat(shards, dim=-1)[..., :vocab_size].float()


def _setup(ckpt_dir: str, tp: int, pp: int, dtype: Optional[str], ep: int = 1, etp: Optional[int] = None):
    # Megatron (seconds) only in the ranks that load the checkpoint
    from hyflow.checkpoint.model import load_model_from_checkpoint
    from hyflow.parallel.groups import init_training_groups

    groups = init_training_groups(Layout(tp=tp, pp=pp, ep=ep, etp=etp).with_dp_for(conversion_world(tp, pp, ep, etp)))
    model, desc, _ = load_model_from_checkpoint(ckpt_dir, groups, dtype=dtype)
    model.eval()
    return model, desc, groups


def checkpoint_logits(ckpt_dir: str, tp: int, pp: int, tokens: Sequence[Sequence[int]],
                      dtype: Optional[str] = None, ep: int = 1, etp: Optional[int] = None) -> Optional[torch.Tensor]:
    """Rank function: load ``ckpt_dir`` at ``tp`` x ``pp`` (x ``ep`` / ``etp`` for experts) and
    return the logits of ``tokens``.

    Returns the ``[b, s, vocab]`` logits on last-stage ranks, None elsewhere. With expert
    parallelism every data-parallel rank runs the same tokens (the experts' all-to-all needs them all).
    """
    model, desc, groups = _setup(ckpt_dir, tp, pp, dtype, ep, etp)
    return forward_logits(model, torch.tensor(tokens, dtype=torch.long), desc.vocab_size, groups)


def greedy_generate(ckpt_dir: str, tp: int, pp: int, prompts: Sequence[Sequence[int]],
                    max_new_tokens: int, stop_ids: Sequence[int] = (),
                    dtype: Optional[str] = None) -> list[list[int]]:
    """Rank function: greedy continuation of each prompt (every rank returns the same lists).

    All prompts are decoded together, right-padded to a common length (causal attention
    keeps the padding invisible to real tokens; each row's next token is read at its own
    last position). A prompt stops after ``max_new_tokens`` or at a token in ``stop_ids``
    (included).
    """
    model, desc, groups = _setup(ckpt_dir, tp, pp, dtype)
    last_rank = dist.get_global_rank(groups.pgs.pp, groups.layout.pp - 1)
    seqs = [list(p) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    for _ in range(max_new_tokens):
        if not active:
            break
        width = max(len(seqs[i]) for i in active)
        batch = torch.zeros(len(active), width, dtype=torch.long)
        for row, i in enumerate(active):
            batch[row, : len(seqs[i])] = torch.tensor(seqs[i])
        logits = forward_logits(model, batch, desc.vocab_size, groups)
        tokens = torch.zeros(len(active), dtype=torch.long)
        if logits is not None:
            for row, i in enumerate(active):
                tokens[row] = int(logits[row, len(seqs[i]) - 1].argmax())
        dist.broadcast(tokens, src=last_rank, group=groups.pgs.pp)
        for row, i in enumerate(active):
            seqs[i].append(int(tokens[row]))
            outputs[i].append(int(tokens[row]))
        active = [i for i in active if outputs[i][-1] not in stop_ids]
    return outputs

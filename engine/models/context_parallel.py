"""Context parallelism: which tokens a CP rank holds, and moving batches and outputs to / from it.

With ``layout.cp > 1`` every sequence is split over the ranks of the CP group. hyflow uses
Megatron-Core's load-balanced layout (also what Transformer Engine's CP attention expects):
the sequence is cut into ``2 cp`` equal chunks and CP rank ``r`` holds chunks ``r`` and
``2 cp - 1 - r``, so under a causal mask every rank does the same attention work. Only
attention needs other ranks' tokens (:mod:`hyflow.models.ulysses_attention` without TE, TE's
ring attention with it); everything else (embedding, MLP, norms, output layer, per-token
losses) runs on the local tokens.

Helpers for the step that feeds a CP model:

* :func:`cp_chunk_index` - the global positions a rank holds (in its local order);
* :func:`split_for_cp` - a batch dict of ``[b, s, ...]`` tensors -> this rank's ``[b, s / cp, ...]``
  share (``position_ids`` stay global positions; a full ``attention_mask [b, 1, s, s]`` is kept
  whole: the all-to-all attention sees the whole sequence);
* :func:`next_token_labels` - labels ``tokens[:, i + 1]`` built *before* splitting (a rank's
  last local token's successor usually lives on another rank);
* :func:`gather_from_cp` - per-token outputs of the local tokens (log-probs, values, entropies)
  -> ``[b, s, ...]`` in natural order (no gradient: for scoring);
* :func:`shard_micro_batch` - a micro-batch of token-aligned per-token columns (the RL job's) ->
  this rank's label-aligned share (``labels`` added, every other per-token column shifted
  left by one, so the position whose logits predict a token carries that token's values);
* :func:`to_token_aligned` - a scorer's label-aligned outputs of the local tokens -> the whole
  sequence, aligned to the scored token again (the inverse, for scoring);
* :func:`cp_token_mean` - the token-mean of a per-token loss over the *whole* sequence: local sum
  over the CP-global token count. Megatron's schedule multiplies a micro-batch's loss by ``cp``
  and DDP averages gradients over ``dp x cp`` ranks, so exactly this gives the CP=1 gradient.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional

import torch
import torch.distributed as dist

#: batch keys that are never split along the sequence
WHOLE_KEYS = ("attention_mask",)


def cp_chunk_index(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions held by CP rank ``cp_rank``, in its local order: chunks ``r`` and
    ``2 cp - 1 - r`` of ``2 cp`` equal chunks."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 * cp = {2 * cp_size}; "
                         f"pad the batch to a multiple of {2 * cp_size} tokens")
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk, device=device)
    return torch.cat([first, last])


def cp_order(seq_len: int, cp_size: int, device=None) -> torch.Tensor:
    """Global position of each token of the rank-ordered concatenation of all shards."""
    return torch.cat([cp_chunk_index(seq_len, cp_size, r, device) for r in range(cp_size)])


def _size_rank(cp_group) -> tuple[int, int]:
    if cp_group is None:
        return 1, 0
    return cp_group.size(), cp_group.rank()


def split_for_cp(batch: Mapping[str, Optional[torch.Tensor]], cp_group, *,
                 keys: Optional[Iterable[str]] = None, seq_dim: int = 1) -> dict:
    """This CP rank's share of ``batch``.

    Split along ``seq_dim``: ``keys`` if given, else every tensor whose ``seq_dim`` has the
    length of ``batch["tokens"]`` (or of the first such tensor), except :data:`WHOLE_KEYS`.
    Everything else (per-sequence values, scalars, None) passes through. ``position_ids`` are
    split like the tokens, so they keep each token's global position.
    """
    size, rank = _size_rank(cp_group)
    if size == 1:
        return dict(batch)
    ref = batch.get("tokens")
    if ref is None:
        ref = next(v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > seq_dim)
    seq_len = ref.shape[seq_dim]
    chosen = set(keys) if keys is not None else {
        k for k, v in batch.items()
        if isinstance(v, torch.Tensor) and v.dim() > seq_dim and v.shape[seq_dim] == seq_len
        and k not in WHOLE_KEYS}
    index = cp_chunk_index(seq_len, size, rank, ref.device)
    return {k: (v.index_select(seq_dim, index.to(v.device)) if k in chosen else v) for k, v in batch.items()}


def next_token_labels(tokens: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """``labels[:, i] = tokens[:, i + 1]`` (the last column ``fill``): build before splitting.

    Works for any per-token ``[b, s]`` tensor: shifting a response mask or old log-probs that
    are aligned to the predicted token (position i = log p(token i)) puts them on the position
    whose logits predict it, which is where a CP rank computes that token's log-prob."""
    labels = torch.full_like(tokens, fill)
    labels[:, :-1] = tokens[:, 1:]
    return labels


@torch.no_grad()
def gather_from_cp(local: torch.Tensor, cp_group, seq_dim: int = 1) -> torch.Tensor:
    """Per-token values of this rank's tokens -> the whole sequence in natural order."""
    size, _ = _size_rank(cp_group)
    if size == 1:
        return local
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local, group=cp_group)
    joined = torch.cat(parts, dim=seq_dim)
    natural = torch.argsort(cp_order(joined.shape[seq_dim], size, joined.device))
    return joined.index_select(seq_dim, natural)


#: micro-batch keys :func:`shard_micro_batch` neither shifts nor splits along the sequence
_KEEP = ("tokens", "position_ids", "labels")


def shard_micro_batch(mb: Mapping, cp_group) -> dict:
    """This CP rank's share of a micro-batch (:func:`hyflow.rl.batch.make_micro_batches`) whose
    per-token columns ``[b, s]`` are aligned to the token they score (position i = token i).

    A rank's last local token's successor usually lives on another rank, so everything is made
    label-aligned *before* the split: ``labels = next_token_labels(tokens)`` and every other
    ``[b, s]`` column shifted left by one (0 at the end). Losses then read the log-probability of
    ``labels`` at each local position (``"labels" in batch`` tells them). A packed row's shift
    crosses sequence boundaries only at positions whose weights are 0 (a sequence's first token
    is a prompt token, padding has no weight). Adds ``cp_split: True``. A micro-batch that has
    ``labels`` already (an LM batch) is only split.

    A packed row's ``[1, 1, s, s]`` mask becomes its sequence boundaries (:func:`sequence_bounds`):
    the all-to-all attention then runs causal attention per sequence, without an ``s x s`` mask
    (which every CP rank would otherwise hold whole)."""
    out = dict(mb)
    mask = mb.get("attention_mask")
    if mb.get("packed") and "segments" in mb and mask is not None and mask.dim() > 1:
        out["attention_mask"] = sequence_bounds([n for _, _, n in mb["segments"]], mb["tokens"].shape[1])
    tokens = out["tokens"]
    width = tokens.shape[1]
    if "labels" not in out:
        out["labels"] = next_token_labels(tokens)
        for key, value in mb.items():
            if key not in _KEEP and isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == width:
                out[key] = next_token_labels(value)
    keys = [k for k, v in out.items()
            if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[1] == width and k not in WHOLE_KEYS]
    out = split_for_cp(out, cp_group, keys=keys)
    out["cp_split"] = True
    return out


def sequence_bounds(lengths: Iterable[int], width: int) -> torch.Tensor:
    """``[0, n1, n1 + n2, ..., width]`` int64: where the packed sequences of a row of ``width``
    tokens start and end (padding after them is one more sequence), the ``attention_mask`` form
    :class:`hyflow.models.ulysses_attention.UlyssesAttention` and the SDPA spec run per sequence.
    A host tensor whatever the micro-batch's device: every attention layer reads it as a list
    (``tolist`` of a device tensor would wait for the GPU once per layer, again in recompute)."""
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + int(n))
    if bounds[-1] < width:
        bounds.append(width)
    return torch.tensor(bounds, dtype=torch.long, device="cpu")


def to_token_aligned(local: torch.Tensor, cp_group, predicts_next: bool = True) -> torch.Tensor:
    """Outputs ``[b, s / cp]`` of this rank's tokens -> ``[b, s]`` of the whole sequence in
    natural order; ``predicts_next``: position i holds a value of token i + 1 (a log-probability of
    the label, the value before it) and is moved to i + 1 (position 0 gets 0), the convention of
    :func:`hyflow.training.logprobs.shifted_token_logprobs`."""
    whole = gather_from_cp(local, cp_group)
    if not predicts_next:
        return whole
    return torch.cat([torch.zeros_like(whole[:, :1]), whole[:, :-1]], dim=1)


def cp_token_mean(values: torch.Tensor, mask: torch.Tensor, cp_group) -> torch.Tensor:
    """``sum(values * mask)`` of the local tokens over the mask's sum on the whole sequence.

    Summed over the CP ranks this is the sequence-level token mean; as a micro-batch loss
    under Megatron's schedule (x cp) and DDP (mean over dp x cp) it gives the CP=1 gradient."""
    mask = mask.to(values.dtype)
    count = mask.sum().detach()
    if _size_rank(cp_group)[0] > 1:
        count = count.clone()
        dist.all_reduce(count, group=cp_group)
    return (values * mask).sum() / count.clamp(min=1)

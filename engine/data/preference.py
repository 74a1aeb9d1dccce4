"""Preference data in TRL's formats, with row-level validation, length filtering and batching.

DPO rows (a jsonl line or a parquet record) hold a prompt and two completions::

    {"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"}                     # strings
    {"prompt": [{"role": "user", "content": "What is 2 + 3?"}],                        # chat messages
     "chosen": [{"role": "assistant", "content": "5"}],
     "rejected": [{"role": "assistant", "content": "6"}]}
    {"chosen":   [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}],
     "rejected": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "6"}]}

The last form has no ``prompt``: two full conversations whose messages agree up to the last
assistant turn (the shared messages are the prompt). KTO rows hold one completion and a
boolean ``label`` (true: desirable)::

    {"prompt": "What is 2 + 3?", "completion": "5", "label": true}

A string prompt is one user message and a string completion one assistant message. The prompt
is rendered with the tokenizer's chat template and a generation prompt (as the RL job and
``hyflow generate`` render prompts); a completion's tokens are what the template adds for the
assistant turn (e.g. ``5<|im_end|>``), with EOS appended when the template ends the turn with
no stop token. Other keys are kept out of the way (``data_source``, ``reward_model``, ...).

Malformed rows raise :class:`~hyflow.data.dataset.DatasetError` naming the file, the row and
the key, after the whole file was scanned. Rows whose prompt or completion is longer than
the limits are dropped, or truncated when asked (prompts keep their end, completions their
start); the counts are logged and kept in :attr:`PreferenceDataset.stats`. Batches come from
:class:`hyflow.data.loader.PromptLoader` (deterministic, resumable) over the dataset.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Any, Iterable, Literal, Optional, Sequence

import numpy as np
import torch

from hyflow.data.dataset import DatasetError, _format_errors, _messages, _RowError, read_rows
from hyflow.data.tokenizer import Tokenizer
from hyflow.data.tasks import make_preference_rows

__all__ = [
    "PreferencePair", "KTOExample", "PreferenceStats", "PreferenceDataset", "validate_dpo_row",
    "validate_kto_row", "build_preference_dataset", "sequence_tensors", "PreferenceKind",
]

_LOG = logging.getLogger(__name__)
PreferenceKind = Literal["dpo", "kto"]


@dataclasses.dataclass
class PreferencePair:
    """One validated, tokenized DPO pair."""

    uid: int                      # index in the dataset (after length filtering)
    path: str                     # the file (or task) it came from
    row: int                      # its 0-based row index there
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    truncated: bool = False

    @property
    def where(self) -> str:
        return f"{self.path} row {self.row}"

    def sequences(self) -> list[tuple[list[int], list[int]]]:
        """(prompt, completion) of the chosen then the rejected sequence."""
        return [(self.prompt_ids, self.chosen_ids), (self.prompt_ids, self.rejected_ids)]


@dataclasses.dataclass
class KTOExample:
    """One validated, tokenized KTO example; ``kl_completion_ids`` is another example's completion
    (KTO's mismatched pair for the KL reference point)."""

    uid: int
    path: str
    row: int
    prompt_ids: list[int]
    completion_ids: list[int]
    label: bool
    kl_completion_ids: list[int] = dataclasses.field(default_factory=list)
    truncated: bool = False

    @property
    def where(self) -> str:
        return f"{self.path} row {self.row}"


@dataclasses.dataclass
class PreferenceStats:
    """Counts from loading: rows read, kept, dropped / truncated for length, pairs dropped because
    truncation made chosen and rejected equal, longest kept prompt and completion, KTO labels."""

    rows: int = 0
    kept: int = 0
    dropped_long: int = 0
    truncated: int = 0
    dropped_identical: int = 0
    max_prompt_tokens: int = 0
    max_completion_tokens: int = 0
    desirable: int = 0
    undesirable: int = 0


# ----------------------------------------------------------------------------- validation


def _completion(value: Any, key: str) -> list[dict]:
    """A completion as chat messages ending with the assistant's (non-empty) turn."""
    if isinstance(value, str):
        if not value.strip():
            raise _RowError(key, "is an empty completion")
        return [{"role": "assistant", "content": value}]
    messages = _messages(value, key)
    last = len(messages) - 1
    if messages[last]["role"] != "assistant":
        raise _RowError(f"{key}[{last}].role", f"the last message must be the assistant's turn, got "
                                               f"{messages[last]['role']!r}")
    if not messages[last]["content"].strip():
        raise _RowError(f"{key}[{last}].content", "is an empty completion")
    return messages


def validate_dpo_row(row: Any) -> tuple[list[dict], list[dict], list[dict]]:
    """Check one DPO row; returns ``(prompt, chosen, rejected)`` as chat messages.

    Raises ``_RowError`` (wrapped into :class:`DatasetError` by the loader) naming the key.
    """
    if not isinstance(row, dict):
        raise _RowError(None, f"row must be an object, got {type(row).__name__}")
    for key in ("chosen", "rejected"):
        if key not in row:
            raise _RowError(key, f"missing key {key!r}")
    if row.get("prompt") is not None:
        prompt = _messages(row["prompt"], "prompt")
        chosen, rejected = _completion(row["chosen"], "chosen"), _completion(row["rejected"], "rejected")
    else:  # full conversations: the shared messages before the last assistant turn are the prompt
        for key in ("chosen", "rejected"):
            if isinstance(row[key], str):
                raise _RowError("prompt", "missing key 'prompt' (string completions need one; without it, "
                                          "chosen and rejected must be full conversations)")
        full_chosen, full_rejected = _completion(row["chosen"], "chosen"), _completion(row["rejected"], "rejected")
        if len(full_chosen) < 2:
            raise _RowError("chosen", "a conversation without 'prompt' needs the prompt's messages before "
                                      "its last assistant turn")
        if full_chosen[:-1] != full_rejected[:-1]:
            raise _RowError("rejected", "differs from 'chosen' before the last assistant turn (without "
                                        "'prompt', the messages before it are the shared prompt)")
        prompt, chosen, rejected = full_chosen[:-1], full_chosen[-1:], full_rejected[-1:]
    if chosen == rejected:
        raise _RowError("rejected", "is identical to 'chosen' (a pair needs two different completions)")
    return prompt, chosen, rejected


def validate_kto_row(row: Any) -> tuple[list[dict], list[dict], bool]:
    """Check one KTO row; returns ``(prompt, completion, label)``."""
    if not isinstance(row, dict):
        raise _RowError(None, f"row must be an object, got {type(row).__name__}")
    for key in ("prompt", "completion", "label"):
        if key not in row:
            raise _RowError(key, f"missing key {key!r}")
    prompt = _messages(row["prompt"], "prompt")
    completion = _completion(row["completion"], "completion")
    label = row["label"]
    if not isinstance(label, bool):
        raise _RowError("label", f"must be true (desirable) or false (undesirable), got {label!r} "
                                 f"({type(label).__name__})")
    return prompt, completion, label


# ----------------------------------------------------------------------------- tokenization


class _Encoder:
    """Prompt and completion ids of chat messages under one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.stop = set(tokenizer.stop_token_ids())

    def prompt_texts(self, prompts: Sequence[list[dict]]) -> list[str]:
        return [self.tok.apply_chat_template(p, add_generation_prompt=True) for p in prompts]

    def completion(self, prompt: list[dict], prompt_text: str, completion: list[dict]) -> list[int]:
        full = self.tok.apply_chat_template(prompt + completion, add_generation_prompt=False)
        if not full.startswith(prompt_text):
            raise ValueError("the chat template does not render the prompt (with its generation prompt) as the "
                             "start of prompt + completion; give string prompts and completions, or use a "
                             "tokenizer whose template does")
        ids = self.tok.encode(full[len(prompt_text):], add_special_tokens=False)
        if not self.stop.intersection(ids):
            ids.append(self.tok.eos_token_id)
        return ids


def _encode_file(path: str, parsed: list, encoder: _Encoder, kind: PreferenceKind) -> list[tuple]:
    """Token ids of every parsed row: ``(row, prompt_ids, [completion ids...], label)``."""
    try:
        prompt_texts = encoder.prompt_texts([p[1] for p in parsed])
        prompt_ids = encoder.tok.encode_prompt_texts(prompt_texts)
    except Exception as exc:  # noqa: BLE001 - find and name the row
        for i, prompt, *_ in parsed:
            try:
                encoder.tok.encode_chat(prompt)
            except Exception as row_exc:  # noqa: BLE001
                raise DatasetError(f"{path}: row {i}: chat template / tokenization failed: {row_exc}",
                                   path=path, row=i, key="prompt") from row_exc
        raise DatasetError(f"{path}: tokenization failed: {exc}", path=path) from exc
    keys = ("chosen", "rejected") if kind == "dpo" else ("completion",)
    out = []
    for (i, prompt, *rest), text, ids in zip(parsed, prompt_texts, prompt_ids):
        completions = []
        for key, messages in zip(keys, rest):
            try:
                completions.append(encoder.completion(prompt, text, messages))
            except Exception as exc:  # noqa: BLE001 - named by row and key
                raise DatasetError(f"{path}: row {i}, key '{key}': {exc}", path=path, row=i, key=key) from exc
        out.append((i, list(ids), completions, rest[-1] if kind == "kto" else None))
    return out


# ----------------------------------------------------------------------------- dataset


class PreferenceDataset(Sequence):
    """Validated, tokenized, length-filtered DPO pairs or KTO examples."""

    def __init__(self, records: list, stats: PreferenceStats, sources: Sequence[str], kind: PreferenceKind) -> None:
        self.records, self.stats, self.sources, self.kind = records, stats, list(sources), kind

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int):  # type: ignore[override]
        return self.records[i]

    @classmethod
    def from_files(cls, paths: Sequence[str], tokenizer: Tokenizer, kind: PreferenceKind,
                   **kwargs: Any) -> "PreferenceDataset":
        """Load and validate every file (keyword arguments as :meth:`from_rows`)."""
        if not paths:
            raise DatasetError("no data files given (data.train_files is empty)")
        return cls._build([(p, read_rows(p)) for p in paths], tokenizer, kind, **kwargs)

    @classmethod
    def from_rows(cls, rows: Sequence[Any], tokenizer: Tokenizer, kind: PreferenceKind, source: str = "<rows>",
                  **kwargs: Any) -> "PreferenceDataset":
        """Build from in-memory rows (``source`` names them in messages). Keyword arguments:
        ``max_prompt_length`` and ``max_completion_length`` (tokens; required), ``truncate``
        (truncate longer rows instead of dropping them) and ``seed`` (KTO's KL pairing)."""
        return cls._build([(source, list(rows))], tokenizer, kind, **kwargs)

    @classmethod
    def _build(cls, files: Iterable[tuple[str, list[Any]]], tokenizer: Tokenizer, kind: PreferenceKind, *,
               max_prompt_length: int, max_completion_length: int, truncate: bool = False,
               seed: int = 1) -> "PreferenceDataset":
        if kind not in ("dpo", "kto"):
            raise ValueError(f"kind must be 'dpo' or 'kto', got {kind!r}")
        validate = validate_dpo_row if kind == "dpo" else validate_kto_row
        encoder = _Encoder(tokenizer)
        records: list = []
        stats, sources = PreferenceStats(), []
        for path, rows in files:
            sources.append(path)
            if not rows:
                raise DatasetError(f"{path}: no rows", path=path)
            parsed, errors = [], []
            for i, row in enumerate(rows):
                try:
                    parsed.append((i, *validate(row)))
                except _RowError as exc:
                    errors.append((i, exc.key, exc.message))
            if errors:
                raise DatasetError(_format_errors(path, errors, len(errors)), path=path, row=errors[0][0],
                                   key=errors[0][1], errors=errors)
            dropped = truncated = identical = 0
            for i, prompt, completions, label in _encode_file(path, parsed, encoder, kind):
                long = len(prompt) > max_prompt_length or any(len(c) > max_completion_length for c in completions)
                if long:
                    if not truncate:
                        dropped += 1
                        continue
                    prompt = prompt[-max_prompt_length:]
                    completions = [c[:max_completion_length] for c in completions]
                    truncated += 1
                    if kind == "dpo" and completions[0] == completions[1]:
                        identical += 1
                        continue
                uid = len(records)
                if kind == "dpo":
                    records.append(PreferencePair(uid, path, i, prompt, completions[0], completions[1], long))
                else:
                    records.append(KTOExample(uid, path, i, prompt, completions[0], bool(label), truncated=long))
                stats.max_prompt_tokens = max(stats.max_prompt_tokens, len(prompt))
                stats.max_completion_tokens = max([stats.max_completion_tokens] + [len(c) for c in completions])
            stats.rows += len(rows)
            stats.dropped_long += dropped
            stats.truncated += truncated
            stats.dropped_identical += identical
            if dropped:
                _LOG.warning("%s: dropped %d of %d rows longer than max_prompt_length=%d / max_completion_length=%d "
                             "tokens (data.truncate_long=true truncates them instead)", path, dropped, len(rows),
                             max_prompt_length, max_completion_length)
            if truncated:
                _LOG.warning("%s: truncated %d of %d rows to max_prompt_length=%d / max_completion_length=%d tokens%s",
                             path, truncated, len(rows), max_prompt_length, max_completion_length,
                             f"; {identical} pairs became identical and were dropped" if identical else "")
        stats.kept = len(records)
        if not records:
            raise DatasetError(f"no rows left in {', '.join(sources)}: all {stats.rows} are longer than "
                               f"max_prompt_length={max_prompt_length} / max_completion_length="
                               f"{max_completion_length} tokens")
        if kind == "kto":
            _pair_for_kl(records, seed)
            stats.desirable = sum(r.label for r in records)
            stats.undesirable = len(records) - stats.desirable
        return cls(records, stats, sources, kind)

    def fingerprint(self) -> str:
        """A digest of every record's token ids (and labels): what reference log-probs depend on."""
        h = hashlib.sha256()
        for r in self.records:
            seqs = [r.prompt_ids, r.chosen_ids, r.rejected_ids] if self.kind == "dpo" else \
                [r.prompt_ids, r.completion_ids, r.kl_completion_ids, [int(r.label)]]
            for s in seqs:
                h.update(np.asarray(s, dtype=np.int64).tobytes())
                h.update(b"|")
        return h.hexdigest()

    def describe(self) -> str:
        """One line of counts for the job's start-up log."""
        s = self.stats
        what = "pairs" if self.kind == "dpo" else f"examples ({s.desirable} desirable, {s.undesirable} undesirable)"
        extra = f", {s.dropped_identical} identical after truncation" if s.dropped_identical else ""
        return (f"{s.kept} {what} from {s.rows} rows ({s.dropped_long} dropped as too long, {s.truncated} "
                f"truncated{extra}); longest prompt {s.max_prompt_tokens} tokens, completion "
                f"{s.max_completion_tokens}")


def _pair_for_kl(examples: list[KTOExample], seed: int) -> None:
    """Give every example another example's completion for KTO's KL estimate: the next one in a
    fixed random cyclic order (a derangement for 2+ examples), so the mismatched pairs are fixed
    per dataset and their reference log-probs can be precomputed."""
    order = np.random.default_rng([seed, 0x6B746F]).permutation(len(examples)).tolist()
    for k, i in enumerate(order):
        examples[i].kl_completion_ids = examples[order[(k + 1) % len(order)]].completion_ids


def build_preference_dataset(data: Any, tokenizer: Tokenizer, kind: PreferenceKind) -> PreferenceDataset:
    """The dataset of a preference job from its ``PreferenceDataConfig``: ``data.task`` (a
    built-in preference task's rows, :mod:`hyflow.data.tasks`) or ``data.train_files``."""
    kwargs = dict(max_prompt_length=data.max_prompt_length, max_completion_length=data.max_completion_length,
                  truncate=data.truncate_long, seed=data.seed)
    if data.task:
        rows = make_preference_rows(data.task, data.task_size, kind, seed=data.seed, **dict(data.task_options))
        return PreferenceDataset.from_rows(rows, tokenizer, kind, source=f"task:{data.task}", **kwargs)
    return PreferenceDataset.from_files(list(data.train_files), tokenizer, kind, **kwargs)


# ----------------------------------------------------------------------------- tensors


def sequence_tensors(sequences: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int, device: Any,
                     length: Optional[int] = None, multiple: int = 1) -> dict:
    """``prompt + completion`` rows right-padded to ``length`` (default: the longest) rounded up to a
    ``multiple`` (sequence parallelism splits the width over TP: ``hyflow.rl.batch.pad_multiple``), as
    ``tokens`` [n, S], ``position_ids`` and ``completion_mask`` (1 on completion tokens, aligned
    like :func:`hyflow.training.logprobs.shifted_token_logprobs`: position j scores token j).
    Built on the host, then moved to ``device`` in one copy per tensor."""
    S = max(len(p) + len(c) for p, c in sequences) if length is None else length
    S = -(-S // multiple) * multiple
    tokens = torch.full((len(sequences), S), pad_id, dtype=torch.long, device="cpu")
    mask = torch.zeros(len(sequences), S, dtype=torch.float32, device="cpu")
    for i, (p, c) in enumerate(sequences):
        if len(p) + len(c) > S:
            raise ValueError(f"sequence {i} has {len(p) + len(c)} tokens, more than the batch length {S}")
        tokens[i, :len(p) + len(c)] = torch.tensor(list(p) + list(c), dtype=torch.long, device="cpu")
        mask[i, len(p):len(p) + len(c)] = 1.0
    tokens, mask = tokens.to(device), mask.to(device)
    positions = torch.arange(S, device=device).unsqueeze(0).expand_as(tokens)
    return {"tokens": tokens, "position_ids": positions, "completion_mask": mask}

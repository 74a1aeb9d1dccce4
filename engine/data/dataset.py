"""Prompt datasets in verl's format, with row-level validation and resumable sampling.

A row is a JSON object (a jsonl line or a parquet record)::

    {"prompt": [{"role": "user", "content": "What is 2 + 3?"}],   # chat messages (or a string)
     "data_source": "hyflow/arithmetic",
     "reward_model": {"ground_truth": "5"},                       # needed by rule/function rewards
     "extra_info": {"answer": "5", ...}}                          # optional; "answer" = SFT reference

Malformed rows raise :class:`DatasetError` naming the file, the row index and the key, after
the whole file was scanned (the first few problems are listed with a total count). Prompts
longer than ``max_prompt_length`` tokens (after the chat template) are dropped, or
left-truncated when asked, and the count is logged and kept in :attr:`PromptDataset.stats`.
Batches come from :class:`hyflow.data.loader.PromptLoader`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Iterable, Optional, Sequence

from hyflow.data.tasks import make_task_rows
from hyflow.data.tokenizer import Tokenizer

__all__ = [
    "DatasetError", "PromptRecord", "DatasetStats", "PromptDataset", "read_rows", "write_rows",
    "validate_row", "build_dataset", "reference_response_ids",
]

_LOG = logging.getLogger(__name__)
_MAX_LISTED = 5


class DatasetError(ValueError):
    """A dataset problem; ``path``, ``row`` (0-based) and ``key`` locate the first one."""

    def __init__(self, message: str, path: Optional[str] = None, row: Optional[int] = None,
                 key: Optional[str] = None, errors: Sequence[tuple[int, Optional[str], str]] = ()) -> None:
        super().__init__(message)
        self.path, self.row, self.key = path, row, key
        self.errors = list(errors)


class _RowError(Exception):
    def __init__(self, key: Optional[str], message: str) -> None:
        super().__init__(message)
        self.key, self.message = key, message


@dataclasses.dataclass
class PromptRecord:
    """One validated, tokenized prompt."""

    uid: int                      # index in the dataset (after length filtering)
    path: str                     # the file (or task name) it came from
    row: int                      # its 0-based row index there
    messages: list[dict]
    prompt_text: str              # after the chat template
    prompt_ids: list[int]
    data_source: str
    ground_truth: Any
    extra_info: dict
    truncated: bool = False

    @property
    def reference(self) -> Optional[str]:
        """Reference response for an SFT warm-up (``extra_info["answer"]``), if any."""
        ans = self.extra_info.get("answer")
        return ans if isinstance(ans, str) else None

    @property
    def where(self) -> str:
        """``path row N`` for messages."""
        return f"{self.path} row {self.row}"


@dataclasses.dataclass
class DatasetStats:
    """Counts from loading: rows read, kept, dropped / truncated for length, longest kept prompt."""

    rows: int = 0
    kept: int = 0
    dropped_long: int = 0
    truncated: int = 0
    max_prompt_tokens: int = 0


# ----------------------------------------------------------------------------- file I/O

def read_rows(path: str, limit: Optional[int] = None) -> list[Any]:
    """Rows of a ``.jsonl`` / ``.json`` (array) / ``.parquet`` file, as Python objects (only
    the first ``limit`` of a ``.jsonl`` / ``.parquet`` file when given: a quick look)."""
    if not os.path.isfile(path):
        raise DatasetError(f"data file not found: {path}", path=path)
    ext = os.path.splitext(path)[1].lower()
    if ext in (".jsonl", ".ndjson"):
        rows = []
        with open(path, "rb") as f:  # decoded per line, so a bad byte is located by row and line
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DatasetError(
                        f"{path}: row {len(rows)} (line {lineno}): not UTF-8 text (byte 0x{raw[exc.start]:02x} at "
                        f"column {exc.start + 1}); save the file as UTF-8", path=path, row=len(rows)) from None
                if not line.strip():
                    continue
                if limit is not None and len(rows) >= limit:
                    break
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{path}: row {len(rows)} (line {lineno}): invalid JSON: {exc}",
                                       path=path, row=len(rows)) from exc
        return rows
    if ext == ".json":
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}: invalid JSON: {exc}", path=path) from exc
            except UnicodeDecodeError as exc:
                raise DatasetError(f"{path}: not UTF-8 text (byte offset {exc.start}); save the file as UTF-8",
                                   path=path) from None
        if not isinstance(data, list):
            raise DatasetError(f"{path}: a .json data file must hold a list of rows", path=path)
        return data
    if ext in (".parquet", ".pq"):
        pq = _pyarrow_parquet(path)
        try:
            if limit is not None:
                batch = next(pq.ParquetFile(path).iter_batches(batch_size=limit), None)
                return batch.to_pylist() if batch is not None else []
            return pq.read_table(path).to_pylist()
        except Exception as exc:  # noqa: BLE001 - pyarrow's errors name no file
            raise DatasetError(f"{path}: not a readable parquet file ({type(exc).__name__}: {exc})",
                               path=path) from None
    raise DatasetError(f"{path}: unsupported data file type {ext!r} (use .jsonl or .parquet)", path=path)


def _pyarrow_parquet(path: str) -> Any:
    try:
        # optional dependency (pyarrow): only this path needs it
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise DatasetError(f"{path}: reading/writing parquet needs pyarrow: `pip install pyarrow` "
                           f"(or use .jsonl)", path=path) from exc
    return pq


def write_rows(rows: Sequence[dict], path: str) -> str:
    """Write rows as ``.jsonl`` or ``.parquet`` (by extension); returns ``path``."""
    ext = os.path.splitext(path)[1].lower()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if ext in (".jsonl", ".ndjson"):
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    elif ext in (".parquet", ".pq"):
        pq = _pyarrow_parquet(path)
        # optional dependency (pyarrow): only this path needs it
        import pyarrow as pa

        pq.write_table(pa.Table.from_pylist(list(rows)), path)
    else:
        raise DatasetError(f"{path}: unsupported data file type {ext!r} (use .jsonl or .parquet)", path=path)
    return path


# ----------------------------------------------------------------------------- validation

#: Chat roles a prompt's messages may have (OpenAI's and the chat templates' of Llama, Qwen, Mistral).
CHAT_ROLES = ("system", "user", "assistant", "tool", "ipython", "function", "developer")

def _messages(value: Any, key: str) -> list[dict]:
    if isinstance(value, str):
        if not value.strip():
            raise _RowError(key, "is an empty string")
        return [{"role": "user", "content": value}]
    if not isinstance(value, (list, tuple)) or not value:
        raise _RowError(key, f"must be a non-empty list of chat messages, got {type(value).__name__}"
                        + (" (empty)" if isinstance(value, (list, tuple)) else ""))
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise _RowError(f"{key}[{i}]", f"must be an object with role and content, got {type(msg).__name__}")
        for field in ("role", "content"):
            if field not in msg:
                raise _RowError(f"{key}[{i}].{field}", "missing")
            if not isinstance(msg[field], str):
                raise _RowError(f"{key}[{i}].{field}", f"must be a string, got {type(msg[field]).__name__}")
            if not msg[field].strip():  # as `prompt: ""`: the model would train on an empty turn
                raise _RowError(f"{key}[{i}].{field}", "is an empty string")
        if msg["role"] not in CHAT_ROLES:  # a chat template fails on it, once the ranks run
            raise _RowError(f"{key}[{i}].role", f"unknown role {msg['role']!r}; one of {', '.join(CHAT_ROLES)}")
        out.append({"role": msg["role"], "content": msg["content"]})
    return out


def validate_row(row: Any, prompt_key: str = "prompt",
                 require_ground_truth: bool = True) -> tuple[list[dict], str, Any, dict]:
    """Check one row; returns ``(messages, data_source, ground_truth, extra_info)``.

    Raises ``_RowError`` (wrapped into :class:`DatasetError` by the loader) naming the key.
    """
    if not isinstance(row, dict):
        raise _RowError(None, f"row must be an object, got {type(row).__name__}")
    if prompt_key not in row:
        raise _RowError(prompt_key, f"missing key {prompt_key!r}")
    messages = _messages(row[prompt_key], prompt_key)
    if "data_source" not in row:
        raise _RowError("data_source", "missing key 'data_source'")
    source = row["data_source"]
    if not isinstance(source, str) or not source:
        raise _RowError("data_source", f"must be a non-empty string, got {source!r}")
    ground_truth = None
    reward = row.get("reward_model")
    if require_ground_truth:
        if reward is None:
            raise _RowError("reward_model", "missing key 'reward_model' (needs reward_model.ground_truth)")
        if not isinstance(reward, dict):
            raise _RowError("reward_model", f"must be an object, got {type(reward).__name__}")
        if "ground_truth" not in reward:
            raise _RowError("reward_model.ground_truth", "missing key 'reward_model.ground_truth'")
        ground_truth = reward["ground_truth"]
        if ground_truth is None or (isinstance(ground_truth, str) and not ground_truth.strip()):
            raise _RowError("reward_model.ground_truth", f"is empty ({ground_truth!r})")
    elif isinstance(reward, dict):
        ground_truth = reward.get("ground_truth")
    extra = row.get("extra_info")
    if extra is None:
        extra = {}
    elif not isinstance(extra, dict):
        raise _RowError("extra_info", f"must be an object, got {type(extra).__name__}")
    return messages, source, ground_truth, dict(extra)


def _format_errors(path: str, errors: list[tuple[int, Optional[str], str]], total: int) -> str:
    lines = [f"{total} malformed row(s) in {path}:"]
    for row, key, msg in errors[:_MAX_LISTED]:
        where = f"row {row}" + (f", key '{key}'" if key else "")
        lines.append(f"  {where}: {msg}")
    if total > _MAX_LISTED:
        lines.append(f"  ... and {total - _MAX_LISTED} more")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- dataset

class PromptDataset(Sequence[PromptRecord]):
    """Validated, tokenized, length-filtered prompts (a list of :class:`PromptRecord`)."""

    def __init__(self, records: list[PromptRecord], stats: DatasetStats, sources: Sequence[str]) -> None:
        self.records = records
        self.stats = stats
        self.sources = list(sources)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> PromptRecord:  # type: ignore[override]
        return self.records[i]

    @classmethod
    def from_files(cls, paths: Sequence[str], tokenizer: Tokenizer, **kwargs: Any) -> "PromptDataset":
        """Load and validate every file (see :meth:`from_rows` for the keyword arguments)."""
        if not paths:
            raise DatasetError("no data files given (data.train_files is empty)")
        return cls._build([(p, read_rows(p)) for p in paths], tokenizer, **kwargs)

    @classmethod
    def from_rows(cls, rows: Sequence[Any], tokenizer: Tokenizer, source: str = "<rows>",
                  **kwargs: Any) -> "PromptDataset":
        """Build from in-memory rows (``source`` names them in messages).

        Keyword arguments: ``max_prompt_length`` (tokens after the chat template; required),
        ``truncate`` (left-truncate longer prompts instead of dropping them), ``prompt_key``
        (the column holding the chat messages) and ``require_ground_truth`` (False for reward
        models, which need no ``reward_model.ground_truth``).
        """
        return cls._build([(source, list(rows))], tokenizer, **kwargs)

    @classmethod
    def _build(cls, files: Iterable[tuple[str, list[Any]]], tokenizer: Tokenizer, *,
               max_prompt_length: int, truncate: bool = False, prompt_key: str = "prompt",
               require_ground_truth: bool = True) -> "PromptDataset":
        if max_prompt_length < 1:
            raise DatasetError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
        records: list[PromptRecord] = []
        stats = DatasetStats()
        sources = []
        for path, rows in files:
            sources.append(path)
            if not rows:
                raise DatasetError(f"{path}: no rows", path=path)
            parsed, errors = [], []
            for i, row in enumerate(rows):
                try:
                    parsed.append((i, *validate_row(row, prompt_key, require_ground_truth)))
                except _RowError as exc:
                    errors.append((i, exc.key, exc.message))
            if errors:
                first = errors[0]
                raise DatasetError(_format_errors(path, errors, len(errors)), path=path,
                                   row=first[0], key=first[1], errors=errors)
            try:
                texts = [tokenizer.apply_chat_template(p[1]) for p in parsed]
                all_ids = tokenizer.encode_prompt_texts(texts)
            except Exception as exc:  # noqa: BLE001 - find and name the row
                raise cls._tokenize_error(path, parsed, tokenizer, exc) from exc
            dropped = truncated = 0
            for (i, messages, source, gt, extra), text, ids in zip(parsed, texts, all_ids):
                cut = False
                if len(ids) > max_prompt_length:
                    if not truncate:
                        dropped += 1
                        continue
                    ids, cut = ids[-max_prompt_length:], True
                    truncated += 1
                records.append(PromptRecord(len(records), path, i, messages, text, list(ids),
                                            source, gt, extra, cut))
                stats.max_prompt_tokens = max(stats.max_prompt_tokens, len(ids))
            stats.rows += len(rows)
            stats.dropped_long += dropped
            stats.truncated += truncated
            if dropped:
                _LOG.warning("%s: dropped %d of %d prompts longer than max_prompt_length=%d tokens "
                             "(rollout.truncate_long_prompts=true left-truncates them instead)",
                             path, dropped, len(rows), max_prompt_length)
            if truncated:
                _LOG.warning("%s: left-truncated %d of %d prompts to max_prompt_length=%d tokens",
                             path, truncated, len(rows), max_prompt_length)
        stats.kept = len(records)
        if not records:
            raise DatasetError(f"no prompts left in {', '.join(sources)}: all {stats.rows} are longer than "
                               f"max_prompt_length={max_prompt_length} tokens")
        return cls(records, stats, sources)

    @staticmethod
    def _tokenize_error(path: str, parsed: list, tokenizer: Tokenizer, exc: Exception) -> DatasetError:
        for i, messages, *_ in parsed:
            try:
                tokenizer.encode_chat(messages)
            except Exception as row_exc:  # noqa: BLE001
                return DatasetError(f"{path}: row {i}: chat template / tokenization failed: {row_exc}",
                                    path=path, row=i, key="prompt")
        return DatasetError(f"{path}: tokenization failed: {exc}", path=path)


def build_dataset(data: Any, rollout: Any, tokenizer: Tokenizer, require_ground_truth: bool = True) -> PromptDataset:
    """The dataset of an RL job from its ``DataConfig`` and ``RolloutConfig``.

    ``data.task`` set: the synthetic task's rows (:mod:`hyflow.data.tasks`, with
    ``data.task_options`` passed to its generator when the config has that key); else
    ``data.train_files``.
    """
    kwargs = dict(max_prompt_length=rollout.max_prompt_length, truncate=rollout.truncate_long_prompts,
                  prompt_key=data.prompt_key, require_ground_truth=require_ground_truth)
    if data.task:
        options = dict(getattr(data, "task_options", None) or {})  # e.g. {max_digits: 4}, when the key exists
        rows = make_task_rows(data.task, data.task_size, seed=data.seed, **options)
        kwargs["prompt_key"] = "prompt"
        return PromptDataset.from_rows(rows, tokenizer, source=f"task:{data.task}", **kwargs)
    return PromptDataset.from_files(list(data.train_files), tokenizer, **kwargs)


def reference_response_ids(record: PromptRecord, tokenizer: Tokenizer) -> list[int]:
    """Token ids of the record's reference answer followed by EOS: the SFT warm-up target.

    Appended to ``record.prompt_ids`` this is the sequence a supervised step trains on (loss on
    the response part only). A row without ``extra_info["answer"]`` raises :class:`DatasetError`.
    """
    if record.reference is None:
        raise DatasetError(f"{record.where}: no reference answer (extra_info.answer) for the SFT warm-up",
                           path=record.path, row=record.row, key="extra_info.answer")
    return tokenizer.encode(record.reference, add_special_tokens=False) + [tokenizer.eos_token_id]

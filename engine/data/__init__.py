"""Prompt data for RL: tokenizers, verl-format datasets with resumable sampling, synthetic tasks.

* :mod:`.tokenizer` -- :class:`Tokenizer` adapters (HF, sentencepiece, :class:`CharTokenizer`)
  and :func:`load_tokenizer`;
* :mod:`.dataset` -- :class:`PromptDataset` (validation with row-level errors, length
  filtering);
* :mod:`.loader` -- :class:`EpochSampler` / :class:`PromptLoader` (deterministic, resumable);
* :mod:`.tasks` -- synthetic verifiable tasks (``digits_reverse`` for the CPU quickstart,
  ``arithmetic`` for SmolLM2) and preference tasks (``pref_digit_add``, ``pref_arithmetic``);
* :mod:`.preference` -- DPO / KTO rows in TRL's formats (:class:`PreferenceDataset`).
"""
from hyflow.data.dataset import (
    DatasetError,
    DatasetStats,
    PromptDataset,
    PromptRecord,
    build_dataset,
    read_rows,
    reference_response_ids,
    validate_row,
    write_rows,
)
from hyflow.data.preference import KTOExample, PreferenceDataset, PreferencePair, build_preference_dataset
from hyflow.data.loader import EpochSampler, PromptLoader
from hyflow.data.tasks import (
    QUICKSTART_TASK,
    TASKS,
    TaskInfo,
    load_data_tokenizer,
    make_preference_rows,
    make_task_rows,
    task_info,
    tokenizer_spec_for,
)
from hyflow.data.tokenizer import (
    CharTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
    simple_chat_text,
)

__all__ = [
    "DatasetError", "DatasetStats", "EpochSampler", "PromptDataset", "PromptLoader", "PromptRecord",
    "build_dataset", "read_rows", "reference_response_ids", "validate_row", "write_rows",
    "KTOExample", "PreferenceDataset", "PreferencePair", "build_preference_dataset", "make_preference_rows",
    "QUICKSTART_TASK", "TASKS", "TaskInfo", "load_data_tokenizer", "make_task_rows", "task_info",
    "tokenizer_spec_for",
    "CharTokenizer", "HFTokenizer", "SentencePieceTokenizer", "Tokenizer", "TokenizerError",
    "load_tokenizer", "simple_chat_text",
]

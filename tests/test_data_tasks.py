"""Synthetic tasks: verl-format rows, correct answers (checked independently), determinism,
file round trips and scoring with the rule verifiers."""
from __future__ import annotations

import re

import pytest

from hyflow.config import ConfigError
from hyflow.data import (
    QUICKSTART_TASK,
    TASKS,
    CharTokenizer,
    PromptDataset,
    load_data_tokenizer,
    make_task_rows,
    task_info,
    tokenizer_spec_for,
    validate_row,
    write_rows,
)
from hyflow.jobs.rl_config import DataConfig
from hyflow.models.description import tiny_llama
from hyflow.rewards import RewardManager


@pytest.mark.parametrize("name", sorted(TASKS))
def test_rows_are_valid_verl_format_and_deterministic(name):
    rows = make_task_rows(name, 40, seed=5)
    assert len(rows) == 40
    for i, r in enumerate(rows):
        messages, source, gt, extra = validate_row(r)
        assert source == f"hyflow/{name}" and isinstance(gt, str) and gt
        roles = [m["role"] for m in messages]  # a tool task opens with a system message naming its tools
        assert roles[-1] == "user" and set(roles) <= {"system", "user"}
        assert extra["answer"] == gt and extra["index"] == i
    assert make_task_rows(name, 40, seed=5) == rows
    assert make_task_rows(name, 40, seed=6) != rows
    assert len({r["prompt"][-1]["content"] for r in rows}) > 10     # not one prompt repeated


def _digits(row) -> str:
    return row["prompt"][0]["content"].split()[-1]


def test_digit_task_answers():
    for r in make_task_rows("digits_reverse", 50, seed=1):
        d = _digits(r)
        assert 3 <= len(d) <= 5 and d.isdigit()
        assert r["reward_model"]["ground_truth"] == "".join(reversed(d))
    for r in make_task_rows("digits_copy", 20, seed=1):
        assert r["reward_model"]["ground_truth"] == _digits(r)
    for r in make_task_rows("digits_sort", 20, seed=1):
        gt = r["reward_model"]["ground_truth"]
        assert list(gt) == sorted(_digits(r)) and all(gt[i] <= gt[i + 1] for i in range(len(gt) - 1))
    for r in make_task_rows("digit_add", 50, seed=1):
        a, b = re.fullmatch(r"(\d)\+(\d)=", r["prompt"][0]["content"]).groups()
        assert int(r["reward_model"]["ground_truth"]) == int(a) + int(b)
    short = make_task_rows("digits_copy", 30, seed=1, min_digits=2, max_digits=2)
    assert {len(_digits(r)) for r in short} == {2}
    with pytest.raises(ValueError, match="min_digits"):
        make_task_rows("digits_copy", 3, min_digits=4, max_digits=2)


def test_arithmetic_word_problems():
    rows = make_task_rows("arithmetic", 200, seed=3, ops="+-*")
    seen_ops = set()
    for r in rows:
        q = r["prompt"][0]["content"]
        m = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\? Answer with just the number\.", q)
        assert m, q
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        seen_ops.add(op)
        want = {"+": a + b, "-": a - b, "*": a * b}[op]
        assert r["reward_model"]["ground_truth"] == str(want) and want >= 0
        assert max(a, b) <= (12 if op == "*" else 50)
    assert seen_ops == {"+", "-", "*"}
    assert {r["prompt"][0]["content"].split()[3] for r in make_task_rows("arithmetic", 50)} == {"+", "-"}
    with pytest.raises(ValueError, match="ops"):
        make_task_rows("arithmetic", 5, ops="/")


def test_reference_answers_score_one_and_wrong_answers_zero():
    for name, info in TASKS.items():
        # max_prompt_length: a tool task's system message counts too (characters here)
        ds = PromptDataset.from_rows(make_task_rows(name, 30, seed=0), CharTokenizer(), max_prompt_length=4096)
        rm = RewardManager.from_rule(info.reward_rule)
        rm.check_records(ds.records)
        good = rm.score_records(ds.records, [r.reference for r in ds])
        assert good.scores == [1.0] * 30, name
        bad = rm.score_records(ds.records, [r.reference + "1" for r in ds])
        if info.reward_rule == "length_match":  # partial credit: one character too many
            assert bad.scores == [1.0 - 1.0 / len(r.reference) for r in ds], name
        else:
            assert bad.scores == [0.0] * 30, name


def test_length_tail_lengths_are_long_tailed():
    rows = make_task_rows("length_tail", 2000, seed=0)
    lengths = [len(r["reward_model"]["ground_truth"]) for r in rows]
    for r, n in zip(rows, lengths):
        assert r["prompt"][0]["content"] == f"write {n}"
        assert r["reward_model"]["ground_truth"] == "".join(str((i + 1) % 10) for i in range(n))
    assert min(lengths) == 3 and max(lengths) == 48
    assert sorted(lengths)[len(lengths) // 2] <= 8           # most are short ...
    assert sum(n >= 30 for n in lengths) >= 20              # ... a few are 10x longer
    with pytest.raises(ValueError, match="min_length < max_length"):
        make_task_rows("length_tail", 4, min_length=9, max_length=9)


def test_arithmetic_accepts_chatty_numeric_answers():
    rows = make_task_rows("arithmetic", 5, seed=0)
    ds = PromptDataset.from_rows(rows, CharTokenizer(), max_prompt_length=128)
    rm = RewardManager.from_rule("numeric_match")
    answers = [f"The answer is {r.ground_truth}." for r in ds]
    assert rm.score_records(ds.records, answers).scores == [1.0] * 5


def test_quickstart_task_fits_the_tiny_model():
    tok = CharTokenizer()
    model = tiny_llama()
    assert TASKS[QUICKSTART_TASK].tokenizer == "char" and tok.vocab_size <= model.vocab_size
    ds = PromptDataset.from_rows(make_task_rows(QUICKSTART_TASK, 500, seed=1), tok, max_prompt_length=32)
    assert ds.stats.dropped_long == 0
    longest = max(len(r.prompt_ids) + len(tok.encode(r.reference)) + 1 for r in ds)
    assert longest <= 32 <= model.max_position_embeddings


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_written_task_files_load_back(tmp_path, ext):
    if ext == "parquet":
        pytest.importorskip("pyarrow")
    rows = make_task_rows("arithmetic", 25, seed=2)
    path = write_rows(rows, str(tmp_path / f"arith.{ext}"))
    ds = PromptDataset.from_files([path], CharTokenizer(), max_prompt_length=128)
    assert [r.ground_truth for r in ds] == [r["reward_model"]["ground_truth"] for r in rows]
    assert ds[3].messages == rows[3]["prompt"] and ds[3].extra_info == rows[3]["extra_info"]


def test_task_lookup_and_tokenizer_spec():
    with pytest.raises(ConfigError, match=r"unknown synthetic task 'nope'; available: arithmetic, digit_add"):
        task_info("nope")
    assert tokenizer_spec_for(DataConfig(task="digits_reverse")) == "char"
    assert isinstance(load_data_tokenizer(DataConfig(task="digit_add")), CharTokenizer)
    assert tokenizer_spec_for(DataConfig(task="arithmetic", tokenizer="/x/tok")) == "/x/tok"
    with pytest.raises(ConfigError, match="task 'arithmetic' has no built-in tokenizer: set data.tokenizer"):
        tokenizer_spec_for(DataConfig(task="arithmetic"))
    with pytest.raises(ConfigError, match="no tokenizer given"):
        tokenizer_spec_for(DataConfig(train_files=["a.jsonl"]))


def test_task_option_values_are_checked(tmp_path, capsys):
    from hyflow.cli import main

    assert make_task_rows("arithmetic", 3, max_operand="7")[0]["extra_info"]["answer"]  # "7" from a command line
    for options, message in ((dict(max_operand="abc"), "option max_operand expects an integer (default 50), got 'abc'"),
                             (dict(max_operand=2.5), "expects an integer"),
                             (dict(max_operand=-1), "must be >= 0"),
                             (dict(digits=3), "task arithmetic has no option digits; its options: ops")):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            make_task_rows("arithmetic", 3, **options)
    out = str(tmp_path / "t.jsonl")
    assert main(["make-task", "arithmetic", "--out", out, "max_operand=abc"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("hyflow make-task: task arithmetic option max_operand expects an integer (default 50), "
                           "got 'abc'")
    assert main(["make-task", "arithmetic", "--out", out, "--size", "4", "max_operand=9", "ops=+"]) == 0

"""verl-format prompt datasets: loading, row-level validation errors, length filtering, sampling."""
from __future__ import annotations

import json
import logging
import sys

import pytest

from hyflow.data import (
    CharTokenizer,
    DatasetError,
    EpochSampler,
    PromptDataset,
    PromptLoader,
    build_dataset,
    read_rows,
    write_rows,
)
from hyflow.jobs.rl_config import DataConfig, RolloutConfig

TOK = CharTokenizer()


def row(q: str = "reverse 123", gt: str = "321", **over) -> dict:
    r = {"prompt": [{"role": "user", "content": q}], "data_source": "toy",
         "reward_model": {"style": "rule", "ground_truth": gt}, "extra_info": {"index": 0, "answer": gt}}
    r.update(over)
    return r


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def load(paths, **kw):
    kw.setdefault("max_prompt_length", 64)
    return PromptDataset.from_files(paths, TOK, **kw)


# ----------------------------------------------------------------------------- loading

def test_jsonl_rows_become_records(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [row("reverse 12", "21"), "", row("copy 7", "7", data_source="b")])
    ds = load([p])
    assert len(ds) == 2 and ds.stats.rows == 2 and ds.stats.kept == 2
    r = ds[1]
    assert (r.uid, r.path, r.row, r.data_source, r.ground_truth) == (1, p, 1, "b", "7")
    assert r.prompt_text == "<s><|user|>copy 7<|assistant|>"
    assert r.prompt_ids == TOK.encode_chat(r.messages) and r.reference == "7"
    assert r.where == f"{p} row 1"


def test_string_prompt_and_optional_fields(tmp_path):
    rows = [{"prompt": "hi", "data_source": "s", "reward_model": {"ground_truth": 3}}]
    r = PromptDataset.from_rows(rows, TOK, max_prompt_length=64)[0]
    assert r.messages == [{"role": "user", "content": "hi"}] and r.extra_info == {} and r.ground_truth == 3
    # without rule/function rewards the ground truth may be absent
    r = PromptDataset.from_rows([{"prompt": "hi", "data_source": "s"}], TOK, max_prompt_length=64,
                                require_ground_truth=False)[0]
    assert r.ground_truth is None and r.reference is None


def test_parquet_roundtrip(tmp_path):
    pytest.importorskip("pyarrow")
    rows = [row(f"reverse {i}23", f"32{i}") for i in range(5)]
    p = write_rows(rows, str(tmp_path / "d.parquet"))
    assert read_rows(p) == rows
    ds = load([p])
    assert [r.ground_truth for r in ds] == [f"32{i}" for i in range(5)]


def test_parquet_without_pyarrow_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    p = tmp_path / "d.parquet"
    p.write_bytes(b"PAR1")
    with pytest.raises(DatasetError, match=r"pip install pyarrow"):
        read_rows(str(p))
    with pytest.raises(DatasetError, match=r"pip install pyarrow"):
        write_rows([row()], str(tmp_path / "out.parquet"))


def test_file_level_errors(tmp_path):
    with pytest.raises(DatasetError, match=r"not found: .*nope\.jsonl"):
        load([str(tmp_path / "nope.jsonl")])
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match=r"unsupported data file type '\.csv'"):
        load([str(tmp_path / "d.csv")])
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match="no rows"):
        load([str(tmp_path / "empty.jsonl")])
    with pytest.raises(DatasetError, match="train_files is empty"):
        load([])


# ----------------------------------------------------------------------------- row errors

@pytest.mark.parametrize("bad, key, message", [
    ({"data_source": "s", "reward_model": {"ground_truth": "1"}}, "prompt", "missing key 'prompt'"),
    (row(data_source=None), "data_source", "non-empty string"),
    ({k: v for k, v in row().items() if k != "data_source"}, "data_source", "missing key 'data_source'"),
    ({k: v for k, v in row().items() if k != "reward_model"}, "reward_model", "missing key 'reward_model'"),
    (row(reward_model={"style": "rule"}), "reward_model.ground_truth", "missing key 'reward_model.ground_truth'"),
    (row(reward_model={"ground_truth": "  "}), "reward_model.ground_truth", "is empty"),
    (row(reward_model="42"), "reward_model", "must be an object"),
    (row(prompt=[]), "prompt", "non-empty list"),
    (row(prompt=[{"role": "user"}]), "prompt[0].content", "missing"),
    (row(prompt=[{"role": "user", "content": 5}]), "prompt[0].content", "must be a string"),
    (row(prompt=[{"role": "user", "content": ""}]), "prompt[0].content", "is an empty string"),
    (row(prompt=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "  "}]),
     "prompt[1].content", "is an empty string"),
    (row(prompt=""), "prompt", "is an empty string"),
    (row(prompt=["hi"]), "prompt[0]", "must be an object"),
    (row(extra_info=[1]), "extra_info", "must be an object"),
    ([1, 2], None, "row must be an object"),
])
def test_malformed_row_is_named(tmp_path, bad, key, message):
    p = write_jsonl(tmp_path / "data.jsonl", [row(), row(), bad, row()])
    with pytest.raises(DatasetError) as info:
        load([p])
    err = info.value
    assert (err.path, err.row, err.key) == (p, 2, key)
    text = str(err)
    assert p in text and "row 2" in text and message in text
    if key:
        assert f"key '{key}'" in text


def test_all_malformed_rows_counted(tmp_path):
    rows = [row()] + [{k: v for k, v in row().items() if k != "data_source"}] * 8
    p = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DatasetError) as info:
        load([p])
    assert str(info.value).startswith(f"8 malformed row(s) in {p}:")
    assert "... and 3 more" in str(info.value)
    assert [e[0] for e in info.value.errors] == list(range(1, 9))


def test_invalid_json_line_names_row_and_line(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [row(), "", '{"prompt": [', row()])
    with pytest.raises(DatasetError, match=r"d\.jsonl: row 1 \(line 3\): invalid JSON") as info:
        load([p])
    assert info.value.row == 1


def test_custom_prompt_key(tmp_path):
    r = row()
    r["question"] = r.pop("prompt")
    ds = PromptDataset.from_rows([r], TOK, max_prompt_length=64, prompt_key="question")
    assert ds[0].messages[0]["content"] == "reverse 123"
    with pytest.raises(DatasetError, match="missing key 'prompt'"):
        PromptDataset.from_rows([r], TOK, max_prompt_length=64)


# ----------------------------------------------------------------------------- length limit

def _length_rows():
    # chat overhead is 3 tokens: <s><|user|> ... <|assistant|>
    return [row("x" * n) for n in (5, 20, 7, 30)]


def test_long_prompts_dropped_and_counted(caplog):
    with caplog.at_level(logging.WARNING, logger="hyflow.data.dataset"):
        ds = PromptDataset.from_rows(_length_rows(), TOK, max_prompt_length=10, source="mem")
    assert [r.row for r in ds] == [0, 2] and [r.uid for r in ds] == [0, 1]
    assert (ds.stats.rows, ds.stats.kept, ds.stats.dropped_long, ds.stats.truncated) == (4, 2, 2, 0)
    assert ds.stats.max_prompt_tokens == 10
    assert "mem: dropped 2 of 4 prompts longer than max_prompt_length=10" in caplog.text


def test_long_prompts_left_truncated_and_counted(caplog):
    with caplog.at_level(logging.WARNING, logger="hyflow.data.dataset"):
        ds = PromptDataset.from_rows(_length_rows(), TOK, max_prompt_length=10, truncate=True, source="mem")
    assert len(ds) == 4 and ds.stats.truncated == 2 and ds.stats.dropped_long == 0
    long = ds[1]
    assert long.truncated and len(long.prompt_ids) == 10
    assert long.prompt_ids == TOK.encode_chat(long.messages)[-10:]   # the end (generation prompt) is kept
    assert long.prompt_ids[-1] == 6
    assert not ds[0].truncated
    assert "left-truncated 2 of 4 prompts" in caplog.text


def test_everything_too_long_is_an_error():
    with pytest.raises(DatasetError, match="all 4 are longer than max_prompt_length=4"):
        PromptDataset.from_rows(_length_rows(), TOK, max_prompt_length=4)


# ----------------------------------------------------------------------------- sampling

def _drain(sampler, n):
    return [sampler.next_indices() for _ in range(n)]


def test_sampler_epochs_are_permutations_fixed_by_seed_and_epoch():
    s = EpochSampler(10, 3, shuffle=True, seed=7)
    batches = _drain(s, 6)                              # 3 full batches per epoch, tail dropped
    e0, e1 = sum(batches[:3], []), sum(batches[3:], [])
    assert len(set(e0)) == 9 and len(set(e1)) == 9      # no repeats within an epoch
    assert e0 == s.order(0)[:9].tolist() and e1 == s.order(1)[:9].tolist()
    assert e0 != e1
    assert _drain(EpochSampler(10, 3, seed=7), 6) == batches      # same seed: same order
    assert _drain(EpochSampler(10, 3, seed=8), 3) != batches[:3]  # other seed: other order
    assert s.state_dict()["epoch"] == 1 and s.state_dict()["index"] == 9
    plain = EpochSampler(5, 2, shuffle=False)
    assert _drain(plain, 3) == [[0, 1], [2, 3], [0, 1]]


def test_sampler_resume_continues_exactly():
    ref = EpochSampler(11, 4, seed=3)
    expected = _drain(ref, 9)
    first = EpochSampler(11, 4, seed=3)
    _drain(first, 4)
    state = json.loads(json.dumps(first.state_dict()))   # survives a checkpoint round trip
    resumed = EpochSampler(11, 4, seed=3)
    resumed.load_state_dict(state)
    assert _drain(resumed, 5) == expected[4:]


def test_sampler_resume_mismatch_and_small_dataset():
    s = EpochSampler(11, 4, seed=3)
    state = s.state_dict()
    with pytest.raises(DatasetError, match="size=11 differs from this run's 12"):
        EpochSampler(12, 4, seed=3).load_state_dict(state)
    with pytest.raises(DatasetError, match="seed=3 differs"):
        EpochSampler(11, 4, seed=4).load_state_dict(state)
    with pytest.raises(DatasetError, match="fewer than one batch of 8"):
        EpochSampler(5, 8)


def test_prompt_loader_batches_and_state():
    ds = PromptDataset.from_rows([row(f"reverse {i}") for i in range(6)], TOK, max_prompt_length=64)
    loader = PromptLoader(ds, batch_size=2, seed=1)
    b1 = loader.next_batch()
    assert len(b1) == 2 and all(r is ds[r.uid] for r in b1)
    state = loader.state_dict()
    rest = [[r.uid for r in loader.next_batch()] for _ in range(4)]
    again = PromptLoader(ds, batch_size=2, seed=1)
    again.load_state_dict(state)
    assert [[r.uid for r in again.next_batch()] for _ in range(4)] == rest
    assert again.epoch == 1


# ----------------------------------------------------------------------------- from config

def test_build_dataset_from_config(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [row("x" * n) for n in (3, 40, 4)])
    ds = build_dataset(DataConfig(train_files=[p]), RolloutConfig(max_prompt_length=16), TOK)
    assert len(ds) == 2 and ds.stats.dropped_long == 1
    ds = build_dataset(DataConfig(train_files=[p]), RolloutConfig(max_prompt_length=16, truncate_long_prompts=True), TOK)
    assert len(ds) == 3 and ds.stats.truncated == 1
    ds = build_dataset(DataConfig(task="digits_reverse", task_size=50, seed=2), RolloutConfig(), TOK)
    assert len(ds) == 50 and ds.sources == ["task:digits_reverse"] and ds[0].path == "task:digits_reverse"
    data = DataConfig(task="digits_reverse", task_size=20)
    data.task_options = {"min_digits": 2, "max_digits": 2}       # a key the lead may add to DataConfig
    assert {len(r.ground_truth) for r in build_dataset(data, RolloutConfig(), TOK)} == {2}


def test_non_utf8_bytes_name_the_row_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    good = json.dumps(row()).encode()
    p.write_bytes(good + b"\n\n" + good[:20] + b"\xff\xfe" + good[20:] + b"\n")
    with pytest.raises(DatasetError) as info:
        load([str(p)])
    assert str(info.value).startswith(f"{p}: row 1 (line 3): not UTF-8 text (byte 0xff at column 21)")
    assert (info.value.path, info.value.row) == (str(p), 1)

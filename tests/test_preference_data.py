"""Preference data (issue #17): TRL's DPO and KTO row formats, row-level errors naming file, row
and key, tokenization of prompt / completion, length filtering with counts, KTO's KL pairing,
the synthetic preference tasks and the preference job configs."""
from __future__ import annotations

import json
import re

import pytest

from hyflow.config import ConfigError, load_config
from hyflow.data import CharTokenizer, DatasetError, PromptLoader, write_rows
from hyflow.data.preference import PreferenceDataset, build_preference_dataset, sequence_tensors
from hyflow.data.tasks import TASKS, make_preference_rows, make_task_rows
from hyflow.jobs.preference_config import DPOJobConfig, KTOJobConfig

TOK = CharTokenizer()
LIMITS = dict(max_prompt_length=64, max_completion_length=16)


def user(text):
    return [{"role": "user", "content": text}]


def assistant(text):
    return [{"role": "assistant", "content": text}]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def dpo(rows, **kw):
    return PreferenceDataset.from_rows(rows, TOK, "dpo", **dict(LIMITS, **kw))


# ----------------------------------------------------------------------------- formats


def test_dpo_string_message_and_implicit_prompt_formats_give_the_same_tokens():
    prompt_ids = TOK.encode("<s><|user|>2+3=<|assistant|>")
    rows = [
        {"prompt": "2+3=", "chosen": "5", "rejected": "6"},
        {"prompt": user("2+3="), "chosen": assistant("5"), "rejected": assistant("6")},
        {"chosen": user("2+3=") + assistant("5"), "rejected": user("2+3=") + assistant("6")},
    ]
    ds = dpo(rows)
    assert len(ds) == 3 and ds.stats.kept == 3
    for i, pair in enumerate(ds):
        assert (pair.uid, pair.row) == (i, i)
        assert pair.prompt_ids == prompt_ids
        # the assistant turn as the chat template renders it: content then the end-of-turn token
        assert pair.chosen_ids == TOK.encode("5</s>") and pair.rejected_ids == TOK.encode("6</s>")


def test_hf_chat_template_completion_is_what_the_template_adds(tmp_path):
    from hyflow.data.tokenizer import load_tokenizer
    from hyflow.testing.fixtures import write_tiny_hf_tokenizer

    tok = load_tokenizer(write_tiny_hf_tokenizer(str(tmp_path / "tok")))
    ds = PreferenceDataset.from_rows([{"prompt": "what is 2 + 3 ?", "chosen": "3", "rejected": "2"}], tok, "dpo",
                                     **LIMITS)
    pair = ds[0]
    full = tok.encode_prompt_texts([tok.apply_chat_template(user("what is 2 + 3 ?") + assistant("3"),
                                                            add_generation_prompt=False)])[0]
    assert full == pair.prompt_ids + pair.chosen_ids
    assert pair.chosen_ids[-1] == tok.tok.convert_tokens_to_ids("<|im_end|>")  # the turn's end, no extra EOS


def test_eos_is_appended_when_the_template_ends_no_turn():
    class Plain(CharTokenizer):  # "role: content" lines: nothing marks the end of the answer
        def apply_chat_template(self, messages, add_generation_prompt=True):
            from hyflow.data.tokenizer import simple_chat_text
            return simple_chat_text(messages, add_generation_prompt)

    tok = Plain()
    pair = PreferenceDataset.from_rows([{"prompt": "q", "chosen": "a", "rejected": "b"}], tok, "dpo", **LIMITS)[0]
    assert pair.chosen_ids == tok.encode("a\n") + [tok.eos_token_id]


def test_kto_rows_and_kl_pairs():
    rows = [{"prompt": f"{i}+1=", "completion": assistant(str(i + 1)) if i % 2 else str(i), "label": bool(i % 2)}
            for i in range(9)]
    ds = PreferenceDataset.from_rows(rows, TOK, "kto", seed=3, **LIMITS)
    assert [e.label for e in ds] == [bool(i % 2) for i in range(9)]
    assert (ds.stats.desirable, ds.stats.undesirable) == (4, 5)
    assert ds[3].completion_ids == TOK.encode("4</s>") and ds[4].completion_ids == TOK.encode("4</s>")
    # every example's KL completion is another example's, each used once (a derangement)
    owners = [next(j for j in range(9) if ds[j].completion_ids is e.kl_completion_ids) for e in ds]
    assert sorted(owners) == list(range(9)) and all(o != i for i, o in enumerate(owners))
    again = PreferenceDataset.from_rows(rows, TOK, "kto", seed=3, **LIMITS)
    assert [e.kl_completion_ids for e in again] == [e.kl_completion_ids for e in ds]
    assert again.fingerprint() == ds.fingerprint()
    other = PreferenceDataset.from_rows(rows, TOK, "kto", seed=4, **LIMITS)
    assert other.fingerprint() != ds.fingerprint()


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_files_round_trip(tmp_path, ext):
    if ext == "parquet":
        pytest.importorskip("pyarrow")
    rows = make_preference_rows("pref_digit_add", 20, "dpo", seed=2)
    path = write_rows(rows, str(tmp_path / f"pairs.{ext}"))
    ds = PreferenceDataset.from_files([path], TOK, "dpo", **LIMITS)
    assert len(ds) == 20 and ds[5].path == path and ds[5].row == 5
    assert ds[5].chosen_ids == TOK.encode(rows[5]["chosen"][0]["content"] + "</s>")


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kind,bad,key,text", [
    ("dpo", {"prompt": "q", "chosen": "a"}, "rejected", "missing key 'rejected'"),
    ("dpo", {"prompt": "q", "chosen": "", "rejected": "b"}, "chosen", "empty completion"),
    ("dpo", {"prompt": "q", "chosen": "a", "rejected": assistant("  ")}, "rejected[0].content", "is an empty string"),
    ("dpo", {"prompt": "q", "chosen": "a", "rejected": "a"}, "rejected", "identical to 'chosen'"),
    ("dpo", {"chosen": "a", "rejected": "b"}, "prompt", "missing key 'prompt'"),
    ("dpo", {"chosen": user("q") + assistant("a"), "rejected": user("p") + assistant("b")}, "rejected",
     "before the last assistant turn"),
    ("dpo", {"prompt": "q", "chosen": user("a"), "rejected": "b"}, "chosen[0].role", "assistant's turn"),
    ("kto", {"prompt": "q", "completion": "a", "label": 1}, "label", "must be true (desirable) or false"),
    ("kto", {"prompt": "q", "completion": "a", "label": "true"}, "label", "got 'true' (str)"),
    ("kto", {"prompt": "q", "completion": [], "label": True}, "completion", "non-empty list"),
    ("kto", {"prompt": "q", "label": True}, "completion", "missing key 'completion'"),
])
def test_malformed_rows_name_file_row_and_key(tmp_path, kind, bad, key, text):
    good = {"prompt": "q", "chosen": "a", "rejected": "b"} if kind == "dpo" else \
        {"prompt": "q", "completion": "a", "label": True}
    path = write_jsonl(tmp_path / "data.jsonl", [good, good, bad, good])
    with pytest.raises(DatasetError) as info:
        PreferenceDataset.from_files([path], TOK, kind, **LIMITS)
    err = info.value
    assert (err.path, err.row, err.key) == (path, 2, key)
    message = str(err)
    assert path in message and f"row 2, key '{key}'" in message and text in message
    assert message.count("row ") == 1  # one problem, one line


def test_all_bad_rows_are_counted_in_one_error(tmp_path):
    rows = [{"prompt": "q", "chosen": "a"}] * 7
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DatasetError, match=r"7 malformed row\(s\) in .*d\.jsonl(.|\n)*and 2 more") as info:
        PreferenceDataset.from_files([path], TOK, "dpo", **LIMITS)
    assert len(info.value.errors) == 7


# ----------------------------------------------------------------------------- lengths


def test_long_rows_are_dropped_or_truncated_with_counts():
    rows = [{"prompt": "q" * 10, "chosen": "a", "rejected": "b"},              # fits
            {"prompt": "p" * 40, "chosen": "a", "rejected": "b"},              # prompt too long
            {"prompt": "q", "chosen": "x" * 20, "rejected": "y" * 3},          # completion too long
            {"prompt": "q", "chosen": "z" * 12 + "1", "rejected": "z" * 12 + "2"}]  # equal once truncated
    kw = dict(max_prompt_length=20, max_completion_length=8)
    dropped = PreferenceDataset.from_rows(rows, TOK, "dpo", **kw)
    assert [p.row for p in dropped] == [0] and dropped.stats.dropped_long == 3 and dropped.stats.kept == 1
    cut = PreferenceDataset.from_rows(rows, TOK, "dpo", truncate=True, **kw)
    assert [p.row for p in cut] == [0, 1, 2]
    assert (cut.stats.truncated, cut.stats.dropped_identical, cut.stats.rows) == (3, 1, 4)
    assert len(cut[1].prompt_ids) == 20 and cut[1].prompt_ids[-1] == TOK.encode("<|assistant|>")[0]  # kept the end
    assert cut[2].chosen_ids == TOK.encode("x" * 8) and cut[2].truncated  # kept the start
    assert "3 truncated, 1 identical after truncation" in cut.describe()
    with pytest.raises(DatasetError, match="no rows left"):
        PreferenceDataset.from_rows(rows[1:2], TOK, "dpo", **kw)


def test_sequence_tensors_pad_and_mask():
    t = sequence_tensors([([1, 2], [3]), ([4], [5, 6, 7])], pad_id=0, device="cpu", length=6)
    assert t["tokens"].tolist() == [[1, 2, 3, 0, 0, 0], [4, 5, 6, 7, 0, 0]]
    assert t["completion_mask"].tolist() == [[0, 0, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0]]
    assert t["position_ids"].tolist() == [list(range(6))] * 2
    with pytest.raises(ValueError, match="more than the batch length"):
        sequence_tensors([([1, 2, 3], [4, 5])], pad_id=0, device="cpu", length=4)


def test_loader_order_is_deterministic_and_resumable():
    ds = dpo(make_preference_rows("pref_digit_add", 40, "dpo", seed=1))
    a = PromptLoader(ds, 8, seed=5)
    first = [[p.uid for p in a.next_batch()] for _ in range(3)]
    state = a.state_dict()
    rest = [[p.uid for p in a.next_batch()] for _ in range(4)]  # crosses into epoch 1
    b = PromptLoader(ds, 8, seed=5)
    assert [[p.uid for p in b.next_batch()] for _ in range(3)] == first
    c = PromptLoader(ds, 8, seed=5)
    c.load_state_dict(state)
    assert [[p.uid for p in c.next_batch()] for _ in range(4)] == rest


# ----------------------------------------------------------------------------- tasks


@pytest.mark.parametrize("name", ["pref_digit_add", "pref_arithmetic"])
def test_preference_tasks_right_answer_chosen_plausible_wrong_rejected(name):
    assert TASKS[name].kind == "preference"
    rows = make_preference_rows(name, 60, "dpo", seed=4)
    plain = make_task_rows(name.replace("pref_", ""), 60, seed=4)
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in plain]  # the same problems
    for r in rows:
        right, wrong = int(r["chosen"][0]["content"]), int(r["rejected"][0]["content"])
        assert str(right) == r["reward_model"]["ground_truth"] and wrong != right and wrong >= 0
        a, b = (int(x) for x in re.findall(r"\d+", r["prompt"][0]["content"]))
        # plausible: close, the same digits, or the other operation's result
        assert abs(wrong - right) <= 10 or sorted(str(wrong)) == sorted(str(right)) or wrong in (a + b, abs(a - b), right % 10), r
    kto = make_preference_rows(name, 30, "kto", seed=4)
    assert len(kto) == 60 and [r["label"] for r in kto[:4]] == [True, False, True, False]
    assert kto[1]["completion"] == rows[0]["rejected"] or kto[1]["prompt"] == rows[0]["prompt"]
    with pytest.raises(ConfigError, match="has prompts only"):
        make_preference_rows("arithmetic", 5, "dpo")


def test_pref_arithmetic_equation_answers_differ_only_in_the_result():
    numbers = make_preference_rows("pref_arithmetic", 40, "dpo", seed=5)
    equations = make_preference_rows("pref_arithmetic", 40, "dpo", seed=5, answer="equation")
    for n, e in zip(numbers, equations):
        question = e["prompt"][0]["content"]
        lhs = re.match(r"What is (\d+ [-+*] \d+)\?", question).group(1)
        # the same problem and the same wrong result, written "a op b = x"
        assert n["prompt"] == e["prompt"]
        for key in ("chosen", "rejected"):
            assert e[key][0]["content"] == f"{lhs} = {n[key][0]['content']}"
    with pytest.raises(ValueError, match="answer must be one of number, equation"):
        make_preference_rows("pref_arithmetic", 4, "dpo", answer="words")


def test_arithmetic_test_split_is_held_out():
    train = {r["prompt"][0]["content"] for r in make_task_rows("arithmetic", 400, seed=1, split="train")}
    test = {r["prompt"][0]["content"] for r in make_task_rows("arithmetic", 100, seed=2, split="test")}
    pref = {r["prompt"][0]["content"] for r in make_preference_rows("pref_arithmetic", 400, "dpo", seed=3,
                                                                      split="train")}
    assert test and not test & train and not test & pref
    # the rows say which split they come from (verl's extra_info.split)
    assert {r["extra_info"]["split"] for r in make_task_rows("arithmetic", 10, seed=2, split="test")} == {"test"}
    assert {r["extra_info"]["split"] for r in make_preference_rows("pref_arithmetic", 10, "dpo", split="train")} == \
        {"train"}
    # split=all (the default) leaves the existing task's rows unchanged
    assert make_task_rows("arithmetic", 20, seed=1) == make_task_rows("arithmetic", 20, seed=1, split="all")


def test_make_task_cli_writes_preference_rows(tmp_path, capsys):
    from hyflow.cli import main

    out = str(tmp_path / "kto.jsonl")
    assert main(["make-task", "pref_arithmetic", "--size", "5", "--out", out, "format=kto", "max_operand=9"]) == 0
    assert "wrote 10 pref_arithmetic rows" in capsys.readouterr().out
    ds = PreferenceDataset.from_files([out], TOK, "kto", max_prompt_length=128, max_completion_length=8)
    assert len(ds) == 10 and ds.stats.desirable == 5


# ----------------------------------------------------------------------------- configs


def _config(tmp_path, text: str, cls=DPOJobConfig, overrides=()):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_config(cls, str(path), list(overrides))


BASE = "job: dpo\ndata: {task: pref_digit_add, train_batch_size: 8}\nactor: {micro_batch_size: 2}\n"


def test_configs_validate_before_any_rank_starts(tmp_path):
    cfg = _config(tmp_path, BASE, overrides=["trainer.nproc=2"])
    assert cfg.actor_layout().dp == 2 and cfg.trainer.output_dir == "runs/dpo"
    with pytest.raises(ConfigError, match=r"train_batch_size=8 pairs must be a multiple of dp \* "
                                          r"actor.micro_batch_size = 2 \* 3"):
        _config(tmp_path, BASE, overrides=["trainer.nproc=2", "actor.micro_batch_size=3"])
    with pytest.raises(ConfigError, match="label_smoothing.*sigmoid only"):
        _config(tmp_path, BASE, overrides=["algorithm.loss_type=ipo", "algorithm.label_smoothing=0.1"])
    with pytest.raises(ConfigError, match="reference_free=true has no reference to precompute"):
        _config(tmp_path, BASE, overrides=["algorithm.reference_free=true", "algorithm.precompute_ref_logprobs=true"])
    with pytest.raises(ConfigError, match="rpo_alpha.*finite number >= 0"):
        _config(tmp_path, BASE, overrides=["algorithm.rpo_alpha=-0.5"])
    with pytest.raises(ConfigError, match="rpo_alpha.*finite number >= 0"):
        _config(tmp_path, BASE, overrides=["algorithm.rpo_alpha=.inf"])
    assert _config(tmp_path, BASE, overrides=["algorithm.rpo_alpha=1.0"]).algorithm.rpo_alpha == 1.0
    with pytest.raises(ConfigError, match="rpo_alpha"):  # RPO's NLL term is a DPO option; KTO has no such key
        _config(tmp_path, BASE.replace("job: dpo", "job: kto"), KTOJobConfig, ["algorithm.rpo_alpha=1.0"])
    with pytest.raises(ConfigError, match="loss_type"):
        _config(tmp_path, BASE.replace("dpo", "kto"), KTOJobConfig, ["algorithm.loss_type=ipo"])
    kto = _config(tmp_path, BASE.replace("job: dpo", "job: kto"), KTOJobConfig,
                  ["algorithm.undesirable_weight=1.33"])
    assert kto.trainer.output_dir == "runs/kto" and kto.algorithm.undesirable_weight == 1.33


def test_train_cli_picks_the_preference_schemas():
    from hyflow.jobs.registry import job_schema

    assert job_schema(None, ["job=dpo"])[0] is DPOJobConfig
    assert job_schema(None, ["job=kto"])[0] is KTOJobConfig


def test_build_preference_dataset_from_task_config():
    cfg = DPOJobConfig()
    cfg.data.task, cfg.data.task_size, cfg.data.max_completion_length = "pref_digit_add", 30, 8
    ds = build_preference_dataset(cfg.data, TOK, "dpo")
    assert len(ds) == 30 and ds.sources == ["task:pref_digit_add"]
    cfg.data.task_options = {"format": "kto"}
    with pytest.raises(ConfigError, match="drop task_options.format"):
        build_preference_dataset(cfg.data, TOK, "dpo")


def test_plan_counts_the_reference_unless_precomputed():
    import os

    from hyflow.plan.core import PlanOptions, build_plan

    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "dpo_smollm2.yaml")
    opts = PlanOptions(world_size=2, megatron_ranks=[])
    per_batch = build_plan(config, [], opts)
    assert not per_batch.errors and [r.name for r in per_batch.roles] == ["actor", "reference"]
    peak = per_batch.peak
    assert peak.phase == "dpo update" and peak.get("reference weights") == peak.get("weights") > 0
    pre = build_plan(config, ["algorithm.precompute_ref_logprobs=true"], opts)
    assert [r.name for r in pre.roles] == ["actor"] and pre.peak.get("reference weights") == 0
    assert pre.required_bytes < per_batch.required_bytes
    quick = config.replace("dpo_smollm2", "dpo_quickstart")
    dpo, kto = build_plan(quick, [], opts), build_plan(quick, ["job=kto"], opts)
    assert not kto.errors and kto.peak.phase == "kto update"
    assert kto.peak.get("activations") < dpo.peak.get("activations")  # one row per example, a pair has two

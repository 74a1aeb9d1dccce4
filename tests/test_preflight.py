"""Everything the config alone can tell fails before any rank starts (issues #22 item 1, #15
item 6): ``hyflow train``, ``hyflow launch local`` and ``hyflow launch slurm`` print one line
naming the key (and the path), exit 2, and never reach the code that starts ranks (it is
replaced by a function that fails the test). Also: the architecture comes from
``actor.checkpoint``'s model.json (#22 item 2)."""

from __future__ import annotations

import json

import pytest

import hyflow.cli as cli
import hyflow.launch.local as local

CONFIG = """\
job: rl
model: {family: llama, vocab_size: 128, hidden_size: 32, num_layers: 2, num_attention_heads: 4,
        num_query_groups: 2, ffn_hidden_size: 64, max_position_embeddings: 32}
actor: {layout: {tp: 2, pp: 1}, micro_batch_size: 4, mini_batch_size: 8}
rollout: {layout: {tp: 1, pp: 1}, n: 2, max_prompt_length: 16, max_new_tokens: 4}
reward: {kind: rule, rule: exact_match}
data: {task: digit_add, task_size: 64, train_batch_size: 4}
trainer: {total_steps: 1, nproc: 2, loggers: [console]}
"""


def _row(content="3+4="):
    return {"prompt": [{"role": "user", "content": content}], "data_source": "t",
            "reward_model": {"ground_truth": "7"}}


@pytest.fixture
def files(tmp_path):
    """Paths the cases use: a config, data files, reward functions, a tokenizer-less directory."""
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    good = json.dumps(_row()).encode()
    (tmp_path / "latin1.jsonl").write_bytes(good + b"\n" + good.replace(b"3+4=", b"3\xe94=") + b"\n")
    (tmp_path / "empty.jsonl").write_text(json.dumps(_row()) + "\n" + json.dumps(_row("")) + "\n")
    role = dict(_row(), prompt=[{"role": "usr", "content": "3+4="}])
    (tmp_path / "role.jsonl").write_text(json.dumps(_row()) + "\n" + json.dumps(role) + "\n")
    (tmp_path / "small.jsonl").write_text("".join(json.dumps(_row()) + "\n" for _ in range(3)))
    (tmp_path / "ok.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                    "    return 1.0\n")
    (tmp_path / "sig.py").write_text("def compute_score(text):\n    return 1.0\n")
    (tmp_path / "notok").mkdir()
    (tmp_path / "notok" / "readme.txt").write_text("x")
    return tmp_path


CASES = [  # (overrides with {d} = the files directory, the key named, words the line must hold)
    (["data.task=null", "data.tokenizer=char", "data.train_files=[{d}/missing.jsonl]"], "data.train_files[0]",
     ["{d}/missing.jsonl", "does not exist"]),
    (["data.task=null", "data.tokenizer=char", "data.train_files=[{d}/latin1.jsonl]"], "data.train_files[0]",
     ["{d}/latin1.jsonl: row 1 (line 2): not UTF-8 text"]),
    (["data.task=null", "data.tokenizer=char", "data.train_files=[{d}/empty.jsonl]"], "data.train_files[0]",
     ["{d}/empty.jsonl: row 1", "prompt[0].content", "is an empty string"]),
    (["data.task=null", "data.tokenizer=char", "data.train_files=[{d}/role.jsonl]"], "data.train_files[0]",
     ["{d}/role.jsonl: row 1", "prompt[0].role", "unknown role 'usr'"]),  # issue #39 point 12
    (["data.task=null", "data.tokenizer=char", "data.train_files=[{d}/small.jsonl]"], "data.train_batch_size",
     ["hold 3 rows, fewer than one batch of 4"]),
    (["data.task_size=3"], "data.train_batch_size", ["data.task_size=3 prompts is fewer than one batch of 4"]),
    (["trainer.output_dir="], "trainer.output_dir", ["is empty"]),
    (["data.task=digit_ad"], "data.task", ["unknown synthetic task 'digit_ad'"]),
    (["data.task=digits_copy", "data.task_options={{min_digits: abc}}"], "data.task_options",
     ["option min_digits expects an integer"]),
    (["data.tokenizer={d}/no/such/tokenizer"], "data.tokenizer", ["{d}/no/such/tokenizer does not exist"]),
    (["data.tokenizer={d}/notok"], "data.tokenizer", ["no tokenizer in {d}/notok"]),
    (["reward.kind=function", "reward.function_path={d}/missing.py"], "reward.function_path",
     ["{d}/missing.py", "not found"]),
    (["reward.kind=function", "reward.function_path={d}/ok.py", "reward.function_name=score"],
     "reward.function_name", ["{d}/ok.py defines no function 'score'", "compute_score"]),
    (["reward.kind=function", "reward.function_path={d}/sig.py"], "reward.function_name",
     ["has signature (text)"]),
    (["reward.model_checkpoint={d}/no_rm"], "reward.model_checkpoint", ["{d}/no_rm"]),
    (["actor.checkpoint={d}/no_ckpt"], "actor.checkpoint", ["{d}/no_ckpt does not exist", "hyflow convert"]),
    (["trainer.resume={d}/no_run"], "trainer.resume", ["checkpoint {d}/no_run does not exist"]),
    (["trainer.output_dir={d}/ok.py/run"], "trainer.output_dir", ["{d}/ok.py is a file"]),
    (["actor.optim.lr=.inf"], "actor.optim.lr", ["must be a finite number, got inf"]),
    (["actor.optim.lr=.nan"], "actor.optim.lr", ["must be a finite number, got nan"]),
    (["algorithm.kl_ctrl.kl_coef=-1"], "algorithm.kl_ctrl.kl_coef", ["must be >= 0", "got -1"]),
    (["actor.layout.tp=1", "actor.layout.cp=2", "actor.policy_loss=gspo", "actor.loss_agg_mode=seq-mean-token-mean"],
     "actor.policy_loss", ["gspo's sequence-level ratio", "actor.layout.cp=2"]),
]


def _no_ranks(*args, **kwargs):
    raise AssertionError("a rank was started although the config cannot work")


def _last_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if not line.startswith("[hyflow] note:")]
    assert len(lines) == 1, err  # one line
    return lines[0]


@pytest.mark.parametrize("overrides, key, words", CASES, ids=[c[1] + str(i) for i, c in enumerate(CASES)])
def test_train_fails_before_any_rank_naming_key_and_path(files, monkeypatch, capsys, overrides, key, words):
    monkeypatch.setattr(local, "launch_local", _no_ranks)
    monkeypatch.setattr(cli, "_run_single", _no_ranks)
    monkeypatch.chdir(files)
    d = str(files)
    code = cli.main(["train", str(files / "cfg.yaml"), *[o.format(d=d) for o in overrides]])
    out = capsys.readouterr()
    assert code == 2, out
    line = _last_line(out.err)
    assert line.startswith(f"hyflow: config error: config key '{key}': "), line
    for word in words:
        assert word.format(d=d) in line, line
    assert "launching" not in out.out


@pytest.mark.parametrize("overrides, key", [
    (["reward.kind=function", "reward.function_path={d}/missing.py"], "reward.function_path"),
    (["data.task=null", "data.tokenizer=char", "data.train_files=[{d}/latin1.jsonl]"], "data.train_files[0]"),
])
def test_launch_local_and_slurm_fail_before_ranks_or_submission(files, monkeypatch, capsys, overrides, key):
    import hyflow.launch.slurm as slurm

    monkeypatch.setattr(local, "launch_local", _no_ranks)
    monkeypatch.setattr(slurm, "submit", _no_ranks)
    monkeypatch.chdir(files)
    args = [o.format(d=files) for o in overrides]
    assert cli.main(["launch", "local", str(files / "cfg.yaml"), "--nproc", "2", *args]) == 2
    assert f"config key '{key}'" in _last_line(capsys.readouterr().err)
    for extra in ([], ["--dry-run"]):
        assert cli.main(["launch", "slurm", str(files / "cfg.yaml"), "--nodes", "1", "--gpus-per-node", "2",
                         *args, *extra]) == 2
        out = capsys.readouterr()
        assert f"config key '{key}'" in _last_line(out.err) and "#!/bin/bash" not in out.out


# --------------------------------------------------------------------------- the architecture of a checkpoint


SMOL = dict(family="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_attention_heads=9,
            num_query_groups=3, ffn_hidden_size=1536, max_position_embeddings=8192, rope_theta=100000.0,
            tied_embeddings=True, eos_token_ids=[2], tokenizer="tokenizer")


def test_resolved_config_shows_the_checkpoints_architecture(tmp_path, capsys):
    from hyflow.config import dump_yaml, load_config
    from hyflow.jobs.rl_config import RLJobConfig

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.json").write_text(json.dumps(SMOL))
    layout = "layout: {tp: 1, pp: 2, stage_layers: [15, 15]}"  # an explicit split: no note about it
    (tmp_path / "cfg.yaml").write_text(CONFIG.split("actor:")[0].split("model:")[0] + "actor:" + CONFIG.split(
        "actor:")[1].replace("layout: {tp: 2, pp: 1}", f"checkpoint: {ckpt}, {layout}"))
    cfg = cli.load_job_config(str(tmp_path / "cfg.yaml"), [])
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.vocab_size) == (576, 30, 49152)
    assert cfg.model.tokenizer == str(ckpt / "tokenizer") and cfg.notes == []  # no model section: no note
    dump_yaml(cfg, str(tmp_path / "config.resolved.yaml"))  # what the run writes
    resolved = load_config(RLJobConfig, str(tmp_path / "config.resolved.yaml"))
    assert resolved.model == cfg.model and resolved.notes == []
    assert cli.main(["config", str(tmp_path / "cfg.yaml")]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith(f"# model: read from {ckpt / 'model.json'} (actor.checkpoint)")
    assert "hidden_size: 576" in shown and "num_layers: 30" in shown
    # a model section that disagrees is overridden, and the user is told
    cfg = cli.load_job_config(str(tmp_path / "cfg.yaml"), ["model.hidden_size=64", "model.num_layers=2"])
    assert cfg.model.hidden_size == 576
    assert len(cfg.notes) == 1 and "differs from" in cfg.notes[0]
    assert "hidden_size: config 64, checkpoint 576" in cfg.notes[0] and "num_layers: config 2, checkpoint 30" \
        in cfg.notes[0]
    assert cli.main(["config", str(tmp_path / "cfg.yaml"), "model.hidden_size=64"]) == 0
    assert "[hyflow] note: the config's model section differs" in capsys.readouterr().err

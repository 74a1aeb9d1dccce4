"""Config files that used to hang or crash the command line (issue #39 points 11-12): a "billion
laughs" document under a nested key, non-UTF-8 bytes, a directory or a device as the config. Each is
one line, in well under 2 s."""

import os
import subprocess
import sys
import time

import pytest

from hyflow.config import ConfigError
from hyflow.config.core import MAX_EXPANDED_NODES, yaml_load
from hyflow.jobs.registry import load_job_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _laughs(levels: int = 9) -> str:
    lines = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines)


@pytest.mark.parametrize("where", ["data.task_options.ops", "trainer.experiment_name"])
def test_a_nested_billion_laughs_is_refused_in_well_under_2_s(tmp_path, where):
    section, key = where.split(".", 1)
    body = "\n".join("    " + line for line in _laughs().splitlines())
    if where == "trainer.experiment_name":
        text = f"job: rl\ndata: {{task: digit_add}}\ntrainer:\n  experiment_name:\n{body}\n"
    else:
        text = f"job: rl\ndata:\n  task: digit_add\n  task_options:\n    ops:\n{body.replace('    ', '      ')}\n"
    path = tmp_path / "laughs.yaml"
    path.write_text(text)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=f"expand to more than {MAX_EXPANDED_NODES} values"):
        load_job_config(str(path), [])
    assert time.perf_counter() - start < 2


def test_aliases_within_the_budget_still_work_and_a_recursive_one_is_refused():
    assert yaml_load("a: &x {lr: 1e-4, n: [1, 2]}\nb: *x\nc: {<<: *x, n: 3}") == {
        "a": {"lr": 1e-4, "n": [1, 2]}, "b": {"lr": 1e-4, "n": [1, 2]}, "c": {"lr": 1e-4, "n": 3}}
    with pytest.raises(Exception, match="expand to more than"):
        yaml_load("a: &x [1, *x]")


def test_config_file_problems_are_one_line(tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"job: rl\ntrainer: {experiment_name: caf\xe9}\n")
    cases = [(str(bad), "is not UTF-8 text (byte 0xe9 at offset 38); save it as UTF-8"),
             (str(tmp_path), "is a directory, not a YAML file"),
             ("/dev/null", "is not a regular file"),
             (str(tmp_path / "missing.yaml"), "does not exist")]
    for path, message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_job_config(path, [])
    out = subprocess.run([sys.executable, "-m", "hyflow.cli", "train", str(bad)], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "not UTF-8" in out.stderr, out.stderr

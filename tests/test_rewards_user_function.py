"""User reward functions: loading errors and call-time errors name the function, file, row and source."""
from __future__ import annotations

import textwrap

import pytest

from hyflow.rewards import RewardError, RewardManager, load_user_function
from hyflow.jobs.rl_config import RewardConfig


def write(tmp_path, body: str, name: str = "reward.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


VERL_STYLE = """
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        bonus = (extra_info or {}).get("bonus", 0.0)
        return float(solution_str.strip() == ground_truth) + bonus

    def helper(x):
        return x
"""


def test_verl_signature_called_with_keywords(tmp_path):
    fn = load_user_function(write(tmp_path, VERL_STYLE))
    assert fn.keywords and fn.passes_extra_info
    assert fn("src", " 7 ", "7") == (1.0, {})
    assert fn("src", "8", "7", {"bonus": 0.25}) == (0.25, {})


def test_other_signatures(tmp_path):
    three = load_user_function(write(tmp_path, """
        def score(data_source, solution_str, ground_truth):
            return len(solution_str)
    """, "three.py"), "score")
    assert not three.passes_extra_info and three("s", "abc", None, {"x": 1}) == (3.0, {})
    positional = load_user_function(write(tmp_path, """
        def compute_score(src, text, gt, info=None):
            return 0.5 if info is None else info["v"]
    """, "pos.py"))
    assert not positional.keywords and positional("s", "t", "g", {"v": 2}) == (2.0, {})
    with pytest.raises(RewardError, match=r"compute_score\(\) .* has signature \(a, b\); expected "
                                          r"\(data_source, solution_str, ground_truth, extra_info=None\)"):
        load_user_function(write(tmp_path, "def compute_score(a, b):\n    return 0\n", "two.py"))


def test_dict_return_gives_extras(tmp_path):
    fn = load_user_function(write(tmp_path, """
        import numpy as np
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": np.float32(0.5), "acc": True, "note": "text is ignored"}
    """))
    assert fn("s", "x", "y") == (0.5, {"acc": 1.0})


def test_missing_file_and_unset_path(tmp_path):
    with pytest.raises(RewardError, match=r"reward function file not found: .*nope\.py \(reward\.function_path\)"):
        load_user_function(str(tmp_path / "nope.py"))
    with pytest.raises(RewardError, match="set reward.function_path"):
        load_user_function(None)


def test_missing_function_lists_what_is_there(tmp_path):
    path = write(tmp_path, VERL_STYLE)
    with pytest.raises(RewardError) as info:
        load_user_function(path, "my_score")
    msg = str(info.value)
    assert path in msg and "'my_score'" in msg and "compute_score, helper" in msg
    assert info.value.function == "my_score" and info.value.path == path
    with pytest.raises(RewardError, match="'compute_score' is a int, not a function"):
        load_user_function(write(tmp_path, "compute_score = 3\n", "num.py"))


@pytest.mark.parametrize("body, pattern", [
    ("def compute_score(:\n", r"importing reward function file .*bad\.py failed: SyntaxError"),
    ("import not_a_module_xyz\n", r"failed: ModuleNotFoundError: No module named 'not_a_module_xyz'"),
    ("raise SystemExit(3)\n", r"failed: SystemExit"),
])
def test_import_failures_name_the_file(tmp_path, body, pattern):
    with pytest.raises(RewardError, match=pattern):
        load_user_function(write(tmp_path, body, "bad.py"))


def test_raising_function_names_function_row_and_source(tmp_path):
    path = write(tmp_path, """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "boom":
                raise KeyError("missing_field")
            return 1.0
    """)
    fn = load_user_function(path)
    with pytest.raises(RewardError) as info:
        fn("gsm8k", "boom", "1", where="train.parquet row 12")
    err = info.value
    msg = str(err)
    assert f"reward function compute_score() from {path} raised KeyError: 'missing_field'" in msg
    assert "on train.parquet row 12 (data_source='gsm8k')" in msg
    assert (err.function, err.path, err.row, err.data_source) == ("compute_score", path, "train.parquet row 12", "gsm8k")
    assert isinstance(err.__cause__, KeyError)


@pytest.mark.parametrize("ret, pattern", [
    ("None", r"returned None \(NoneType\); expected a float or a dict with a 'score' key"),
    ("'1.0'", r"returned '1.0' \(str\)"),
    ("float('nan')", r"non-finite score \(nan\)"),
    ("float('inf')", r"non-finite score \(inf\)"),
    ("{'acc': 1.0}", r"dict without a 'score' key \(keys: \['acc'\]\)"),
    ("[1.0]", r"returned \[1.0\] \(list\)"),
])
def test_bad_return_values_are_errors(tmp_path, ret, pattern):
    fn = load_user_function(write(tmp_path, f"""
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return {ret}
    """))
    with pytest.raises(RewardError, match=pattern) as info:
        fn("src", "x", "y", where="row 3")
    assert "row 3 (data_source='src')" in str(info.value)


def test_manager_from_config_function(tmp_path):
    path = write(tmp_path, VERL_STYLE)
    rm = RewardManager.from_config(RewardConfig(kind="function", function_path=path))
    batch = rm.score(["7", "8"], ["a", "a"], ["7", "7"], [None, {"bonus": 0.5}])
    assert batch.scores == [1.0, 0.5] and rm.name == "function:compute_score"
    with pytest.raises(RewardError, match="defines no function 'other'"):
        RewardManager.from_config(RewardConfig(kind="function", function_path=path, function_name="other"))
    with pytest.raises(RewardError, match="not found"):
        RewardManager.from_config(RewardConfig(kind="function", function_path=str(tmp_path / "gone.py")))

"""Rule verifiers: answer extraction, numeric / exact / format matching, bad ground truths."""
from __future__ import annotations

from fractions import Fraction

import pytest

from hyflow.rewards import (
    RULES,
    exact_match,
    extract_answer,
    extract_number,
    format_match,
    length_match,
    numeric_match,
    parse_number,
    rule_names,
)


@pytest.mark.parametrize("text, want", [
    ("42", 42),
    ("The answer is 42.", 42),
    ("3 + 4 = 7, so 7 apples", 7),
    ("Natalia sold 48 clips... #### 72", 72),
    ("#### 1,234", 1234),
    ("first #### 5\nthen #### 6 dollars", 6),          # last ####, trailing words ignored
    ("so the result is \\boxed{42}.", 42),
    ("\\boxed{1} wait, \\boxed{-17}", -17),            # last box
    ("\\boxed{\\frac{3}{4}}", Fraction(3, 4)),
    ("\\boxed{x = 12}", 12),
    ("\\boxed{\\$1{,}000}", 1000),
    ("answer: 12 then 2024 then 7", 7),                # last number
    ("x = -3", -3),
    ("5-3=2", 2),
    ("5-3", 3),                                        # a minus between digits is not a sign
    ("it costs $1,234.50 total", 1234.5),
    ("roughly 1e3", 1000.0),
    ("half is 1/2", Fraction(1, 2)),
    ("12.5%", 12.5),
    ("\u22125", -5),                                   # unicode minus
    ("no digits here", None),
    ("", None),
])
def test_extract_number(text, want):
    got = extract_number(text)
    assert got == want and type(got) is type(want)


def test_extract_answer_and_parse_number():
    assert extract_answer("blah #### 42 ") == "42"
    assert extract_answer("\\boxed{a{b}c}") == "a{b}c"                 # balanced braces
    assert extract_answer("42") is None
    assert parse_number(" 1,234 ") == 1234
    assert parse_number("\\frac{6}{4}") == Fraction(3, 2)
    assert parse_number("1/0") is None and parse_number("12 apples") is None
    assert parse_number("1,23") is None                                  # not a thousands group


def test_numeric_match():
    assert numeric_match("The answer is 42", "42") == 1.0
    assert numeric_match("#### 42", 42) == 1.0
    assert numeric_match("I think 41", "42") == 0.0
    assert numeric_match("nothing", "42") == 0.0
    assert numeric_match("\\boxed{0.5}", "\\frac{1}{2}") == 1.0
    assert numeric_match("0.3333", "1/3") == 0.0                          # tolerance is relative 1e-6
    assert numeric_match("0.3333333", "1/3") == 1.0
    assert numeric_match("1,000", "1000") == 1.0
    assert numeric_match("1000.0000001", 1000) == 1.0
    assert numeric_match("2", "#### 2") == 1.0                            # GSM8K-style ground truth
    assert numeric_match("7", ["6", "7"]) == 1.0
    assert numeric_match("3.14", "3.14159", rel_tol=1e-3) == 1.0


@pytest.mark.parametrize("gt", ["forty-two", None, True, float("nan"), [], {"a": 1}])
def test_numeric_match_rejects_unusable_ground_truth(gt):
    with pytest.raises(ValueError, match="numeric_match"):
        numeric_match("42", gt)


def test_exact_match():
    assert exact_match("  1284 \n", "1284") == 1.0
    assert exact_match("a   b", "a b") == 1.0
    assert exact_match("1284", "1248") == 0.0
    assert exact_match("12840", "1284") == 0.0
    assert exact_match("Paris", "paris") == 0.0
    assert exact_match("Paris", "paris", case_sensitive=False) == 1.0
    assert exact_match("b", ["a", "b"]) == 1.0
    assert exact_match("7", 7) == 1.0
    with pytest.raises(ValueError, match="ground truth must be a string"):
        exact_match("x", None)
    with pytest.raises(ValueError, match="empty list"):
        exact_match("x", [])


def test_format_match_and_rule_table():
    assert format_match("42") == 1.0 and format_match(" -1,234.5 ") == 1.0
    assert format_match("42 apples") == 0.0 and format_match("") == 0.0
    assert format_match("<think>x</think> 5", r"<think>.*</think>\s*\d+") == 1.0
    assert rule_names() == ["exact_match", "format", "length_match", "numeric_match"]
    assert RULES["format"]("abc", None, {"format_pattern": "[a-c]+"}) == 1.0
    assert RULES["format"]("abc", None, None) == 0.0
    assert RULES["numeric_match"]("x 5", "5", None) == 1.0
    assert RULES["exact_match"]("A", "a", None, case_sensitive=False) == 1.0


def test_length_match_scores_the_relative_length_error():
    assert length_match("1234", "1234") == 1.0
    assert length_match("  abcd\n", "1234") == 1.0                 # length only, whitespace stripped
    assert length_match("12", "1234") == 0.5
    assert length_match("123456", "1234") == 0.5
    assert length_match("", "1234") == 0.0
    assert length_match("1" * 20, "1234") == 0.0                    # never negative
    assert RULES["length_match"]("123", "1234", extra_info={}) == 0.75
    for bad in ("", "   ", None, 12):
        with pytest.raises(ValueError, match="length_match: ground truth must be a non-empty string"):
            length_match("12", bad)

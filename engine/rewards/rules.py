"""Rule verifiers: exact answer match, numeric match and format checks.

All verifiers return a float in ``[0, 1]``. A ground truth the rule cannot use (no number in it
for :func:`numeric_match`, not a string for :func:`exact_match`) raises ``ValueError``: a
broken label is a data error, never a silent zero.

Number extraction (:func:`extract_answer`) looks, in order, for the last ``#### X`` (GSM8K
style), the last ``\\boxed{X}`` (balanced braces; ``\\frac{a}{b}`` understood), then the last
number anywhere. Numbers may carry a sign, thousands separators (``1,234``), decimals,
exponents, a ``a/b`` fraction, or a trailing ``%`` (kept as the number itself).
"""
from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any, Callable, Optional, Union

__all__ = [
    "normalize_text", "exact_match", "extract_number", "extract_answer", "parse_number",
    "numeric_match", "format_match", "length_match", "DEFAULT_FORMAT_PATTERN", "RuleFn", "RULES", "rule_names",
]

Number = Union[int, float, Fraction]
RuleFn = Callable[..., float]

#: Default pattern of the ``format`` rule: the whole response is one number.
DEFAULT_FORMAT_PATTERN = r"\s*[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?\s*"

_NUM = (r"(?:(?<![\w.])[-+])?"                          # sign, not part of an expression like 5-3
        r"(?:\d{1,3}(?:,\d{3})+(?![\d])|\d+)"            # 1,234 or 1234
        r"(?:\.\d+)?(?:[eE][-+]?\d+)?")                   # decimals, exponent
_NUMBER_RE = re.compile(rf"({_NUM})(?:\s*/\s*(\d+)(?![\d.]))?")
_HASHES_RE = re.compile(r"####\s*([^\n]*)")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*([^{}]*)\s*\}\s*\{\s*([^{}]*)\s*\}")
_WS_RE = re.compile(r"\s+")


def normalize_text(text: str) -> str:
    """Strip, collapse runs of whitespace to one space."""
    return _WS_RE.sub(" ", text).strip()


def exact_match(solution_str: str, ground_truth: Any, case_sensitive: bool = True) -> float:
    """1.0 when the response equals the ground truth (or one of a list of them) after
    whitespace normalisation, else 0.0."""
    if isinstance(ground_truth, (list, tuple)):
        if not ground_truth:
            raise ValueError("exact_match: empty list of ground truths")
        return max(exact_match(solution_str, g, case_sensitive) for g in ground_truth)
    if isinstance(ground_truth, (int, float)) and not isinstance(ground_truth, bool):
        ground_truth = str(ground_truth)
    if not isinstance(ground_truth, str):
        raise ValueError(f"exact_match: ground truth must be a string, got {type(ground_truth).__name__}")
    got, want = normalize_text(solution_str), normalize_text(ground_truth)
    if not case_sensitive:
        got, want = got.lower(), want.lower()
    return float(got == want)


def parse_number(text: str) -> Optional[Number]:
    """The number spelled by ``text`` alone (``"1,234"``, ``"-3.5"``, ``"3/4"``, ``"\\frac{3}{4}"``, ``"$5"``)."""
    text = text.strip().replace("\u2212", "-")
    text = _FRAC_RE.sub(r"\1/\2", text)
    text = text.replace("{,}", ",")
    text = re.sub(r"\\[!,;: ]|\\(?:text|mathrm)\{[^{}]*\}|\\?[$%]", "", text).strip()
    match = _NUMBER_RE.fullmatch(text)
    return _to_number(match) if match else None


def _to_number(match: "re.Match[str]") -> Optional[Number]:
    head = match.group(1).replace(",", "")
    try:
        value: Number = int(head) if re.fullmatch(r"[-+]?\d+", head) else float(head)
    except (ValueError, OverflowError):
        return None
    if match.group(2) is not None:
        den = int(match.group(2))
        if den == 0:
            return None
        return Fraction(value, den) if isinstance(value, int) else value / den
    return value


def _last_number(text: str) -> Optional[Number]:
    text = _FRAC_RE.sub(r"\1/\2", text.replace("\u2212", "-"))
    matches = list(_NUMBER_RE.finditer(text))
    for match in reversed(matches):
        value = _to_number(match)
        if value is not None:
            return value
    return None


def _boxed_contents(text: str) -> list[str]:
    out = []
    for match in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, start = 1, match.end()
        for pos in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[pos], 0)
            if depth == 0:
                out.append(text[start:pos])
                break
    return out


def extract_answer(text: str) -> Optional[str]:
    """The final-answer span: last ``#### X``, else last ``\\boxed{X}``, else ``None``."""
    hashes = _HASHES_RE.findall(text)
    if hashes:
        return hashes[-1].strip()
    boxed = _boxed_contents(text)
    return boxed[-1].strip() if boxed else None


def extract_number(text: str) -> Optional[Number]:
    """The answer number of a response (see the module docstring for the order), or None."""
    span = extract_answer(text)
    if span is not None:
        value = parse_number(span)
        return value if value is not None else _last_number(span)
    return _last_number(text)


def _ground_truth_number(ground_truth: Any) -> Number:
    if isinstance(ground_truth, bool):
        raise ValueError(f"numeric_match: ground truth is a boolean ({ground_truth})")
    if isinstance(ground_truth, (int, Fraction)):
        return ground_truth
    if isinstance(ground_truth, float):
        if not math.isfinite(ground_truth):
            raise ValueError(f"numeric_match: ground truth is not finite ({ground_truth})")
        return ground_truth
    if isinstance(ground_truth, str):
        value = parse_number(ground_truth)
        if value is None:
            value = extract_number(ground_truth)
        if value is not None:
            return value
    raise ValueError(f"numeric_match: no number in ground truth {ground_truth!r}")


def numeric_match(solution_str: str, ground_truth: Any, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> float:
    """1.0 when the response's answer number equals the ground truth's (within tolerance)."""
    if isinstance(ground_truth, (list, tuple)):
        if not ground_truth:
            raise ValueError("numeric_match: empty list of ground truths")
        return max(numeric_match(solution_str, g, rel_tol, abs_tol) for g in ground_truth)
    want = _ground_truth_number(ground_truth)
    got = extract_number(solution_str)
    if got is None:
        return 0.0
    if isinstance(got, (int, Fraction)) and isinstance(want, (int, Fraction)):
        return float(got == want)
    return float(math.isclose(float(got), float(want), rel_tol=rel_tol, abs_tol=abs_tol))


def format_match(solution_str: str, pattern: str = DEFAULT_FORMAT_PATTERN) -> float:
    """1.0 when the whole response matches the regular expression ``pattern``."""
    return float(re.fullmatch(pattern, solution_str, flags=re.DOTALL) is not None)


def _format_rule(solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None,
                 pattern: Optional[str] = None) -> float:
    row_pattern = (extra_info or {}).get("format_pattern")
    return format_match(solution_str, row_pattern or pattern or DEFAULT_FORMAT_PATTERN)


def length_match(solution_str: str, ground_truth: Any) -> float:
    """``1 - |len(response) - len(ground truth)| / len(ground truth)``, at least 0: how close the
    response's length (characters, surrounding whitespace stripped) is to the reference's."""
    if not isinstance(ground_truth, str) or not ground_truth.strip():
        raise ValueError(f"length_match: ground truth must be a non-empty string, got {ground_truth!r}")
    want = len(ground_truth.strip())
    return max(0.0, 1.0 - abs(len(solution_str.strip()) - want) / want)


#: Rule name -> ``fn(solution_str, ground_truth, extra_info=None, **options) -> float``.
RULES: dict[str, RuleFn] = {
    "exact_match": lambda s, gt, extra_info=None, **kw: exact_match(s, gt, **kw),
    "numeric_match": lambda s, gt, extra_info=None, **kw: numeric_match(s, gt, **kw),
    "format": _format_rule,
    "length_match": lambda s, gt, extra_info=None, **kw: length_match(s, gt, **kw),
}


def rule_names() -> list[str]:
    """The available rule names."""
    return sorted(RULES)

"""Synthetic verifiable tasks generated locally (no downloads), as verl-format rows.

Character-level tasks for the tiny CPU quickstart model (``CharTokenizer``, exact-match reward):

* ``digits_copy``    -- ``"copy 4821"``    -> ``"4821"``
* ``digits_reverse`` -- ``"reverse 4821"`` -> ``"1284"``
* ``digits_sort``    -- ``"sort 4821"``    -> ``"1248"``
* ``digit_add``      -- ``"3+5="``         -> ``"8"``
* ``length_tail``    -- ``"write 12"``     -> ``"123456789012"`` (scored by ``length_match``: the
  response's length against the asked one); the asked lengths follow a truncated Pareto law, so
  most answers are short and a few are 10x longer (the long tail that ``trainer.mode: async``
  is for)

Word problems for an instruct model such as SmolLM2-135M-Instruct (numeric-match reward):

* ``arithmetic`` -- ``"What is 17 + 25? Answer with just the number."`` -> ``"42"``
* ``tool_arithmetic`` -- ``"What is 347 * 28?"`` -> ``"9716"``, with the calculator tool (multi-turn
  rollouts); rows carry a tool-using demonstration for the SFT warm-up

Preference tasks for the DPO / KTO jobs (the same problems, a right and a plausible wrong answer):

* ``pref_digit_add``  -- ``digit_add`` with ``chosen: "12"``, ``rejected: "11"`` (char tokenizer);
* ``pref_arithmetic`` -- ``arithmetic`` with ``chosen: "42"``, ``rejected: "41"`` / ``"52"`` / ``"8"`` ...

Their rows are in TRL's formats (option ``format=dpo``: ``prompt`` / ``chosen`` / ``rejected``
chat messages; ``format=kto``: two rows per problem, ``prompt`` / ``completion`` / ``label``) and
keep the verl keys too, so the same file can be scored with ``hyflow generate --reward``.

Each row carries the reference answer in ``extra_info["answer"]`` (the SFT warm-up target) as
well as in ``reward_model.ground_truth``. Generation is deterministic in ``seed``. The
arithmetic tasks take ``split=train|test|all``: a fixed fifth of all questions (by a hash of
the question) is the test split, so a model can be scored on questions it never trained on.
"""
from __future__ import annotations

import dataclasses
import inspect
import random
import zlib
from typing import Any, Callable, Optional

from hyflow.config import ConfigError
from hyflow.data.tokenizer import load_tokenizer

__all__ = ["TaskInfo", "TASKS", "task_info", "task_options", "check_task_options", "make_task_rows",
           "make_preference_rows", "tokenizer_spec_for", "load_data_tokenizer", "QUICKSTART_TASK",
           "DPO_QUICKSTART_TASK"]

QUICKSTART_TASK = "digits_reverse"
DPO_QUICKSTART_TASK = "pref_digit_add"


@dataclasses.dataclass(frozen=True)
class TaskInfo:
    """A synthetic task: how to make its rows, its tokenizer spec and reward rule."""

    name: str
    description: str
    make: Callable[..., list[dict]]     # make(size, seed, **options) -> rows
    tokenizer: Optional[str]            # "char", or None (use data.tokenizer)
    reward_rule: str                    # the hyflow.rewards rule that scores it
    kind: str = "rl"                    # "rl": prompts; "preference": rows for job dpo / kto


def _row(task: str, index: int, question: str, answer: str, ability: str, split: str = "all") -> dict:
    return {
        "data_source": f"hyflow/{task}",
        "prompt": [{"role": "user", "content": question}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "test" if split == "test" else "train", "index": index, "question": question,
                       "answer": answer},
    }


def _digit_task(task: str, verb: str, fn: Callable[[str], str]) -> Callable[..., list[dict]]:
    def make(size: int, seed: int = 0, min_digits: int = 3, max_digits: int = 5) -> list[dict]:
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        rng = random.Random(f"{task}:{seed}")
        rows = []
        for i in range(size):
            digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_digits, max_digits)))
            rows.append(_row(task, i, f"{verb} {digits}", fn(digits), "copy"))
        return rows
    make.__doc__ = f"Rows '{verb} <digits>' -> the task's answer (strings of min..max digits)."
    return make


def _digit_add_problems(size: int, seed: int) -> list[tuple[str, int, tuple[int, str, int]]]:
    rng = random.Random(f"digit_add:{seed}")
    out = []
    for _ in range(size):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        out.append((f"{a}+{b}=", a + b, (a, "+", b)))
    return out


def _make_digit_add(size: int, seed: int = 0) -> list[dict]:
    """Rows ``"a+b="`` -> ``"a+b"`` for single digits a, b."""
    return [_row("digit_add", i, q, str(ans), "math") for i, (q, ans, _) in enumerate(_digit_add_problems(size, seed))]


def _make_length_tail(size: int, seed: int = 0, min_length: int = 3, max_length: int = 48,
                      alpha: float = 1.0) -> list[dict]:
    """Rows ``"write N"`` -> the first N characters of ``"1234567890"`` repeated, N from a Pareto law
    of shape ``alpha`` truncated to ``[min_length, max_length]`` (heavy at ``min_length``)."""
    if not 1 <= min_length < max_length:
        raise ValueError(f"need 1 <= min_length < max_length, got {min_length}, {max_length}")
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    rng = random.Random(f"length_tail:{seed}")
    tail = 1.0 - (min_length / max_length) ** alpha
    rows = []
    for i in range(size):
        n = min(max_length, round(min_length / (1.0 - rng.random() * tail) ** (1.0 / alpha)))
        rows.append(_row("length_tail", i, f"write {n}", ("1234567890" * (n // 10 + 1))[:n], "length"))
    return rows


_OPS: dict[str, tuple[str, Callable[[int, int], int]]] = {
    "+": ("+", lambda a, b: a + b),
    "-": ("-", lambda a, b: a - b),
    "*": ("*", lambda a, b: a * b),
}


SPLITS = ("all", "train", "test")


def _in_split(question: str, split: str) -> bool:
    """``test``: a fixed fifth of all questions (by a CRC of the text); ``train``: the rest."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    held_out = zlib.crc32(question.encode()) % 5 == 0
    return split == "all" or held_out == (split == "test")


def _arithmetic_problems(size: int, seed: int, ops: str, max_operand: int, max_factor: int,
                         split: str) -> list[tuple[str, int, tuple[int, str, int]]]:
    unknown = set(ops) - set(_OPS)
    if not ops or unknown:
        raise ValueError(f"ops must be drawn from '+-*', got {ops!r}")
    if max_operand < 0 or max_factor < 0:
        raise ValueError(f"max_operand and max_factor must be >= 0, got {max_operand}, {max_factor}")
    _in_split("", split)  # checks the name
    rng = random.Random(f"arithmetic:{seed}")
    out: list[tuple[str, int, tuple[int, str, int]]] = []
    for _ in range(1000 * size):  # a split keeps about 4/5 or 1/5 of the draws
        if len(out) == size:
            break
        op = rng.choice(ops)
        hi = max_factor if op == "*" else max_operand
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        if op == "-" and b > a:
            a, b = b, a
        symbol, fn = _OPS[op]
        question = f"What is {a} {symbol} {b}? Answer with just the number."
        if _in_split(question, split):
            out.append((question, fn(a, b), (a, op, b)))
    if len(out) < size:
        raise ValueError(f"split={split!r} holds too few questions for ops={ops!r} max_operand={max_operand}")
    return out


def _make_arithmetic(size: int, seed: int = 0, ops: str = "+-", max_operand: int = 50,
                     max_factor: int = 12, split: str = "all") -> list[dict]:
    """Rows ``"What is a op b? Answer with just the number."`` -> the result (non-negative)."""
    problems = _arithmetic_problems(size, seed, ops, max_operand, max_factor, split)
    return [_row("arithmetic", i, q, str(ans), "math", split) for i, (q, ans, _) in enumerate(problems)]


# ----------------------------------------------------------------------------- preference tasks


def _plausible_wrong(answer: int, operands: tuple[int, str, int], rng: random.Random) -> int:
    """A wrong answer a model could give: off by one or ten, a dropped carry, the other operation,
    reversed digits."""
    a, op, b = operands
    candidates = {answer - 1, answer + 1, answer + 10, answer - 10, a - b if op == "+" else a + b,
                  answer + a if op == "*" else abs(a - b)}
    if answer >= 10 and answer % 10:  # the carry dropped; the digits swapped
        candidates |= {answer % 10, int(str(answer)[::-1])}
    options = sorted(c for c in candidates if c >= 0 and c != answer)
    return rng.choice(options)


ANSWER_STYLES = ("number", "equation")


def _preference_rows(task: str, problems: list, seed: int, fmt: str, split: str = "all",
                     answer: str = "number") -> list[dict]:
    if fmt not in ("dpo", "kto"):
        raise ValueError(f"format must be 'dpo' or 'kto', got {fmt!r}")
    if answer not in ANSWER_STYLES:
        raise ValueError(f"answer must be one of {', '.join(ANSWER_STYLES)}, got {answer!r}")
    rng = random.Random(f"{task}:wrong:{seed}")
    rows = []
    for i, (question, result, operands) in enumerate(problems):
        base = _row(task, i, question, str(result), "math", split)
        # equation: "14 + 20 = 34", the chosen and rejected texts differ only in the result
        say = (lambda x, o=operands: f"{o[0]} {o[1]} {o[2]} = {x}") if answer == "equation" else str
        right = [{"role": "assistant", "content": say(result)}]
        wrong = [{"role": "assistant", "content": say(_plausible_wrong(result, operands, rng))}]
        if fmt == "dpo":
            rows.append(dict(base, chosen=right, rejected=wrong))
        else:  # one desirable and one undesirable example per problem
            rows.append(dict(base, completion=right, label=True))
            rows.append(dict(base, completion=wrong, label=False))
    return rows


def _make_pref_digit_add(size: int, seed: int = 0, format: str = "dpo") -> list[dict]:  # noqa: A002 - the option's name
    """``digit_add`` problems with the right sum as ``chosen`` and a plausible wrong one as ``rejected``
    (``format=kto``: two rows per problem, labels true / false)."""
    return _preference_rows("pref_digit_add", _digit_add_problems(size, seed), seed, format)


def _make_pref_arithmetic(size: int, seed: int = 0, format: str = "dpo", ops: str = "+-",  # noqa: A002
                          max_operand: int = 50, max_factor: int = 12, split: str = "all",
                          answer: str = "number") -> list[dict]:
    """``arithmetic`` problems (the same ones for the same seed and options) with the right result as
    ``chosen`` and a plausible wrong one as ``rejected`` (``format=kto``: two rows per problem);
    ``answer=equation`` writes both as ``"14 + 20 = 34"`` (how instruct models tend to answer)."""
    problems = _arithmetic_problems(size, seed, ops, max_operand, max_factor, split)
    return _preference_rows("pref_arithmetic", problems, seed, format, split, answer)


#: the system prompt of ``tool_arithmetic``: how to call the calculator (SmolLM2's template has no tools)
TOOL_SYSTEM_PROMPT = ('You have a calculator. To use it, write <tool_call>{"name": "calculator", "arguments": '
                      '{"expression": "12*34"}}</tool_call> and its result comes back. Then reply with just the '
                      'number.')


def _make_tool_arithmetic(size: int, seed: int = 0, digits_a: int = 3, digits_b: int = 2, ops: str = "*",
                          split: str = "all", system: bool = True) -> list[dict]:
    """Rows ``"What is 347 * 28?"`` (``digits_a``- and ``digits_b``-digit operands) that a small model
    solves with the ``calculator`` tool (``rollout.multi_turn``). ``system``: a system message says how
    to call it. ``extra_info.demonstration`` is the tool-using answer for a multi-turn SFT warm-up:
    the call, the calculator's result, the result repeated."""
    unknown = set(ops) - set(_OPS)
    if not ops or unknown:
        raise ValueError(f"ops must be drawn from '+-*', got {ops!r}")
    if not (1 <= digits_a <= 6 and 1 <= digits_b <= 6):
        raise ValueError(f"digits_a and digits_b must be in 1..6, got {digits_a}, {digits_b}")
    _in_split("", split)
    rng = random.Random(f"tool_arithmetic:{seed}")
    rows: list[dict] = []
    for _ in range(1000 * size):
        if len(rows) == size:
            break
        a = rng.randint(10 ** (digits_a - 1), 10 ** digits_a - 1)
        b = rng.randint(10 ** (digits_b - 1), 10 ** digits_b - 1)
        op = rng.choice(ops)
        if op == "-" and b > a:
            a, b = b, a
        question = f"What is {a} {op} {b}?"
        if not _in_split(question, split):
            continue
        result = str(_OPS[op][1](a, b))
        row = _row("tool_arithmetic", len(rows), question, result, "math", split)
        if system:
            row["prompt"].insert(0, {"role": "system", "content": TOOL_SYSTEM_PROMPT})
        call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%d%s%d"}}</tool_call>' % (a, op, b)
        row["extra_info"]["demonstration"] = [{"role": "assistant", "content": call},
                                              {"role": "tool", "content": result},
                                              {"role": "assistant", "content": result}]
        rows.append(row)
    if len(rows) < size:
        raise ValueError(f"split={split!r} holds too few questions for digits_a={digits_a} digits_b={digits_b}")
    return rows


TASKS: dict[str, TaskInfo] = {
    t.name: t for t in (
        TaskInfo("digits_copy", "copy a 3-5 digit string", _digit_task("digits_copy", "copy", lambda s: s),
                 "char", "exact_match"),
        TaskInfo("digits_reverse", "reverse a 3-5 digit string",
                 _digit_task("digits_reverse", "reverse", lambda s: s[::-1]), "char", "exact_match"),
        TaskInfo("digits_sort", "sort the digits of a 3-5 digit string",
                 _digit_task("digits_sort", "sort", lambda s: "".join(sorted(s))), "char", "exact_match"),
        TaskInfo("digit_add", "add two single digits", _make_digit_add, "char", "exact_match"),
        TaskInfo("length_tail", "'write N' -> N characters, N long-tailed (3-48): response lengths vary >10x",
                 _make_length_tail, "char", "length_match"),
        TaskInfo("arithmetic", "'What is 17 + 25? Answer with just the number.' word problems",
                 _make_arithmetic, None, "numeric_match"),
        TaskInfo("tool_arithmetic", "'What is 347 * 28?' for a model with the calculator tool (multi-turn)",
                 _make_tool_arithmetic, None, "numeric_match"),
        TaskInfo("pref_digit_add", "digit_add preference pairs: right sum chosen, a plausible wrong one rejected",
                 _make_pref_digit_add, "char", "exact_match", kind="preference"),
        TaskInfo("pref_arithmetic", "arithmetic preference pairs: right result chosen, a plausible wrong one "
                 "rejected", _make_pref_arithmetic, None, "numeric_match", kind="preference"),
    )
}


def task_info(name: str) -> TaskInfo:
    """The task called ``name`` (a ConfigError listing the tasks otherwise)."""
    if name not in TASKS:
        raise ConfigError(f"unknown synthetic task {name!r}; available: {', '.join(sorted(TASKS))}",
                          key="data.task")
    return TASKS[name]


def task_options(name: str) -> dict[str, Any]:
    """The options of task ``name``'s generator with their defaults."""
    params = inspect.signature(task_info(name).make).parameters
    return {n: p.default for n, p in params.items() if n not in ("size", "seed")}


def check_task_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` checked against task ``name``'s generator: known names, and values of the
    type of each default (``"20"`` from a command line becomes 20). Raises ``ValueError``
    naming the option, what it expects and what it got."""
    known = task_options(name)
    out = {}
    for key, value in options.items():
        if key not in known:
            raise ValueError(f"task {name} has no option {key}; its options: {', '.join(known) or 'none'}")
        default = known[key]
        if isinstance(default, bool) or not isinstance(default, (int, float, str)):
            out[key] = value
            continue
        kind = type(default)
        try:
            if isinstance(value, bool) or (kind is int and isinstance(value, float) and not value.is_integer()):
                raise ValueError
            out[key] = kind(value)
        except (TypeError, ValueError):
            what = {int: "an integer", float: "a number", str: "a string"}[kind]
            raise ValueError(f"task {name} option {key} expects {what} (default {default!r}), got {value!r}") \
                from None
    return out


def make_task_rows(name: str, size: int, seed: int = 0, **options: Any) -> list[dict]:
    """``size`` verl-format rows of task ``name`` (``options`` go to the task's generator, after
    :func:`check_task_options`)."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    return task_info(name).make(size, seed, **check_task_options(name, options))


def make_preference_rows(name: str, size: int, kind: str, seed: int = 0, **options: Any) -> list[dict]:
    """Rows of preference task ``name`` for job ``kind`` (``dpo``: one pair per problem; ``kto``: a
    desirable and an undesirable example per problem); ``options`` go to the task's generator."""
    info = task_info(name)
    if info.kind != "preference":
        prefs = ", ".join(sorted(t.name for t in TASKS.values() if t.kind == "preference"))
        raise ConfigError(f"task {name!r} has prompts only, no preference pairs; preference tasks: {prefs}",
                          key="data.task")
    if "format" in options:
        raise ConfigError("the job sets the preference task's format (dpo / kto): drop task_options.format",
                          key="data.task_options")
    return make_task_rows(name, size, seed, format=kind, **options)


def tokenizer_spec_for(data: Any) -> str:
    """The tokenizer spec of a ``DataConfig``: ``data.tokenizer``, else the task's own."""
    if data.tokenizer:
        return data.tokenizer
    if data.task and task_info(data.task).tokenizer:
        return task_info(data.task).tokenizer  # type: ignore[return-value]
    what = f"task {data.task!r} has no built-in tokenizer" if data.task else "no tokenizer given"
    raise ConfigError(f"{what}: set data.tokenizer (HF tokenizer dir, .gguf, sentencepiece .model or 'char')",
                      key="data.tokenizer")


def load_data_tokenizer(data: Any) -> Any:
    """Load the tokenizer a ``DataConfig`` names (see :func:`tokenizer_spec_for`)."""
    return load_tokenizer(tokenizer_spec_for(data))

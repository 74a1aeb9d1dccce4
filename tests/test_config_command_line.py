"""The command line a verl / Hydra user writes: every problem of one command reported at once,
Hydra's ``+key=`` / ``++key=`` / ``~key`` and ``${...}`` interpolation, a string where a list is
expected, and ``hyflow config --describe`` naming the unit of every size."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest

from hyflow.config import ConfigError, load_config
from hyflow.config.core import _iter_keys, apply_overrides, parse_override
from hyflow.jobs.registry import JOBS, load_job_config, resolve

QUICKSTART = "configs/quickstart.yaml"


@dataclass
class Inner:
    size: int = 2
    names: list[str] = field(default_factory=list)

    def validate(self) -> None:
        if self.size < 1:
            raise ConfigError("must be >= 1", key="size")


@dataclass
class Outer:
    a: Inner = field(default_factory=Inner)
    b: Inner = field(default_factory=Inner)
    steps: int = 10


def test_every_error_of_one_command_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load_config(Outer, None, ["a.sizee=1", "b.size=0", "steps=x", "c=1"])
    message = str(info.value)
    assert message.startswith("4 config errors:")
    for part in ("unknown config key 'a.sizee'; did you mean 'a.size'", "config key 'b.size': must be >= 1",
                 "config key 'steps': expected int, got 'x'", "unknown config key 'c'"):
        assert part in message
    assert len(info.value.errors) == 4
    with pytest.raises(ConfigError) as info:  # one error keeps its own message, no count
        load_config(Outer, None, ["b.size=0"])
    assert str(info.value) == "config key 'b.size': must be >= 1" and len(info.value.errors) == 1


def test_hydra_prefixes_and_removal():
    assert parse_override("+a.size=3") == ("set", "a.size", 3)
    assert parse_override("++a.size=3") == ("set", "a.size", 3)
    assert parse_override("~a.size") == ("del", "a.size", "")
    data = apply_overrides({"a": {"size": 5, "names": ["x"]}}, ["~a.size", "++b.size=4", "+steps=2", "~b.nothing"])
    assert data == {"a": {"names": ["x"]}, "b": {"size": 4}, "steps": 2}
    cfg = load_config(Outer, None, ["++a.size=3", "+b.size=4", "~steps"])
    assert (cfg.a.size, cfg.b.size, cfg.steps) == (3, 4, 10)
    with pytest.raises(ConfigError, match="unknown config key 'a.nope'"):
        load_config(Outer, None, ["~a.nope"])


def test_interpolation_resolves_set_and_default_keys(monkeypatch):
    monkeypatch.setenv("HYFLOW_TEST_DIR", "/data/runs")
    cfg = load_config(Outer, None, ["a.size=7", "b.size=${a.size}", "steps=${b.size}",
                                    "a.names=${oc.env:HYFLOW_TEST_DIR}/x"])
    assert (cfg.a.size, cfg.b.size, cfg.steps, cfg.a.names) == (7, 7, 7, ["/data/runs/x"])
    cfg = load_config(Outer, None, ["steps=${a.size}"])  # a.size left at its default
    assert cfg.steps == 2
    with pytest.raises(ConfigError, match="cannot resolve the interpolation of config key 'steps'"):
        load_config(Outer, None, ["steps=${a.missing}"])
    cfg = load_job_config(QUICKSTART, ["rollout.max_new_tokens=${rollout.max_prompt_length}"])
    assert cfg.rollout.max_new_tokens == cfg.rollout.max_prompt_length == 16


def test_a_string_where_a_list_is_expected_is_a_list_of_one():
    cfg = load_config(Outer, None, ["a.names=x.parquet"])
    assert cfg.a.names == ["x.parquet"]
    cfg = load_job_config(QUICKSTART, ["data.train_files=/data/train.parquet", "trainer.loggers=console"])
    assert cfg.data.train_files == ["/data/train.parquet"] and cfg.trainer.loggers == ["console"]
    with pytest.raises(ConfigError, match=re.escape("(a list: write [5])")):
        load_config(Outer, None, ["a.names=5"])


SIZE = re.compile(r"(batch_size|_length|max_new_tokens|max_tokens\w*|task_size|max_concurrent|chunk_size|^n)$")


@pytest.mark.parametrize("job", sorted(JOBS))
def test_every_size_names_its_unit_in_describe(job):
    from hyflow.config import describe

    schema = resolve(JOBS[job][0])
    sizes = [key for key, f, _, section in _iter_keys(schema) if not section and SIZE.search(key.split(".")[-1])]
    assert sizes
    text = describe(schema).splitlines()
    for key in sizes:
        entry = next(line for line in text if line.startswith(f"{key}:"))
        assert re.search(r"  \[[^\]]+\]$", entry), entry
    if job == "rl":  # the units a verl user gets wrong: responses vs prompts, per DP rank vs all
        assert any("actor.mini_batch_size" in line and "responses, all DP ranks" in line for line in text)
        assert any("actor.micro_batch_size" in line and "per DP rank (verl: per GPU)" in line for line in text)
        assert any("data.train_batch_size" in line and "prompts, all DP ranks" in line for line in text)

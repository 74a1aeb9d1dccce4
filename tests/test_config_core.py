"""Tests for hyflow.config.core: typed dataclass configs, YAML loading and overrides."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import pytest

from hyflow.config import (
    ConfigError,
    apply_overrides,
    config_keys,
    describe,
    dump_yaml,
    format_config,
    from_dict,
    load_config,
    to_dict,
)

# --------------------------------------------------------------------------- test schemas


@dataclass
class OptimConfig:
    lr: float = field(default=1e-5, metadata={"help": "Peak learning rate."})
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.0


@dataclass
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0
    targets: list[str] = field(default_factory=lambda: ["q_proj"])

    def validate(self) -> None:
        if self.rank <= 0:
            raise ConfigError("must be positive", key="rank")


@dataclass
class ModelConfig:
    path: str = field(metadata={"help": "Checkpoint directory."})
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    lora: Optional[LoraConfig] = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainerConfig:
    total_steps: int = 100
    seed: Optional[int] = None
    use_kl: bool = False
    ids: list[int] = field(default_factory=list)
    algo: Literal["ppo", "grpo", "dpo"] = "ppo"
    name: str = "run"
    tag: int | str = 0

    def validate(self) -> None:
        if self.total_steps <= 0:
            raise ConfigError("must be > 0", key="total_steps")


@dataclass
class RootConfig:
    model: ModelConfig
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)

    def validate(self) -> None:
        if self.trainer.algo == "dpo" and self.model.lora is not None:
            raise ConfigError("algo 'dpo' does not support lora")


CALLS: list[str] = []


@dataclass
class Leaf:
    x: int = 1

    def validate(self) -> None:
        CALLS.append("leaf")


@dataclass
class Mid:
    leaf: Leaf = field(default_factory=Leaf)

    def validate(self) -> None:
        CALLS.append("mid")
        raise ConfigError("mid is broken")


@dataclass
class Top:
    mid: Mid = field(default_factory=Mid)

    def validate(self) -> None:
        CALLS.append("top")


@dataclass
class BadSchema:
    items: set[int] = field(default_factory=set)


BASE = {"model": {"path": "/ckpt"}}


def build(extra: dict | None = None) -> RootConfig:
    data = {"model": {"path": "/ckpt"}}
    for key, value in (extra or {}).items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key].update(value)
        else:
            data[key] = value
    return from_dict(RootConfig, data)


def err(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return str(info.value)


# --------------------------------------------------------------------------- from_dict


def test_nested_defaults_and_int_accepted_for_float():
    cfg = build({"optim": {"lr": 1}, "trainer": {"ids": [1, 2], "seed": 7}})
    assert cfg.model.path == "/ckpt" and cfg.model.lora is None
    assert cfg.trainer == TrainerConfig(ids=[1, 2], seed=7)
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.betas == [0.9, 0.999]


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)
    assert ConfigError("x", key="a.b").key == "a.b"


def test_str_given_for_int_names_key_type_and_value():
    msg = err(build, {"trainer": {"total_steps": "abc"}})
    assert "'trainer.total_steps'" in msg and "int" in msg and "'abc'" in msg
    assert "trainer.total_steps=<value>" in msg  # says how to fix


@pytest.mark.parametrize("value", ["yes", 1, 0, "true", None])
def test_bool_is_strict(value):
    msg = err(build, {"trainer": {"use_kl": value}})
    assert "'trainer.use_kl'" in msg and "bool" in msg


def test_real_bool_accepted():
    assert build({"trainer": {"use_kl": True}}).trainer.use_kl is True


@pytest.mark.parametrize("value", [True, 3.0, "3"])
def test_int_rejects_bool_float_and_str(value):
    assert "'trainer.total_steps'" in err(build, {"trainer": {"total_steps": value}})


def test_float_rejects_bool_and_str_is_not_coerced():
    assert "'optim.lr'" in err(build, {"optim": {"lr": True}})
    assert "'optim.lr'" in err(build, {"optim": {"lr": "1e-4"}})
    assert "quote it" in err(build, {"trainer": {"name": 5}})


def test_optional_scalar_and_union():
    assert build({"trainer": {"seed": None}}).trainer.seed is None
    msg = err(build, {"trainer": {"seed": "x"}})
    assert "'trainer.seed'" in msg and "expected int | null" in msg
    assert build({"trainer": {"tag": "v1"}}).trainer.tag == "v1"
    assert build({"trainer": {"tag": 3}}).trainer.tag == 3
    msg = err(build, {"trainer": {"tag": [1]}})
    assert "'trainer.tag'" in msg and "int | str" in msg


def test_optional_nested_dataclass():
    assert build({"model": {"lora": None}}).model.lora is None
    cfg = build({"model": {"lora": {"rank": 4}}})
    assert cfg.model.lora == LoraConfig(rank=4)
    msg = err(build, {"model": {"lora": {"rnk": 4}}})
    assert msg.startswith("unknown config key 'model.lora.rnk'; did you mean 'model.lora.rank'")
    assert "'model.lora.alpha'" in err(build, {"model": {"lora": {"alpha": "big"}}})


def test_literal_rejection_lists_allowed_values():
    msg = err(build, {"trainer": {"algo": "grpoo"}})
    assert "'trainer.algo'" in msg and "'ppo', 'grpo', 'dpo'" in msg
    assert "did you mean 'grpo'" in msg
    assert "'bf16', 'fp16', 'fp32'" in err(build, {"model": {"dtype": 16}})


def test_unknown_nested_key_suggestion_exact_text():
    msg = err(build, {"trainer": {"totl_steps": 5}})
    assert msg == "unknown config key 'trainer.totl_steps'; did you mean 'trainer.total_steps'?"


def test_misplaced_key_suggests_other_section():
    assert "did you mean 'optim.lr'?" in err(build, {"lr": 0.1})
    assert "'optim.lr'" in err(build, {"trainer": {"lr": 0.1}})
    assert "'trainer'" in err(build, {"trainr": {}})


def test_unknown_key_without_match_lists_valid_keys():
    msg = err(build, {"trainer": {"zzzzzz": 1}})
    assert "valid keys under 'trainer'" in msg and "total_steps" in msg and "did you" not in msg


def test_missing_required_fields_named():
    assert "'model.path'" in err(from_dict, RootConfig, {"model": {"dtype": "bf16"}})
    # a required section absent altogether is built from {} and reports its own missing keys
    assert "'model.path'" in err(from_dict, RootConfig, {})


def test_list_and_dict_fields():
    assert "'trainer.ids[1]'" in err(build, {"trainer": {"ids": [1, "x"]}})
    assert "'trainer.ids'" in err(build, {"trainer": {"ids": 5}})
    assert "'optim.betas[0]'" in err(build, {"optim": {"betas": ["a"]}})
    cfg = build({"model": {"extra": {"a": [1, {"b": None}]}}})
    assert cfg.model.extra == {"a": [1, {"b": None}]}
    assert "'model.extra'" in err(build, {"model": {"extra": [1]}})
    assert "keys must be strings" in err(build, {"model": {"extra": {1: "x"}}})


def test_section_given_scalar_or_null():
    assert "'trainer'" in err(build, {"trainer": 5})
    assert from_dict(RootConfig, {"model": {"path": "p"}, "trainer": None}).trainer == \
        TrainerConfig()


def test_from_dict_path_prefix_and_bad_inputs():
    msg = err(from_dict, TrainerConfig, {"totl_steps": 1}, path="trainer")
    assert "'trainer.totl_steps'" in msg and "'trainer.total_steps'" in msg
    assert "mapping" in err(from_dict, RootConfig, [1, 2])
    with pytest.raises(TypeError):
        from_dict(dict, {})
    with pytest.raises(TypeError, match="unsupported field type"):
        from_dict(BadSchema, {"items": [1]})


# --------------------------------------------------------------------------- validate hooks


def test_validate_error_prefixed_with_path():
    msg = err(build, {"trainer": {"total_steps": 0}})
    assert msg == "config key 'trainer.total_steps': must be > 0"
    assert "config key 'model.lora.rank': must be positive" in err(
        build, {"model": {"lora": {"rank": 0}}})


def test_root_validate_and_section_without_key():
    assert err(build, {"trainer": {"algo": "dpo"}, "model": {"lora": {}}}) == \
        "invalid config: algo 'dpo' does not support lora"
    CALLS.clear()
    assert err(from_dict, Top, {}) == "config section 'mid': mid is broken"
    assert CALLS == ["leaf", "mid"]  # children first; parent never validated after failure


def test_prebuilt_section_instances_accepted_and_validated():
    cfg = from_dict(RootConfig, {"model": ModelConfig(path="p"), "trainer": TrainerConfig(seed=1)})
    assert cfg.model.path == "p" and cfg.trainer.seed == 1
    msg = err(from_dict, RootConfig, {"model": {"path": "p"},
                                      "trainer": TrainerConfig(total_steps=-1)})
    assert msg == "config key 'trainer.total_steps': must be > 0"


def test_validate_order_children_first():
    CALLS.clear()
    with pytest.raises(ConfigError) as info:
        from_dict(Top, {"mid": {"leaf": {"x": 2}}})
    assert info.value.key == "mid"
    assert CALLS == ["leaf", "mid"]


# --------------------------------------------------------------------------- overrides


def test_overrides_parse_values():
    out = apply_overrides(BASE, [
        "trainer.total_steps=3", "optim.lr=1e-4", "trainer.use_kl=true", "trainer.ids=[1,2]",
        "trainer.seed=null", "optim.weight_decay=0.1", "trainer.name=",
    ], schema=RootConfig)
    assert out["trainer"] == {"total_steps": 3, "use_kl": True, "ids": [1, 2], "seed": None,
                              "name": ""}
    assert out["optim"] == {"lr": 1e-4, "weight_decay": 0.1}
    assert isinstance(out["optim"]["lr"], float)
    assert BASE == {"model": {"path": "/ckpt"}}  # input not mutated
    cfg = from_dict(RootConfig, out)
    assert cfg.trainer.total_steps == 3 and cfg.optim.lr == 1e-4 and cfg.trainer.name == ""


def test_override_nested_creation_and_equals_in_value():
    out = apply_overrides({"model": {"path": "p", "lora": None}},
                          ["model.lora.rank=4", "model.path=s3://b/x?a=b", "model.extra.cmd=a=b"],
                          schema=RootConfig)
    assert out["model"] == {"path": "s3://b/x?a=b", "lora": {"rank": 4},
                            "extra": {"cmd": "a=b"}}
    assert apply_overrides({}, ["a.b.c=1"]) == {"a": {"b": {"c": 1}}}  # no schema: anything


@pytest.mark.parametrize("bad", ["trainer.total_steps", "=3", "a..b=1", "  =x"])
def test_malformed_override(bad):
    msg = err(apply_overrides, {}, [bad], schema=RootConfig)
    assert "malformed override" in msg and repr(bad) in msg


def test_override_unknown_key_checked_before_applying():
    msg = err(apply_overrides, BASE, ["trainer.total_steps=3", "trainer.totl_steps=3"],
              schema=RootConfig)
    assert msg == "unknown config key 'trainer.totl_steps'; did you mean 'trainer.total_steps'?"
    assert "did you mean 'optim.lr'" in err(apply_overrides, BASE, ["lr=0.1"], schema=RootConfig)
    assert "not a section" in err(apply_overrides, BASE, ["trainer.total_steps.x=1"],
                                  schema=RootConfig)


def test_override_bad_values():
    assert "not valid YAML" in err(apply_overrides, BASE, ["trainer.ids=[1,2"])
    msg = err(apply_overrides, {"trainer": 5}, ["trainer.total_steps=1"], schema=RootConfig)
    assert "'trainer' is 5" in msg


# --------------------------------------------------------------------------- YAML files


def test_load_config_file_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  path: /m\noptim:\n  lr: 3e-6\ntrainer:\n  total_steps: 10\n")
    cfg = load_config(RootConfig, str(path), ["trainer.total_steps=20"])
    assert cfg.optim.lr == 3e-6 and cfg.trainer.total_steps == 20 and cfg.model.path == "/m"
    assert load_config(RootConfig, None, ["model.path=/x"]).model.path == "/x"


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    msg = err(load_config, RootConfig, str(missing), [])
    assert str(missing) in msg and "not found" in msg
    assert "is a directory, not a YAML file" in err(load_config, RootConfig, str(tmp_path), [])


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  path: /m\ntrainer: [1, 2\n")
    msg = err(load_config, RootConfig, str(path), [])
    assert str(path) in msg and re.search(r"line \d+", msg)


def test_duplicate_key_is_error_with_line(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("model:\n  path: /a\n  path: /b\n")
    msg = err(load_config, RootConfig, str(path), [])
    assert "duplicate key 'path'" in msg and "line 3" in msg


def test_top_level_not_mapping_and_empty_file(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    msg = err(load_config, RootConfig, str(path), [])
    assert str(path) in msg and "list" in msg
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    assert load_config(RootConfig, str(empty), ["model.path=p"]).trainer == TrainerConfig()


def test_unknown_key_in_file_uses_dotted_path(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  path: /m\n  lora:\n    rnak: 3\n")
    assert "did you mean 'model.lora.rank'" in err(load_config, RootConfig, str(path), [])


# --------------------------------------------------------------------------- dump / describe


def test_dump_load_round_trip(tmp_path):
    cfg = build({
        "model": {"lora": {"rank": 2, "targets": ["1e-4", "true", "null", "a: b"]},
                  "extra": {"nested": {"x": [1, 2.5, None]}, "s": "3"}},
        "trainer": {"seed": 3, "ids": [4, 5], "algo": "grpo", "name": "1e5", "tag": "7"},
        "optim": {"lr": 1.5e-7, "betas": [0.5, 1]},
    })
    path = tmp_path / "resolved.yaml"
    dump_yaml(cfg, str(path))
    again = load_config(RootConfig, str(path), [])
    assert again == cfg
    assert again.model.lora.targets[0] == "1e-4" and again.trainer.tag == "7"
    assert from_dict(RootConfig, to_dict(cfg)) == cfg


def test_to_dict_and_format_config():
    cfg = build()
    d = to_dict(cfg)
    assert d["trainer"]["total_steps"] == 100 and d["model"]["lora"] is None
    text = format_config(cfg)
    assert "total_steps: 100" in text and "path: /ckpt" in text


def test_config_keys():
    assert config_keys(OptimConfig) == ["lr", "betas", "weight_decay"]
    keys = config_keys(RootConfig)
    assert "model.lora.rank" in keys and "trainer.total_steps" in keys and "optim.lr" in keys
    assert "model" not in keys and "model.lora" not in keys
    assert "model.extra" in keys


def test_describe():
    text = describe(RootConfig)
    assert "optim.lr: float = 1.0e-05\n    Peak learning rate." in text
    assert "model.path: str (required)\n    Checkpoint directory." in text
    assert "model.lora: LoraConfig | null = null" in text
    assert "trainer.algo: 'ppo' | 'grpo' | 'dpo' = ppo" in text
    assert "optim.betas: list[float] = [0.9, 0.999]" in text

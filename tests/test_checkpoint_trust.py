"""Checkpoints a user can trust (issue #15): nothing is unpickled from a checkpoint beyond plain
data, damage is found (manifest checksums) and named, ``trainer.resume=auto`` falls back past a
damaged checkpoint (set aside, never deleted), and a full disk names the directory and keeps the
previous checkpoint usable. One tiny model saved by a 1-rank process; the checks on files run here.
"""

import errno
import json
import os
import pickle
import shutil

import pytest
import torch

from hyflow.checkpoint.discovery import MARKER_FILE, STATE_FILE, step_dir_name
from hyflow.checkpoint.errors import CheckpointDamaged, CheckpointError
from hyflow.checkpoint.manifest import MANIFEST_FILE, read_manifest, verify_manifest, write_manifest
from hyflow.testing import run_on_ranks
from hyflow.testing.checkpoints import build_tiny as _build
from hyflow.testing.checkpoints import fresh_copy
from hyflow.testing.checkpoints import resume_tiny as _resume
from hyflow.testing.checkpoints import step_path as _step
from hyflow.testing.checkpoints import tiny_description as _tiny


def _save_steps(out: str, steps: list, frozen: bool = False) -> None:
    """Rank function: checkpoint a tiny model (char tokenizer) at ``steps`` (its weights change
    in between)."""
    from hyflow.checkpoint.checkpointer import Checkpointer, TrainedModel

    groups, model = _build()
    ckpt = Checkpointer(out, groups, _tiny(), keep_last=5, log=lambda m: None, tokenizer="char")
    for step in steps:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * step)
        ckpt.save(step, {"actor": TrainedModel([model])}, {"step": step},
                  frozen={"reference": model} if frozen else None)
    ckpt.close()


def _save_on_full_disk(out: str) -> dict:
    """Rank function: step 1 saves; while step 2 saves, every write of a tensor file fails with
    ENOSPC. Returns the error, and what resume=auto then finds."""
    import builtins

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from hyflow.checkpoint.checkpointer import Checkpointer, TrainedModel

    groups, model = _build()
    ckpt = Checkpointer(out, groups, _tiny(), log=lambda m: None)
    ckpt.save(1, {"actor": TrainedModel([model])}, {"step": 1})

    def full_disk(path, *args, **kwargs):
        if step_dir_name(2) in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return builtins.open(path, *args, **kwargs)

    filesystem_async.open = full_disk  # module global: shadows the builtin in Megatron's writer
    try:
        ckpt.save(2, {"actor": TrainedModel([model])}, {"step": 2})
        error = None
    except CheckpointError as e:
        error = str(e)
    finally:
        del filesystem_async.open
    ckpt.close()
    return {"error": error, "resume": _resume(out, "auto")}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run directory with complete checkpoints at steps 1 and 2 (and a frozen reference)."""
    out = tmp_path_factory.mktemp("saved") / "run"
    run_on_ranks(_save_steps, 1, str(out), [1, 2], True, timeout=300)
    return out


@pytest.fixture
def run(saved, tmp_path):
    return fresh_copy(saved, tmp_path)


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


class _Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


def _rewrite_manifest(step_dir):
    """What an attacker who can write the checkpoint does too: make the manifest match."""
    os.remove(step_dir / MANIFEST_FILE)
    write_manifest(str(step_dir), exclude=(MARKER_FILE,))


# --------------------------------------------------------------------------- the manifest


def test_manifest_lists_every_file_and_is_written_before_the_marker(saved):
    step = _step(saved, 2)
    manifest = read_manifest(str(step))
    files = set(manifest["files"])
    on_disk = {str(p.relative_to(step)) for p in step.rglob("*") if p.is_file()}
    assert files == on_disk - {MANIFEST_FILE, MARKER_FILE}
    assert {"actor/__0_0.distcp", "actor/.metadata", "rng/rank_00000.pt", STATE_FILE} <= files
    assert all(len(e["sha256"]) == 64 and e["size"] > 0 for e in manifest["files"].values())
    assert os.stat(step / MANIFEST_FILE).st_mtime_ns <= os.stat(step / MARKER_FILE).st_mtime_ns
    assert json.loads((step / MARKER_FILE).read_text())["save_seconds"] > 0
    reference = saved / "checkpoints" / "reference"  # a model checkpoint has its own
    assert "__0_0.distcp" in read_manifest(str(reference))["files"]
    assert verify_manifest(str(step)) is manifest or verify_manifest(str(step))["files"] == manifest["files"]


@pytest.mark.parametrize("victim", ["actor/__0_0.distcp", "actor/.metadata", "rng/rank_00000.pt", STATE_FILE])
def test_one_flipped_byte_is_found_and_named(run, victim):
    step = _step(run, 2)
    _flip_byte(step / victim)
    with pytest.raises(CheckpointDamaged, match="does not match its checksum") as err:
        verify_manifest(str(step))
    assert err.value.file == victim and str(step / victim) in str(err.value)
    os.environ["HYFLOW_NO_VERIFY"] = "1"  # --no-verify: sizes only
    try:
        assert verify_manifest(str(step)) is not None
    finally:
        del os.environ["HYFLOW_NO_VERIFY"]
    (step / victim).write_bytes((step / victim).read_bytes()[:-1])
    with pytest.raises(CheckpointDamaged, match="does not have the size"):
        verify_manifest(str(step))


@pytest.mark.multirank
def test_resume_auto_sets_a_damaged_checkpoint_aside_and_uses_the_previous(run):
    _flip_byte(_step(run, 2) / "actor" / "__0_0.distcp")
    result = run_on_ranks(_resume, 1, str(run), "auto", timeout=300)[0]
    assert result["error"] is None, result
    assert result["path"] == str(_step(run, 1)) and result["job"] == {"step": 1}
    aside = f"{_step(run, 2)}.corrupt-checksum"
    assert os.path.isdir(aside) and not _step(run, 2).exists()  # renamed, never deleted
    assert len(result["warnings"]) == 1
    assert f"checkpoint {_step(run, 2)} is damaged and was set aside as {aside}" in result["warnings"][0]
    assert "actor/__0_0.distcp does not match its checksum" in result["warnings"][0]
    # the same checkpoint named explicitly is refused, naming the file
    shutil.move(aside, _step(run, 2))
    explicit = run_on_ranks(_resume, 1, str(run), str(_step(run, 2)), timeout=300)[0]
    assert explicit["type"] == "CheckpointDamaged" and "actor/__0_0.distcp" in explicit["error"]
    assert _step(run, 2).is_dir()


@pytest.mark.multirank
def test_a_corrupt_trainer_state_names_its_file(run):
    step = _step(run, 2)
    (step / STATE_FILE).write_text("{\"step\": 2, \"trunc")
    os.remove(step / MANIFEST_FILE)  # as a checkpoint written before manifests (--no-verify loads it): the parse
    result = run_on_ranks(_resume, 1, str(run), str(step), True, timeout=300)[0]  # must name the file
    assert result["type"] == "CheckpointDamaged"
    assert f"{step / STATE_FILE} is not valid JSON" in result["error"]


# --------------------------------------------------------------------------- no code from a checkpoint


@pytest.mark.multirank
@pytest.mark.parametrize("victim", ["rng/rank_00000.pt", "actor/.metadata", "actor/common.pt"])
def test_a_pickled_callable_in_a_checkpoint_is_refused_and_never_runs(run, tmp_path, victim):
    marker = tmp_path / "pwned"
    step = _step(run, 2)
    if victim.endswith(".metadata"):
        (step / victim).write_bytes(pickle.dumps(_Payload(marker)))
    else:
        torch.save({"format": "hyflow-rng", "payload": _Payload(marker)}, step / victim)
    _rewrite_manifest(step)
    result = run_on_ranks(_resume, 1, str(run), str(step), timeout=300)[0]
    assert not marker.exists(), "the pickled callable ran"
    assert result["error"] and str(step / victim) in result["error"], result
    assert "never runs code from a checkpoint" in result["error"] or "refusing" in result["error"]


def test_model_checkpoint_pickles_are_checked_before_torch_reads_them(saved, tmp_path):
    from hyflow.checkpoint.model import read_checkpoint_info

    reference = tmp_path / "reference"
    shutil.copytree(saved / "checkpoints" / "reference", reference)
    assert read_checkpoint_info(str(reference)).num_layers == 1
    marker = tmp_path / "pwned"
    (reference / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    os.remove(reference / MANIFEST_FILE)  # an attacker rewrites it; without one only the unpickler stands
    with pytest.raises(CheckpointError, match="references posix.system|references os.system"):
        read_checkpoint_info(str(reference))
    assert not marker.exists()


# --------------------------------------------------------------------------- disk full


@pytest.mark.multirank
def test_disk_full_names_the_directory_and_the_previous_checkpoint_stays_usable(tmp_path):
    out = tmp_path / "run"
    result = run_on_ranks(_save_on_full_disk, 1, str(out), timeout=300)[0]
    step2 = _step(out, 2)
    assert result["error"] is not None
    assert result["error"].startswith(f"checkpoint step 2 was not saved: no space left on the device while "
                                      f"writing the actor weights to {step2}/actor")
    assert f"the previous checkpoint {_step(out, 1)} (step 1) is intact" in result["error"]
    assert not (step2 / MARKER_FILE).exists()
    resumed = result["resume"]
    assert resumed["error"] is None and resumed["path"] == str(_step(out, 1)) and resumed["job"] == {"step": 1}


# --------------------------------------------------------------------------- export and generate


def test_export_refuses_a_damaged_checkpoint_naming_the_file(run, tmp_path, capsys):
    from hyflow.cli import main

    _flip_byte(_step(run, 2) / "actor" / "__0_0.distcp")
    out = tmp_path / "hf"
    assert main(["export", "--ckpt", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{_step(run, 2)}/actor/__0_0.distcp does not match its checksum" in err
    assert not out.exists()  # nothing written


@pytest.mark.multirank
def test_export_without_a_tokenizer_says_so(saved, tmp_path, capsys):
    from hyflow.cli import main

    out = tmp_path / "hf"
    assert main(["export", "--ckpt", str(saved), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "built-in character tokenizer ('char'), which has no Hugging Face tokenizer files" in err
    assert (out / "config.json").exists() and not (out / "tokenizer.json").exists()


def test_generate_takes_a_run_directory_and_refuses_a_damaged_checkpoint(run, tmp_path, capsys, monkeypatch):
    from hyflow.cli import main
    from hyflow.rollout import cli as generate_cli

    monkeypatch.delenv("HYFLOW_NO_VERIFY", raising=False)
    assert generate_cli.resolve_model_dir(str(run)) == str(_step(run, 2) / "actor")  # as export --ckpt
    assert generate_cli.resolve_model_dir(str(_step(run, 1))) == str(_step(run, 1) / "actor")
    _flip_byte(_step(run, 2) / "actor" / "__0_0.distcp")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2, 3]}\n')
    # refused before any process group or model exists
    monkeypatch.setattr("hyflow.parallel.distributed.init_distributed", lambda *a, **k: pytest.fail("started"))
    assert main(["generate", "--ckpt", str(run), "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert f"{_step(run, 2)}/actor/__0_0.distcp does not match its checksum" in err and "Traceback" not in err

"""Checkpoint faults that used to lose work or data (issue #39): non-finite weights are never
written or loaded (the error names the tensor), a checkpoint without a manifest or with a file its
manifest does not list is refused, manifest paths stay inside the checkpoint, and a save on 2 ranks
writes its manifest in per-rank parts without a world-wide pickled collective (issue #33).
One tiny model; the file checks run here, loads and saves on 1-2 gloo ranks."""

import json
import os

import pytest
import torch

from hyflow.checkpoint.discovery import MARKER_FILE
from hyflow.checkpoint.errors import CheckpointDamaged, CheckpointError
from hyflow.checkpoint.manifest import (MANIFEST_FILE, PARTS_DIR, ManifestMissing, file_digest, read_manifest,
                                        sizes_match, verify_manifest, write_manifest)
from hyflow.testing import run_on_ranks
from hyflow.testing.checkpoints import build_tiny as _build
from hyflow.testing.checkpoints import fresh_copy
from hyflow.testing.checkpoints import resume_tiny as _resume
from hyflow.testing.checkpoints import step_path as _step
from hyflow.testing.checkpoints import tiny_description as _tiny

NAN_TENSOR = "decoder.layers.0.mlp.linear_fc1.weight"


def _poison(model) -> None:
    with torch.no_grad():
        dict(model.named_parameters())[NAN_TENSOR][1, 2] = float("nan")


def _save_steps(out: str, steps: list, poison_last: bool = False) -> dict:
    """Rank function: checkpoint the tiny model at ``steps``; ``poison_last``: plant a NaN before
    the last one. Returns the error of a refused save."""
    from hyflow.checkpoint.checkpointer import Checkpointer, TrainedModel

    groups, model = _build()
    ckpt = Checkpointer(out, groups, _tiny(), keep_last=5, log=lambda m: None, tokenizer="char")
    try:
        for step in steps:
            if poison_last and step == steps[-1]:
                _poison(model)
            ckpt.save(step, {"actor": TrainedModel([model])}, {"step": step})
    except CheckpointError as e:
        return {"error": str(e), "type": type(e).__name__, "tensor": getattr(e, "tensor", None)}
    finally:
        ckpt.close()
    return {"error": None}


def _overwrite_with_nan(step_dir: str) -> None:
    """Rank function: what a hand edit or a buggy tool does: the step's actor weights rewritten with
    a NaN by dist_checkpointing itself (no hyflow check in the way), the manifest left as it was."""
    from megatron.core import dist_checkpointing

    _, model = _build()
    _poison(model)
    actor = os.path.join(step_dir, "actor")
    for name in os.listdir(actor):
        if name.endswith(".distcp") or name in (".metadata", "common.pt", "metadata.json"):
            os.remove(os.path.join(actor, name))
    dist_checkpointing.save(model.sharded_state_dict(), actor)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "run"
    assert run_on_ranks(_save_steps, 1, str(out), [1, 2], timeout=300)[0]["error"] is None
    return out


@pytest.fixture
def run(saved, tmp_path):
    return fresh_copy(saved, tmp_path)


# --------------------------------------------------------------------------- non-finite weights


@pytest.mark.multirank
def test_a_save_with_nan_weights_fails_naming_the_tensor_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    result = run_on_ranks(_save_steps, 1, str(out), [1, 2], True, timeout=300)[0]
    assert result["type"] == "NonFiniteWeights" and result["tensor"] == f"actor/{NAN_TENSOR}"
    assert f"actor/{NAN_TENSOR} holds NaN or inf" in result["error"]
    assert "saving checkpoint step 2" in result["error"] and "step_000001 (step 1) is intact" in result["error"]
    assert not _step(out, 2).exists() and (_step(out, 1) / MARKER_FILE).exists()


@pytest.mark.multirank
@pytest.mark.parametrize("manifest", ["deleted", "rewritten"])
def test_nan_weights_in_a_checkpoint_are_refused_on_resume_and_export(run, tmp_path, manifest, capsys):
    """Issue #39 point 1: NaN planted into step 2's weights. With the manifest deleted the load is
    refused for the missing manifest (unless --no-verify); with a manifest rewritten to match, and with
    --no-verify, the finite check refuses it, naming the tensor. Export writes nothing either way."""
    from hyflow.cli import main

    step = _step(run, 2)
    run_on_ranks(_overwrite_with_nan, 1, str(step), timeout=300)
    os.remove(step / MANIFEST_FILE)
    if manifest == "rewritten":
        write_manifest(str(step), exclude=(MARKER_FILE,))
        result = run_on_ranks(_resume, 1, str(run), "auto", timeout=300)[0]
    else:
        result = run_on_ranks(_resume, 1, str(run), "auto", timeout=300)[0]
        assert result["type"] == "ManifestMissing" and "--no-verify" in result["error"], result
        assert step.is_dir()  # refused, not set aside: nothing was found damaged
        result = run_on_ranks(_resume, 1, str(run), "auto", True, timeout=300)[0]
    assert result["type"] == "NonFiniteWeights" and result["tensor"] == f"actor/{NAN_TENSOR}", result
    assert f"loading checkpoint {step}" in result["error"] and "trainer.resume" in result["error"]
    out = tmp_path / "hf"
    args = ["export", "--ckpt", str(run), "--out", str(out)] + (["--no-verify"] if manifest == "deleted" else [])
    try:
        assert main(args) == 2
    finally:
        os.environ.pop("HYFLOW_NO_VERIFY", None)
    err = capsys.readouterr().err
    assert f"{NAN_TENSOR} holds NaN or inf" in err and "Traceback" not in err
    assert not out.exists()


def test_the_finite_check_names_every_kind_of_non_finite_tensor():
    from hyflow.checkpoint.finite import check_finite, nonfinite_names

    big = torch.full((4,), 6.0e4, dtype=torch.float16)  # finite; its 2-norm overflows fp16
    named = [("a", torch.ones(3)), ("b", torch.tensor([1.0, float("inf")])), ("c", big),
             ("d", torch.tensor([float("nan")], dtype=torch.bfloat16)), ("e", torch.zeros(0))]
    assert nonfinite_names(named) == ["b", "d"]
    with pytest.raises(CheckpointError, match=r"m/bias holds NaN or inf \(and 0|m/bias holds NaN or inf while"):
        module = torch.nn.Linear(2, 2)
        with torch.no_grad():
            module.bias[0] = float("-inf")
        check_finite({"m": module, "absent": None}, "testing")


# --------------------------------------------------------------------------- the manifest


def test_a_checkpoint_without_a_manifest_is_refused_unless_verification_is_off(run, monkeypatch):
    step = _step(run, 2)
    os.remove(step / MANIFEST_FILE)
    with pytest.raises(ManifestMissing, match="no manifest.json.*--no-verify"):
        verify_manifest(str(step))
    monkeypatch.setenv("HYFLOW_NO_VERIFY", "1")
    assert verify_manifest(str(step)) is None


@pytest.mark.parametrize("victim", ["actor/extra.distcp", "rng/rank_00001.pt", "sneaky", f"{PARTS_DIR}/rank_00001.json"])
def test_a_file_the_manifest_does_not_list_is_refused(run, victim):
    step = _step(run, 2)
    (step / victim).parent.mkdir(exist_ok=True)
    (step / victim).write_bytes(b"x" * 10)
    with pytest.raises(CheckpointDamaged, match="is not listed in manifest.json") as err:
        verify_manifest(str(step))
    assert err.value.file == victim and err.value.reason == "unlisted"
    # an entry dropped from the manifest (the probe's "shard's manifest entry dropped") is the same
    os.remove(step / victim)
    manifest = json.loads((step / MANIFEST_FILE).read_text())
    del manifest["files"]["actor/__0_0.distcp"]
    (step / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointDamaged, match="actor/__0_0.distcp is not listed"):
        verify_manifest(str(step))


@pytest.mark.parametrize("entry, reason", [("actor/../../../../../../../dev/zero", "not a file path inside"),
                                           ("../../../../../../../../etc/hostname", "not a file path inside"),
                                           ("/etc/hostname", "not a file path inside"),
                                           ("zero", "not a regular file"), ("link", "not a regular file")])
def test_manifest_paths_are_confined_to_the_checkpoint(run, entry, reason):
    """Issue #39 point 5: an entry outside the checkpoint, or a device / symlink inside it, is refused
    before it is opened (hashing /dev/zero used to run forever)."""
    step = _step(run, 2)
    target = "/etc/hostname"
    if entry == "zero":
        os.symlink("/dev/zero", step / "zero")
    if entry == "link":
        os.symlink(target, step / "link")
    manifest = json.loads((step / MANIFEST_FILE).read_text())
    size = os.path.getsize(target)
    manifest["files"][entry] = {"size": size, "sha256": file_digest(target)}
    (step / MANIFEST_FILE).write_text(json.dumps(manifest))
    for check in (lambda: verify_manifest(str(step)), lambda: sizes_match(str(step))):
        with pytest.raises(CheckpointDamaged, match=reason):
            check()


# --------------------------------------------------------------------------- per-rank parts (issue #33)

_OBJECT_COLLECTIVES = ("broadcast_object_list", "gather_object", "all_gather_object", "scatter_object_list")


def _save_counting(out: str) -> dict:
    """Rank function (2 ranks, dp=2): three saves, the object collectives of each counted by caller."""
    import traceback

    import torch.distributed as dist

    from hyflow.checkpoint.checkpointer import Checkpointer, TrainedModel

    groups, model = _build(dp=2)
    ckpt = Checkpointer(out, groups, _tiny(), keep_last=5, log=lambda m: None, tokenizer="char")
    calls: dict[int, list] = {}
    original = {name: getattr(dist, name) for name in _OBJECT_COLLECTIVES}

    def counting(name):
        def call(*args, **kwargs):
            caller = next((f"{os.path.basename(f.filename)}:{f.name}" for f in reversed(traceback.extract_stack()[:-1])
                           if "dist_checkpointing" in f.filename or "/hyflow/" in f.filename
                           or "/engine/" in f.filename), "?")
            calls[step].append((name, caller))
            return original[name](*args, **kwargs)
        return call

    for name in _OBJECT_COLLECTIVES:
        setattr(dist, name, counting(name))
    try:
        for step in (1, 2, 3):
            calls[step] = []
            ckpt.save(step, {"actor": TrainedModel([model])}, {"step": step})
    finally:
        for name, fn in original.items():
            setattr(dist, name, fn)
        ckpt.close()
    verified = _resume(out, "auto", dp=2)
    return {"calls": calls, "resumed": verified}


@pytest.mark.multirank
def test_a_save_on_two_ranks_writes_manifest_parts_without_world_wide_pickled_collectives(tmp_path):
    out = tmp_path / "run"
    results = run_on_ranks(_save_counting, 2, str(out), timeout=600)
    for rank, result in enumerate(results):
        assert result["resumed"]["error"] is None and result["resumed"]["job"] == {"step": 3}, result
        for step, calls in result["calls"].items():
            ours = [c for c in calls if not c[1].startswith(("state_dict_saver", "utils", "validation"))]
            assert ours == [], f"rank {rank} step {step}: hyflow's own object collectives {ours}"
            megatron_validation = [c for c in calls if c[1].startswith("validation")]
            # Megatron's access-integrity check (all_gather_object of every rank's shard metadata) runs
            # on the first save of the run only
            assert bool(megatron_validation) == (step == 1), (rank, step, calls)
            # what remains is torch DCP's own: local plans and write results gathered on rank 0, which
            # writes the tensor index (.metadata) of the torch_dist format
            assert {c[0] for c in calls if c[1].startswith(("state_dict_saver", "utils"))} <= {"gather_object"}
    step = _step(out, 3)
    manifest = read_manifest(str(step))
    assert manifest["parts"] == 2 and "actor/__1_0.distcp" not in manifest["files"]
    part = json.loads((step / PARTS_DIR / "rank_00001.json").read_text())
    rank1 = {str(p.relative_to(step)) for p in step.rglob("*") if p.name.startswith(("__1_", "rank_00001.pt"))}
    assert "rng/rank_00001.pt" in rank1 and set(part["files"]) == rank1  # rank 1 hashed its own files only
    assert "actor/__0_0.distcp" in manifest["files"] and "rng/rank_00000.pt" in manifest["files"]
    assert not set(manifest["files"]) & rank1
    assert verify_manifest(str(step)) is not None  # one process reads both parts (export, pre-flight)
    # damage in rank 1's part is found and named from one process, and from two ranks
    victim = step / "rng" / "rank_00001.pt"
    victim.write_bytes(victim.read_bytes()[:-1])
    with pytest.raises(CheckpointDamaged, match="rng/rank_00001.pt does not have the size"):
        verify_manifest(str(step))
    os.remove(step / PARTS_DIR / "rank_00001.json")
    with pytest.raises(CheckpointDamaged, match="manifest.parts/rank_00001.json .* is missing or unreadable"):
        verify_manifest(str(step))


# --------------------------------------------------------------------------- export safety (point 8)


@pytest.mark.multirank
def test_export_force_replaces_only_an_export_and_writes_readable_files(saved, tmp_path, capsys):
    from hyflow.cli import main

    out = tmp_path / "hf"
    old = os.umask(0o022)
    try:
        assert main(["export", "--ckpt", str(saved), "--out", str(out)]) == 0
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o644, modes
    assert main(["export", "--ckpt", str(saved), "--out", str(out), "--force"]) == 0  # a previous export
    unrelated = tmp_path / "home"
    (unrelated / "src").mkdir(parents=True)
    (unrelated / "notes.txt").write_text("keep me")
    capsys.readouterr()
    assert main(["export", "--ckpt", str(saved), "--out", str(unrelated), "--force"]) == 2
    assert "does not look like a model directory hyflow export wrote" in capsys.readouterr().err
    assert (unrelated / "notes.txt").read_text() == "keep me" and (unrelated / "src").is_dir()
    assert not list(tmp_path.glob("*.partial-*"))


@pytest.mark.multirank
@pytest.mark.parametrize("change", [{"step": "four"}, {"models": ["actor"]}, {"layout": {}}, {"version": "1"}])
def test_a_malformed_trainer_state_is_named_not_a_bare_value_error(run, change):
    step = _step(run, 2)
    state = json.loads((step / "trainer_state.json").read_text())
    state.update(change)
    (step / "trainer_state.json").write_text(json.dumps(state))
    write_manifest(str(step), exclude=(MARKER_FILE,))  # as written: only the contents are wrong
    result = run_on_ranks(_resume, 1, str(run), str(step), timeout=300)[0]
    assert result["type"] in ("CheckpointDamaged", "CheckpointError"), result
    assert f"{step}/trainer_state.json" in result["error"]

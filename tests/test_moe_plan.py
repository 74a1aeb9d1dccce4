"""Mixture-of-experts jobs before any rank starts: one-line config errors, ``hyflow plan`` on the
Qwen3-235B-A22B preset at 1024 GPUs (every phase fits in 80 GB, expert all-to-all and exchange
bytes reported, Megatron's expert groups equal the layout's), and the Slurm script's expert line.
"""

import os

import pytest

from hyflow.config import ConfigError
from hyflow.jobs.registry import load_job_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET = os.path.join(REPO, "configs", "qwen3_235b_a22b_1024gpu.yaml")
QUICKSTART = os.path.join(REPO, "configs", "moe_quickstart.yaml")
DENSE = os.path.join(REPO, "configs", "quickstart.yaml")


@pytest.mark.parametrize("config, overrides, needle", [
    (DENSE, ["actor.layout.tp=1", "actor.layout.ep=2"], "expert parallelism needs a mixture-of-experts model"),
    (DENSE, ["actor.layout.tp=1", "rollout.routing_replay=true"], "model.family=llama is dense"),
    (QUICKSTART, ["actor.layout.ep=4"], "ep=4 x etp=1 = 4 ranks per expert replica do not divide"),
    (QUICKSTART, ["actor.layout.ep=1", "trainer.nproc=3", "data.train_batch_size=33",
                  "actor.layout.ep=3"], "layout.ep=3 does not divide the 8 experts"),
    (QUICKSTART, ["actor.layout.ep=1", "actor.layout.tp=2"], "needs layout.sequence_parallel=true"),
    (QUICKSTART, ["rollout.routing_replay=true", "actor.recompute=full"], "actor.recompute=full"),
    (QUICKSTART, ["rollout.routing_replay=false", "rollout.record_routing=true", "actor.old_logprobs=rollout"],
     "actor.old_logprobs=recompute"),
])
def test_bad_moe_configs_fail_with_one_line(config, overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_job_config(config, overrides)
    assert needle in str(err.value) and "\n" not in str(err.value).strip()


def test_preset_fits_80gb_at_1024_ranks_with_expert_traffic():
    from hyflow.plan.core import PlanOptions, build_plan

    result = build_plan(PRESET, [], PlanOptions(world_size=1024, megatron_ranks=[0, 1023]))
    assert not result.errors, result.errors
    assert result.fits and result.required_bytes <= 80 * 2**30
    for phase in result.phases:  # every phase, worst rank, with fragmentation and reserve
        assert phase.total * (1 + result.fragmentation) + result.reserve_bytes <= 80 * 2**30, phase.phase
    gen = next(p for p in result.phases if p.phase == "generation")
    assert gen.get("generation experts") > 20 * 2**30  # 128 experts x 25 layers at 1/4 per generation rank
    x = result.experts
    assert (x["ep"], x["etp"], x["edp"], x["experts_per_rank"]) == (32, 1, 4, 4)
    assert x["alltoall_bytes_per_step"]["total"] > x["alltoall_bytes_per_step"]["actor update"] > 0
    assert x["exchange"]["recv_bytes_max"] > 0 and x["exchange"]["group_size"] == 256
    checks = {c.rank: c for c in result.checks}
    assert set(checks) == {0, 1023} and not any(c.mismatches for c in checks.values())
    assert checks[0].megatron["expert_ep"] == list(range(32))  # Megatron's EP group of rank 0


def test_slurm_script_names_the_expert_groups(tmp_path):
    from hyflow.launch.local import resolve_target
    from hyflow.launch.slurm import SlurmOptions, render_sbatch

    target = resolve_target(PRESET, [f"trainer.output_dir={tmp_path}/run"], 1024)
    text = render_sbatch(target, SlurmOptions(nodes=128, gpus_per_node=8, workdir=str(tmp_path)))
    assert "# actor experts: ep=32 x etp=1 (expert dp 4), 4 of 128 experts per rank and layer" in text
    assert "spans 4 node(s)" in text

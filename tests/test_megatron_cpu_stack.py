"""Megatron-Core subsystems the CPU layer must carry: dist-checkpointing (with
resharding across layouts) and KV-cache inference contexts."""

import pytest
import torch

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank


def _model(tp: int, pp: int = 1, seed: int = 5):
    from hyflow.models.builder import build_gpt_model
    from hyflow.models.description import tiny_llama
    from hyflow.models.weights import load_full_state_dict, random_full_state_dict
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout

    groups = init_training_groups(Layout(tp=tp, pp=pp))
    desc = tiny_llama()
    model = build_gpt_model(desc, groups)
    load_full_state_dict(model, random_full_state_dict(desc, seed=seed), desc, groups)
    return model, desc, groups


def _save(directory: str):
    from megatron.core import dist_checkpointing

    from hyflow.models.weights import gather_full_state_dict

    model, desc, groups = _model(tp=2, seed=5)
    dist_checkpointing.save(model.sharded_state_dict(), directory)
    return gather_full_state_dict(model, desc, groups)


def _load(directory: str, tp: int, pp: int):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from hyflow.models.weights import gather_full_state_dict

    model, desc, groups = _model(tp=tp, pp=pp, seed=99)  # different init, overwritten by the load
    state = dist_checkpointing.load(model.sharded_state_dict(), directory)
    model.load_state_dict(state)
    full = gather_full_state_dict(model, desc, groups)
    return full if dist.get_rank() == 0 else None


@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2)])
def test_dist_checkpoint_saved_at_tp2_loads_at_other_layouts(tmp_path, tp, pp):
    saved = run_on_ranks(_save, 2, str(tmp_path))[0]
    loaded = run_on_ranks(_load, tp * pp, str(tmp_path), tp, pp)[0]
    assert set(saved) == set(loaded)
    for name in saved:
        assert torch.equal(saved[name], loaded[name]), name


def _incremental_vs_full(tp: int):
    from megatron.core.inference.contexts import StaticInferenceContext

    model, desc, _ = _model(tp=tp)
    model.eval()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, desc.vocab_size, (2, 10), generator=g)
    with torch.no_grad():
        full = model(tokens, torch.arange(10).expand(2, 10), None, runtime_gather_output=True)
        ctx = StaticInferenceContext(max_batch_size=2, max_sequence_length=16)
        steps = [model(tokens[:, :6], torch.arange(6).expand(2, 6), None, inference_context=ctx,
                       runtime_gather_output=True)]
        ctx.sequence_len_offset += 6
        for pos in range(6, 10):
            out = model(tokens[:, pos:pos + 1], torch.full((2, 1), pos), None, inference_context=ctx,
                        runtime_gather_output=True)
            ctx.sequence_len_offset += 1
            steps.append(out)
    return full, torch.cat(steps, dim=1)


@pytest.mark.parametrize("tp", [1, 2])
def test_kv_cache_inference_context_matches_full_forward(tp):
    full, incremental = run_on_ranks(_incremental_vs_full, tp, tp)[0]
    # The static context materialises only the last prompt position's logits at prefill,
    # then one position per decode step: positions 5..9.
    assert incremental.shape == (2, 5, full.shape[-1])
    torch.testing.assert_close(incremental, full[:, 5:], rtol=1e-5, atol=1e-5)

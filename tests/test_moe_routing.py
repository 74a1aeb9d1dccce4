"""Routing record and replay on Megatron-Core's routers (hyflow.models.routing_replay), against an
independent reference: transformers' Qwen3-MoE with its routers forced to the same experts.

* Replaying a forward's own recorded routing gives that forward's logits bit for bit.
* Replaying another routing (every token sent to its experts + 3 mod E; the last position left to
  the router) gives transformers' logits when transformers' routers are forced the same way, with
  the probabilities from the current router logits at the forced experts (fp32, <= 1e-5).
* The rollout engine records, for every sample, the experts of each fed token (the prompt and every
  sampled token but the last), as a full forward over the sample routes them.
"""

import pytest
import torch

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank


def _models(tmp: str):
    from safetensors.torch import load_file

    from hyflow.models.builder import build_gpt_model
    from hyflow.models.hf_mapping import description_from_hf_config, hf_to_megatron
    from hyflow.models.weights import load_full_state_dict
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.testing.tiny_models import make_tiny_hf_model

    hf = make_tiny_hf_model(tmp, "qwen3_moe")
    desc = description_from_hf_config(hf.config.to_dict())
    groups = init_training_groups(Layout())
    model = build_gpt_model(desc, groups, config_overrides={"perform_initialization": False})
    load_full_state_dict(model, hf_to_megatron(load_file(f"{tmp}/model.safetensors"), desc), desc, groups)
    return hf, model.eval(), desc


def _forward(model, tokens):
    b, s = tokens.shape
    return model(tokens, torch.arange(s).expand(b, s), None)[..., :300]


def _force_hf(hf, forced: torch.Tensor) -> None:
    """Qwen3-MoE's routers choose ``forced[b, s, layer] - 1`` (their own top-k where forced is 0),
    weighting the chosen experts by the softmax of their router logits (norm_topk_prob)."""
    import torch.nn.functional as F

    for layer, block in enumerate(hf.model.layers):
        gate = block.mlp.gate
        wanted = forced[:, :, layer].reshape(-1, gate.top_k)

        def forward(hidden, gate=gate, wanted=wanted):
            logits = F.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            own = torch.topk(logits, gate.top_k, dim=-1).indices
            choice = torch.where(wanted > 0, wanted - 1, own)
            weights = torch.softmax(logits.float().gather(1, choice), dim=-1).to(logits.dtype)
            return logits, weights, choice

        gate.forward = forward


def _replay_vs_transformers(tmp: str):
    from hyflow.models.routing_replay import recording, replaying, take_recorded

    hf, model, desc = _models(tmp)
    experts = desc.moe.num_experts
    tokens = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    b, s = tokens.shape
    with torch.no_grad():
        with recording(model) as hooks:
            plain = _forward(model, tokens)
            own = take_recorded(hooks)  # [layers, s*b, k]
        own = own.view(own.shape[0], s, b, -1).permute(2, 1, 0, 3).contiguous()  # [b, s, layers, k]
        with replaying(model, own):
            again = _forward(model, tokens)
        forced = ((own.long() - 1 + 3) % experts + 1).to(own.dtype)
        forced[:, -1] = 0  # no record: the router's own choice
        with replaying(model, forced):
            replayed = _forward(model, tokens)
        _force_hf(hf, forced.long())
        reference = hf(tokens).logits
    return dict(bit_exact=torch.equal(plain, again), own=own, plain=plain, replayed=replayed, reference=reference)


def test_replay_matches_transformers_forced_to_the_same_experts(tmp_path):
    pytest.importorskip("transformers")
    r = run_on_ranks(_replay_vs_transformers, 1, str(tmp_path / "hf"))[0]
    assert r["bit_exact"]
    assert r["own"].shape == (2, 11, 4, 2) and int(r["own"].min()) >= 1
    err = ((r["replayed"] - r["reference"]).abs().max() / r["reference"].abs().max()).item()
    assert err <= 1e-5, err
    moved = ((r["replayed"] - r["plain"]).abs().max() / r["plain"].abs().max()).item()
    assert moved > 1e-2, moved  # the forced experts change the outputs: the replay is not a no-op


def _rollout_records(tmp: str):
    from hyflow.models.routing_replay import recording, take_recorded
    from hyflow.rollout.config import GenerationConfig, SamplingConfig
    from hyflow.rollout.engine import GenerationEngine

    _, model, desc = _models(tmp)
    engine = GenerationEngine(model, GenerationConfig(
        sampling=SamplingConfig(max_new_tokens=5, temperature=1.0, n=2, seed=3), record_routing=True,
        max_seq_len=64, max_prefill_tokens=16), vocab_size=300)
    result = engine.generate([[5, 9, 2, 7], [11, 3, 3, 8, 1, 4, 6]])
    out = []
    for sample in result.samples:
        seq = torch.tensor([sample.prompt_ids + sample.token_ids])
        with torch.no_grad(), recording(model) as hooks:
            _forward(model, seq)
            full = take_recorded(hooks)[:, :, None].transpose(0, 1)[:, :, 0]  # [tokens, layers, k]
        out.append((len(sample.prompt_ids), len(sample.token_ids), sample.routing, full))
    return out


def test_rollout_records_every_fed_token(tmp_path):
    pytest.importorskip("transformers")
    samples = run_on_ranks(_rollout_records, 1, str(tmp_path / "hf"))[0]
    assert len(samples) == 4
    same = total = 0
    for prompt, response, routing, full in samples:
        assert routing.shape == (prompt + response - 1, 4, 2)  # the last sampled token is never fed
        fed = full[:prompt + response - 1]
        # the KV-cache forward routes like the full one (as sets: top-k order may differ on ties)
        same += int((routing.sort(-1).values == fed.sort(-1).values).all(-1).sum())
        total += fed.shape[0] * fed.shape[1]
    assert same >= 0.99 * total, (same, total)

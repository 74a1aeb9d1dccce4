"""DPO (sigmoid, cDPO, IPO, hinge, reference-free) and KTO losses and gradients against float64
references written here from the papers' formulas (issue #17):

* on random sequence log-probs, with the gradients derived by hand;
* on a real step of the job on a tiny Megatron model (one rank): the step's loss, rewards and the
  parameters' gradients equal the formula applied in float64 to the model's logits.

DPO (Rafailov et al. 2023, eq. 7): l = -log sigmoid(beta * h), h = (log pi(y_w) - log ref(y_w)) -
(log pi(y_l) - log ref(y_l)); RPO (Pang et al. 2024): DPO's l - alpha * log pi(y_w) / |y_w|; cDPO: -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h); IPO (Azar
et al. 2023, eq. 17): (h - 1 / (2 beta))^2; SLiC hinge: max(0, 1 - beta h). KTO (Ethayarajh et
al. 2024, eq. 8): l = lambda_y - v, v = lambda_D sigmoid(beta (r - z0)) for desirable and
lambda_U sigmoid(beta (z0 - r)) for undesirable y, r = log pi(y) - log ref(y), z0 = max(0, mean
over mismatched pairs of log pi(y'|x) - log ref(y'|x)), no gradient through z0.
"""
from __future__ import annotations

import math

import pytest
import torch

from hyflow.algorithms import dpo_loss, kto_loss
from hyflow.testing import run_on_ranks

F64 = torch.float64


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def dpo_reference(h: float, beta: float, kind: str, eps: float) -> tuple[float, float]:
    """(loss, d loss / d h) of one pair."""
    if kind == "sigmoid":
        loss = -(1 - eps) * math.log(sig(beta * h)) - eps * math.log(sig(-beta * h))
        return loss, -(1 - eps) * beta * (1 - sig(beta * h)) + eps * beta * (1 - sig(-beta * h))
    if kind == "ipo":
        return (h - 1 / (2 * beta)) ** 2, 2 * (h - 1 / (2 * beta))
    return max(0.0, 1 - beta * h), (-beta if 1 - beta * h > 0 else 0.0)


@pytest.mark.parametrize("kind,eps,ref_free", [("sigmoid", 0.0, False), ("sigmoid", 0.2, False), ("ipo", 0.0, False),
                                               ("hinge", 0.0, False), ("sigmoid", 0.0, True)])
def test_dpo_loss_and_gradients_on_random_logprobs(kind, eps, ref_free):
    gen = torch.Generator().manual_seed(7)
    n, beta = 16, 0.3
    pc, pr = (-20 * torch.rand(n, generator=gen, dtype=F64)).requires_grad_(), \
        (-20 * torch.rand(n, generator=gen, dtype=F64)).requires_grad_()
    rc, rr = -20 * torch.rand(n, generator=gen, dtype=F64), -20 * torch.rand(n, generator=gen, dtype=F64)
    if ref_free:
        rc, rr = torch.zeros(n, dtype=F64), torch.zeros(n, dtype=F64)
    loss, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=eps, kind=kind)
    loss.backward()
    want_loss, want_grad = 0.0, []
    for i in range(n):
        h = (pc[i].item() - rc[i].item()) - (pr[i].item() - rr[i].item())
        value, grad = dpo_reference(h, beta, kind, eps)
        want_loss += value / n
        want_grad.append(grad / n)
    assert loss.item() == pytest.approx(want_loss, rel=1e-12, abs=1e-14)
    torch.testing.assert_close(pc.grad, torch.tensor(want_grad, dtype=F64), rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(pr.grad, -torch.tensor(want_grad, dtype=F64), rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(chosen, beta * (pc.detach() - rc))
    torch.testing.assert_close(rejected, beta * (pr.detach() - rr))


def test_rpo_adds_alpha_times_the_chosen_token_mean_nll_with_its_gradient():
    """RPO (Pang et al. 2024, eq. 2): l = DPO loss - alpha * log pi(y_w) / |y_w| per pair; d/d log pi(y_w)
    gains -alpha / |y_w|, the rejected gradient is DPO's; the job's sum * 1/global pairs is the mean."""
    from hyflow.jobs.preference_losses import chosen_nll, loss_scale

    gen = torch.Generator().manual_seed(11)
    n, beta, alpha = 10, 0.1, 1.5
    pc, pr = (-20 * torch.rand(n, generator=gen, dtype=F64)).requires_grad_(), \
        (-20 * torch.rand(n, generator=gen, dtype=F64)).requires_grad_()
    rc, rr = -20 * torch.rand(n, generator=gen, dtype=F64), -20 * torch.rand(n, generator=gen, dtype=F64)
    tokens = torch.randint(1, 9, (n,), generator=gen)
    dpo, _, _ = dpo_loss(pc, pr, rc, rr, beta=beta, kind="sigmoid", reduction="none")
    # the job's reduction: two "ranks" of 5 pairs, each summing its pairs' losses * 1/global pairs
    halves = [slice(0, 5), slice(5, 10)]
    total = sum(((dpo[h] + alpha * chosen_nll(pc[h], tokens[h])).sum() * loss_scale(n)) for h in halves)
    total.backward()
    want_loss, want_c, want_r = 0.0, [], []
    for i in range(n):
        h = (pc[i].item() - rc[i].item()) - (pr[i].item() - rr[i].item())
        value, grad = dpo_reference(h, beta, "sigmoid", 0.0)
        nll = -pc[i].item() / int(tokens[i])
        want_loss += (value + alpha * nll) / n
        want_c.append((grad - alpha / int(tokens[i])) / n)
        want_r.append(-grad / n)
    assert total.item() == pytest.approx(want_loss, rel=1e-12)
    torch.testing.assert_close(pc.grad, torch.tensor(want_c, dtype=F64), rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(pr.grad, torch.tensor(want_r, dtype=F64), rtol=1e-10, atol=1e-14)
    # an empty chosen response contributes no NLL (and no division by zero)
    assert chosen_nll(torch.zeros(1, dtype=F64), torch.zeros(1, dtype=torch.long)).item() == 0.0


def test_kto_loss_and_gradients_on_random_logprobs():
    gen = torch.Generator().manual_seed(8)
    n, beta, wd, wu = 12, 0.25, 1.0, 1.33
    policy = (-10 * torch.rand(n, generator=gen, dtype=F64)).requires_grad_()
    ref = -10 * torch.rand(n, generator=gen, dtype=F64)
    desirable = torch.rand(n, generator=gen) > 0.5
    pol_kl, ref_kl = -10 * torch.rand(n, generator=gen, dtype=F64), -10 * torch.rand(n, generator=gen, dtype=F64)
    z0_value = max(0.0, sum(pol_kl[i].item() - ref_kl[i].item() for i in range(n)) / n)
    z0 = torch.tensor(z0_value, dtype=F64, requires_grad=True)
    loss = kto_loss(policy, ref, desirable, z0, beta=beta, desirable_weight=wd, undesirable_weight=wu)
    loss.backward()
    want_loss, want_grad = 0.0, []
    for i in range(n):
        r = policy[i].item() - ref[i].item()
        if desirable[i]:
            s = sig(beta * (r - z0_value))
            want_loss += wd * (1 - s) / n
            want_grad.append(-wd * beta * s * (1 - s) / n)
        else:
            s = sig(beta * (z0_value - r))
            want_loss += wu * (1 - s) / n
            want_grad.append(wu * beta * s * (1 - s) / n)
    assert loss.item() == pytest.approx(want_loss, rel=1e-12)
    torch.testing.assert_close(policy.grad, torch.tensor(want_grad, dtype=F64), rtol=1e-10, atol=1e-14)
    assert z0.grad is None  # the reference point is a constant of the loss
    # a negative KL estimate is clamped to 0
    low = kto_loss(policy.detach(), ref, desirable, torch.tensor(-3.0, dtype=F64), beta=beta)
    assert low.item() == pytest.approx(kto_loss(policy.detach(), ref, desirable, torch.tensor(0.0, dtype=F64),
                                                beta=beta).item(), rel=1e-14)


# ----------------------------------------------------------------------------- a real step


def _seq_logps64(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, vocab: int) -> torch.Tensor:
    logp = torch.log_softmax(logits[..., :vocab].double(), dim=-1)
    picked = logp[:, :-1].gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (picked * mask[:, 1:].double()).sum(-1)


def _dpo64(pol: torch.Tensor, ref: torch.Tensor, algo) -> torch.Tensor:
    beta, eps = algo.beta, algo.label_smoothing
    h = (pol[:, 0] - ref[:, 0]) - (pol[:, 1] - ref[:, 1])
    if algo.loss_type == "sigmoid":
        return -(1 - eps) * torch.log(torch.sigmoid(beta * h)) - eps * torch.log(torch.sigmoid(-beta * h))
    if algo.loss_type == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    return torch.clamp(1 - beta * h, min=0)


def _kto64(pol, ref, desirable, z0, algo) -> torch.Tensor:
    r = pol - ref
    return torch.where(desirable, algo.desirable_weight * (1 - torch.sigmoid(algo.beta * (r - z0))),
                       algo.undesirable_weight * (1 - torch.sigmoid(algo.beta * (z0 - r))))


def _real_step(job: str, cases: list) -> list:
    """One rank: for each case (algorithm overrides), perturb the policy away from the reference,
    compute the float64 reference loss / rewards / gradients from the model's logits, then run the
    job's step on the same weights and return both."""
    import hyflow.jobs.dpo as job_module
    from hyflow.config import apply_overrides, from_dict, to_dict
    from hyflow.data.preference import build_preference_dataset, sequence_tensors
    from hyflow.data.tasks import load_data_tokenizer
    from hyflow.jobs.preference_config import DPOJobConfig, KTOJobConfig
    from hyflow.jobs.preference_models import ReferenceLogps, build_policy, build_reference_model
    from hyflow.monitor.timers import PhaseTimers

    schema = DPOJobConfig if job == "dpo" else KTOJobConfig
    base = to_dict(schema())
    base.update(model=dict(base["model"], vocab_size=128, hidden_size=32, num_layers=2, ffn_hidden_size=64,
                           max_position_embeddings=32))
    base["data"].update(task="pref_digit_add", task_size=40, train_batch_size=6, max_prompt_length=16,
                        max_completion_length=8)
    base["actor"].update(micro_batch_size=2, optim=dict(base["actor"]["optim"], clip_grad=0.0, lr=1e-3))
    base["trainer"].update(nproc=1, total_steps=1)
    cfg = from_dict(schema, base)
    tok = load_data_tokenizer(cfg.data)
    dataset = build_preference_dataset(cfg.data, tok, job)
    records = [dataset[i] for i in range(6)]
    policy = build_policy(cfg, tok)
    frozen = build_reference_model(cfg, policy)
    chunk = policy.chunks[0]
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # move the policy away from the reference, so h and r are not all 0
        for p in chunk.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    vocab = policy.vocab_size
    if job == "kto":  # make the KL estimate positive (z0 > 0): swap the models when it is not
        kl = sequence_tensors([(r.prompt_ids, r.kl_completion_ids) for r in records], 0, "cpu")
        with torch.no_grad():
            diff = _seq_logps64(chunk(kl["tokens"], kl["position_ids"], None), kl["tokens"], kl["completion_mask"],
                                vocab) - _seq_logps64(frozen(kl["tokens"], kl["position_ids"], None), kl["tokens"],
                                                      kl["completion_mask"], vocab)
            if diff.mean() <= 0:
                for p, q in zip(chunk.parameters(), frozen.parameters()):
                    tmp = p.detach().clone()
                    p.copy_(q)
                    q.copy_(tmp)
    start = [p.detach().clone() for p in chunk.parameters()]
    results, base_dict = [], to_dict(cfg)
    for overrides in cases:
        cfg = from_dict(schema, apply_overrides(base_dict, overrides, schema))
        with torch.no_grad():
            for p, p0 in zip(chunk.parameters(), start):
                p.copy_(p0)
        ref_free = getattr(cfg.algorithm, "reference_free", False)
        # float64 reference from the model's own logits (gradients into the DDP buffers, as the step's)
        chunk.zero_grad_buffer()
        policy.optimizer.zero_grad()  # the previous case's step left .grad aliased to the buffers
        if job == "dpo":
            t = sequence_tensors([s for r in records for s in r.sequences()], 0, "cpu")
        else:
            t = sequence_tensors([(r.prompt_ids, r.completion_ids) for r in records], 0, "cpu")
            kl = sequence_tensors([(r.prompt_ids, r.kl_completion_ids) for r in records], 0, "cpu")
        with torch.no_grad():
            ref = torch.zeros(t["tokens"].shape[0], dtype=F64) if ref_free else \
                _seq_logps64(frozen(t["tokens"], t["position_ids"], None), t["tokens"], t["completion_mask"], vocab)
        pol = _seq_logps64(chunk(t["tokens"], t["position_ids"], None), t["tokens"], t["completion_mask"], vocab)
        if job == "dpo":
            pol2, ref2 = pol.view(-1, 2), ref.view(-1, 2)
            # RPO's term: the chosen response's token-mean NLL, its length counted from the records
            chosen_len = torch.tensor([len(r.chosen_ids) for r in records], dtype=F64)
            nll = -pol2[:, 0] / chosen_len
            losses = _dpo64(pol2, ref2, cfg.algorithm) + cfg.algorithm.rpo_alpha * nll
            chosen, rejected = cfg.algorithm.beta * (pol2[:, 0] - ref2[:, 0]), cfg.algorithm.beta * (pol2[:, 1] - ref2[:, 1])
            want = {"loss": losses.mean(), "rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
                    "rewards/margins": (chosen - rejected).mean(), "rewards/accuracies": (chosen > rejected).double().mean(),
                    "logps/chosen": pol2[:, 0].mean(), "logps/rejected": pol2[:, 1].mean(), "nll_loss": nll.mean()}
        else:
            with torch.no_grad():
                pol_kl = _seq_logps64(chunk(kl["tokens"], kl["position_ids"], None), kl["tokens"], kl["completion_mask"], vocab)
                ref_kl = _seq_logps64(frozen(kl["tokens"], kl["position_ids"], None), kl["tokens"], kl["completion_mask"], vocab)
                z0 = torch.clamp((pol_kl - ref_kl).mean(), min=0)
            desirable = torch.tensor([r.label for r in records])
            losses = _kto64(pol, ref, desirable, z0, cfg.algorithm)
            rewards = cfg.algorithm.beta * (pol - ref)
            want = {"loss": losses.mean(), "kl": z0, "rewards/chosen": rewards[desirable].mean(),
                    "rewards/rejected": rewards[~desirable].mean(), "logps/chosen": pol[desirable].mean()}
        losses.mean().backward()
        want_grads = [p.main_grad.detach().clone() for p in chunk.parameters()]
        # the job's step (its micro-batches: 3 pairs / examples of 2, through Megatron's schedule)
        chunk.zero_grad_buffer()
        reference = ReferenceLogps(free=True) if ref_free else ReferenceLogps(model=frozen)
        step = job_module.dpo_step if job == "dpo" else job_module.kto_step
        got = step(cfg, policy, reference, records, PhaseTimers(phases=("ref", "kl", "update")))
        got_grads = [p.main_grad.detach().clone() for p in chunk.parameters()]
        results.append(({k: float(v.detach()) for k, v in want.items()}, got, want_grads, got_grads))
    return results


def _check(results):
    for want, got, want_grads, got_grads in results:
        for key, value in want.items():
            # the step sums float32 log-probs of ~-20 per sequence: ~1e-5 absolute from the float64 sums
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key
        assert any(float(g.abs().max()) > 0 for g in want_grads)
        for w, g in zip(want_grads, got_grads):
            torch.testing.assert_close(g, w.float(), rtol=1e-4, atol=1e-6)


def test_dpo_step_on_a_tiny_model_equals_the_float64_formula():
    cases = [["algorithm.loss_type=sigmoid", "algorithm.beta=0.5"],
             ["algorithm.loss_type=sigmoid", "algorithm.label_smoothing=0.2"],
             ["algorithm.loss_type=ipo", "algorithm.beta=0.5"],
             ["algorithm.loss_type=hinge", "algorithm.beta=2.0"],
             ["algorithm.loss_type=sigmoid", "algorithm.reference_free=true", "algorithm.beta=0.1"],
             ["algorithm.loss_type=sigmoid", "algorithm.beta=0.1", "algorithm.rpo_alpha=2.0"]]
    results = run_on_ranks(_real_step, 1, "dpo", cases, timeout=600)[0]
    _check(results)
    assert len({round(r[0]["loss"], 6) for r in results}) == len(cases)


def test_kto_step_on_a_tiny_model_equals_the_float64_formula():
    results = run_on_ranks(_real_step, 1, "kto", [["algorithm.beta=0.5", "algorithm.undesirable_weight=1.33"]],
                           timeout=600)[0]
    _check(results)
    assert results[0][0]["kl"] > 0  # the perturbed policy has a positive KL estimate: z0 is exercised

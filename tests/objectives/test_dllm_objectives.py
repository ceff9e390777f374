"""The diffusion-LLM objectives' losses against the special cases their papers name: StableDRL is GRPO when nothing
is clipped and the group is exactly normalised, EGSPO's per-step gradient is the exact one (every trajectory of a
tiny model enumerated), LightningRL's filter and NLL."""

from __future__ import annotations

import itertools

import pytest
import torch

from gyremedia.interfaces import BuildContext
from gyremedia.objectives.clipped_ratio import clipped_ratio_loss
from gyremedia.objectives.egspo import egspo_loss, entropy_guided_steps
from gyremedia.objectives.lightning_rl import kept_groups
from gyremedia.objectives.stable_drl import stable_drl_loss
from gyremedia.plugins import PluginManager
from gyremedia.rollout import Rollout


def test_stable_drl_is_grpos_sequence_loss_when_nothing_is_clipped_and_each_group_sums_to_its_size():
    log_ratio = torch.log(torch.tensor([1.1, 0.9, 1.05, 0.95])).requires_grad_()  # each pair sums to 2
    advantages, groups = torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.tensor([0, 0, 1, 1])
    stable, _ = stable_drl_loss(log_ratio, advantages, groups, 0.2, 0.2)
    grpo = clipped_ratio_loss(log_ratio, advantages, 0.2, 0.2)[0].mean()
    torch.testing.assert_close(stable, grpo)
    (stable_grad,) = torch.autograd.grad(stable, log_ratio)
    (grpo_grad,) = torch.autograd.grad(grpo, log_ratio)
    torch.testing.assert_close(stable_grad, grpo_grad)


def test_stable_drl_clips_an_outlier_ratio_whatever_its_advantage_and_stays_in_the_convex_hull():
    """A ratio the estimator's noise threw to 50 with A < 0 passes GRPO's conditional clip (a gradient of 50 A);
    StableDRL's unconditional clip gives it none, and its weights on the others sum to at most 1."""
    log_ratio = torch.log(torch.tensor([50.0, 1.0, 1.1, 0.7])).requires_grad_()
    advantages, groups = torch.tensor([-1.0, 1.0, 1.0, -1.0]), torch.zeros(4, dtype=torch.long)
    (grpo_grad,) = torch.autograd.grad(clipped_ratio_loss(log_ratio, advantages, 0.2, 0.2)[0].mean(), log_ratio)
    assert grpo_grad[0] == pytest.approx(50 / 4)  # the spike
    loss, clipped = stable_drl_loss(log_ratio, advantages, groups, 0.2, 0.2)
    (grad,) = torch.autograd.grad(loss, log_ratio)
    assert grad[0] == 0 and grad[3] == 0  # both outside [0.8, 1.2]
    weights = -grad / advantages  # d loss / d log r_b = -w_b A_b
    assert (weights >= 0).all() and weights.sum() <= 1
    torch.testing.assert_close(weights[1:3], torch.tensor([1.0, 1.1]) / clipped.sum())


def test_egspo_per_step_gradient_is_the_exact_policy_gradient(make_dllm_config):
    """Every trajectory of a 2-token completion decoded in 2 steps in random order: sum_tau p(tau) sum_k (R - b(s_k))
    grad log pi(a_k | s_k) equals grad sum_tau p(tau) R(tau) for any state baseline b."""
    config = make_dllm_config("backbone.max_new_tokens=2", "backbone.remasking=random")
    policy = PluginManager().build(config.backbone, BuildContext(device=torch.device("cpu")))
    mask_id = policy.tokenizer.mask_token_id
    vocabulary = [t for t in range(len(policy.tokenizer)) if t != mask_id]
    trajectories = list(itertools.product([(0, 1), (1, 0)], vocabulary, vocabulary))
    prompt = torch.tensor(policy.tokenizer("12+3=", add_special_tokens=False).input_ids)
    rollout = Rollout(
        prompts=["12+3="] * len(trajectories),
        sample_ids=torch.arange(len(trajectories)),
        group_ids=torch.zeros(len(trajectories), dtype=torch.long),
        conditions={
            "prompt_mask": torch.ones(len(trajectories), len(prompt), dtype=torch.long),
            "order": torch.tensor([order for order, _, _ in trajectories]),
        },
        states=torch.stack([torch.cat([prompt, torch.tensor([a, b])]) for _, a, b in trajectories]),
        prompt_length=len(prompt),
    )
    steps = policy.step_log_probs(rollout, [0, 1])  # [N, 2], with gradients
    probability = 0.5 * steps.sum(-1).exp()  # the order is drawn uniformly, independent of the policy
    assert probability.sum().item() == pytest.approx(1.0, abs=1e-5)
    tokens = rollout.states[:, -2:].float()
    reward = (tokens[:, 0] == tokens[:, 1]).float() + 0.1 * tokens[:, 0] - 0.05 * tokens[:, 1]
    first = rollout.states[:, -2:].gather(1, rollout.conditions["order"].argmin(-1, keepdim=True))[:, 0]
    baseline = torch.stack([torch.full_like(reward, 0.7), 0.2 * first.float()], dim=1)  # b(s_0), b(s_1)
    parameters = [p for p in policy.transformer.parameters() if p.requires_grad]
    exact = torch.autograd.grad((probability * reward).sum(), parameters, retain_graph=True)
    per_sample, _ = egspo_loss(
        steps - steps.detach(), reward[:, None] - baseline, torch.ones_like(steps, dtype=torch.bool), 0.2, 0.2
    )
    estimated = torch.autograd.grad(-(probability.detach() * per_sample).sum(), parameters)
    for e, x in zip(estimated, exact):
        torch.testing.assert_close(e, x, atol=1e-6, rtol=1e-4)
    assert max(x.abs().max() for x in exact) > 1e-3  # the gradient compared is not zero


def test_entropy_guided_steps_keep_each_samples_most_uncertain_taken_steps():
    entropy = torch.tensor([[0.1, 0.9, 0.5, 0.7], [0.8, 0.2, 0.6, 0.1]])
    taken = torch.tensor([[True, True, True, True], [True, False, True, True]])
    chosen = entropy_guided_steps(entropy, taken, 2)
    assert chosen.tolist() == [[False, True, False, True], [True, False, True, False]]
    assert torch.equal(entropy_guided_steps(entropy, taken, 0), taken)


def test_egspo_trains_a_masked_diffusion_policy_on_policy(make_dllm_config):
    from gyremedia.trainer import Trainer

    # a weight-0 reward that reads the whole decoding is logged, not asked to score one-step predictions
    rewards = "rewards=[{name: format, pattern: '^[0-9][0-9]', mode: search}, {name: tokens_per_forward, weight: 0}]"
    config = make_dllm_config("objective.name=egspo", "objective.steps_per_update=2", "train.steps=1", rewards)
    metrics = Trainer(config, PluginManager()).train().last_metrics
    assert metrics["ratio"] == 1.0 and metrics["clip_fraction"] == 0.0 and metrics["trained_steps"] == 2.0
    assert metrics["grad_norm"] > 0


def test_lightning_rl_filters_all_wrong_and_signal_free_groups():
    correct = torch.tensor([1, 0, 0, 0, 1, 1, 1, 1], dtype=torch.bool)
    speed = torch.tensor([1.0, 2.0, 1.0, 2.0, 1.0, 3.0, 2.0, 2.0])
    rewards = torch.stack([correct.float(), speed], dim=1)
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    # mixed correctness trains; all wrong (only speed varies) does not; all correct trains when speed varies
    assert kept_groups(correct, rewards, groups).tolist() == [True, True, False, False, True, True, False, False]


@pytest.mark.parametrize("objective", ["stable_drl", "lightning_rl"])
def test_the_sequence_objectives_train_a_masked_diffusion_policy_on_policy(make_dllm_config, objective):
    from gyremedia.trainer import Trainer

    overrides = [f"objective.name={objective}", "train.steps=1", "backbone.likelihood=mean_field"]
    if objective == "lightning_rl":
        overrides += [
            "advantage.combine=normalize_each",
            "rewards=[{name: format, pattern: '^[0-9][0-9]', mode: search}, {name: tokens_per_forward}]",
            "objective.correct_threshold=1",
        ]
    metrics = Trainer(make_dllm_config(*overrides), PluginManager()).train().last_metrics
    assert metrics["ratio"] == 1.0 and metrics["clip_fraction"] == 0.0 and metrics["grad_norm"] > 0

"""The masked-diffusion token policy (masked_diffusion_lm) through the same core: decoding by unmasking, replayed
step log-probs, on-policy ratios, the likelihood proxies, export, and the config's refusals."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
import torch

from gyremedia.backbones.masked_diffusion_lm import attention_mask, transfer_counts
from gyremedia.config import ConfigError
from gyremedia.interfaces import BuildContext, RolloutRequest
from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer

PROMPTS = ["1+2=", "123+456=", "7+8=", "99+1=", "5+5=", "321+9="]  # left padding: prompts of 4 to 8 tokens


def backbone(make_dllm_config, *overrides: str):
    config = make_dllm_config(*overrides)
    return PluginManager().build(config.backbone, BuildContext(device=torch.device("cpu")))


def request(prompts: list[str], step: int = 0, ids: list[int] | None = None) -> RolloutRequest:
    sample_ids = torch.tensor(ids if ids is not None else range(len(prompts)))
    return RolloutRequest(
        step=step, seed=0, prompts=prompts, sample_ids=sample_ids, group_ids=sample_ids // 2, chunks=1, settings=None
    )


DECODINGS = {
    "one token a step, most confident first": [],
    "random order": ["backbone.remasking=random"],
    "two blocks, staircase attention": ["backbone.block_length=2", "backbone.steps=2", "backbone.attention=staircase"],
    "parallel above a confidence threshold": ["backbone.confidence_threshold=0.07"],
}


@pytest.mark.parametrize("decoding", DECODINGS)
def test_replayed_step_log_probs_equal_the_rollouts(make_dllm_config, decoding):
    policy = backbone(make_dllm_config, *DECODINGS[decoding])
    rollout = policy.collect_rollout(request(PROMPTS))
    order = rollout.conditions["order"]
    assert (order >= 0).all() and rollout.log_probs.lt(0).all()  # every position committed, by a sampled token
    with torch.no_grad():
        replayed = policy.token_log_probs(rollout)
        steps = list(range(int(order.max()) + 1))
        per_step = policy.step_log_probs(rollout, steps)
    torch.testing.assert_close(replayed, rollout.log_probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(per_step.sum(-1), rollout.log_probs.sum(-1), atol=1e-5, rtol=0)
    # a sample's tokens depend on its id alone: the same ids in another batch decode the same
    again = policy.collect_rollout(request(PROMPTS[::-1], ids=list(range(len(PROMPTS)))[::-1]))
    assert policy.media(again).data == policy.media(rollout).data[::-1]
    assert policy.media(policy.collect_rollout(request(PROMPTS, step=1))).data != policy.media(rollout).data


def test_the_schedule_commits_each_block_in_its_steps_and_a_threshold_commits_in_parallel(make_dllm_config):
    assert transfer_counts(8, 4, 2) == [[2, 2], [2, 2]] and transfer_counts(5, 2, 1) == [[3, 2]]
    blocks = backbone(make_dllm_config, "backbone.block_length=2", "backbone.steps=2")
    order = blocks.collect_rollout(request(PROMPTS)).conditions["order"]
    assert (order[:, :2] == 0).all() and (order[:, 2:] == 1).all()
    # the tiny random model is about 1/15 sure of every token: a threshold below that commits a block at once
    parallel = backbone(make_dllm_config, "backbone.confidence_threshold=0.01")
    rollout = parallel.collect_rollout(request(PROMPTS))
    assert rollout.metrics["tokens_per_forward"] == 4.0 and rollout.metrics["forwards"] == 1.0
    assert (parallel.media(rollout).meta["tokens_per_forward"] == 4.0).all()


def test_staircase_attention_hides_later_blocks(make_dllm_config):
    mask = attention_mask(torch.tensor([[0, 1, 1]]), 4, 2, staircase=True)[0, 0]
    assert mask.shape == (7, 7) and not mask[:, 0].any()  # padding is never seen
    assert mask[3, :5].tolist() == [False, True, True, True, True] and not mask[3, 5:].any()
    assert mask[1, 3:].sum() == 0 and mask[6, 1:].all()  # the prompt sees itself; the last block everything
    policy = backbone(make_dllm_config, "backbone.block_length=2", "backbone.attention=staircase")
    ids, prompt_mask = policy._tokenize(PROMPTS)
    logits = policy._logits_fn(ids, prompt_mask)
    with torch.no_grad():
        first = logits(torch.tensor([[3, 4, 5, 6]] * len(PROMPTS)))
        later_changed = logits(torch.tensor([[3, 4, 7, 8]] * len(PROMPTS)))
    torch.testing.assert_close(first[:, :2], later_changed[:, :2])
    assert not torch.allclose(first[:, 2:], later_changed[:, 2:])


@pytest.mark.parametrize("likelihood", ["trajectory", "mean_field", "elbo"])
def test_the_first_update_is_on_policy_exactly_under_every_likelihood(make_dllm_config, likelihood):
    config = make_dllm_config(f"backbone.likelihood={likelihood}", "objective.kl_beta=0.1", "train.steps=1")
    metrics = Trainer(config, PluginManager()).train().last_metrics
    assert metrics["ratio"] == 1.0 and metrics["approx_kl"] == 0.0 and metrics["clip_fraction"] == 0.0
    assert metrics["token_kl/kl"] == 0.0 and metrics["grad_norm"] > 0
    assert metrics["tokens_per_forward"] == 1.0


def test_the_likelihood_proxies(make_dllm_config):
    rollout = None
    values = {}
    for likelihood in ("trajectory", "mean_field", "elbo"):
        policy = backbone(make_dllm_config, f"backbone.likelihood={likelihood}", "backbone.elbo_samples=3")
        rollout = policy.collect_rollout(request(PROMPTS))
        with torch.no_grad():
            values[likelihood] = policy.token_log_probs(rollout)
        assert values[likelihood].shape == rollout.log_probs.shape and values[likelihood].isfinite().all()
    masks = rollout.conditions["elbo_masks"]
    assert masks.shape == (len(PROMPTS), 3, 4) and masks.any(-1).all()  # no empty mask
    # the mean-field proxy reads every token with the whole completion masked: the first step's distribution
    assert not torch.allclose(values["mean_field"], values["trajectory"])
    first = rollout.conditions["order"] == 0
    torch.testing.assert_close(values["mean_field"][first], values["trajectory"][first], atol=1e-5, rtol=0)


def test_export_loads_in_plain_transformers_and_its_readme_loop_decodes_as_the_policy(make_dllm_config, tmp_path):
    from transformers import AutoModelForMaskedLM

    policy = backbone(make_dllm_config, "backbone.lora.enabled=true")
    with torch.no_grad():
        for p in policy.transformer.parameters():
            if p.requires_grad:
                p.add_(0.05)  # adapters that change the decoding
    policy.save_pretrained(tmp_path / "export")
    assert isinstance(AutoModelForMaskedLM.from_pretrained(tmp_path / "export"), torch.nn.Module)
    readme = (tmp_path / "export" / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code, {})
    assert printed.getvalue().strip() == policy.generate(["47+385="], seed=0).media.data[0]


def test_a_masked_diffusion_policy_refuses_what_it_cannot_do(make_dllm_config, make_llm_config, tiny_lm):
    with pytest.raises(ConfigError, match="sampler"):
        make_dllm_config("sampler.name=ode")
    with pytest.raises(ConfigError, match="egspo"):
        make_llm_config("objective.name=egspo")
    with pytest.raises(ConfigError, match="advantage.combine=normalize_each"):
        make_dllm_config("objective.name=lightning_rl")
    with pytest.raises(ConfigError, match="block_length"):
        make_dllm_config("backbone.block_length=3")
    with pytest.raises(ValueError, match="mask token"):
        backbone(make_dllm_config, f"backbone.pretrained={tiny_lm}")


def test_replayed_steps_go_through_together_within_the_logits_budget(make_dllm_config, monkeypatch):
    """The steps' states share forwards; a budget that holds one state's logits replays them one at a time, with
    the same log-probs and gradients."""
    from gyremedia.backbones import masked_diffusion_lm

    policy = backbone(make_dllm_config)
    rollout = policy.collect_rollout(request(PROMPTS))
    calls = []
    policy.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )

    def replay() -> tuple[torch.Tensor, torch.Tensor]:
        policy.transformer.zero_grad()
        log_probs = policy.token_log_probs(rollout)
        log_probs.sum().backward()
        return log_probs.detach(), policy.transformer.bert.embeddings.word_embeddings.weight.grad.clone()

    together = replay()
    assert calls == [4 * len(PROMPTS)]  # 4 steps' states in one forward
    calls.clear()
    monkeypatch.setattr(masked_diffusion_lm, "LOGITS_PER_CHUNK", 1)
    one_by_one = replay()
    assert calls == [len(PROMPTS)] * 4
    torch.testing.assert_close(together[0], one_by_one[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(together[1], one_by_one[1], atol=1e-5, rtol=1e-4)

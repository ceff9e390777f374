"""The token policy (causal_lm) through the same core: rollouts, replayed log-probs, on-policy ratios,
the k3 KL, export, and the config's refusals."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from compile_checks import train_eager_and_compiled
from gyremedia.config import ConfigError
from gyremedia.interfaces import BuildContext, RolloutRequest
from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer


def backbone(make_llm_config, *overrides: str):
    config = make_llm_config(*overrides)
    return PluginManager().build(config.backbone, BuildContext(device=torch.device("cpu")))


def request(prompts: list[str], chunks: int = 1, step: int = 0) -> RolloutRequest:
    ids = torch.arange(len(prompts))
    return RolloutRequest(
        step=step, seed=0, prompts=prompts, sample_ids=ids, group_ids=ids // 2, chunks=chunks, settings=None
    )


PROMPTS = ["1+2=", "123+456=", "7+8=", "99+1=", "5+5=", "321+9="]  # left padding: prompts of 4 to 8 tokens


def test_replayed_log_probs_equal_the_rollouts_with_left_padding_and_mixed_lengths(make_llm_config):
    policy = backbone(make_llm_config)
    rollout = policy.collect_rollout(request(PROMPTS, chunks=2), None)
    lengths = rollout.mask.sum(-1)
    assert rollout.conditions["prompt_mask"].sum(-1).unique().numel() > 1  # the prompts were padded
    assert lengths.unique().numel() > 1  # some completions ended early, others ran to max_new_tokens
    with torch.no_grad():
        replayed = policy.token_log_probs(rollout)
    torch.testing.assert_close(replayed, rollout.log_probs * rollout.mask, atol=1e-5, rtol=0)
    assert (rollout.log_probs[~rollout.mask] == 0).all()
    # the same request samples the same completions; another step, others
    assert torch.equal(policy.collect_rollout(request(PROMPTS, chunks=2), None).states, rollout.states)
    assert not torch.equal(policy.collect_rollout(request(PROMPTS, chunks=2, step=1), None).states, rollout.states)


def test_each_samples_tokens_depend_on_its_id_alone(make_llm_config):
    policy = backbone(make_llm_config)
    whole = policy.collect_rollout(request(PROMPTS), None)
    halves = policy.collect_rollout(request(PROMPTS, chunks=3), None)
    assert policy.media(whole).data == policy.media(halves).data


def test_top_k_sampling_stays_in_the_top_k(make_llm_config):
    policy = backbone(make_llm_config, "backbone.top_k=1")
    rollout = policy.collect_rollout(request(PROMPTS), None)
    greedy = policy.generate(PROMPTS, seed=0).media.data
    assert policy.media(rollout).data == greedy  # top-1 sampling is greedy decoding


def test_a_stop_string_ends_the_completion(make_llm_config):
    policy = backbone(make_llm_config, "backbone.max_new_tokens=8")
    texts = policy.media(policy.collect_rollout(request(PROMPTS * 2), None)).data
    stop = next(c for c in "0123456789" if any(c in t for t in texts))
    stopped = backbone(make_llm_config, "backbone.max_new_tokens=8", f"backbone.stop=['{stop}']")
    for text in stopped.media(stopped.collect_rollout(request(PROMPTS * 2), None)).data:
        assert stop not in text[:-1]  # nothing after the first stop string


@pytest.mark.parametrize("lora", [False, True])
def test_the_first_update_is_on_policy_exactly_and_the_k3_kl_starts_at_zero(make_llm_config, tmp_path, lora):
    config = make_llm_config(f"backbone.lora.enabled={lora}", "objective.kl_beta=0.1", "train.steps=1")
    metrics = Trainer(config, PluginManager()).train().last_metrics
    assert metrics["ratio"] == 1.0 and metrics["approx_kl"] == 0.0 and metrics["clip_fraction"] == 0.0
    assert metrics["token_kl/kl"] == 0.0 and metrics["grad_norm"] > 0
    later = make_llm_config(
        f"backbone.lora.enabled={lora}",
        "objective.kl_beta=0.1",
        "train.steps=3",
        "train.num_iterations=2",
        f"run.output_dir={tmp_path}/later",
    )
    metrics = Trainer(later, PluginManager()).train().last_metrics
    assert metrics["token_kl/kl"] > 0  # the policy has moved away from the reference


@pytest.mark.slow
def test_a_compiled_token_policy_trains_like_the_eager_one(make_llm_config, tmp_path):
    """train.compile on the token policy: generation with its KV cache, the update and the KL's reference copy run
    compiled, and the update follows the eager one's up to the compiled kernels' rounding."""
    runs = train_eager_and_compiled(make_llm_config, tmp_path, 2, "objective.kl_beta=0.1", "train.num_iterations=2")
    assert runs.compiled_modules == [[False, False], [True, True]]
    assert runs.graphs_ran and runs.same_names
    assert runs.eager.norm() > 0 and runs.relative_difference() < 1e-3


def test_resume_reproduces_an_uninterrupted_run(llm_yaml, tmp_path):
    from gyremedia.cli import main

    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(["train", str(llm_yaml), f"run.output_dir={straight}", "train.steps=3"]) == 0
    assert main(["train", str(llm_yaml), f"run.output_dir={split}", "train.steps=1"]) == 0
    assert main(["train", "--resume", str(split), "train.steps=3"]) == 0

    def steps(run):
        lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        # the first run's last step was evaluated too: compare what training measured
        return [
            {k: v for k, v in m.items() if not k.startswith(("time/", "eval/", "monitor/"))}
            for m in lines
            if "loss" in m
        ]

    assert steps(split) == steps(straight)


def test_evaluation_writes_sample_completions_and_the_summary(make_llm_config, tmp_path):
    trainer = Trainer(make_llm_config("train.steps=1", "monitor.drift=true"), PluginManager())
    trainer.train()
    before = (tmp_path / "run" / "samples" / "before.txt").read_text().splitlines()
    assert len(before) == 6 and before[0].startswith("'1+2=' -> ")
    assert trainer.state.last_metrics["eval/drift"] >= 0
    assert any(line.startswith("samples: ") and "before.txt" in line for line in trainer.summary())


@pytest.mark.parametrize("merge", [True, False])
def test_export_loads_in_plain_transformers_and_decodes_the_same(make_llm_config, tmp_path, merge):
    config = make_llm_config("backbone.lora.enabled=true", "train.steps=1")
    state = Trainer(config, PluginManager()).train()
    out = tmp_path / "export"
    state.backbone.save_pretrained(out, merge_lora=merge)
    ours = state.backbone.generate(PROMPTS, seed=0).media.data
    load = (
        f"model = AutoModelForCausalLM.from_pretrained({str(out)!r});"
        if merge
        else "from peft import PeftModel;"
        f"model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({str(config.backbone.options.pretrained)!r}), {str(out)!r});"
    )
    script = (
        "import json, sys, torch; from transformers import AutoModelForCausalLM, AutoTokenizer;"
        f"tok = AutoTokenizer.from_pretrained({str(out)!r}); {load}"
        f"batch = tok({PROMPTS!r}, return_tensors='pt', padding=True);"
        "out = model.generate(**batch, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id);"
        "print(json.dumps(tok.batch_decode(out[:, batch['input_ids'].shape[1]:], skip_special_tokens=True)))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == ours
    assert (out / ("model.safetensors" if merge else "adapter_model.safetensors")).is_file()


def test_a_token_policy_takes_no_sampler_and_only_token_objectives(make_llm_config):
    with pytest.raises(ConfigError, match="'sampler': backbone 'causal_lm' emits tokens and samples them itself"):
        make_llm_config("sampler.name=flow_sde")
    with pytest.raises(
        ConfigError,
        match="objective 'grpo' trains denoising transitions, but backbone "
        "'causal_lm' emits tokens: choose one of egspo, lightning_rl, stable_drl, token_grpo",
    ):
        make_llm_config("objective={name: grpo}")
    with pytest.raises(
        ConfigError, match="reward 'jpeg_compressibility' scores image/video, but backbone 'causal_lm' makes text"
    ):
        make_llm_config("rewards=[jpeg_compressibility]")


def test_a_third_party_text_reward_is_selected_by_name_and_trains(make_llm_config):
    from gyremedia import hookimpl

    class ShortAnswers:
        """1 / (1 + length): a third party's text reward, registered the way any package's would be."""

        kinds = {"text"}

        def __call__(self, media, prompts):
            return torch.tensor([1.0 / (1 + len(text)) for text in media.data])

    class Plugin:
        @hookimpl
        def gyremedia_register_rewards(self, register):
            register("short_answers", lambda context: ShortAnswers())

    pm = PluginManager(extra_plugins=[Plugin()])
    state = Trainer(make_llm_config("rewards=[short_answers]", "train.steps=1", plugins=pm), pm).train()
    assert "reward/short_answers" in state.last_metrics and state.last_metrics["grad_norm"] > 0


@pytest.fixture(scope="module")
def wide_lm(tmp_path_factory):
    """A 1-layer Llama of width 16 with a 4,096-token vocabulary whose every id decodes (a word-level tokenizer):
    a vocabulary wide enough that a ``[B, T, V]`` tensor stands out among everything else a step makes."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocabulary = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: 3 + i for i, c in enumerate("0123456789+=")}}
    vocabulary.update({f"w{i}": i for i in range(len(vocabulary), 4096)})
    words = Tokenizer(WordLevel(vocabulary, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    words.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("wide_lm")
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_no_tensor_spans_the_completion_and_the_vocabulary_at_once(make_llm_config, wide_lm, monkeypatch):
    """A training step (rollout, replay, reference, update) at 32 new tokens makes no tensor of
    ``rows x tokens x vocabulary`` elements: the noise is drawn a position at a time and the log-probs a chunk of
    positions at a time, recomputed in the backward (what lets a 151,936-token vocabulary train at 1,024 tokens)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import gyremedia.backbones.causal_lm as causal_lm

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numel, self.op = 0, None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor) and tensor.numel() > self.numel:
                    self.numel, self.op = tensor.numel(), func
            return out

    monkeypatch.setattr(causal_lm, "LOGITS_PER_CHUNK", 2**15, raising=False)  # 8 rows x 1 position x 4,096 tokens
    config = make_llm_config(
        f"backbone.pretrained={wide_lm}",
        "backbone.max_new_tokens=32",
        "rollout.batch_size=8",
        "rollout.group_size=4",
        "objective.kl_beta=0.04",
        "eval.every=0",
    )
    trainer = Trainer(config, PluginManager())
    trainer.setup()
    with Largest() as largest:
        metrics = trainer.train_step(0)
    assert metrics["completion_tokens"] > 16  # the random model writes long completions
    assert largest.numel < 8 * 32 * 4096 // 4, (largest.numel, largest.op)


def test_a_chat_template_that_writes_the_bos_gets_one_bos(make_llm_config, wide_lm, tmp_path):
    """Llama 3, Gemma and Mistral templates write the BOS themselves and their tokenizers add one to any text: the
    prompt is the template's tokens, with a single BOS (rendering it to text and tokenizing that gave two)."""
    import shutil

    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    folder = tmp_path / "templated"
    shutil.copytree(wide_lm, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer._tokenizer.post_processor = TemplateProcessing(single="<unk> $A", special_tokens=[("<unk>", 2)])
    tokenizer.bos_token = "<unk>"  # id 2: a BOS the model's vocabulary already has
    tokenizer.chat_template = "{{ bos_token }}{{ messages[0]['content'] }}="
    tokenizer.save_pretrained(folder)
    policy = backbone(make_llm_config, f"backbone.pretrained={folder}")
    ids, mask = policy._tokenize(["1+2", "33+4"])
    assert ids.tolist() == [[0, 2, 4, 13, 5, 14], [2, 6, 6, 13, 7, 14]]  # left padding, then <bos>1+2= and <bos>33+4=
    assert mask.tolist() == [[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
    assert policy.tokenizer("1+2")["input_ids"] == [2, 4, 13, 5]  # plain text still gets its BOS


def test_stop_strings_are_looked_for_in_the_newest_tokens_only(make_llm_config, wide_lm):
    """Each step decodes only the tokens that could spell the longest stop string, not every completion whole
    (which made a 1,024-token rollout decode half a million tokens per row); completions end where they did."""
    policy = backbone(
        make_llm_config, f"backbone.pretrained={wide_lm}", "backbone.max_new_tokens=48", "backbone.stop=['w4000', '=w']"
    )
    widths, decode = [], policy.tokenizer.batch_decode

    def recording(ids, **kwargs):
        widths.append(ids.shape[1])
        return decode(ids, **kwargs)

    policy.tokenizer.batch_decode = recording
    rollout = policy.collect_rollout(request(PROMPTS), None)
    assert max(widths) == 4 * len("w4000") and len(widths) > 20
    for text in policy.media(rollout).data:
        assert not any(s in text[:-1] for s in ("w4000", "=w"))


@pytest.mark.parametrize("filtering", ["backbone.top_p=0.6", "backbone.top_k=3"])
def test_the_replay_takes_log_probs_under_the_filter_the_rollout_sampled_with(make_llm_config, filtering):
    """With top-p or top-k the rollout samples from the filtered distribution: the replay's log-probs are that
    distribution's (before, the unfiltered ones: every TIS weight was the nucleus mass, not 1)."""
    from gyremedia.objectives.token_grpo import importance_weights

    policy = backbone(make_llm_config, filtering, "backbone.max_new_tokens=6")
    rollout = policy.collect_rollout(request(PROMPTS * 2), None)
    with torch.no_grad():
        replayed = policy.token_log_probs(rollout)
    torch.testing.assert_close(replayed, rollout.log_probs * rollout.mask, atol=1e-5, rtol=0)
    weights = importance_weights(replayed, rollout.log_probs, "tis", cap=2.0, threshold=1.0)[rollout.mask]
    torch.testing.assert_close(weights, torch.ones_like(weights), atol=1e-4, rtol=0)
    assert (rollout.log_probs[rollout.mask] < 0).any()  # a real draw, not one certain token each time


def test_a_filtered_policy_trains_with_finite_losses(make_llm_config):
    """Two passes over each rollout under top-p: after the first update a sampled token may leave the nucleus (its
    log-prob -inf); the bounded log ratio keeps the loss and the gradient finite (train.on_nonfinite stops else)."""
    config = make_llm_config(
        "backbone.top_p=0.6",
        "train.num_iterations=2",
        "train.learning_rate=0.05",
        "objective.kl_beta=0.04",
        "train.steps=3",
    )
    state = Trainer(config, PluginManager()).train()
    assert state.step == 3 and math.isfinite(state.last_metrics["loss"])


@pytest.mark.parametrize("disable", [True, False])
def test_dropout_is_off_in_the_update_unless_the_yaml_keeps_it(make_llm_config, tiny_lm, tmp_path, disable):
    """A model saved with attention dropout replays, in train mode, the log-probs its rollout recorded (in eval
    mode) exactly when ``disable_dropout`` is on; kept on, the replay is noisy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path / "dropout_lm"
    model = AutoModelForCausalLM.from_pretrained(tiny_lm, attention_dropout=0.5)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_lm).save_pretrained(folder)
    policy = backbone(make_llm_config, f"backbone.pretrained={folder}", f"backbone.disable_dropout={disable}")
    rollout = policy.collect_rollout(request(PROMPTS), None)
    policy.trainable_module().train()
    torch.manual_seed(0)
    with torch.no_grad():
        replayed = policy.token_log_probs(rollout)
    same = torch.allclose(replayed, rollout.log_probs * rollout.mask, atol=1e-5, rtol=0)
    assert same == disable


def test_sampled_tokens_follow_the_distribution_and_skip_filtered_ones():
    """Inverse-CDF sampling, one uniform per row: frequencies match softmax(scores) and a token the filter
    removed (probability 0) is never drawn; the recorded log-prob is the token's own."""
    from gyremedia.backbones.causal_lm import sample_tokens

    rows = 20_000
    scores = torch.tensor([1.0, 0.0, -math.inf, 2.0, 0.5]).expand(rows, -1)
    generators = [torch.Generator().manual_seed(i) for i in range(rows)]
    tokens, log_probs = sample_tokens(scores, generators)
    expected = scores[0].softmax(-1)
    frequencies = torch.bincount(tokens, minlength=5).float() / rows
    assert frequencies[2] == 0
    torch.testing.assert_close(frequencies, expected, atol=0.01, rtol=0)
    torch.testing.assert_close(log_probs, expected.log()[tokens])


def test_a_shared_prompt_is_read_once_and_gives_the_whole_sequences_log_probs_and_gradients(
    make_llm_config, monkeypatch
):
    """Rows of a group continue from their prompt's cache in the replay: the same log-probs and gradients as the
    whole sequences, with the model run over each distinct prompt once."""
    policy = backbone(make_llm_config)
    prompts = [p for p in PROMPTS[:3] for _ in range(4)]  # groups of 4 rows per prompt
    rollout = policy.collect_rollout(request(prompts), None)
    model = policy.trainable_module()

    def replay() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        log_probs = policy.token_log_probs(rollout)
        log_probs.sum().backward()
        return log_probs.detach(), [p.grad.clone() for p in model.parameters()]

    rows_read = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: rows_read.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    shared, shared_grads = replay()
    assert rows_read[0][0] == 3  # the prompts, once each, then the completions of all 12 rows
    monkeypatch.setattr(policy.options, "gradient_checkpointing", True)  # the whole sequences (no cache)
    whole, whole_grads = replay()
    torch.testing.assert_close(shared, whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(shared, rollout.log_probs * rollout.mask, atol=1e-5, rtol=0)
    for a, b in zip(shared_grads, whole_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)

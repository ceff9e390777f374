"""Token policies: a transformers causal language model as a policy whose transitions are sampled tokens.

Loads ``AutoModelForCausalLM`` + ``AutoTokenizer`` from a local folder or hub id. A rollout is the
left-padded prompts and the completions sampled from them with a KV cache; each token is drawn by
inverse-CDF sampling from a uniform that depends on ``(seed, step, sample id)`` alone, so a sample is the
same on one process or many and after a resume. The log-prob of every sampled token under the
sampling distribution (temperature, then top-k / top-p) is recorded in fp32; the trainer recomputes
them under the same distribution (:meth:`CausalLMBackbone.token_log_probs`): at the sampling temperature, as
TRL does, and through the same top-k / top-p filter, so the policy trained is the one that sampled.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from gyremedia import hookimpl
from gyremedia.backbones.transformer_policy import LoraOptions, TransformerPolicy, adapters_disabled, merge_adapters
from gyremedia.interfaces import BuildContext, Generated, RolloutRequest
from gyremedia.options import option, pretrained_source
from gyremedia.rollout import Media, Rollout
from gyremedia.runtime.streams import Stream, sample_generators

logger = logging.getLogger("gyremedia")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: Logits computed at once when log-probs are taken over the completion: ``rows x positions x vocabulary`` of
#: at most this many (64 MiB in fp32), so no ``[B, T, V]`` tensor is ever whole (see :func:`chunked_positions`).
LOGITS_PER_CHUNK = 2**24


@dataclass
class CausalLMOptions:
    pretrained: str = option(check=pretrained_source, help="a causal LM folder (model and tokenizer) or hub id")
    dtype: Literal["float32", "bfloat16", "float16"] = option("float32", help="the model's weights")
    lora: LoraOptions = field(
        default_factory=lambda: LoraOptions(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    )
    gradient_checkpointing: bool = option(False, help="recompute activations in the backward pass (less memory)")
    disable_dropout: bool = option(
        True,
        help="dropout off in the update too (as TRL's disable_dropout), so the "
        "replay's log-probs equal the rollout's and the KL is not noisy; rollouts "
        "always sample in eval mode",
    )
    max_new_tokens: int = option(64, ge=1, help="longest completion, in tokens")
    temperature: float = option(1.0, gt=0, help="sampling temperature of rollouts (and of the trained log-probs)")
    top_p: float = option(1.0, gt=0, le=1, help="nucleus sampling: keep the smallest set of tokens with this mass")
    top_k: int = option(0, ge=0, help="keep the k likeliest tokens; 0 keeps all")
    stop: list[str] = option(default_factory=list, help="a completion ends after the first of these strings")
    chat_template: bool = option(True, help="wrap each prompt in the tokenizer's chat template, if it has one")
    eval_temperature: float = option(0.0, ge=0, help="temperature of evaluation samples; 0 decodes greedily")
    batch_size: int = option(64, ge=1, help="prompts generated at once in evaluation")


def inverse_cdf_sample(scores: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``scores`` ``[..., V]`` (tempered, filtered logits) from one uniform per row
    (``uniform`` ``[...]``) by inverse-CDF sampling, and its log-prob under ``softmax(scores)``. A token of
    probability 0 (outside a top-k / top-p filter) has an empty interval of the CDF and is never drawn."""
    log_probs = scores.log_softmax(-1)
    cdf = log_probs.exp().cumsum(-1)
    token = torch.searchsorted(cdf, (uniform * cdf[..., -1])[..., None], right=True)[..., 0]
    token = token.clamp_max(scores.shape[-1] - 1)
    return token, log_probs.gather(-1, token[..., None])[..., 0]


def sample_tokens(scores: torch.Tensor, generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``scores`` ``[B, V]`` and its log-prob (:func:`inverse_cdf_sample`).

    Each row takes one uniform from its own generator per position, so a sample depends on its id alone, on any
    number of processes. One number per row, not one per vocabulary entry: the Gumbel-max trick this replaced
    drew ``B x V`` uniforms and took two logarithms of each at every position, which at a 151,936-token
    vocabulary made the rollout slower than TRL's."""
    uniform = torch.cat([torch.rand(1, generator=g, device=g.device) for g in generators])
    return inverse_cdf_sample(scores, uniform)


def disable_dropout(model: torch.nn.Module) -> None:
    """Every dropout of ``model`` at probability 0: its ``nn.Dropout`` layers and the attention dropout rate
    transformers' attention modules keep as a float (the saved config is left as it was)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def chunked_positions(rows: int, positions: int, vocabulary: int) -> int:
    """How many positions one chunk of logits covers (at least one)."""
    return max(1, min(positions, LOGITS_PER_CHUNK // max(rows * vocabulary, 1)))


def _token_log_probs(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    tokens: torch.Tensor,
    temperature: float,
    keep: Callable[[torch.Tensor], torch.Tensor] | None,
) -> torch.Tensor:
    logits = head(hidden).float() / temperature
    if keep is not None:
        logits = keep(logits)
    return logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]


def completion_log_probs(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    tokens: torch.Tensor,
    temperature: float,
    keep: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``[B, T]`` log-probs of ``tokens`` under ``softmax(keep(head(hidden) / temperature))`` (``keep``: the
    sampler's top-k / top-p filter, if any), the output projection and the log-softmax taken a chunk of positions
    at a time. With gradients, each chunk's logits are recomputed in the backward pass (as fused
    linear-cross-entropy kernels do), so a chunk's logits are all that lives at once, in the forward and the
    backward, whatever the completion's length and the vocabulary. Logits that fit in one chunk are kept for the
    backward instead (no recomputation: they are no larger than a chunk)."""
    step = chunked_positions(hidden.shape[0], hidden.shape[1], head.weight.shape[0])
    if step >= hidden.shape[1]:
        return _token_log_probs(hidden, head, tokens, temperature, keep)
    recompute = torch.is_grad_enabled() and hidden.requires_grad
    parts = []
    for begin in range(0, hidden.shape[1], step):
        piece = (hidden[:, begin : begin + step], head, tokens[:, begin : begin + step], temperature, keep)
        parts.append(
            checkpoint(_token_log_probs, *piece, use_reentrant=False) if recompute else _token_log_probs(*piece)
        )
    return torch.cat(parts, dim=1)


class CausalLMBackbone(TransformerPolicy):
    """A causal LM seen as a policy over tokens (``transitions = "tokens"``, media kind ``text``)."""

    media_kind = "text"
    transitions = "tokens"

    def __init__(self, options: CausalLMOptions, context: BuildContext) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.options = options
        self.device = context.device
        self.tokenizer = AutoTokenizer.from_pretrained(options.pretrained)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:  # many chat models ship without one: pad with the end token
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.transformer = AutoModelForCausalLM.from_pretrained(options.pretrained, dtype=DTYPES[options.dtype])
        self.transformer.to(self.device)
        self.transformer.generation_config.pad_token_id = self.tokenizer.pad_token_id
        self._check_head_reads_last_hidden()
        if options.disable_dropout:
            disable_dropout(self.transformer)
        self._prepare_training(options.lora, options.gradient_checkpointing, context.mixed_precision)
        self.max_new_tokens = options.max_new_tokens
        self.temperature = options.temperature
        self._token_cache: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ tokens

    def _token_ids(self, prompts: list[str]) -> list[list[int]]:
        """The prompts' ids as the model reads them: in its chat template when it has one (and it is asked for),
        tokenized in one go, so the special tokens are the template's own (rendering it to text and tokenizing
        that again added a second BOS for Llama 3, Gemma and Mistral); else the prompt with the tokenizer's."""
        if not (self.options.chat_template and getattr(self.tokenizer, "chat_template", None)):
            return self.tokenizer(list(prompts))["input_ids"]
        encoded = self.tokenizer.apply_chat_template(
            [[{"role": "user", "content": p}] for p in prompts], tokenize=True, add_generation_prompt=True
        )
        return list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)

    def _tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompt ids and their attention mask, ``[B, P]`` (each prompt tokenized once per run)."""
        missing = [p for p in dict.fromkeys(prompts) if p not in self._token_cache]
        if missing:
            for prompt, ids in zip(missing, self._token_ids(missing)):
                self._token_cache[prompt] = ids
        rows = [self._token_cache[p] for p in prompts]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[self.tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        return ids.to(self.device), mask.to(self.device)

    def _logits(self, ids: torch.Tensor, attention: torch.Tensor, *, past=None) -> tuple[torch.Tensor, object]:
        """The next token's logits ``[B, 1, V]`` after ``ids``, and the cache; positions count only attended tokens
        (left padding). Only the last position goes through the output projection."""
        positions = (attention.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
        with self._autocast():
            out = self.transformer(
                input_ids=ids,
                attention_mask=attention,
                position_ids=positions,
                cache=past,
                use_cache=True,
                logits_to_keep=1,
            )
        return out.logits, out.cache

    def _hidden(self, ids: torch.Tensor, attention: torch.Tensor, *, reference: bool = False) -> torch.Tensor:
        """The last layer's normalised hidden states ``[B, S, H]`` (what the output projection reads), without
        projecting them: the logits of a whole sequence are never made at once (:func:`completion_log_probs`)."""
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        out = self._forward(
            reference,
            input_ids=ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=False,
            output_hidden_states=True,
            logits_to_keep=1,
            return_dict=True,
        )
        return out.hidden_states[-1]

    def _completion_hidden(self, rollout: Rollout, reference: bool) -> torch.Tensor:
        """The hidden states that predict the completion's tokens, ``[B, T, H]``: the last prompt position's and
        every completion position's but the last.

        A group's rows share their prompt, so each distinct prompt goes through the model once and every row
        continues from its cache, as sampling does: at 8 completions per prompt the forward and the backward read
        a prompt once instead of 8 times. Not when nothing repeats, nor when transformers turns the cache off
        (gradient checkpointing), nor through a wrapper that expects one forward per backward (DDP, FSDP2,
        torch.compile): those run the whole sequences, with the same log-probs to rounding."""
        length = rollout.prompt_length
        prompt, prompt_mask, mask = rollout.states[:, :length], rollout.conditions["prompt_mask"], rollout.mask.long()
        distinct, inverse = torch.unique(torch.cat([prompt, prompt_mask], dim=1), dim=0, return_inverse=True)
        wrapped = torch.is_grad_enabled() and not reference and self._training_module is not self.transformer
        if len(distinct) == len(prompt) or self.options.gradient_checkpointing or wrapped:
            attention = torch.cat([prompt_mask, mask], dim=1)
            return self._hidden(rollout.states, attention, reference=reference)[:, length - 1 : -1]
        shared = dict(use_cache=True, output_hidden_states=True, logits_to_keep=1, return_dict=True)
        positions = (distinct[:, length:].cumsum(-1) - 1).clamp(min=0)
        head = self._forward(
            reference,
            input_ids=distinct[:, :length],
            attention_mask=distinct[:, length:],
            position_ids=positions,
            **shared,
        )
        last_prompt = head.hidden_states[-1][inverse, -1:]
        if rollout.states.shape[1] == length + 1:  # one-token completions: the prompt predicts them all
            return last_prompt
        cache = head.cache
        cache.reorder_cache(inverse)
        attention = torch.cat([prompt_mask, mask[:, :-1]], dim=1)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)[:, length:]
        tail = self._forward(
            reference,
            input_ids=rollout.states[:, length:-1],
            attention_mask=attention,
            position_ids=positions,
            cache=cache,
            **shared,
        )
        return torch.cat([last_prompt, tail.hidden_states[-1]], dim=1)

    @contextlib.contextmanager
    def _head(self, reference: bool) -> Iterator[torch.nn.Module]:
        """The output projection of the policy, or of the frozen reference; under autocast like every forward."""
        with self._autocast():
            if not reference:
                yield self.transformer.get_output_embeddings()
            elif self._reference_transformer is not None:
                yield self._reference_transformer.get_output_embeddings()
            else:
                with torch.no_grad(), adapters_disabled(self.transformer):
                    yield self.transformer.get_output_embeddings()

    def _check_head_reads_last_hidden(self) -> None:
        """:meth:`_hidden` assumes the output projection alone turns the last hidden states into the logits (Llama,
        Qwen, Mistral...); a model that does more (Gemma's logit soft-capping) is refused rather than trained on
        other log-probs than it samples from."""
        ids = torch.tensor([[self.tokenizer.eos_token_id] * 3], device=self.device)
        with torch.no_grad():
            out = self.transformer(input_ids=ids, output_hidden_states=True, return_dict=True)
            projected = self.transformer.get_output_embeddings()(out.hidden_states[-1])
        if not torch.allclose(projected.float(), out.logits.float(), rtol=1e-4, atol=1e-4):
            raise ValueError(
                f"backbone.pretrained={self.options.pretrained!r}: its logits are not its output "
                "projection of its last hidden states (a soft-capped or otherwise post-processed head), "
                "which the chunked log-probs need"
            )

    def _filter(self, scores: torch.Tensor) -> torch.Tensor:
        """Temperature-scaled logits ``[..., V]`` with everything outside top-k / top-p set to -inf."""
        if self.options.top_k:
            kth = scores.topk(min(self.options.top_k, scores.shape[-1]), dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, -math.inf)
        if self.options.top_p < 1:
            ordered, order = scores.sort(dim=-1, descending=True)
            mass = ordered.softmax(-1).cumsum(-1)
            beyond = mass - ordered.softmax(-1) >= self.options.top_p  # the nucleus is full before them
            scores = scores.masked_fill(torch.zeros_like(beyond).scatter(-1, order, beyond), -math.inf)
        return scores

    @torch.no_grad()
    def _sample(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        generators: list[torch.Generator] | None,
        temperature: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Completions ``[B, T]`` (pad after the end), their log-probs under the sampling distribution, their
        mask, and which ones ``max_new_tokens`` cut off ``[B]``. ``generators`` None (or ``temperature`` 0)
        decodes greedily."""
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        # A group's rows share their prompt: read each distinct prompt once, then give every row its cache.
        distinct, inverse = torch.unique(torch.cat([prompt_ids, prompt_mask], dim=1), dim=0, return_inverse=True)
        width = prompt_ids.shape[1]
        logits, past = self._logits(distinct[:, :width], distinct[:, width:])
        logits = logits[inverse]
        past.reorder_cache(inverse)
        attention, done = prompt_mask, torch.zeros(len(prompt_ids), dtype=torch.bool, device=self.device)
        tokens, log_probs, alive = [], [], []
        sampled = generators is not None and temperature > 0
        for position in range(self.max_new_tokens):
            scores = logits[:, -1].float()
            if not sampled:
                token = scores.argmax(-1)
                log_prob = torch.zeros(len(token), device=self.device)
            else:
                token, log_prob = sample_tokens(self._filter(scores / temperature), generators)
            tokens.append(torch.where(done, pad, token))
            log_probs.append(torch.where(done, 0.0, log_prob))
            alive.append(~done)
            done = done | (token == eos) | self._stopped(torch.stack(tokens, dim=1), done)
            if done.all():
                break
            attention = torch.cat([attention, alive[-1].long()[:, None]], dim=1)
            logits, past = self._logits(tokens[-1][:, None], attention, past=past)
        return torch.stack(tokens, dim=1), torch.stack(log_probs, dim=1), torch.stack(alive, dim=1), ~done

    def _stopped(self, tokens: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        """Which rows' completions now contain a stop string. One found now ends in the newest token (the
        earlier ones were checked), so only the tokens that could spell the longest stop string are decoded: a
        character is at most 4 bytes and a token at least one, so ``4 x characters`` tokens cover it (decoding
        every completion whole at every step cost time quadratic in its length)."""
        if not self.options.stop:
            return torch.zeros_like(done)
        window = 4 * max(len(s) for s in self.options.stop)
        texts = self.tokenizer.batch_decode(tokens[:, -window:], skip_special_tokens=True)
        return torch.tensor([any(s in text for s in self.options.stop) for text in texts], device=done.device)

    # ------------------------------------------------------------------ policy stages

    def collect_rollout(self, request: RolloutRequest, sampler=None) -> Rollout:
        """Sample one completion per prompt, in the chunks training replays: ``states`` holds the prompt and
        completion ids ``[B, P+T]``, ``log_probs`` / ``mask`` the completion's ``[B, T]``."""
        prompt_ids, prompt_mask = self._tokenize(request.prompts)
        chunk = len(request.prompts) // request.chunks
        parts = []
        for begin in range(0, len(request.prompts), chunk):
            span = slice(begin, begin + chunk)
            generators = sample_generators(
                request.seed, request.step, Stream.GENERATION, request.sample_ids[span].tolist(), self.device
            )
            parts.append(self._sample(prompt_ids[span], prompt_mask[span], generators, self.temperature))
        width = max(p[0].shape[1] for p in parts)
        pad = self.tokenizer.pad_token_id
        completion = torch.cat([F.pad(p[0], (0, width - p[0].shape[1]), value=pad) for p in parts])
        log_probs = torch.cat([F.pad(p[1], (0, width - p[1].shape[1])) for p in parts])
        mask = torch.cat([F.pad(p[2], (0, width - p[2].shape[1])) for p in parts])
        return Rollout(
            prompts=list(request.prompts),
            sample_ids=request.sample_ids,
            group_ids=request.group_ids,
            conditions={"prompt_mask": prompt_mask},
            states=torch.cat([prompt_ids, completion], dim=1),
            log_probs=log_probs,
            mask=mask,
            prompt_length=prompt_ids.shape[1],
            truncated=torch.cat([p[3] for p in parts]),
        )

    def token_log_probs(self, rollout: Rollout, *, reference: bool = False) -> torch.Tensor:
        """``[B, T]`` fp32 log-probs of the completion tokens at the sampling temperature (0 where masked)."""
        length = rollout.prompt_length
        hidden = self._completion_hidden(rollout, reference)
        # The policy's: the distribution the rollout sampled from, so its log-probs (and an importance correction's
        # weights) compare like with like; under top_p < 1 every sampler-vs-trainer weight was the nucleus mass.
        # The reference's: its whole distribution, so the KL stays finite for a token outside its top-p set and
        # pulls back exactly the tokens that drifted (it starts at -log of the nucleus mass, not at 0).
        keep = self._filter if (self.options.top_k or self.options.top_p < 1) and not reference else None
        with self._head(reference) as head:
            log_probs = completion_log_probs(hidden, head, rollout.states[:, length:], self.temperature, keep)
        # where, not a product: the padding after a completion's end can lie outside the filter (log-prob -inf)
        return torch.where(rollout.mask.bool(), log_probs, 0.0)

    def _completions(self, completion: torch.Tensor, mask: torch.Tensor) -> list[str]:
        return self.tokenizer.batch_decode(
            completion.masked_fill(~mask.bool(), self.tokenizer.pad_token_id), skip_special_tokens=True
        )

    def media(self, rollout: Rollout) -> Media:
        """The completions as text (special tokens dropped)."""
        return Media("text", self._completions(rollout.states[:, rollout.prompt_length :], rollout.mask))

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        *,
        seed: int,
        sampler=None,
        num_steps: int = 0,
        guidance_scale: float = 1.0,
        preference: torch.Tensor | None = None,
    ) -> Generated:
        """One completion per prompt at ``eval_temperature`` (greedy at 0), sample ``i`` seeded by ``(seed, i)``.
        Extras: the rollout-shaped ids the reference drift reads."""
        temperature, size = self.options.eval_temperature, self.options.batch_size
        texts, rollouts = [], []
        for begin in range(0, len(prompts), size):
            chunk = prompts[begin : begin + size]
            ids, attention = self._tokenize(chunk)
            generators = sample_generators(
                seed, 0, Stream.GENERATION, list(range(begin, begin + len(chunk))), self.device
            )
            completion, _, mask, _ = self._sample(ids, attention, generators if temperature else None, temperature)
            texts += self._completions(completion, mask)
            rollouts.append(
                Rollout(
                    prompts=chunk,
                    sample_ids=torch.arange(len(chunk)),
                    group_ids=torch.arange(len(chunk)),
                    conditions={"prompt_mask": attention},
                    states=torch.cat([ids, completion], dim=1),
                    mask=mask,
                    prompt_length=ids.shape[1],
                )
            )
        return Generated(Media("text", texts), {"rollouts": rollouts})

    @torch.no_grad()
    def reference_drift(
        self,
        prompts: list[str],
        generated: Generated,
        *,
        levels: int = 0,
        guidance_scale: float = 1.0,
        preference: torch.Tensor | None = None,
    ) -> float:
        """Mean per-token ``KL(pi || pi_ref)`` over the evaluation completions (exact, over the vocabulary)."""
        total = count = 0.0
        for rollout in generated.extras["rollouts"]:
            length = rollout.prompt_length
            attention = torch.cat([rollout.conditions["prompt_mask"], rollout.mask.long()], dim=1)
            hidden = {
                ref: self._hidden(rollout.states, attention, reference=ref)[:, length - 1 : -1] for ref in (False, True)
            }
            vocabulary = self.transformer.get_output_embeddings().weight.shape[0]
            step = chunked_positions(len(rollout.states), hidden[False].shape[1], vocabulary)
            for begin in range(0, hidden[False].shape[1], step):  # a chunk of positions' distributions at a time
                distributions = []
                for ref in (False, True):
                    with self._head(ref) as head:
                        logits = head(hidden[ref][:, begin : begin + step]).float()
                    distributions.append((logits / self.temperature).log_softmax(-1))
                policy, ref = distributions
                kl = (policy.exp() * (policy - ref)).sum(-1)
                total += float((kl * rollout.mask[:, begin : begin + step]).sum())
            count += float(rollout.mask.sum())
        return total / max(count, 1.0)

    # ------------------------------------------------------------------ export

    def save_pretrained(self, out_dir: Path, *, merge_lora: bool = True) -> None:
        """A folder plain transformers loads without gyremedia (``AutoModelForCausalLM``), with the tokenizer and a
        README; under LoRA with ``merge_lora`` false the adapters alone (:func:`save_language_model`)."""
        save_language_model(self, Path(out_dir), merge_lora, "AutoModelForCausalLM", USAGE)


def save_language_model(policy: Any, out_dir: Path, merge_lora: bool, auto_class: str, usage: str) -> None:
    """Write ``policy``'s tokenizer, model and a README: the trained model (``auto_class.from_pretrained``), or
    under LoRA with ``merge_lora`` false the adapters alone in peft's format (``PeftModel.from_pretrained`` onto
    the base named in adapter_config.json). ``usage``: the README, with ``{load}`` and ``{folder}`` to fill."""
    out_dir.mkdir(parents=True, exist_ok=True)
    policy.tokenizer.save_pretrained(out_dir)
    base = policy.options.pretrained
    if policy.lora_enabled and not merge_lora:
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        config = policy.transformer.peft_config["default"]
        config.base_model_name_or_path = base
        config.save_pretrained(out_dir)
        save_file(
            {k: v.contiguous() for k, v in get_peft_model_state_dict(policy.transformer).items()},
            str(out_dir / "adapter_model.safetensors"),
        )
        load = ADAPTERS.format(base=base, folder=out_dir, auto_class=auto_class)
    else:
        (merge_adapters(policy.transformer) if policy.lora_enabled else policy.transformer).save_pretrained(out_dir)
        load = MODEL.format(folder=out_dir, auto_class=auto_class)
    (out_dir / "README.md").write_text(usage.format(load=load, folder=out_dir))


MODEL = 'model = {auto_class}.from_pretrained("{folder}")'
ADAPTERS = (
    'from peft import PeftModel\n\nmodel = PeftModel.from_pretrained({auto_class}.from_pretrained("{base}"), '
    '"{folder}")  # the LoRA adapters alone'
)
USAGE = """# Trained with gyremedia

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

{load}
tokenizer = AutoTokenizer.from_pretrained("{folder}")
inputs = tokenizer(["47+385="], return_tensors="pt")
print(tokenizer.decode(model.generate(**inputs, max_new_tokens=8, do_sample=False)[0]))
```
"""


@hookimpl
def gyremedia_register_backbones(register):
    register(
        "causal_lm",
        CausalLMBackbone,
        options=CausalLMOptions,
        description="a transformers causal LM as a token policy (KV-cache sampling, full or LoRA)",
    )

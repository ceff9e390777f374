"""Masked-diffusion language models (LLaDA-style) as token policies whose transitions are unmasking steps.

A completion of ``max_new_tokens`` positions starts all masked; each step runs the bidirectional network on the
prompt and the partly unmasked completion, samples a token at every masked position of the current block and
commits some of them: a fixed number per step (``steps`` spread evenly over the blocks, as LLaDA's
``get_num_transfer_tokens``), or every token at least ``confidence_threshold`` sure (at least one: Fast-dLLM's
parallel decoding, so the number of forwards varies). Which ones: the most confident (``confidence``) or random
ones (``random``). Positions after the answer are filled with the end token, as LLaDA's are. Blocks are decoded
left to right; ``attention: staircase`` lets a block see the prompt and the blocks before it only (a 4D mask,
block diffusion's), ``full`` lets every position see every other.

The network is a stock transformers masked LM (``AutoModelForMaskedLM``: BERT, RoBERTa...): its attention is
bidirectional, it has a mask token, and it takes a 4D boolean attention mask, which staircase attention needs. A
decoder class run with a non-causal mask would export as a causal LM whose ``generate`` decodes left to right,
which is not how it was trained; no stock class decodes by unmasking, so :func:`unmask` does, and the export's
README shows the loop.

A rollout records, for completion position ``i``, the step ``order[i]`` that committed it and the token's log-prob
at that step under the sampling distribution (temperature; the choice of positions is not part of it). The
policy's log-probs (``likelihood``) are one of the three the papers compare:

- ``trajectory``: each token's log-prob at the step that committed it, replayed from that step's state (one
  forward per step): their sum over step k is the step's transition log-prob, over all steps the trajectory's;
  the first update's ratios are exactly 1 (EGSPO trains these per step).
- ``mean_field``: each token's log-prob with the whole completion masked, one forward (diffu-GRPO's proxy).
- ``elbo``: each token's share of a Monte Carlo ELBO, ``mean_m 1[i masked in m] log p_m(x_i) / t_m`` over
  ``elbo_samples`` masks of ratio ``t_m ~ U(0, 1]`` drawn with the rollout (LLaDA's likelihood bound; the same
  masks are replayed, so the first update's ratios are exactly 1 and the estimate's noise is between samples).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from gyremedia import hookimpl
from gyremedia.backbones.causal_lm import (
    DTYPES,
    LOGITS_PER_CHUNK,
    disable_dropout,
    inverse_cdf_sample,
    save_language_model,
)
from gyremedia.backbones.transformer_policy import LoraOptions, TransformerPolicy
from gyremedia.interfaces import BuildContext, Generated, RolloutRequest
from gyremedia.options import OptionError, option, pretrained_source
from gyremedia.rollout import Media, Rollout
from gyremedia.runtime.streams import Stream, sample_generators

#: ``Media.meta`` key of each completion's tokens per forward (the ``tokens_per_forward`` reward reads it).
TOKENS_PER_FORWARD = "tokens_per_forward"


@dataclass
class MaskedDiffusionLMOptions:
    pretrained: str = option(check=pretrained_source, help="a masked LM folder (model and tokenizer) or hub id")
    dtype: Literal["float32", "bfloat16", "float16"] = option("float32", help="the model's weights")
    lora: LoraOptions = field(default_factory=lambda: LoraOptions(target_modules=["query", "key", "value"]))
    gradient_checkpointing: bool = option(False, help="recompute activations in the backward pass (less memory)")
    disable_dropout: bool = option(
        True, help="dropout off in the update too, so replayed log-probs equal the rollout's"
    )
    max_new_tokens: int = option(32, ge=1, help="completion length (LLaDA's gen_length); the end token fills the rest")
    steps: int | None = option(None, ge=1, help="unmasking steps with a fixed schedule (default: max_new_tokens)")
    block_length: int | None = option(
        None, ge=1, help="decode blocks of this many positions left to right (default: one)"
    )
    remasking: Literal["confidence", "random"] = option(
        "confidence", help="which sampled tokens a step commits: the most confident (LLaDA's low_confidence) or random"
    )
    confidence_threshold: float = option(
        0.0, ge=0, lt=1, help="> 0: commit every token at least this sure, at least one, per step (steps vary)"
    )
    attention: Literal["full", "staircase"] = option(
        "full", help="staircase: a block sees the prompt and earlier blocks only (block diffusion)"
    )
    temperature: float = option(1.0, gt=0, help="sampling temperature of rollouts (and of the trained log-probs)")
    likelihood: Literal["trajectory", "mean_field", "elbo"] = option(
        "trajectory", help="the policy's log-probs: exact per step, one-forward mean-field, or Monte Carlo ELBO"
    )
    elbo_samples: int = option(4, ge=1, help="likelihood=elbo: masks per sample")
    eval_temperature: float = option(0.0, ge=0, help="temperature of evaluation samples; 0 decodes greedily")
    batch_size: int = option(64, ge=1, help="prompts generated at once in evaluation")

    def validate(self) -> None:
        block = self.block_length or self.max_new_tokens
        if self.max_new_tokens % block:
            raise OptionError("block_length", f"must divide max_new_tokens ({self.max_new_tokens})")
        blocks, steps = self.max_new_tokens // block, self.steps or self.max_new_tokens
        if steps % blocks or steps > self.max_new_tokens:
            raise OptionError(
                "steps", f"must be a multiple of the {blocks} blocks and at most max_new_tokens ({self.max_new_tokens})"
            )


# ---------------------------------------------------------------------------------------------- decoding


def transfer_counts(length: int, steps: int, blocks: int) -> list[list[int]]:
    """Tokens committed at each step of each block: a block's positions spread evenly over its steps, the
    remainder on the first ones (LLaDA's schedule)."""
    block, per_block = length // blocks, steps // blocks
    return [[block // per_block + (s < block % per_block) for s in range(per_block)] for _ in range(blocks)]


def attention_mask(prompt_mask: torch.Tensor, length: int, block_length: int, staircase: bool) -> torch.Tensor:
    """The network's attention mask for ``[prompt, completion]``: ``[B, S]`` (every real position sees every
    other), or ``[B, 1, S, S]`` booleans where a block sees the prompt and the blocks up to its own."""
    attended = torch.cat([prompt_mask, prompt_mask.new_ones(len(prompt_mask), length)], dim=1)
    if not staircase:
        return attended
    prompt = prompt_mask.shape[1]
    index = torch.arange(prompt + length, device=prompt_mask.device)
    block = torch.where(index < prompt, -1, (index - prompt) // block_length)
    return (block[None, :] <= block[:, None])[None, None] & attended.bool()[:, None, None, :]


LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # completion ids [B, L] -> completion logits [B, L, V]


def masked_lm_logits(
    model: Callable[..., torch.Tensor],
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    mask: torch.Tensor,
    mask_id: int,
) -> LogitsFn:
    """The completion's fp32 logits under ``model`` (``input_ids, attention_mask, position_ids`` -> logits) after
    the left-padded prompt, positions counted from the first real token; the mask token's at -inf (a committed
    token is never a mask)."""
    attended = torch.cat(
        [prompt_mask, prompt_mask.new_ones(len(prompt_mask), mask.shape[-1] - prompt_mask.shape[1])], 1
    )
    positions = (attended.cumsum(-1) - 1).clamp(min=0)
    prompt = prompt_ids.shape[1]

    def logits(completion: torch.Tensor) -> torch.Tensor:
        ids = torch.cat([prompt_ids, completion], dim=1)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions)[:, prompt:].float()
        logits[..., mask_id] = -math.inf  # in place: no second copy of [B, L, V] (the head's backward needs none)
        return logits

    return logits


@dataclass
class Unmasked:
    """What :func:`unmask` decoded: ``tokens``, ``order`` (the step that committed each position) and
    ``log_probs`` ``[B, L]``; per step ``[B, K]`` the mean ``entropy`` of the positions it could commit and the
    one-step ``predictions`` ``[B, K, L]`` (the state with every mask filled by its likeliest token); ``forwards``
    ``[B]``: the steps that committed one of a sample's tokens (its NFEs)."""

    tokens: torch.Tensor
    order: torch.Tensor
    log_probs: torch.Tensor
    entropy: torch.Tensor
    predictions: torch.Tensor
    forwards: torch.Tensor


@torch.no_grad()
def unmask(
    logits_fn: LogitsFn,
    batch: int,
    length: int,
    mask_id: int,
    *,
    steps: int,
    blocks: int,
    remasking: str = "confidence",
    threshold: float = 0.0,
    temperature: float = 1.0,
    generators: list[torch.Generator] | None = None,
    device: torch.device | str = "cpu",
) -> Unmasked:
    """Decode ``batch`` completions of ``length`` tokens by unmasking, block by block (see the module docstring).
    ``temperature`` 0 (or no ``generators``) commits each position's likeliest token; ``generators`` (one per
    row) draw the tokens and the random order, so a sample depends on its generator alone."""
    completion = torch.full((batch, length), mask_id, device=device)
    order = torch.full((batch, length), -1, device=device)
    log_probs = torch.zeros(batch, length, device=device)
    forwards = torch.zeros(batch, dtype=torch.long, device=device)
    entropies, predictions, step = [], [], 0
    sampled = generators is not None and temperature > 0
    block = length // blocks
    for b, counts in enumerate(transfer_counts(length, steps, blocks)):
        span = slice(b * block, (b + 1) * block)
        scheduled = iter(counts)
        while (completion[:, span] == mask_id).any():
            masked = completion == mask_id
            logits = logits_fn(completion)
            predictions.append(torch.where(masked, logits.argmax(-1), completion))
            own = logits[:, span].log_softmax(-1)  # the model's distribution: what confidence is read from
            if sampled:
                scores = logits[:, span] / temperature
                token, log_prob = inverse_cdf_sample(scores, _uniforms(generators, block))
                policy = scores.log_softmax(-1)
            else:
                token, log_prob, policy = own.argmax(-1), torch.zeros(batch, block, device=device), own
            eligible = masked[:, span]
            entropy = -(policy.exp() * policy).nan_to_num().sum(-1)  # the mask token: 0 x -inf
            entropies.append((entropy * eligible).sum(-1) / eligible.sum(-1).clamp(min=1))
            # LLaDA's low_confidence: the model's probability of the token drawn, whatever the temperature (a
            # greedy decode's tempered distribution would make every token certain)
            confidence = own.gather(-1, token[..., None])[..., 0].exp()
            if remasking == "random":
                confidence = _uniforms(generators, block) if generators is not None else torch.rand_like(confidence)
            confidence = confidence.masked_fill(~eligible, -math.inf)
            if threshold > 0:
                count = (confidence >= threshold).sum(-1).clamp(min=1)
            else:
                count = torch.full((batch,), next(scheduled, block), device=device)
            rank = confidence.argsort(dim=-1, descending=True, stable=True).argsort(-1)  # ties: leftmost first
            commit = (rank < count[:, None]) & eligible
            completion[:, span] = torch.where(commit, token, completion[:, span])
            order[:, span] = torch.where(commit, step, order[:, span])
            log_probs[:, span] = torch.where(commit, log_prob, log_probs[:, span])
            forwards += commit.any(-1)
            step += 1
    return Unmasked(completion, order, log_probs, torch.stack(entropies, 1), torch.stack(predictions, 1), forwards)


def _uniforms(generators: list[torch.Generator], count: int) -> torch.Tensor:
    """``[B, count]`` uniforms, row ``b`` from ``generators[b]``."""
    return torch.stack([torch.rand(count, generator=g, device=g.device) for g in generators])


def completion_text(tokenizer, tokens: torch.Tensor) -> list[str]:
    """The completions as text: up to the first end token, special tokens dropped."""
    eos, texts = tokenizer.eos_token_id, []
    for row in tokens.tolist():
        texts.append(tokenizer.decode(row[: row.index(eos)] if eos in row else row, skip_special_tokens=True))
    return texts


# ---------------------------------------------------------------------------------------------- the policy


class MaskedDiffusionLMBackbone(TransformerPolicy):
    """A masked-diffusion LM seen as a policy over unmasking steps (``transitions = "tokens"``, media ``text``)."""

    media_kind = "text"
    transitions = "tokens"
    replays_steps = True  # capability: step_log_probs, step_media and each step's entropy (EGSPO)

    def __init__(self, options: MaskedDiffusionLMOptions, context: BuildContext) -> None:
        from transformers import AutoModelForMaskedLM, AutoTokenizer

        self.options = options
        self.device = context.device
        self.tokenizer = AutoTokenizer.from_pretrained(options.pretrained)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.mask_token_id is None or self.tokenizer.eos_token_id is None:
            raise ValueError(
                f"backbone.pretrained={options.pretrained!r}: its tokenizer needs a mask token and an end token "
                "(masked diffusion unmasks the one and fills the completion with the other)"
            )
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.transformer = AutoModelForMaskedLM.from_pretrained(options.pretrained, dtype=DTYPES[options.dtype])
        self.transformer.to(self.device)
        if options.disable_dropout:
            disable_dropout(self.transformer)
        self._prepare_training(options.lora, options.gradient_checkpointing, context.mixed_precision)
        self.max_new_tokens = options.max_new_tokens
        self.temperature = options.temperature
        self.blocks = options.max_new_tokens // (options.block_length or options.max_new_tokens)
        self.steps = options.steps or options.max_new_tokens
        self.vocabulary = self.transformer.get_output_embeddings().weight.shape[0]
        self._token_cache: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ forwards

    def _tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompt ids and their attention mask ``[B, P]`` (each prompt tokenized once per run)."""
        missing = [p for p in dict.fromkeys(prompts) if p not in self._token_cache]
        if missing:
            self._token_cache.update(zip(missing, self.tokenizer(missing, add_special_tokens=False)["input_ids"]))
        rows = [self._token_cache[p] for p in prompts]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[self.tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        return ids.to(self.device), mask.to(self.device)

    def _logits_fn(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, reference: bool = False) -> LogitsFn:
        block = self.max_new_tokens // self.blocks
        mask = attention_mask(prompt_mask, self.max_new_tokens, block, self.options.attention == "staircase")
        return masked_lm_logits(
            lambda **inputs: self._forward(reference, **inputs),
            prompt_ids,
            prompt_mask,
            mask,
            self.tokenizer.mask_token_id,
        )

    def _decode(self, prompts: list[str], generators: list[torch.Generator] | None, temperature: float):
        ids, prompt_mask = self._tokenize(prompts)
        o = self.options
        decoded = unmask(
            self._logits_fn(ids, prompt_mask),
            len(prompts),
            self.max_new_tokens,
            self.tokenizer.mask_token_id,
            steps=self.steps,
            blocks=self.blocks,
            remasking=o.remasking,
            threshold=o.confidence_threshold,
            temperature=temperature,
            generators=generators,
            device=self.device,
        )
        return ids, prompt_mask, decoded

    # ------------------------------------------------------------------ policy stages

    def collect_rollout(self, request: RolloutRequest, sampler=None) -> Rollout:
        """Decode one completion per prompt: ``states`` holds the prompt and completion ids ``[B, P+L]``,
        ``log_probs`` each token's at the step that committed it ``[B, L]``; ``conditions`` the prompt mask and
        the commit order, and for ``likelihood: elbo`` the masks replayed; ``extras`` the steps' entropies and
        one-step predictions (EGSPO reads them) and each sample's forwards."""
        generators = sample_generators(
            request.seed, request.step, Stream.GENERATION, request.sample_ids.tolist(), self.device
        )
        ids, prompt_mask, decoded = self._decode(request.prompts, generators, self.temperature)
        conditions = {"prompt_mask": prompt_mask, "order": decoded.order}
        if self.options.likelihood == "elbo":
            conditions.update(self._elbo_masks(request))
        forwards = decoded.forwards.float()
        return Rollout(
            prompts=list(request.prompts),
            sample_ids=request.sample_ids,
            group_ids=request.group_ids,
            conditions=conditions,
            states=torch.cat([ids, decoded.tokens], dim=1),
            log_probs=decoded.log_probs,
            mask=torch.ones_like(decoded.tokens, dtype=torch.bool),
            prompt_length=ids.shape[1],
            truncated=torch.zeros(len(ids), dtype=torch.bool, device=self.device),
            metrics={
                "tokens_per_forward": float((self.max_new_tokens / forwards).mean()),
                "forwards": float(forwards.mean()),
            },
            extras={"step_entropy": decoded.entropy, "step_predictions": decoded.predictions, "forwards": forwards},
        )

    def _elbo_masks(self, request: RolloutRequest) -> dict[str, torch.Tensor]:
        """``elbo_ratio`` ``[B, M]`` (t ~ U(0, 1]) and ``elbo_masks`` ``[B, M, L]`` (each position masked with
        probability t, at least one), drawn per sample id."""
        m, length = self.options.elbo_samples, self.max_new_tokens
        generators = sample_generators(
            request.seed, request.step, (Stream.GENERATION, 1), request.sample_ids.tolist(), self.device
        )
        draws = torch.stack([torch.rand(m * (length + 1), generator=g, device=g.device) for g in generators])
        ratio = 1 - draws[:, :m]  # in (0, 1]
        masks = draws[:, m:].reshape(-1, m, length) < ratio[..., None]
        first = torch.zeros_like(masks)
        first[..., 0] = True
        masks |= first & ~masks.any(-1, keepdim=True)  # never an empty mask
        return {"elbo_ratio": ratio, "elbo_masks": masks}

    def _split(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        length = rollout.prompt_length
        return rollout.states[:, :length], rollout.conditions["prompt_mask"], rollout.states[:, length:]

    def _tokens_log_probs(self, logits: torch.Tensor, tokens: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """``[B, L]`` log-probs of ``tokens`` at the sampling temperature where ``where``, 0 elsewhere; the
        log-softmax only over the selected positions (no ``[B, L, V]`` of it)."""
        out = torch.zeros(tokens.shape, device=logits.device, dtype=torch.float32)
        chosen = logits[where] / self.temperature
        return out.index_put((where,), chosen.log_softmax(-1).gather(-1, tokens[where][:, None])[:, 0])

    def _replayed(
        self, rollout: Rollout, noisy: list[tuple[torch.Tensor, torch.Tensor]], reference: bool
    ) -> torch.Tensor:
        """``[n, B, L]`` log-probs of the completion's tokens read from each of ``noisy``'s ``n`` partly masked
        completions ``[B, L]`` at its selected positions ``[B, L]`` (0 elsewhere). The ``n`` states go through the
        network together, as many per forward as keep its logits within ``LOGITS_PER_CHUNK`` (the network's head
        reads every position): at the quickstart's size one forward and one backward instead of ``n``."""
        prompt_ids, prompt_mask, tokens = self._split(rollout)
        per_forward = max(1, LOGITS_PER_CHUNK // (len(tokens) * rollout.states.shape[1] * self.vocabulary))
        parts = []
        for begin in range(0, len(noisy), per_forward):
            chunk = noisy[begin : begin + per_forward]
            logits = self._logits_fn(prompt_ids.repeat(len(chunk), 1), prompt_mask.repeat(len(chunk), 1), reference)
            states, where = (torch.cat(column) for column in zip(*chunk))
            parts.append(self._tokens_log_probs(logits(states), tokens.repeat(len(chunk), 1), where))
        return torch.cat(parts).view(len(noisy), *tokens.shape)

    def _step_states(self, rollout: Rollout, steps: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each of ``steps``' state (the tokens committed before it, masks elsewhere) and what it committed."""
        order, tokens = rollout.conditions["order"], rollout.states[:, rollout.prompt_length :]
        return [(torch.where(order < k, tokens, self.tokenizer.mask_token_id), order == k) for k in steps]

    def step_log_probs(self, rollout: Rollout, steps: list[int], *, reference: bool = False) -> torch.Tensor:
        """``[B, len(steps)]`` log-probs of the tokens each of ``steps`` committed, replayed from its state
        (0 for a sample that committed nothing at a step)."""
        return self._replayed(rollout, self._step_states(rollout, steps), reference).sum(-1).T

    def token_log_probs(self, rollout: Rollout, *, reference: bool = False) -> torch.Tensor:
        """``[B, L]`` fp32 log-probs of the completion tokens under ``likelihood`` (module docstring)."""
        tokens, mask_id = rollout.states[:, rollout.prompt_length :], self.tokenizer.mask_token_id
        likelihood = self.options.likelihood
        if likelihood == "mean_field":
            everything = torch.ones_like(tokens, dtype=torch.bool)
            return self._replayed(rollout, [(torch.full_like(tokens, mask_id), everything)], reference)[0]
        if likelihood == "elbo":
            masks, ratio = rollout.conditions["elbo_masks"], rollout.conditions["elbo_ratio"]
            noisy = [(torch.where(masks[:, m], mask_id, tokens), masks[:, m]) for m in range(masks.shape[1])]
            return (self._replayed(rollout, noisy, reference) / ratio.T[..., None]).mean(0)
        order = rollout.conditions["order"]
        return self._replayed(rollout, self._step_states(rollout, list(range(int(order.max()) + 1))), reference).sum(0)

    def step_media(self, rollout: Rollout, rows: torch.Tensor, steps: torch.Tensor) -> Media:
        """The one-step predictions of sample ``rows[i]`` at step ``steps[i]``, as text."""
        return Media("text", completion_text(self.tokenizer, rollout.extras["step_predictions"][rows, steps]))

    def media(self, rollout: Rollout) -> Media:
        """The completions as text, each with its tokens per forward (``meta["tokens_per_forward"]``)."""
        forwards = rollout.extras.get("forwards")
        meta = {} if forwards is None else {TOKENS_PER_FORWARD: self.max_new_tokens / forwards.float().cpu()}
        return Media("text", completion_text(self.tokenizer, rollout.states[:, rollout.prompt_length :]), meta)

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
        Extras: the rollouts the reference drift replays."""
        texts, rollouts, forwards = [], [], []
        for begin in range(0, len(prompts), self.options.batch_size):
            chunk = prompts[begin : begin + self.options.batch_size]
            ids = list(range(begin, begin + len(chunk)))
            generators = sample_generators(seed, 0, Stream.GENERATION, ids, self.device)
            prompt_ids, prompt_mask, decoded = self._decode(chunk, generators, self.options.eval_temperature)
            texts += completion_text(self.tokenizer, decoded.tokens)
            forwards.append(decoded.forwards.float().cpu())
            rollouts.append(
                Rollout(
                    prompts=chunk,
                    sample_ids=torch.tensor(ids),
                    group_ids=torch.tensor(ids),
                    conditions={"prompt_mask": prompt_mask, "order": decoded.order},
                    states=torch.cat([prompt_ids, decoded.tokens], dim=1),
                    mask=torch.ones_like(decoded.tokens, dtype=torch.bool),
                    prompt_length=prompt_ids.shape[1],
                )
            )
        meta = {TOKENS_PER_FORWARD: self.max_new_tokens / torch.cat(forwards)}
        return Generated(Media("text", texts, meta), {"rollouts": rollouts})

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
        """Mean per-token ``KL(pi || pi_ref)`` over the evaluation completions: each token's distribution at the
        step that committed it (exact, over the vocabulary)."""
        total = count = 0.0
        mask_id = self.tokenizer.mask_token_id
        for rollout in generated.extras["rollouts"]:
            prompt_ids, prompt_mask, tokens = self._split(rollout)
            order = rollout.conditions["order"]
            policy, ref = (self._logits_fn(prompt_ids, prompt_mask, r) for r in (False, True))
            for k in range(int(order.max()) + 1):
                committed = order == k
                state = torch.where(order < k, tokens, mask_id)
                p, q = ((fn(state)[committed] / self.temperature).log_softmax(-1) for fn in (policy, ref))
                total += float((p.exp() * (p - q)).nan_to_num().sum())  # the mask token: 0 x (-inf - -inf)
            count += tokens.numel()
        return total / max(count, 1.0)

    # ------------------------------------------------------------------ export

    def save_pretrained(self, out_dir: Path, *, merge_lora: bool = True) -> None:
        """A folder plain transformers loads (``AutoModelForMaskedLM``), with the tokenizer and a README whose
        decoding loop unmasks as the rollouts do; or, under LoRA with ``merge_lora`` false, the adapters alone."""
        save_language_model(
            self, Path(out_dir), merge_lora, "AutoModelForMaskedLM", USAGE.format(length=self.max_new_tokens)
        )


USAGE = """# Trained with gyremedia: a masked-diffusion language model

No stock class decodes by unmasking; this loop does (greedy, the most confident position first, one token per
forward; the completion is {length} tokens, the answer then end tokens):

```python
import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer

{{load}}
tokenizer = AutoTokenizer.from_pretrained("{{folder}}")
prompt = tokenizer("47+385=", add_special_tokens=False, return_tensors="pt").input_ids
ids = torch.cat([prompt, torch.full((1, {length}), tokenizer.mask_token_id)], dim=1)
with torch.no_grad():
    while (masked := ids == tokenizer.mask_token_id).any():
        logits = model(input_ids=ids).logits
        logits[..., tokenizer.mask_token_id] = -torch.inf  # a committed token is never a mask
        confidence, token = logits.softmax(-1).max(-1)
        best = confidence.masked_fill(~masked, -1).argmax(-1)
        ids[0, best] = token[0, best]
completion = ids[0, prompt.shape[1]:].tolist() + [tokenizer.eos_token_id]
print(tokenizer.decode(completion[: completion.index(tokenizer.eos_token_id)], skip_special_tokens=True))
```
"""


class TokensPerForward:
    """The completion's tokens per forward (its length over the forwards that decoded it), from the media's
    ``meta`` (a masked_diffusion_lm rollout's): a speed reward for parallel decoding (LightningRL)."""

    kinds = {"text"}

    def __init__(self, options: object = None, context: object = None) -> None:
        pass

    def __call__(self, media: Media, prompts: list[str]) -> torch.Tensor:
        if TOKENS_PER_FORWARD not in media.meta:
            raise ValueError(
                "reward tokens_per_forward reads each completion's decoding speed, which this backbone's media do not "
                "carry: use it with backbone masked_diffusion_lm"
            )
        return media.meta[TOKENS_PER_FORWARD].float()


@hookimpl
def gyremedia_register_rewards(register):
    register(
        "tokens_per_forward",
        TokensPerForward,
        description="text: a masked-diffusion completion's tokens per forward (decoding speed)",
    )


@hookimpl
def gyremedia_register_backbones(register):
    register(
        "masked_diffusion_lm",
        MaskedDiffusionLMBackbone,
        options=MaskedDiffusionLMOptions,
        description="a transformers masked LM as a masked-diffusion token policy (unmasking steps, blocks)",
    )

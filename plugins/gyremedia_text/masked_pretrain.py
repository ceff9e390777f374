"""Pretrain the tiny masked-diffusion addition model (CPU, fixed seed).

    python -m gyremedia_text.masked_pretrain --out assets/addition_masked

The same task, splits and character tokenizer as ``assets/addition`` (plus a mask token), and a tiny stock
``BertForMaskedLM`` trained from scratch with LLaDA's objective: the completion (the sum's digits, then end
tokens up to ``MAX_NEW_TOKENS`` positions) masked at a ratio ``t ~ U(0, 1]`` drawn per sequence, the mean
cross-entropy of the masked positions (``--elbo-weight``: weighted by ``1 / t``, the ELBO's weight, as LLaDA's
pretraining; far slower here), the prompt never masked.
Evaluation decodes with the backbone's own loop (:func:`gyremedia.backbones.masked_diffusion_lm.unmask`: one
token per step, the most confident first), greedy and sampled. Stopped early on purpose, with room for RL. Writes
a folder ``AutoModelForMaskedLM`` / ``AutoTokenizer.from_pretrained`` load, the prompt files and
``pretraining.json``; deterministic for a given seed, step count and torch thread count.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForMaskedLM, PreTrainedTokenizerFast

from gyremedia.backbones.masked_diffusion_lm import attention_mask, completion_text, masked_lm_logits, unmask
from gyremedia_text.pretrain import (
    EVAL_SEED,
    MAX_LENGTH,
    MAX_NEW_TOKENS,
    Family,
    arguments,
    build_tokenizer,
    pretrain,
    report,
)
from gyremedia_text.task import answer

MODEL = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4, type_vocab_size=1)


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> BertForMaskedLM:
    """The tiny BERT masked LM, initialised from ``seed``, dropout off (the policy replays its log-probs)."""
    config = BertConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        max_position_embeddings=MAX_LENGTH,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **MODEL,
    )
    torch.manual_seed(seed)
    return BertForMaskedLM(config)


def prompt_batch(tokenizer: PreTrainedTokenizerFast, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and their mask, as the backbone reads them."""
    rows = tokenizer(prompts, add_special_tokens=False).input_ids
    width = max(len(r) for r in rows)
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
    return ids, torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])


def targets(tokenizer: PreTrainedTokenizerFast, prompts: list[str]) -> torch.Tensor:
    """``[B, MAX_NEW_TOKENS]`` completions: the sum's digits, then end tokens."""
    rows = tokenizer([answer(p) for p in prompts], add_special_tokens=False).input_ids
    return torch.tensor([r + [tokenizer.eos_token_id] * (MAX_NEW_TOKENS - len(r)) for r in rows])


def logits_fn(model: BertForMaskedLM, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, mask_id: int):
    mask = attention_mask(prompt_mask, MAX_NEW_TOKENS, MAX_NEW_TOKENS, staircase=False)
    return masked_lm_logits(lambda **inputs: model(**inputs).logits, prompt_ids, prompt_mask, mask, mask_id)


def loss(
    model: BertForMaskedLM, tokenizer: PreTrainedTokenizerFast, prompts: list[str], generator, weighted: bool = False
) -> torch.Tensor:
    """The masked positions' mean cross-entropy; ``weighted``: LLaDA's, each over ``t``, summed and divided by the
    completion length (the ELBO's weighting, whose rare small ``t`` made the loss spike to 1000 and training
    slow: assets/README.md)."""
    prompt_ids, prompt_mask = prompt_batch(tokenizer, prompts)
    answer_ids = targets(tokenizer, prompts)
    ratio = 1 - torch.rand(len(prompts), 1, generator=generator)
    masked = torch.rand(answer_ids.shape, generator=generator) < ratio
    masked[:, 0] |= ~masked.any(-1)
    noisy = answer_ids.masked_fill(masked, tokenizer.mask_token_id)
    logits = logits_fn(model, prompt_ids, prompt_mask, tokenizer.mask_token_id)(noisy)
    errors = F.cross_entropy(logits.transpose(1, 2), answer_ids, reduction="none") * masked
    if not weighted:
        return errors.sum() / masked.sum()
    return (errors / ratio).sum(-1).mean() / MAX_NEW_TOKENS


@torch.no_grad()
def complete(model, tokenizer, prompts: list[str], temperature: float = 0.0, seed: int = EVAL_SEED) -> list[str]:
    """One completion per prompt, decoded one token per step, the most confident first."""
    from gyremedia.runtime.streams import Stream, sample_generators

    prompt_ids, prompt_mask = prompt_batch(tokenizer, prompts)
    generators = sample_generators(seed, 0, Stream.GENERATION, list(range(len(prompts)))) if temperature else None
    decoded = unmask(
        logits_fn(model, prompt_ids, prompt_mask, tokenizer.mask_token_id),
        len(prompts),
        MAX_NEW_TOKENS,
        tokenizer.mask_token_id,
        steps=MAX_NEW_TOKENS,
        blocks=1,
        temperature=temperature,
        generators=generators,
    )
    return completion_text(tokenizer, decoded.tokens)


def family(elbo_weight: bool = False) -> Family:
    """The masked-diffusion model's pretraining: its tokenizer with a mask token, BERT, the masked loss and the
    unmasking decoder."""
    return Family(
        module="gyremedia_text.masked_pretrain",
        tokenizer=partial(build_tokenizer, mask=True),
        model=build_model,
        loss=partial(loss, weighted=elbo_weight),
        complete=complete,
        evaluation="exact match; greedy (one token per step, the most confident first)",
        shape=MODEL,
    )


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__, 2750)
    parser.add_argument(
        "--elbo-weight", action="store_true", help="LLaDA's 1 / t weighting (learns far slower here: assets/README.md)"
    )
    args = parser.parse_args(argv)
    summary = pretrain(
        args.out,
        args.steps,
        args.seed,
        args.batch,
        args.lr,
        args.warmup,
        args.eval_every,
        args.threads,
        family(args.elbo_weight),
        " --elbo-weight" if args.elbo_weight else "",
    )
    report(summary, args.out)


if __name__ == "__main__":
    main()

"""Pretrain the tiny addition language model (CPU, fixed seed).

    python -m gyremedia_text.pretrain --out assets/addition

Trains a character-level WordLevel tokenizer (digits, '+', '=', and <pad>/<eos>/<unk>), builds a
tiny stock ``LlamaForCausalLM`` and trains it from scratch on ``prompt + answer + <eos>`` sequences
drawn from the train split, with the loss on the answer and <eos> only. Training is stopped early on
purpose (575 steps: about 40% held-out greedy exact match) while sampled completions (temperature 1)
often contain the right answer, which is the room GRPO needs. Writes a folder that
``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` load, the train and held-out prompt
files, and ``pretraining.json`` (settings, duration, accuracies). The learning rate is constant after
warm-up, so a longer run passes through the same weights. Deterministic for a given seed, step count
and torch thread count.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from tokenizers.trainers import WordLevelTrainer
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from gyremedia_text.task import MAX_DIGITS, answer, is_correct, make_problems, parse_prompt

PAD, EOS, UNK, MASK = "<pad>", "<eos>", "<unk>", "<mask>"
MAX_LENGTH = 32  # positions; the longest sequence, "999+999=1998<eos>", has 13 tokens
MAX_NEW_TOKENS = MAX_DIGITS + 2  # the sum's digits and <eos>
TRAIN_PROMPTS, HELDOUT_PROMPTS = 2000, 256
TRAIN_FILE_SEED, HELDOUT_FILE_SEED = 1, 2  # the prompt files do not depend on --seed
EVAL_SEED, EVAL_SAMPLES = 1234, 8
MODEL = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=MAX_LENGTH,
    tie_word_embeddings=True,
)


def build_tokenizer(corpus: list[str], mask: bool = False) -> PreTrainedTokenizerFast:
    """A one-token-per-character tokenizer trained on ``corpus``; pads on the left for generation. ``mask``
    adds the mask token a masked-diffusion model unmasks."""
    tokenizer = Tokenizer(WordLevel(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()  # concatenate characters, no spaces between them
    tokenizer.train_from_iterator(corpus, WordLevelTrainer(special_tokens=[PAD, EOS, UNK] + [MASK] * mask))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        model_max_length=MAX_LENGTH,
        **({"mask_token": MASK} if mask else {}),
    )


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    """The tiny Llama causal LM, initialised from ``seed``.

    Llama rather than Qwen2: ``AutoTokenizer`` swaps in its own byte-level BPE class for a
    ``qwen2`` model folder, whereas for ``llama`` it loads the saved character tokenizer as it is.
    """
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        **MODEL,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def training_batch(tokenizer: PreTrainedTokenizerFast, prompts: list[str]) -> dict[str, torch.Tensor]:
    """Right-padded ``prompt + answer + <eos>`` ids with labels on the answer and <eos> only.

    Right padding keeps every sequence's positions starting at 0, as generation from a left-padded
    batch does (its position ids count from the first real token).
    """
    prompt_ids = tokenizer(prompts).input_ids
    answer_ids = tokenizer([answer(p) for p in prompts]).input_ids
    length = max(len(p) + len(a) + 1 for p, a in zip(prompt_ids, answer_ids))
    input_ids = torch.full((len(prompts), length), tokenizer.pad_token_id)
    labels = torch.full((len(prompts), length), -100)
    attention_mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for row, (p, a) in enumerate(zip(prompt_ids, answer_ids)):
        target = a + [tokenizer.eos_token_id]
        input_ids[row, : len(p) + len(target)] = torch.tensor(p + target)
        labels[row, len(p) : len(p) + len(target)] = torch.tensor(target)
        attention_mask[row, : len(p) + len(target)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


@torch.no_grad()
def complete(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    prompts: list[str],
    temperature: float = 0.0,
    seed: int = EVAL_SEED,
) -> list[str]:
    """One completion per prompt (text before <eos>): greedy at temperature 0, else sampled.

    Prompts are batched by token length, so no batch needs padding; each step recomputes the
    whole (at most 13-token) sequence instead of keeping a cache.
    """
    generator = torch.Generator().manual_seed(seed)
    encoded = tokenizer(prompts).input_ids
    completions = [""] * len(prompts)
    for length in sorted({len(ids) for ids in encoded}):
        rows = [i for i, ids in enumerate(encoded) if len(ids) == length]
        ids = torch.tensor([encoded[i] for i in rows])
        for _ in range(MAX_NEW_TOKENS):
            logits = model(input_ids=ids).logits[:, -1].float()
            if temperature == 0:
                token = logits.argmax(-1)
            else:
                token = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0]
            ids = torch.cat([ids, token[:, None]], 1)
        for row, generated in zip(rows, ids[:, length:].tolist()):
            if tokenizer.eos_token_id in generated:
                generated = generated[: generated.index(tokenizer.eos_token_id)]
            completions[row] = tokenizer.decode(generated)
    return completions


def evaluate(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    train: list[str],
    heldout: list[str],
    complete: Callable[..., list[str]] = complete,
) -> dict[str, float | dict[str, float]]:
    """Exact-match accuracies of ``complete``'s answers (``model, tokenizer, prompts[, temperature]`` -> texts):
    greedy on both splits, and temperature-1 pass@1 / pass@8 held out."""
    model.eval()
    greedy = [is_correct(p, c) for p, c in zip(heldout, complete(model, tokenizer, heldout))]
    by_digits: dict[str, list[bool]] = {}
    for prompt, ok in zip(heldout, greedy):
        by_digits.setdefault(str(len(str(max(parse_prompt(prompt))))), []).append(ok)
    repeated = [p for p in heldout for _ in range(EVAL_SAMPLES)]
    sampled = np.array([is_correct(p, c) for p, c in zip(repeated, complete(model, tokenizer, repeated, 1.0))])
    sampled = sampled.reshape(len(heldout), EVAL_SAMPLES)
    metrics = {
        "heldout_greedy": float(np.mean(greedy)),
        "train_greedy": float(np.mean([is_correct(p, c) for p, c in zip(train, complete(model, tokenizer, train))])),
        "heldout_sampled_pass@1": float(sampled.mean()),
        f"heldout_sampled_pass@{EVAL_SAMPLES}": float(sampled.any(1).mean()),
        "heldout_greedy_by_max_digits": {k: float(np.mean(v)) for k, v in sorted(by_digits.items())},
    }
    model.train()
    return metrics


@dataclass(frozen=True)
class Family:
    """What a pretraining run needs of a model family: its tokenizer, model, loss and decoder, how its command is
    spelled and what its evaluation decodes."""

    module: str  # the command's module: python -m MODULE
    tokenizer: Callable[[list[str]], PreTrainedTokenizerFast]
    model: Callable[[PreTrainedTokenizerFast, int], torch.nn.Module]
    loss: Callable[[torch.nn.Module, PreTrainedTokenizerFast, list[str], torch.Generator], torch.Tensor]
    complete: Callable[..., list[str]]
    evaluation: str
    shape: dict[str, Any]  # the model's size, for the summary


def causal_loss(model, tokenizer: PreTrainedTokenizerFast, prompts: list[str], generator) -> torch.Tensor:
    """Next-token cross-entropy on the answer and <eos> (no randomness: ``generator`` is unused)."""
    return model(**training_batch(tokenizer, prompts)).loss


CAUSAL = Family(
    module="gyremedia_text.pretrain",
    tokenizer=build_tokenizer,
    model=build_model,
    loss=causal_loss,
    complete=complete,
    evaluation="exact match of the leading digits; greedy",
    shape=MODEL,
)


def pretrain(
    out: Path,
    steps: int,
    seed: int,
    batch: int,
    lr: float,
    warmup: int,
    eval_every: int,
    threads: int,
    family: Family = CAUSAL,
    flags: str = "",
) -> dict:
    """Train ``family``'s model, evaluate every ``eval_every`` steps, save the folder and return the summary
    (``flags``: the command's family-specific options, as written)."""
    torch.set_num_threads(threads)
    started = time.time()
    train_prompts = make_problems(TRAIN_PROMPTS, TRAIN_FILE_SEED, "train", unique=True)
    heldout_prompts = make_problems(HELDOUT_PROMPTS, HELDOUT_FILE_SEED, "heldout", unique=True)
    stream = make_problems(steps * batch, seed, "train")
    tokenizer = family.tokenizer([p + answer(p) for p in train_prompts])
    model = family.model(tokenizer, seed)
    model.train()
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    history = []
    progress = tqdm(range(1, steps + 1), desc="pretrain", mininterval=5)
    for step in progress:
        loss = family.loss(model, tokenizer, stream[(step - 1) * batch : step * batch], generator)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        progress.set_postfix(loss=f"{loss.item():.4f}")
        if step % eval_every == 0 or step == steps:
            record = {
                "step": step,
                "seconds": round(time.time() - started, 1),
                "loss": float(loss),
                **evaluate(model, tokenizer, train_prompts, heldout_prompts, family.complete),
            }
            history.append(record)
            tqdm.write(json.dumps(record))
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "train_prompts.txt").write_text("\n".join(train_prompts) + "\n")
    (out / "heldout_prompts.txt").write_text("\n".join(heldout_prompts) + "\n")
    summary = {
        "command": f"python -m {family.module} --out {out} --steps {steps} --seed {seed} --batch {batch} "
        f"--lr {lr} --warmup {warmup} --eval-every {eval_every} --threads {threads}{flags}",
        "seed": seed,
        "steps": steps,
        "batch": batch,
        "lr": lr,
        "warmup": warmup,
        "torch_threads": threads,
        "model": {"class": type(model).__name__, **family.shape, "vocab_size": len(tokenizer)},
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": round(time.time() - started, 1),
        "evaluation": f"{family.evaluation} on {HELDOUT_PROMPTS} held-out and "
        f"{TRAIN_PROMPTS} train prompts; {EVAL_SAMPLES} samples per held-out prompt at "
        f"temperature 1 (seed {EVAL_SEED}); by_max_digits groups by the longer operand",
        "final": history[-1],
        "history": history,
        "train_prompts": len(train_prompts),
        "heldout_prompts": len(heldout_prompts),
    }
    (out / "pretraining.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def arguments(description: str, steps: int) -> argparse.ArgumentParser:
    """The options every pretraining command takes (``steps``: its default step count)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="model folder to write")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--seed", type=int, default=0, help="initialisation, training-data order and masks")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100, help="linear warm-up steps; constant afterwards")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (results depend on it)")
    return parser


def report(summary: dict, out: Path) -> None:
    """Print what a pretraining run made and its final accuracies."""
    final = summary["final"]
    print(f"{summary['parameters']:,} parameters, {summary['steps']} steps in {summary['seconds']:.0f} s -> {out}")
    print(
        f"held-out greedy {final['heldout_greedy']:.3f}, train greedy {final['train_greedy']:.3f}, "
        f"held-out sampled pass@1 {final['heldout_sampled_pass@1']:.3f}, "
        f"pass@{EVAL_SAMPLES} {final[f'heldout_sampled_pass@{EVAL_SAMPLES}']:.3f}"
    )


def main(argv: list[str] | None = None) -> None:
    args = arguments(__doc__, 575).parse_args(argv)
    report(
        pretrain(args.out, args.steps, args.seed, args.batch, args.lr, args.warmup, args.eval_every, args.threads),
        args.out,
    )


if __name__ == "__main__":
    main()

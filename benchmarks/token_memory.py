"""Peak memory of a token-policy training step at a real vocabulary, against completion length.

    python benchmarks/token_memory.py [--vocabulary 151936] [--tokens 32 256] [--rows 16]
    python benchmarks/token_memory.py --family masked_diffusion_lm --vocabulary 126464 --rows 8

A 1-layer Llama of hidden 64 with Qwen2's vocabulary (151,936 ids) and a word-level tokenizer that decodes every
id, built in a temporary folder: narrow everywhere except the width that grows, the vocabulary. For each
completion length, ``gyremedia train llm_quickstart`` runs one step on it in a child process (``rollout.batch_size``
rows, an evaluation of 4 samples, no export) and the child's peak resident set (``ru_maxrss``) is reported, with the
growth between the shortest and the longest completion: what a rollout, its replay, the reference and the update
add per token. The children run with ``MALLOC_MMAP_THRESHOLD_=65536``, so the peak follows the live tensors (glibc
otherwise keeps freed heap, and the same step peaked anywhere from 1.2 to 2.9 GiB). The random model rarely writes its end token, so completions run to their full length.

``--family masked_diffusion_lm`` does the same for ``dllm_quickstart`` on a 1-layer, 64-wide ``BertForMaskedLM`` (with
a mask token; LLaDA's vocabulary is 126,464 ids), decoding blocks of 32 tokens, 8 per forward: 4 forwards per
block, so 4 steps at 32 tokens and 32 at 256, each replayed for the update.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

MEASURE = """
import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def build_model(folder: Path, vocabulary: int, family: str = "causal_lm") -> None:
    """The 1-layer, 64-wide Llama (or BERT masked LM) and its word-level tokenizer (every id decodes), saved as a
    stock folder."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: 3 + i for i, c in enumerate("0123456789+=")}}
    words.update({f"w{i}": i for i in range(len(words), vocabulary - 1)})
    words["<mask>"] = vocabulary - 1
    tokenizer = Tokenizer(WordLevel(words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    config = LlamaConfig(
        vocab_size=vocabulary,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    if family == "causal_lm":
        LlamaForCausalLM(config).save_pretrained(folder)
    else:
        bert = BertConfig(
            vocab_size=vocabulary,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            max_position_embeddings=4096,
            type_vocab_size=1,
            pad_token_id=0,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        BertForMaskedLM(bert).save_pretrained(folder)
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        mask_token="<mask>",
        padding_side="left",
        model_max_length=4096,
    ).save_pretrained(folder)


#: family -> its quickstart and the overrides that size its decoding for ``tokens`` new tokens
QUICKSTARTS = {
    "causal_lm": ("llm_quickstart", lambda tokens: []),
    "masked_diffusion_lm": (
        "dllm_quickstart",
        lambda tokens: ["backbone.block_length=32", f"backbone.steps={tokens // 8}", "rewards=[addition_verifier]"],
    ),
}


def peak_gib(model: Path, run_dir: Path, tokens: int, rows: int, family: str = "causal_lm") -> float:
    quickstart, sizing = QUICKSTARTS[family]
    command = [
        sys.executable,
        "-m",
        "gyremedia.cli",
        "train",
        quickstart,
        f"backbone.pretrained={model}",
        f"rollout.batch_size={rows}",
        "train.steps=1",
        f"backbone.max_new_tokens={tokens}",
        f"run.output_dir={run_dir}",
        "eval.prompts_file=null",
        "data.eval_prompts=[1+2=, 3+4=]",
        "eval.samples=4",
        "checkpoint.every=100",
        "export.on_train_end=false",
        "logging.progress=false",
        *sizing(tokens),
    ]
    # glibc maps every buffer of 64 KiB or more on its own and unmaps it on free, so the resident set follows the
    # live tensors rather than freed heap (as benchmarks/memory.py does)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, *command], capture_output=True, text=True, check=True, env=env
    )
    return int(done.stdout.split()[-1]) / 2**20  # KiB -> GiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocabulary", type=int, default=151_936)
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--family", choices=list(QUICKSTARTS), default="causal_lm")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        build_model(model, args.vocabulary, args.family)
        peaks = {n: peak_gib(model, Path(tmp) / f"run{n}", n, args.rows, args.family) for n in args.tokens}
    print(
        f"{args.family}: vocabulary {args.vocabulary}, {args.rows} rows, 1 layer of width 64 ({platform.machine()}, "
        f"{platform.processor() or 'cpu'})"
    )
    for n, peak in peaks.items():
        print(f"  {n:>5} new tokens: peak {peak:.2f} GiB")
    growth = peaks[max(peaks)] - peaks[min(peaks)]
    print(f"  growth from {min(peaks)} to {max(peaks)} tokens: {growth:+.2f} GiB")
    print(json.dumps({"vocabulary": args.vocabulary, "rows": args.rows, "peak_gib": peaks, "growth_gib": growth}))


if __name__ == "__main__":
    main()

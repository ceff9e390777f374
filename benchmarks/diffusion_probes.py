"""Why the tiny SD-1.x UNet base could not place objects: the probes of docs/benchmarks.md ("Diffusion UNet:
the diagnosis"), each a few minutes on a CPU.

    python benchmarks/diffusion_probes.py text
    python benchmarks/diffusion_probes.py train --condition oracle --steps 1500
    python benchmarks/diffusion_probes.py train --text-encoder t5 --steps 1500

``text``: a linear probe of where the first-named object of a relation goes (first = left or above, or
second) from one token's state of each frozen text encoder: trained on the train split's relation prompts,
scored on the held-out ones. A causal encoder's states before the relation word cannot carry it (50%).

``train``: pretrains a UNet as ``gyremedia_shapes.pretrain --family diffusion`` does (same widths, recipe
and autoencoder) and reports, on relation prompts, how often the relation holds among the samples that
drew both objects (``position_given_objects``; a random layout of two objects in distinct cells of the
2x2 grid satisfies it 1 time in 3). ``--condition oracle`` replaces each prompt by its layout, every
object followed by its cell's name ("red circle topleft blue square bottomright"): the text path then
only has to say what is in each cell, so what is left is whether the UNet can put it there.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from gyremedia.tiny.sd import TinySDOptions
from gyremedia_shapes.pretrain import DIFFUSION_MODEL, EMA, DiffusionFamily, evaluate, generate, load_vae
from gyremedia_shapes.verifier import verify
from gyremedia_shapes.world import VOCABULARY, cells_for, parse_prompt, render, split_prompts

ASSETS = Path(__file__).resolve().parents[1] / "assets"
CELL_NAMES = {(0, 0): "topleft", (0, 1): "topright", (1, 0): "bottomleft", (1, 1): "bottomright"}
#: where a relation puts its first and its second object
SIDES = {
    "left of": ("leftside", "rightside"),
    "right of": ("rightside", "leftside"),
    "above": ("topside", "bottomside"),
    "below": ("bottomside", "topside"),
}


def relation_prompts(prompts: list[str]) -> list[str]:
    return [p for p in prompts if parse_prompt(p).relation is not None]


# --------------------------------------------------------------------------- text probe


@torch.no_grad()
def token_states(tokenizer, encoder, prompts: list[str]) -> tuple[torch.Tensor, list[list[str]]]:
    """Last hidden states ``[N, L, D]`` and each prompt's tokens as words."""
    ids = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, return_tensors="pt")
    states = encoder(ids.input_ids).last_hidden_state
    words = [tokenizer.convert_ids_to_tokens(row) for row in ids.input_ids]
    return states, words


def role_index(words: list[str], role: str) -> int:
    """Position of the token playing ``role`` in a relation prompt's tokens."""
    clean = [w.replace("</w>", "").replace("\u2581", "") for w in words]
    shapes = [i for i, w in enumerate(clean) if w in ("circle", "square", "triangle")]
    if role == "first object":
        return shapes[0]
    if role == "second object":
        return shapes[1]
    return next(i for i, w in enumerate(clean) if w in ("<|endoftext|>", "</s>"))  # end of text


def linear_probe(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor) -> float:
    """Held-out accuracy of a logistic regression (L2 1e-3, 500 full-batch L-BFGS steps, standardised inputs)."""
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6
    train_x, test_x = (train_x - mean) / std, (test_x - mean) / std
    weight = torch.zeros(train_x.shape[1], requires_grad=True)
    bias = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=500)

    def closure():
        optimizer.zero_grad()
        logits = train_x @ weight + bias
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, train_y) + 1e-3 * weight.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        return float(((test_x @ weight + bias > 0).float() == test_y).float().mean())


def text_probe(folders: list[Path]) -> list[dict]:
    """The probe on every text encoder of each pipeline folder and a freshly built bidirectional one of the
    shipped UNet's encoder size."""
    from diffusers import DiffusionPipeline

    from gyremedia.tiny.sd import build_text_encoder

    train, heldout = (relation_prompts(p) for p in split_prompts(seed=0))
    encoders = {
        "T5, random weights (bidirectional)": build_text_encoder(
            TinySDOptions(**{**DIFFUSION_MODEL.__dict__, "text_encoder": "t5"})
        )
    }
    for folder in folders:
        pipe = DiffusionPipeline.from_pretrained(folder)
        for suffix in ("", "_2"):
            if getattr(pipe, f"text_encoder{suffix}", None) is not None:
                name = f"{folder.name} text_encoder{suffix} ({type(getattr(pipe, f'text_encoder{suffix}')).__name__})"
                encoders[name] = (getattr(pipe, f"tokenizer{suffix}"), getattr(pipe, f"text_encoder{suffix}"))
    labels = {
        split: torch.tensor([float(parse_prompt(p).relation in ("left of", "above")) for p in prompts])
        for split, prompts in (("train", train), ("heldout", heldout))
    }
    rows = []
    for name, (tokenizer, encoder) in encoders.items():
        encoder.eval()
        states = {
            split: token_states(tokenizer, encoder, prompts)
            for split, prompts in (("train", train), ("heldout", heldout))
        }
        for role in ("first object", "second object", "end of text"):
            pick = {
                split: torch.stack([s[role_index(w, role)] for s, w in zip(*states[split], strict=True)])
                for split in states
            }
            accuracy = linear_probe(pick["train"], labels["train"], pick["heldout"], labels["heldout"])
            rows.append({"encoder": name, "token": role, "heldout_accuracy": accuracy})
            print(json.dumps(rows[-1]), flush=True)
    return rows


# --------------------------------------------------------------------------- noise probe


@torch.no_grad()
def noise_probe(folders: list[Path], pairs: int = 64) -> list[dict]:
    """How often the same starting noise gives the same layout whatever the relation: each object pair of the
    held-out relation prompts is drawn from one noise under all four relations; where both objects are found
    in all four images, the share of cases where each object sits in the same grid cell in all four. A model
    that follows the relation moves them (at most 1 case in 4 for one object pair: left of and right of
    cannot both hold), a model whose layout comes from the noise does not."""
    from diffusers import DiffusionPipeline

    from gyremedia_shapes.verifier import detect_batch
    from gyremedia_shapes.world import CELL, RELATIONS

    objects = sorted(
        {
            (p.colour, p.shape, p.colour2, p.shape2)
            for p in map(parse_prompt, relation_prompts(split_prompts(seed=0)[1]))
        }
    )
    rows = []
    for folder in folders:
        pipe = DiffusionPipeline.from_pretrained(folder)
        pipe.set_progress_bar_config(disable=True)
        extra = {"max_sequence_length": 1} if "transformer" in pipe.components else {}
        same = []
        for i in range(pairs):
            c1, s1, c2, s2 = objects[i % len(objects)]
            texts = [f"a {c1} {s1} {r} a {c2} {s2}" for r in RELATIONS]
            images = generate(pipe, texts, [10_000 + i] * len(texts), arguments=extra)
            layouts = []
            for found in detect_batch(images):
                cells = [
                    next(((int(o.y // CELL), int(o.x // CELL)) for o in found if (o.colour, o.shape) == wanted), None)
                    for wanted in ((c1, s1), (c2, s2))
                ]
                layouts.append(None if None in cells else tuple(cells))
            if None not in layouts:
                same.append(len(set(layouts)) == 1)
        rows.append(
            {"model": str(folder), "pairs_found": len(same), "same_layout_for_all_relations": float(np.mean(same))}
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


# --------------------------------------------------------------------------- training probe


def oracle_text(prompt: str, cells: list[tuple[int, int]], condition: str = "oracle") -> str:
    """The prompt's objects, each followed by the name of the cell it is drawn in (``oracle``), or for a
    relation by the side the relation puts it on and otherwise the prompt itself (``sides``)."""
    parsed = parse_prompt(prompt)
    if condition == "sides":
        if parsed.relation is None:
            return prompt
        first, second = SIDES[parsed.relation]
        return f"{parsed.colour} {parsed.shape} {first} {parsed.colour2} {parsed.shape2} {second}"
    if parsed.relation is None:
        objects = [(parsed.colour, parsed.shape)] * parsed.count
    else:
        objects = [(parsed.colour, parsed.shape), (parsed.colour2, parsed.shape2)]
    return " ".join(
        f"{colour} {shape} {CELL_NAMES[cell]}" for (colour, shape), cell in zip(objects, cells, strict=True)
    )


def condition_batch(prompts: list[str], rng: np.random.Generator, condition: str) -> tuple[list[str], np.ndarray]:
    """Conditioning texts and ``[B, 3, H, W]`` renders in [0, 1]."""
    texts, images = [], []
    for prompt in prompts:
        cells = cells_for(parse_prompt(prompt), rng)
        texts.append(prompt if condition == "text" else oracle_text(prompt, cells, condition))
        images.append(render(prompt, rng, cells))
    return texts, np.stack(images).transpose(0, 3, 1, 2)


@torch.no_grad()
def oracle_evaluate(pipe, prompts: list[str], samples: int, condition: str, seed: int = 1234) -> dict[str, float]:
    """``position_given_objects`` of relation prompts generated from their layouts' oracle texts."""
    rng = np.random.default_rng(seed)
    chosen = [prompts[i % len(prompts)] for i in range(samples)]
    texts = [oracle_text(p, cells_for(parse_prompt(p), rng), condition) for p in chosen]
    images = generate(pipe, texts, [seed + i for i in range(samples)])
    results = [verify(image, prompt) for image, prompt in zip(images, chosen, strict=True)]
    found = [r["position"] for r in results if r["colour"]]
    return {"colour": float(np.mean([r["colour"] for r in results])), "position_given_objects": float(np.mean(found))}


def train_probe(args: argparse.Namespace) -> list[dict]:
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    train_prompts, heldout_prompts = split_prompts(seed=0)
    oracle = args.condition != "text"
    schedule = {"prediction_type": "v_prediction", "zero_terminal_snr": True} if args.zero_terminal_snr else {}
    family = DiffusionFamily(
        **schedule,
        text_encoder=args.text_encoder,
        unet_channels=args.unet_channels,
        high_noise_share=args.high_noise_share,
    )
    if oracle:
        family.sizes["words"] = [*VOCABULARY, *CELL_NAMES.values(), *{w for pair in SIDES.values() for w in pair}]
    pipe = family.build(args.seed)
    if args.unet_config:  # the same UNet with other stock config values
        from diffusers import UNet2DConditionModel

        overrides = {key: json.loads(value) for key, value in (item.split("=", 1) for item in args.unet_config)}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)
            pipe.register_modules(unet=UNet2DConditionModel.from_config({**pipe.unet.config, **overrides}))
    pipe.set_progress_bar_config(disable=True)
    load_vae(pipe, ASSETS / "shapes16", train_prompts, rng)
    modules = [pipe.unet, pipe.text_encoder]
    params = [p for m in modules for p in m.parameters()]
    for m in modules:
        m.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 300))
    ema = EMA(params, decay=0.995)
    started, history = time.time(), []
    relations = {"heldout": relation_prompts(heldout_prompts), "train": relation_prompts(train_prompts)}
    for step in range(1, args.steps + 1):
        prompts = list(rng.choice(train_prompts, args.batch))
        texts, renders = condition_batch(prompts, rng, args.condition)
        with torch.no_grad():
            latents = pipe.vae.encode(torch.from_numpy(renders) * 2 - 1).latent_dist.mode()
            x0 = latents * pipe.vae.config.scaling_factor
        loss = family.loss(pipe, x0, texts, "uniform")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        warmup.step()
        optimizer.zero_grad(set_to_none=True)
        ema.update(step)
        if step % args.eval_every == 0:
            ema.swap()
            for m in modules:
                m.eval()
            record = {"step": step, "minutes": round((time.time() - started) / 60, 1)}
            for split, prompts_of_split in relations.items():
                if oracle:
                    record[split] = oracle_evaluate(pipe, prompts_of_split, args.eval_samples, args.condition)
                else:
                    record[split] = evaluate(pipe, prompts_of_split, args.eval_samples, arguments={})
            history.append(record)
            print(json.dumps(record), flush=True)
            if step == args.steps and args.save is not None:
                pipe.save_pretrained(args.save)
            ema.swap()
            for m in modules:
                m.train()
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="probe", required=True)
    text = commands.add_parser("text", help="linear probes of the frozen text encoders")
    text.add_argument("models", type=Path, nargs="*", default=[ASSETS / "shapes16_sd", ASSETS / "shapes16"])
    noise = commands.add_parser("noise", help="does the starting noise or the relation decide the layout?")
    noise.add_argument("models", type=Path, nargs="*", default=[ASSETS / "shapes16_sd", ASSETS / "shapes16"])
    train = commands.add_parser("train", help="pretrain a UNet variant and measure its layouts")
    train.add_argument("--condition", choices=("text", "oracle", "sides"), default="text")
    train.add_argument("--save", type=Path, default=None, help="save the pipeline here at the end")
    train.add_argument("--text-encoder", choices=("clip", "t5"), default="clip")
    train.add_argument("--unet-channels", type=int, nargs="+", default=None)
    train.add_argument("--high-noise-share", type=float, default=0.0, help="share of timesteps from the top 15%%")
    train.add_argument(
        "--unet-config",
        nargs="+",
        default=[],
        metavar="KEY=JSON",
        help="UNet2DConditionModel config values, e.g. conv_out_kernel=17 (every output sees the padding around "
        "the whole 16x16 latent) or addition_embed_type='\"text\"' addition_embed_type_num_heads=4 (the prompt "
        "pooled into every resnet, as SD3 conditions on CLIP's pooled output)",
    )
    train.add_argument("--zero-terminal-snr", action="store_true", help="v-prediction, betas rescaled to SNR 0 at T")
    train.add_argument("--steps", type=int, default=1500)
    train.add_argument("--eval-every", type=int, default=500)
    train.add_argument("--eval-samples", type=int, default=256)
    train.add_argument("--batch", type=int, default=32)
    train.add_argument("--lr", type=float, default=1.5e-3)
    train.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    if args.probe == "text":
        text_probe(args.models)
    elif args.probe == "noise":
        noise_probe(args.models)
    else:
        train_probe(args)


if __name__ == "__main__":
    main()

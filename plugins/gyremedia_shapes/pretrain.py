"""Pretrain the tiny quickstart text-to-image models on ShapesBench renders (CPU, fixed seed).

    python -m gyremedia_shapes.pretrain --out assets/shapes16 --steps 1500 --eval-every 500
    python -m gyremedia_shapes.pretrain --family diffusion_zero_snr --high-noise-share 0.5 \
        --vae-from assets/shapes16 --out assets/shapes16_sd ...

The diffusion families (see :data:`FAMILIES`) make the SD-1.x/2.x-style ``StableDiffusionPipeline`` instead: a
UNet trained on ``scheduler.add_noise`` states (DDPM timesteps drawn uniformly, or ``--high-noise-share`` of
each batch from the noisiest 15%), DDIM for evaluation, and by default the already trained autoencoder of
``--vae-from`` (its ``shift_factor`` dropped: Stable Diffusion's pipelines only scale latents, so the diffusion
model learns latents with their small mean). ``--family diffusion`` is SD 1.x's epsilon-prediction schedule,
``diffusion_zero_snr`` v-prediction with betas rescaled to a zero terminal SNR and "trailing" DDIM spacing (SD
2.x-style). The shipped ``assets/shapes16_sd`` is the latter with half of each batch at the noisiest levels:
SD 1.x's schedule leaves enough signal at its last timestep to read the layout off the noise, so its UNet never
learns to take the layout from the prompt (docs/benchmarks.md, "Diffusion UNet").

Stage 1 trains the tiny AutoencoderKL to reconstruct renders; stage 2 trains the SD3 transformer and
both CLIP text encoders with the rectified-flow loss on its latents (AdamW, EMA). Timesteps are drawn
uniformly by default: the layout of a scene (where the objects of a relation go) is decided at high
noise, which SD3's logit-normal density rarely visits on a 16x16 canvas (``--timesteps logit_normal``
learns shapes and colours but leaves relations at chance).
The result is a stock ``StableDiffusion3Pipeline`` folder holding the EMA weights, plus
``pretraining.json`` with the held-out and train-prompt verifier accuracy measured at the end.
Deterministic for a given seed, step count and torch thread count.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from gyremedia.sampling import renoise
from gyremedia.tiny.sd import TinySDOptions, build_tiny_sd_pipeline
from gyremedia.tiny.sd3 import TinySD3Options, add_silent_t5, build_tiny_sd3_pipeline
from gyremedia_shapes.verifier import verify
from gyremedia_shapes.world import CANVAS, VOCABULARY, record, render_batch, split_prompts

MODEL = TinySD3Options(
    latent_size=CANVAS,
    latent_channels=4,
    vae_channels=[32],
    patch_size=2,
    num_layers=4,
    num_attention_heads=4,
    attention_head_dim=32,
    text_hidden_size=32,
    text_layers=2,
    text_max_length=12,
    words=VOCABULARY,
)
MAX_SEQUENCE_LENGTH = 1  # T5 is silent (its output is zero): one zero token stands in for its embeddings
DIFFUSION_MODEL = TinySDOptions(
    latent_size=CANVAS,
    latent_channels=4,
    vae_channels=[32],
    unet_channels=[32, 64],
    layers_per_block=1,
    attention_heads=4,
    text_hidden_size=32,
    text_layers=2,
    text_max_length=12,
    words=VOCABULARY,
)


def train_vae(
    pipe, prompts: list[str], steps: int, rng: np.random.Generator, batch: int = 64, shift: bool = True
) -> float:
    """Fit the autoencoder to renders; returns the final reconstruction MSE (images in [-1, 1]). Latents are
    normalised to unit variance, and to zero mean when ``shift`` (SD3's ``shift_factor``)."""
    vae = pipe.vae.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    loss = torch.tensor(0.0)
    for _ in tqdm(range(steps), desc="vae", mininterval=5):
        images = torch.from_numpy(render_batch(list(rng.choice(prompts, batch)), rng)) * 2 - 1
        posterior = vae.encode(images).latent_dist
        reconstruction = vae.decode(posterior.sample()).sample
        loss = torch.nn.functional.mse_loss(reconstruction, images)
        (loss + 1e-5 * posterior.kl().mean()).backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    vae.eval().requires_grad_(False)
    normalise_latents(vae, prompts, rng, shift)
    return float(loss)


@torch.no_grad()
def normalise_latents(vae, prompts: list[str], rng: np.random.Generator, shift: bool) -> None:
    """Set the VAE's ``scaling_factor`` (and ``shift_factor`` when ``shift``, as SD3's config has one; else
    none, as Stable Diffusion 1.x's pipeline only scales) so training latents have unit variance."""
    images = torch.from_numpy(render_batch(list(rng.choice(prompts, 512)), rng)) * 2 - 1
    latents = vae.encode(images).latent_dist.mode()
    vae.register_to_config(
        shift_factor=float(latents.mean()) if shift else None, scaling_factor=float(1 / latents.std())
    )


@torch.no_grad()
def generate(pipe, texts: list[str], seeds: list[int], steps: int = 10, arguments: dict | None = None) -> np.ndarray:
    """``[N, CANVAS, CANVAS, 3]`` images in [0, 1] of the stock pipeline for ``texts``, one generator per seed,
    without guidance (the tiny models are not trained for it)."""
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    return pipe(
        texts,
        num_inference_steps=steps,
        guidance_scale=1.0,
        height=CANVAS,
        width=CANVAS,
        generator=generators,
        output_type="np",
        **(arguments or {}),
    ).images


@torch.no_grad()
def evaluate(
    pipe, prompts: list[str], samples: int, seed: int = 1234, steps: int = 10, arguments: dict | None = None
) -> dict[str, float]:
    """Verifier accuracy of ``samples`` images (prompts cycled), generated by the stock pipeline (called with
    ``arguments`` besides; default: the SD3 pipeline's text length)."""
    arguments = {"max_sequence_length": MAX_SEQUENCE_LENGTH} if arguments is None else arguments
    chosen = [prompts[i % len(prompts)] for i in range(samples)]
    correct, criteria = [], {}
    for begin in range(0, samples, 64):
        batch = chosen[begin : begin + 64]
        images = generate(pipe, batch, [seed + begin + i for i in range(len(batch))], steps, arguments)
        for image, prompt in zip(images, batch):
            result = verify(image, prompt)
            if "position" in result and result["colour"]:  # the relation where both objects were drawn
                criteria.setdefault("position_given_objects", []).append(result["position"])
            correct.append(result.pop("correct"))
            for name, ok in result.items():
                criteria.setdefault(name, []).append(ok)
    return {"accuracy": float(np.mean(correct)), **{k: float(np.mean(v)) for k, v in criteria.items()}}


def write_prompt_files(out: Path, seed: int = 0) -> None:
    """The train and held-out prompt lists the quickstart config reads."""
    train, heldout = split_prompts(seed=seed)
    for name, prompts in (("train_prompts", train), ("heldout_prompts", heldout)):
        (out / f"{name}.txt").write_text("\n".join(prompts) + "\n")
        (out / f"{name}.jsonl").write_text("".join(json.dumps(record(p)) + "\n" for p in prompts))


class EMA:
    """Exponential moving average of parameters, swapped in for evaluation and saving."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float) -> None:
        self.params, self.decay = params, decay
        self.shadow = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        decay = min(self.decay, (1 + step) / (10 + step))
        for shadow, p in zip(self.shadow, self.params):
            shadow.lerp_(p.detach(), 1 - decay)

    @torch.no_grad()
    def swap(self) -> None:
        for shadow, p in zip(self.shadow, self.params):
            tmp = p.detach().clone()
            p.copy_(shadow)
            shadow.copy_(tmp)


TIMESTEP_SAMPLERS = {
    "uniform": lambda n: torch.rand(n),
    "logit_normal": lambda n: torch.sigmoid(torch.randn(n)),
}


class FlowFamily:
    """The SD3 pipeline: rectified flow, ``x_t = (1 - t) x0 + t eps``, the transformer predicts ``eps - x0``."""

    denoiser = "transformer"
    text_encoders = ("text_encoder", "text_encoder_2")
    eval_arguments = {"max_sequence_length": MAX_SEQUENCE_LENGTH}

    def build(self, seed: int):
        return build_tiny_sd3_pipeline(TinySD3Options(**{**MODEL.__dict__, "seed": seed}))

    def loss(self, pipe, x0: torch.Tensor, prompts: list[str], timesteps: str) -> torch.Tensor:
        t = TIMESTEP_SAMPLERS[timesteps](len(prompts))
        noise = torch.randn_like(x0)
        xt = renoise(x0, noise, t)
        embeds, _, pooled, _ = pipe.encode_prompt(
            prompts,
            None,
            None,
            device="cpu",
            do_classifier_free_guidance=False,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
        )
        velocity = pipe.transformer(
            hidden_states=xt,
            timestep=t * 1000,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            return_dict=False,
        )[0]
        return torch.nn.functional.mse_loss(velocity, noise - x0)


#: the noisiest share of the diffusion timesteps, which ``--high-noise-share`` of each batch is drawn from
HIGH_NOISE = 0.15


class DiffusionFamily:
    """The SD-1.x-style pipeline: ``x_t = scheduler.add_noise(x0, eps, t)`` at a DDPM timestep drawn uniformly
    (``--timesteps uniform``; the only choice), the UNet trained on the target of the scheduler's
    ``prediction_type`` (``eps``, or ``scheduler.get_velocity`` for v-prediction), as diffusers' examples do."""

    denoiser = "unet"
    text_encoders = ("text_encoder",)
    eval_arguments: dict = {}

    def __init__(
        self,
        prediction_type: str = "epsilon",
        zero_terminal_snr: bool = False,
        unet_channels: list[int] | None = None,
        text_encoder: str = "clip",
        high_noise_share: float = 0.0,
    ) -> None:
        self.schedule = {"prediction_type": prediction_type, "zero_terminal_snr": zero_terminal_snr}
        self.sizes = {"unet_channels": list(unet_channels)} if unet_channels else {}
        self.sizes["text_encoder"] = text_encoder
        self.high_noise_share = high_noise_share

    def build(self, seed: int):
        options = TinySDOptions(**{**DIFFUSION_MODEL.__dict__, **self.schedule, **self.sizes, "seed": seed})
        options.validate()
        return build_tiny_sd_pipeline(options)

    def loss(self, pipe, x0: torch.Tensor, prompts: list[str], timesteps: str) -> torch.Tensor:
        if timesteps != "uniform":
            raise ValueError("--family diffusion draws DDPM timesteps uniformly: use --timesteps uniform")
        scheduler = pipe.scheduler
        steps = scheduler.config.num_train_timesteps
        t = torch.randint(0, steps, (len(prompts),))
        high = torch.rand(len(prompts)) < self.high_noise_share  # where the prompt alone decides the layout
        t = torch.where(high, torch.randint(int(steps * (1 - HIGH_NOISE)), steps, (len(prompts),)), t)
        noise = torch.randn_like(x0)
        xt = scheduler.add_noise(x0, noise, t)
        target = noise if scheduler.config.prediction_type == "epsilon" else scheduler.get_velocity(x0, noise, t)
        embeds, _ = pipe.encode_prompt(
            prompts, device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=False
        )
        output = pipe.unet(xt, t, encoder_hidden_states=embeds, return_dict=False)[0]
        return torch.nn.functional.mse_loss(output, target)


#: ``--family``: what is pretrained (the VAE stage and the loop are shared)
FAMILIES = {
    "flow": FlowFamily(),
    "diffusion": DiffusionFamily(),
    "diffusion_zero_snr": DiffusionFamily("v_prediction", zero_terminal_snr=True),
}


def load_vae(pipe, folder: Path, prompts: list[str], rng: np.random.Generator) -> None:
    """Put the trained AutoencoderKL of the pipeline ``folder`` into ``pipe``, normalised without a shift."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(folder, subfolder="vae").eval().requires_grad_(False)
    normalise_latents(vae, prompts, rng, shift=False)
    pipe.register_modules(vae=vae)


def pretrain(
    out: Path,
    steps: int,
    vae_steps: int,
    seed: int,
    batch: int,
    lr: float,
    eval_every: int,
    eval_samples: int,
    snapshots: Path | None,
    timesteps: str = "uniform",
    family: str = "flow",
    vae_from: Path | None = None,
    unet_channels: list[int] | None = None,
    text_encoder: str = "clip",
    high_noise_share: float = 0.0,
) -> dict:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    kind = FAMILIES[family]
    if isinstance(kind, DiffusionFamily):
        kind = DiffusionFamily(
            **kind.schedule, unet_channels=unet_channels, text_encoder=text_encoder, high_noise_share=high_noise_share
        )
    train_prompts, heldout_prompts = split_prompts(seed=0)
    pipe = kind.build(seed)
    pipe.set_progress_bar_config(disable=True)
    started = time.time()
    if vae_from is not None:
        load_vae(pipe, vae_from, train_prompts, rng)
        vae_mse = None
    else:
        vae_mse = train_vae(pipe, train_prompts, vae_steps, rng, shift=family == "flow")
    vae_minutes = (time.time() - started) / 60

    modules = [getattr(pipe, name) for name in (kind.denoiser, *kind.text_encoders)]
    params = [p for m in modules for p in m.parameters()]
    for m in modules:
        m.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    warmup = 300
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    ema = EMA(params, decay=0.995)
    vae = pipe.vae
    history = []
    progress = tqdm(range(1, steps + 1), desc=family, mininterval=10)
    for step in progress:
        prompts = list(rng.choice(train_prompts, batch))
        with torch.no_grad():
            images = torch.from_numpy(render_batch(prompts, rng)) * 2 - 1
            # The posterior mean: its noise would only be noise for the flow model to learn.
            latents = vae.encode(images).latent_dist.mode()
            x0 = (latents - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor
        loss = kind.loss(pipe, x0, prompts, timesteps)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        ema.update(step)
        progress.set_postfix(loss=f"{loss.item():.4f}")
        if step % eval_every == 0 or step == steps:
            ema.swap()
            for m in modules:
                m.eval()
            record = {
                "step": step,
                "minutes": (time.time() - started) / 60,
                "loss": loss.item(),
                "heldout": evaluate(pipe, heldout_prompts, eval_samples, arguments=kind.eval_arguments),
                "train": evaluate(pipe, train_prompts, eval_samples, arguments=kind.eval_arguments),
            }
            history.append(record)
            print(json.dumps(record), flush=True)
            if snapshots is not None:
                pipe.save_pretrained(snapshots / f"step-{step:06d}")
            if step == steps:
                break  # keep the EMA weights in the pipeline for saving
            ema.swap()
            for m in modules:
                m.train()
    for m in modules:
        m.eval().requires_grad_(False)
    pipe.save_pretrained(out)
    write_prompt_files(out)
    options = (
        (f" --family {family}" if family != "flow" else "")
        + (f" --vae-from {vae_from}" if vae_from else "")
        + (f" --unet-channels {' '.join(map(str, unet_channels))}" if unet_channels else "")
        + (f" --text-encoder {text_encoder}" if text_encoder != "clip" else "")
        + (f" --high-noise-share {high_noise_share}" if high_noise_share else "")
    )
    summary = {
        "command": f"python -m gyremedia_shapes.pretrain --out {out} --steps {steps} --vae-steps {vae_steps} "
        f"--seed {seed} --batch {batch} --lr {lr} --timesteps {timesteps}{options}",
        "family": family,
        "seed": seed,
        "steps": steps,
        "timesteps": timesteps,
        "vae_steps": vae_steps,
        "vae_mse": vae_mse,
        "vae_minutes": vae_minutes,
        "minutes": (time.time() - started) / 60,
        "torch_threads": torch.get_num_threads(),
        "parameters": {
            name: sum(p.numel() for p in getattr(pipe, name).parameters())
            for name in (kind.denoiser, "vae", *kind.text_encoders)
        },
        "final": history[-1],
        "history": history,
        "train_prompts": len(train_prompts),
        "heldout_prompts": len(heldout_prompts),
    }
    (out / "pretraining.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="pipeline folder to write")
    parser.add_argument(
        "--family",
        choices=sorted(FAMILIES),
        default="flow",
        help="flow: the SD3 pipeline; diffusion: the SD-1.x-style UNet pipeline; diffusion_zero_snr: "
        "the same with v-prediction and a zero-terminal-SNR schedule (SD 2.x-style)",
    )
    parser.add_argument(
        "--vae-from",
        type=Path,
        default=None,
        help="take the trained autoencoder of this pipeline folder instead of training one",
    )
    parser.add_argument(
        "--unet-channels",
        type=int,
        nargs="+",
        default=None,
        help="diffusion families: the UNet's width per level (default: the shipped asset's "
        f"{' '.join(map(str, DIFFUSION_MODEL.unet_channels))}; each extra level halves the size)",
    )
    parser.add_argument(
        "--text-encoder",
        choices=("clip", "t5"),
        default="clip",
        help="diffusion families: clip (SD 1.x's, causal) or t5 (bidirectional: a word's state sees the whole "
        "prompt, which the UNet needs to tell which object a relation puts first)",
    )
    parser.add_argument(
        "--high-noise-share",
        type=float,
        default=0.0,
        help="diffusion families: the share of each batch whose timesteps are drawn from the noisiest "
        f"{round(HIGH_NOISE * 100)} percent instead of all (where the prompt alone must decide the layout)",
    )
    parser.add_argument("--steps", type=int, default=1500, help="denoiser training steps")
    parser.add_argument("--vae-steps", type=int, default=800)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument(
        "--timesteps", choices=sorted(TIMESTEP_SAMPLERS), default="uniform", help="flow-matching timestep density"
    )
    parser.add_argument("--eval-every", type=int, default=1000)
    parser.add_argument("--eval-samples", type=int, default=256)
    parser.add_argument("--snapshots", type=Path, default=None, help="also save the pipeline at every evaluation")
    parser.add_argument(
        "--add-t5",
        action="store_true",
        help="only give the pipeline in --out (saved before pipelines had T5) its silent T5 encoder",
    )
    args = parser.parse_args(argv)
    if (args.unet_channels or args.text_encoder != "clip" or args.high_noise_share) and args.family == "flow":
        parser.error(
            "--unet-channels, --text-encoder, --high-noise-share: only the diffusion families take them; "
            "add --family diffusion"
        )
    if args.add_t5:
        add_silent_t5(str(args.out), MODEL.words)
        return
    summary = pretrain(
        args.out,
        args.steps,
        args.vae_steps,
        args.seed,
        args.batch,
        args.lr,
        args.eval_every,
        args.eval_samples,
        args.snapshots,
        args.timesteps,
        args.family,
        args.vae_from,
        args.unet_channels,
        args.text_encoder,
        args.high_noise_share,
    )
    print(json.dumps(summary["final"], indent=2))


if __name__ == "__main__":
    main()

"""First-party rewards, registered through the ``gyremedia`` entry point like any third party's.

Each module imports its heavy dependency (open_clip, pytesseract, ...) only when a run builds the
reward, so listing plugins stays fast and a missing optional package fails only the run that needs it.
"""

from gyremedia import hookimpl
from gyremedia.config import ConfigError
from gyremedia_rewards.clap import ClapOptions, ClapScore
from gyremedia_rewards.clip import ClipOptions, ClipScore, ClipSteering, ClipSteeringOptions
from gyremedia_rewards.compressibility import JpegCompressibility, JpegOptions
from gyremedia_rewards.geneval import GenEval, GenEvalOptions
from gyremedia_rewards.ocr import OcrOptions, OcrReward
from gyremedia_rewards.pinned import HPSv3, HPSv3Options, ImageReward, ImageRewardOptions, VideoAlign, VideoAlignOptions
from gyremedia_rewards.preference import (
    AestheticOptions,
    AestheticScore,
    HPSv2,
    HPSv2Options,
    PickScore,
    PickScoreOptions,
)
from gyremedia_rewards.remote import RemoteOptions, RemoteReward
from gyremedia_rewards.text import FormatOptions, FormatReward, LengthPenalty, LengthPenaltyOptions
from gyremedia_rewards.vlm_judge import VlmJudge, VlmJudgeOptions, missing_key


@hookimpl
def gyremedia_register_rewards(register):
    register(
        "jpeg_compressibility",
        JpegCompressibility,
        options=JpegOptions,
        description="DDPO's compressibility: minus the JPEG size of the image in kB",
    )
    register(
        "clip_score",
        ClipScore,
        options=ClipOptions,
        description="cosine similarity of image and prompt in open_clip's embedding",
    )
    register(
        "clip_steering",
        ClipSteering,
        options=ClipSteeringOptions,
        description="CLIP steering safety reward: the prompt's similarity moved toward positive, away from negative texts",
    )
    register(
        "pickscore",
        PickScore,
        options=PickScoreOptions,
        description="PickScore (Kirstain et al. 2023): logit_scale x cos(image, prompt) of its CLIP, / 26 as Flow-GRPO",
    )
    register(
        "hpsv2",
        HPSv2,
        options=HPSv2Options,
        description="Human Preference Score v2/v2.1: cos(image, prompt) under the HPS-tuned open_clip ViT-H-14",
    )
    register(
        "image_reward",
        ImageReward,
        options=ImageRewardOptions,
        description="ImageReward (Xu et al. 2023) by its own package; serve it from its own environment",
    )
    register(
        "hpsv3",
        HPSv3,
        options=HPSv3Options,
        description="HPSv3 (Ma et al. 2025): its predicted mean preference, by its own package; serve it from its "
        "own environment",
    )
    register(
        "videoalign",
        VideoAlign,
        options=VideoAlignOptions,
        description="VideoReward (VideoAlign): visual, motion and text-alignment quality of each clip, summed, by "
        "its repository's own code; serve it from its own environment",
    )
    register(
        "aesthetic",
        AestheticScore,
        options=AestheticOptions,
        description="the LAION aesthetic predictor v2: an MLP on the CLIP ViT-L/14 image embedding (about 1-10)",
    )
    register(
        "clap",
        ClapScore,
        options=ClapOptions,
        description="LAION CLAP: cos(audio, prompt) of transformers' ClapModel, audio mixed to mono at 48 kHz",
    )
    register(
        "geneval",
        GenEval,
        options=GenEvalOptions,
        description="GenEval: objects, counts, colours and positions (Mask2Former, CLIP) vs the prompt record's "
        "metadata; Flow-GRPO's partial score, GenEval's correct logged",
    )
    register(
        "ocr",
        OcrReward,
        options=OcrOptions,
        description="1 - normalised edit distance between the prompt's quoted text and the OCR reading (PP-OCR or Tesseract)",
    )
    register(
        "format",
        FormatReward,
        options=FormatOptions,
        description="text: 1 when the completion matches a regular expression",
    )
    register(
        "length_penalty",
        LengthPenalty,
        options=LengthPenaltyOptions,
        description="text: DAPO's soft overlong punishment, 0 below max_length - cache, down to -1 at max_length",
    )
    register(
        "remote",
        RemoteReward,
        options=RemoteOptions,
        description="a reward served by `gyremedia serve-reward` in its own process or environment, by its url",
    )
    register(
        "vlm_judge",
        VlmJudge,
        options=VlmJudgeOptions,
        description="a vision-language model behind an OpenAI-compatible server grades each image by a rubric",
    )


@hookimpl
def gyremedia_configure(config, accelerator):
    """A training run stops before any model loads when a judge on another machine has no key (checked here, not
    with the options, so ``gyremedia export`` and ``config`` of such a run need no key), or when a judge that grades
    images only (a UnifiedReward preset) would be given a token policy's text."""
    media = config.backbone.meta.get("media_kind") if config.backbone is not None else None
    for key, selected in [
        *((f"rewards.{i}", s) for i, s in enumerate(config.rewards)),
        *((f"monitor.gold.{i}", s) for i, s in enumerate(config.gold_rewards)),
    ]:
        if not isinstance(selected.options, VlmJudgeOptions):
            continue
        why = missing_key(selected.options)
        if why:
            raise ConfigError(f"{key}.api_key_env={selected.options.api_key_env!r}: {why}")
        if media == "text" and selected.options.text_rubric is None:
            raise ConfigError(
                f"{key}.preset={selected.options.preset!r}: judges images, but backbone "
                f"{config.backbone.name!r} makes text: use preset: none (its text_rubric), or set "
                "text_rubric, score_pattern and max_score"
            )

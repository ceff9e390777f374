"""VLM-as-judge reward: an OpenAI-compatible chat-completions client (vLLM, SGLang, hosted APIs).

Each image goes to ``{base_url}/chat/completions`` as a PNG data URL beside a rubric naming the
prompt; a text completion (a token policy's) goes inside ``text_rubric`` beside its prompt, so the
same client is an LLM judge. The first number in the reply (the first match of ``score_pattern``), divided by
``max_score``, is the score. Requests run
``max_concurrency`` at a time; connection errors, timeouts, HTTP 429/5xx and unparseable replies
are retried with exponential backoff. A sample whose retries run out gets a NaN score, which the
reward's ``on_failure`` policy turns into a clear error (``fail``) or a dropped sample (``drop``).
Start a judge with e.g. ``vllm serve Qwen/Qwen2.5-VL-7B-Instruct`` and point ``base_url`` at it.

``preset`` names a judge whose question its model was trained on, and fills in ``model``, ``rubric``,
``text_rubric``, ``score_pattern``, ``max_score`` and ``max_tokens`` where the yaml leaves them out (a key the
yaml sets wins, e.g. ``model: UnifiedReward`` for a server started with ``--served-model-name UnifiedReward``):

- ``unified_reward``: UnifiedReward's pointwise image-generation question for its Qwen2.5-VL checkpoints
  (``vllm serve CodeGoat24/UnifiedReward-qwen-7b``, or ``UnifiedReward-2.0-qwen-7b``).
- ``unified_reward_flow_grpo``: the question Flow-GRPO's ``unifiedreward`` reward sends to the LLaVA checkpoint
  ``CodeGoat24/UnifiedReward-7b-v1.5`` (served by SGLang in Flow-GRPO's README).

Both send the image before the question, as their sources do, and read the number after ``Final Score:`` (1 to 5)
divided by 5, as Flow-GRPO does; both judge images only. Where Flow-GRPO scores a reply without a score 0, it is
retried here and then NaN, like any unreadable reply; and Flow-GRPO resizes each image to 512x512 first, where this
client sends it as sampled.

The API key (from ``api_key_env``) goes only over https or to this machine (loopback), unless the yaml sets
``allow_insecure_key``; it is never forwarded when the server redirects to another host. A server elsewhere
needs its key set before the run starts (checked with the config), or ``api_key_env: ""`` for one that takes none.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import ipaddress
import json
import logging
import math
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from PIL import Image

from gyremedia.interfaces import BuildContext
from gyremedia.options import OptionError, option, regular_expression
from gyremedia.rollout import Media
from gyremedia_rewards.retry import Retry, with_backoff

logger = logging.getLogger("gyremedia")


@dataclass(frozen=True)
class Preset:
    """What ``preset`` fills in where the yaml leaves a key out: the judge, its questions, how its reply is read."""

    model: str
    rubric: str
    text_rubric: str | None  # None: the judge grades images only
    score_pattern: str
    max_score: float
    max_tokens: int


#: The number after "Final Score:" (1 to 5), as Flow-GRPO's ``unifiedreward_score_sglang`` reads it
#: (yifan123/flow_grpo, flow_grpo/rewards.py).
UNIFIED_REWARD_SCORE = r"Final Score:\s*([1-5](?:\.\d+)?)"

PRESETS: dict[str, Preset] = {
    "none": Preset(
        model="Qwen/Qwen2.5-VL-7B-Instruct",
        rubric='Does this image match the description: "{prompt}"? Rate it from 0 (not at all) to 10 (perfectly). '
        "Answer with the number only.",
        text_rubric="Here is a request and an answer to it.\n\nRequest: {prompt}\n\nAnswer: {completion}\n\n"
        "Rate the answer from 0 (useless or wrong) to 10 (correct and helpful). Answer with the number "
        "only.",
        score_pattern=r"-?\d+(?:\.\d+)?",
        max_score=10.0,
        max_tokens=16,
    ),
    # The pointwise image-generation question UnifiedReward's authors ask its Qwen2.5-VL checkpoints, verbatim
    # (CodeGoat24/UnifiedReward, inference_qwen/image_generation/qwen_point_score_image_generation.py; the
    # "Classic" capabilities of UnifiedReward-2.0-qwen). The reply lists "element (type): 0/1" lines, then
    # "Final Score: X"; 512 tokens as that script's max_new_tokens.
    "unified_reward": Preset(
        model="CodeGoat24/UnifiedReward-qwen-7b",
        rubric="You are given a text caption and a generated image based on that caption. Your task is to evaluate "
        "this image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image "
        "aligns with the provided caption. Consider the accuracy of depicted objects, their relationships, and "
        "attributes as described in the caption.\n2. Overall Image Quality: Examine the visual quality of this "
        "image, including clarity, detail preservation, color accuracy, and overall aesthetic appeal.\nExtract "
        "key elements from the provided text caption, evaluate their presence in the generated image using the "
        "format: 'element (type): value' (where value=0 means not generated, and value=1 means generated), and "
        "assign a score from 1 to 5 after 'Final Score:'.\nYour task is provided as follows:\n"
        "Text Caption: [{prompt}]",
        text_rubric=None,
        score_pattern=UNIFIED_REWARD_SCORE,
        max_score=5.0,
        max_tokens=512,
    ),
    # The question Flow-GRPO's "unifiedreward" reward sends, verbatim with its leading "<image>\n" (LLaVA's image
    # placeholder), beside the image, to CodeGoat24/UnifiedReward-7b-v1.5 served by SGLang (yifan123/flow_grpo,
    # flow_grpo/rewards.py, unifiedreward_score_sglang; the same text is CodeGoat24/UnifiedReward's
    # sglang_llava/sglang_inference.py). Flow-GRPO divides the score by 5.
    "unified_reward_flow_grpo": Preset(
        model="CodeGoat24/UnifiedReward-7b-v1.5",
        rubric="<image>\nYou are given a text caption and a generated image based on that caption. Your task is to "
        "evaluate this image based on two key criteria:\n1. Alignment with the Caption: Assess how well this "
        "image aligns with the provided caption. Consider the accuracy of depicted objects, their "
        "relationships, and attributes as described in the caption.\n2. Overall Image Quality: Examine the "
        "visual quality of this image, including clarity, detail preservation, color accuracy, and overall "
        "aesthetic appeal.\nBased on the above criteria, assign a score from 1 to 5 after 'Final Score:'.\n"
        "Your task is provided as follows:\nText Caption: [{prompt}]",
        text_rubric=None,
        score_pattern=UNIFIED_REWARD_SCORE,
        max_score=5.0,
        max_tokens=512,
    ),
}

#: The keys a preset fills in.
PRESET_KEYS = tuple(f.name for f in dataclasses.fields(Preset))
#: The keys that say what the question is and how its answer is read: one of them left at the built-in
#: judge's value under another preset mixes two judges (typically a config saved before the preset was chosen).
QUESTION_KEYS = ("rubric", "score_pattern", "max_score")


@dataclass
class VlmJudgeOptions:
    base_url: str = option(
        "http://127.0.0.1:8000/v1",
        help="the server's OpenAI-compatible root",
        check=lambda v: None if v.startswith(("http://", "https://")) else "give an http(s):// URL",
    )
    preset: Literal["none", "unified_reward", "unified_reward_flow_grpo"] = option(
        "none",
        help="a judge whose question its model was trained on: fills in model, rubric, text_rubric, "
        "score_pattern, max_score and max_tokens where they are not set (unified_reward: UnifiedReward's "
        "Qwen checkpoints; unified_reward_flow_grpo: Flow-GRPO's UnifiedReward-7b-v1.5 question)",
    )
    model: str | None = option(
        None, help="the model name the server serves (None: the preset's; preset none: Qwen/Qwen2.5-VL-7B-Instruct)"
    )
    api_key_env: str = option(
        "OPENAI_API_KEY",
        help="environment variable holding the key (keys never go in a yaml); "
        "empty for a server elsewhere that takes no key",
    )
    allow_insecure_key: bool = option(
        False, help="send the key over plain http to a host other than this machine (anyone on the way can read it)"
    )
    rubric: str | None = option(
        None,
        help="the question; {prompt} is the sample's prompt (None: the preset's; preset "
        "none asks for a 0-10 match with the description)",
        check=lambda v: None if "{prompt}" in v else "must contain {prompt}, where the sample's prompt goes",
    )
    text_rubric: str | None = option(
        None,
        help="the question for text media; {prompt} and {completion} are filled in "
        "(None: the preset's; a UnifiedReward preset judges images only)",
        check=lambda v: None if "{completion}" in v else "must contain {completion}, where the answer goes",
    )
    score_pattern: str | None = option(
        None,
        help="the first match in the reply is the raw score, or its first "
        "group when the pattern has one (None: the preset's; preset none: "
        "the first number; UnifiedReward: the number after 'Final Score:')",
        check=regular_expression,
    )
    max_score: float | None = option(
        None,
        gt=0,
        help="raw scores are divided by this, then clipped to [0, 1] (None: the preset's: 10, or 5 for UnifiedReward)",
    )
    max_concurrency: int = option(8, ge=1, help="requests in flight at once")
    request_timeout: float = option(60.0, gt=0, help="seconds per request")
    max_retries: int = option(3, ge=0, help="extra attempts after a failed or unparseable reply")
    backoff: float = option(1.0, ge=0, help="seconds before the first retry, doubled after each")
    max_tokens: int | None = option(
        None,
        ge=1,
        help="longest reply (None: the preset's: 16, or 512 for UnifiedReward, "
        "which lists what it checked before its score)",
    )
    temperature: float = option(0.0, ge=0, help="the judge's sampling temperature")

    def __post_init__(self) -> None:
        """Fill the keys the yaml left out from the preset, so the options (and the config a run saves) hold the
        values the judge uses."""
        preset = PRESETS.get(self.preset)
        if preset is None:  # not a preset: validate() names the choices
            return
        for key in PRESET_KEYS:
            if getattr(self, key) is None:
                setattr(self, key, getattr(preset, key))

    def validate(self) -> None:
        """A preset's question is not mixed with the built-in one; a key goes to a server elsewhere only over https,
        unless the yaml opts in."""
        if self.preset != "none":
            builtin, chosen = PRESETS["none"], PRESETS[self.preset]
            for key in QUESTION_KEYS:
                if getattr(self, key) == getattr(builtin, key) != getattr(chosen, key):
                    raise OptionError(
                        key,
                        f"is preset none's {key}, which preset {self.preset!r} replaces with its "
                        f"own: leave {key} out (a config saved before the preset was chosen holds "
                        "it), or set preset: none",
                    )
        url = urllib.parse.urlsplit(self.base_url)
        if is_loopback(url.hostname or ""):
            return
        if self.api_key_env and url.scheme != "https" and not self.allow_insecure_key:
            raise OptionError(
                "base_url",
                f"{self.base_url} would send the key in {self.api_key_env} unencrypted to "
                "another machine: use https://, or set allow_insecure_key: true",
            )


def missing_key(options: VlmJudgeOptions) -> str | None:
    """Why a judge on another machine cannot be called: its key's variable is not set (``None`` when it can)."""
    if is_loopback(urllib.parse.urlsplit(options.base_url).hostname or "") or not options.api_key_env:
        return None
    if os.environ.get(options.api_key_env):
        return None
    return (
        f"{options.api_key_env} is not set, and base_url={options.base_url} is not on this machine: export "
        f"{options.api_key_env}=<key> before the run, or set api_key_env to '' for a server that takes no key"
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine: ``localhost`` or a loopback address (127.0.0.0/8, ::1)."""
    if host.lower() in ("localhost", "localhost.localdomain") or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class KeepKeyOnSameHost(urllib.request.HTTPRedirectHandler):
    """Follows redirects, dropping the ``Authorization`` header when one leads to another host or scheme
    (urllib forwards it everywhere by default)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        before, after = urllib.parse.urlsplit(req.full_url), urllib.parse.urlsplit(newurl)
        if new is not None and (before.scheme, before.netloc) != (after.scheme, after.netloc):
            new.headers = {k: v for k, v in new.headers.items() if k.lower() != "authorization"}
            new.unredirected_hdrs = {k: v for k, v in new.unredirected_hdrs.items() if k.lower() != "authorization"}
        return new


class JudgeReplyError(RuntimeError):
    """The server answered, but not with something the rubric's score can be read from."""


def image_data_url(image: torch.Tensor) -> str:
    """A ``[3, H, W]`` image in [0, 1] as a PNG data URL."""
    pixels = (image.detach().cpu().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


class VlmJudge:
    """Asks a vision-language model to grade each image (or a language model each text) against its prompt."""

    kinds = {"image", "text"}

    def __init__(self, options: VlmJudgeOptions, context: BuildContext | None = None) -> None:
        self.options = options
        self.pattern = re.compile(options.score_pattern)
        self.url = options.base_url.rstrip("/") + "/chat/completions"
        self.api_key = os.environ.get(options.api_key_env, "") if options.api_key_env else ""
        self._opener = urllib.request.build_opener(KeepKeyOnSameHost)

    def message(self, prompt: str, sample: torch.Tensor | str) -> list[dict]:
        """The user message's content for one sample: the image and the rubric, or the text rubric."""
        if isinstance(sample, str):
            if self.options.text_rubric is None:
                raise RuntimeError(
                    f"vlm_judge preset {self.options.preset!r} judges images, not text: set text_rubric "
                    "(and a score_pattern and max_score to read its answer), or use preset: none"
                )
            return [{"type": "text", "text": self.options.text_rubric.format(prompt=prompt, completion=sample)}]
        return [
            {"type": "image_url", "image_url": {"url": image_data_url(sample)}},
            {"type": "text", "text": self.options.rubric.format(prompt=prompt)},
        ]

    def _request(self, content: list[dict]) -> str:
        body = {
            "model": self.options.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.options.max_tokens,
            "temperature": self.options.temperature,
        }
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, json.dumps(body).encode(), headers, method="POST")
        with self._opener.open(request, timeout=self.options.request_timeout) as response:
            reply = json.loads(response.read())
        try:
            return reply["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError) as exc:
            raise JudgeReplyError(f"no choices[0].message.content in the reply {str(reply)[:200]!r}") from exc

    def parse(self, text: str) -> float:
        """The reply's score in [0, 1]; raises :class:`JudgeReplyError` when there is none."""
        match = self.pattern.search(text)
        raw = match and match.group(1 if self.pattern.groups else 0)
        if not raw:
            raise JudgeReplyError(f"no score in the reply {text[:200]!r}")
        try:
            value = float(raw)
        except ValueError as exc:
            raise JudgeReplyError(f"the score {raw!r} in the reply {text[:200]!r} is not a number") from exc
        return min(max(value / self.options.max_score, 0.0), 1.0)

    def judge(self, prompt: str, sample: torch.Tensor | str) -> float:
        """One sample's score, retried with backoff; NaN when every attempt failed."""
        content = self.message(prompt, sample)

        def attempt() -> float:
            try:
                return self.parse(self._request(content))
            except urllib.error.HTTPError as exc:
                if exc.code != 429 and exc.code < 500:  # the request itself is wrong: retrying cannot help
                    raise RuntimeError(
                        f"judge at {self.url} refused the request: HTTP {exc.code} {exc.read()[:200]!r}"
                    ) from exc
                raise Retry(f"HTTP {exc.code}") from exc
            except (urllib.error.URLError, TimeoutError, ConnectionError, JudgeReplyError, json.JSONDecodeError) as exc:
                raise Retry(f"{type(exc).__name__}: {exc}") from exc

        try:
            return with_backoff(attempt, self.options.max_retries, self.options.backoff)
        except Retry as exc:
            logger.warning(
                "vlm_judge gave up on prompt %r after %d attempts: %s", prompt, self.options.max_retries + 1, exc
            )
            return math.nan

    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        with ThreadPoolExecutor(max_workers=self.options.max_concurrency) as pool:
            scores = list(pool.map(self.judge, prompts, list(media.data)))
        return {"score": torch.tensor(scores, dtype=torch.float32)}

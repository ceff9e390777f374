"""VLM-as-judge reward: an OpenAI-compatible chat-completions client (vLLM, SGLang, hosted APIs).

Each image goes to ``{base_url}/chat/completions`` as a PNG data URL beside a rubric naming the
prompt; a text completion (a token policy's) goes inside ``text_rubric`` beside its prompt, so the
same client is an LLM judge. The first number in the reply, divided by ``max_score``, is the score. Requests run
``max_concurrency`` at a time; connection errors, timeouts, HTTP 429/5xx and unparseable replies
are retried with exponential backoff. A sample whose retries run out gets a NaN score, which the
reward's ``on_failure`` policy turns into a clear error (``fail``) or a dropped sample (``drop``).
Start a judge with e.g. ``vllm serve Qwen/Qwen2.5-VL-7B-Instruct`` and point ``base_url`` at it.

The API key (from ``api_key_env``) goes only over https or to this machine (loopback), unless the yaml sets
``allow_insecure_key``; it is never forwarded when the server redirects to another host. A server elsewhere
needs its key set before the run starts (checked with the config), or ``api_key_env: ""`` for one that takes none.
"""

from __future__ import annotations

import base64
import ipaddress
import io
import json
import logging
import math
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from gyremedia.interfaces import BuildContext
from gyremedia.options import OptionError, option, regular_expression
from gyremedia.rollout import Media

logger = logging.getLogger("gyremedia")


@dataclass
class VlmJudgeOptions:
    base_url: str = option("http://127.0.0.1:8000/v1", help="the server's OpenAI-compatible root",
                           check=lambda v: None if v.startswith(("http://", "https://")) else "give an http(s):// URL")
    model: str = option("Qwen/Qwen2.5-VL-7B-Instruct", help="the model name the server serves")
    api_key_env: str = option("OPENAI_API_KEY", help="environment variable holding the key (keys never go in a yaml); "
                              "empty for a server elsewhere that takes no key")
    allow_insecure_key: bool = option(False, help="send the key over plain http to a host other than this machine "
                                      "(anyone on the way can read it)")
    rubric: str = option("Does this image match the description: \"{prompt}\"? Rate it from 0 (not at all) to 10 "
                         "(perfectly). Answer with the number only.", help="the question; {prompt} is the sample's prompt",
                         check=lambda v: None if "{prompt}" in v else "must contain {prompt}, where the sample's prompt goes")
    text_rubric: str = option("Here is a request and an answer to it.\n\nRequest: {prompt}\n\nAnswer: {completion}\n\n"
                              "Rate the answer from 0 (useless or wrong) to 10 (correct and helpful). Answer with the "
                              "number only.", help="the question for text media; {prompt} and {completion} are filled in",
                              check=lambda v: None if "{completion}" in v else "must contain {completion}, where the answer goes")
    score_pattern: str = option(r"-?\d+(?:\.\d+)?", help="the first match in the reply is the raw score",
                                check=regular_expression)
    max_score: float = option(10.0, gt=0, help="raw scores are divided by this")
    max_concurrency: int = option(8, ge=1, help="requests in flight at once")
    request_timeout: float = option(60.0, gt=0, help="seconds per request")
    max_retries: int = option(3, ge=0, help="extra attempts after a failed or unparseable reply")
    backoff: float = option(1.0, ge=0, help="seconds before the first retry, doubled after each")
    max_tokens: int = option(16, ge=1, help="longest reply")
    temperature: float = option(0.0, ge=0, help="the judge's sampling temperature")

    def validate(self) -> None:
        """A key goes to a server elsewhere only over https, unless the yaml opts in."""
        url = urllib.parse.urlsplit(self.base_url)
        if is_loopback(url.hostname or ""):
            return
        if self.api_key_env and url.scheme != "https" and not self.allow_insecure_key:
            raise OptionError("base_url", f"{self.base_url} would send the key in {self.api_key_env} unencrypted to "
                                          "another machine: use https://, or set allow_insecure_key: true")


def missing_key(options: VlmJudgeOptions) -> str | None:
    """Why a judge on another machine cannot be called: its key's variable is not set (``None`` when it can)."""
    if is_loopback(urllib.parse.urlsplit(options.base_url).hostname or "") or not options.api_key_env:
        return None
    if os.environ.get(options.api_key_env):
        return None
    return (f"{options.api_key_env} is not set, and base_url={options.base_url} is not on this machine: export "
            f"{options.api_key_env}=<key> before the run, or set api_key_env to '' for a server that takes no key")


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
            return [{"type": "text", "text": self.options.text_rubric.format(prompt=prompt, completion=sample)}]
        return [{"type": "image_url", "image_url": {"url": image_data_url(sample)}},
                {"type": "text", "text": self.options.rubric.format(prompt=prompt)}]

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
        if match is None:
            raise JudgeReplyError(f"no score in the reply {text[:200]!r}")
        return min(max(float(match.group(0)) / self.options.max_score, 0.0), 1.0)

    def judge(self, prompt: str, sample: torch.Tensor | str) -> float:
        """One sample's score, retried with backoff; NaN when every attempt failed."""
        content = self.message(prompt, sample)
        delay, problem = self.options.backoff, ""
        for attempt in range(self.options.max_retries + 1):
            if attempt:
                time.sleep(delay)
                delay *= 2
            try:
                return self.parse(self._request(content))
            except urllib.error.HTTPError as exc:
                if exc.code != 429 and exc.code < 500:  # the request itself is wrong: retrying cannot help
                    raise RuntimeError(f"judge at {self.url} refused the request: HTTP {exc.code} "
                                       f"{exc.read()[:200]!r}") from exc
                problem = f"HTTP {exc.code}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, JudgeReplyError, json.JSONDecodeError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
        logger.warning("vlm_judge gave up on prompt %r after %d attempts: %s", prompt,
                       self.options.max_retries + 1, problem)
        return math.nan

    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        with ThreadPoolExecutor(max_workers=self.options.max_concurrency) as pool:
            scores = list(pool.map(self.judge, prompts, list(media.data)))
        return {"score": torch.tensor(scores, dtype=torch.float32)}

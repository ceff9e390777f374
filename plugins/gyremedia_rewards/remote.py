"""``remote``: a reward served by ``gyremedia serve-reward`` in another process or on another machine.

The run calls it by the served reward's name (its metrics are ``reward/<name>/...``, so ``eval.metric:
shapes_verifier/correct`` works through it) and checks its media kinds against the backbone's with the config;
both come from the server's ``/health`` unless the yaml gives ``reward`` and ``kinds`` (then the config is checked
without the server, and they are compared with what it serves at the first call). A batch goes out in requests of
``batch_size`` samples, ``concurrency`` at a time. Connection errors, timeouts and HTTP 429/502/503/504 are retried
with exponential backoff; once the retries run out, or the reward itself raised on the server, the call fails
naming the url, and the reward's ``on_failure`` decides (``fail`` stops the run, ``drop`` drops the samples). Each
call reconnects, so a restarted server is picked up at the next one.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from gyremedia.interfaces import BuildContext
from gyremedia.options import OptionError, option
from gyremedia.reward_server import CONTENT_TYPE, decode_scores, encode_batch
from gyremedia.rollout import MEDIA_KINDS, Media
from gyremedia.scoring import MalformedRewardOutput
from gyremedia_rewards.retry import Retry, with_backoff

RETRIED_STATUS = {429, 502, 503, 504}  # the server is busy, restarting or behind a proxy that lost it: try again


@dataclass
class RemoteOptions:
    url: str | None = option(
        None,
        help="the server's root, e.g. http://127.0.0.1:8000",
        check=lambda v: None if v.startswith(("http://", "https://")) else "give an http(s):// URL",
    )
    reward: str | None = option(
        None, help="the served reward's name, which the run calls it by (default: asked of the server)"
    )
    kinds: list[str] | None = option(
        None,
        help="the media kinds it scores (default: asked of the server)",
        check=lambda v: None if set(v) <= set(MEDIA_KINDS) else f"expected kinds among {', '.join(MEDIA_KINDS)}",
    )
    request_timeout: float = option(60.0, gt=0, help="seconds one request may take")
    retries: int = option(3, ge=0, help="extra attempts after a connection error, a timeout or a busy server")
    backoff: float = option(0.5, ge=0, help="seconds before the first retry, doubled after each")
    concurrency: int = option(4, ge=1, help="requests in flight at once")
    batch_size: int = option(32, ge=1, help="samples per request")

    def validate(self) -> None:
        """Without ``reward`` and ``kinds`` the server must answer now: they are read from its ``/health``."""
        if self.url is None:
            raise OptionError(
                "url",
                "give the reward server's root, e.g. http://127.0.0.1:8000 (start one with "
                "`gyremedia serve-reward NAME --port 8000`)",
            )
        if self.reward is not None and self.kinds is not None:
            return
        try:
            health = server_health(self.url, min(self.request_timeout, 5.0))
        except OSError as exc:
            raise OptionError(
                "url",
                f"no reward server answers at {self.url}/health ({exc}): start it with "
                "`gyremedia serve-reward NAME`, or set reward and kinds to check the config "
                "without it",
            ) from exc
        self.reward = self.reward or health["reward"]
        self.kinds = self.kinds or list(health["kinds"])

    def capabilities(self) -> dict:
        """This selection's media kinds, and the served name the run calls it by."""
        return {"kinds": set(self.kinds or ()), "label": self.reward}


def server_health(url: str, timeout: float) -> dict:
    """The server's ``/health`` answer; raises ``OSError`` (a connection error, HTTP error or timeout) otherwise."""
    with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as response:
        return json.loads(response.read())


class RemoteReward:
    """Scores a batch by posting it to a reward server (:mod:`gyremedia.reward_server`)."""

    def __init__(self, options: RemoteOptions, context: BuildContext | None = None) -> None:
        self.options, self.url = options, options.url.rstrip("/")
        self.kinds = set(options.kinds or ())
        self.checked = False  # whether the server was seen to serve the reward and kinds the run was configured with

    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        if not self.checked:
            self._check_served()
        size = self.options.batch_size
        starts = range(0, len(prompts), size)
        with ThreadPoolExecutor(max_workers=min(self.options.concurrency, len(starts))) as pool:
            parts = list(
                pool.map(
                    lambda begin: self._post(
                        encode_batch(media.select(slice(begin, begin + size)), prompts[begin : begin + size])
                    ),
                    starts,
                )
            )
        return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}

    def _check_served(self) -> None:
        """The server serves the reward and kinds the run expects (checked once; a server that does not answer is
        left to the scoring requests, which retry and name it)."""
        try:
            health = server_health(self.url, self.options.request_timeout)
        except OSError:
            return
        if self.options.reward != health["reward"] or not self.kinds <= set(health["kinds"]):
            raise RuntimeError(
                f"the server at {self.url} serves reward {health['reward']!r} of "
                f"{'/'.join(health['kinds'])} media, but the run expects {self.options.reward!r} of "
                f"{'/'.join(sorted(self.kinds))}: point url at its server, or fix reward and kinds"
            )
        self.checked = True

    def _post(self, body: bytes) -> dict[str, torch.Tensor]:
        """One request's scores, retried with backoff; raises naming the url once the retries run out."""
        request = urllib.request.Request(self.url + "/score", body, {"Content-Type": CONTENT_TYPE}, method="POST")

        def attempt() -> dict[str, torch.Tensor]:
            try:
                with urllib.request.urlopen(request, timeout=self.options.request_timeout) as response:
                    return decode_scores(response.read())
            except urllib.error.HTTPError as exc:
                if exc.code not in RETRIED_STATUS:
                    raise _server_error(self.url, exc) from exc
                raise Retry(f"HTTP {exc.code}") from exc
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                raise Retry(f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}") from exc

        try:
            return with_backoff(attempt, self.options.retries, self.options.backoff)
        except Retry as exc:
            raise ConnectionError(
                f"no answer from the reward server at {self.url} after {self.options.retries + 1} attempts ({exc})"
            ) from exc


def _server_error(url: str, error: urllib.error.HTTPError) -> Exception:
    """What the server's refusal means here: a broken reward contract (fatal), or the reward's own error."""
    try:
        answer = json.loads(error.read())
    except ValueError:
        answer = {}
    message = f"the reward server at {url} answered HTTP {error.code}: {answer.get('error', error.reason)}"
    return MalformedRewardOutput(message) if answer.get("contract") else RuntimeError(message)

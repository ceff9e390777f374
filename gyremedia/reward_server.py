"""Any registered reward behind HTTP, in a process (and an environment) of its own: ``gyremedia serve-reward``.

Rewards whose packages pin an old torch or transformers run in their own environment and are called by the
``remote`` reward over loopback or a network. The server is Starlette on uvicorn: a small, well-kept ASGI stack
(the one FastAPI is built on) with no torch, numpy or transformers pins of its own, so it installs beside any
reward's stack; nothing here needs FastAPI's request models, since a request body is one binary document.

The wire is lossless and holds no pickle. A request and an answer are each one safetensors document: tensors
exactly as they were (any dtype, bit for bit) and a string-to-string header for the rest, as JSON:

- ``POST /score`` sends the media (``media``: the batch tensor; text media as JSON in the header), the media's
  ``kind`` and ``meta`` (numbers and strings as JSON, tensors as ``meta/<key>``) and the prompt records
  (``prompts``: a JSON list of ``[text, fields]``); the answer holds each component as a float32 tensor.
- ``GET /health`` answers (JSON) once the reward is built: its name, media kinds, ``batch_size`` and metric names
  (``<name>/score`` and every component it has returned since the server started).

Requests that arrive together are scored together (up to ``max_batch`` samples waiting ``batch_wait`` seconds for
company), one reward call at a time in one worker thread, so a reward need not be thread-safe.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from gyremedia.data import Prompt, prompt_fields
from gyremedia.rollout import Media
from gyremedia.scoring import MalformedRewardOutput, call_reward

logger = logging.getLogger("gyremedia")

#: The content type of a request or answer body: one safetensors document.
CONTENT_TYPE = "application/vnd.gyremedia.safetensors"
EMPTY = torch.zeros(0)  # safetensors refuses a document with no tensors: text media and records travel in the header


class WireError(ValueError):
    """A body that is not a well-formed request or answer (a client or server of another version, or corrupt)."""


def encode_batch(media: Media, prompts: list[str]) -> bytes:
    """A scoring request: the media and the prompt records, losslessly and without pickle."""
    tensors: dict[str, torch.Tensor] = {"empty": EMPTY}
    meta = {}
    for key, value in media.meta.items():
        if isinstance(value, torch.Tensor):
            tensors[f"meta/{key}"] = value.detach().cpu().contiguous()
        else:
            meta[key] = value
    header = {
        "kind": media.kind,
        "meta": _json(meta, "media.meta"),
        "prompts": _json([[str(p), dict(prompt_fields(p))] for p in prompts], "the prompt records' fields"),
    }
    if isinstance(media.data, list):
        header["text"] = _json(media.data, "text media")
    else:
        tensors["media"] = media.data.detach().cpu().contiguous()
    return save_tensors(tensors, metadata=header)


def decode_batch(body: bytes) -> tuple[Media, list[Prompt]]:
    """The media and prompt records of :func:`encode_batch`'s document."""
    tensors, header = _load(body)
    try:
        meta = json.loads(header["meta"])
        meta.update({key.removeprefix("meta/"): value for key, value in tensors.items() if key.startswith("meta/")})
        data = json.loads(header["text"]) if "text" in header else tensors["media"]
        prompts = [Prompt(text, fields) for text, fields in json.loads(header["prompts"])]
        return Media(header["kind"], data, meta), prompts
    except (KeyError, ValueError, TypeError) as exc:
        raise WireError(f"not a scoring request ({type(exc).__name__}: {exc})") from exc


def encode_scores(components: dict[str, torch.Tensor]) -> bytes:
    """A scoring answer: each component as float32 ``[B]``."""
    return save_tensors({key: value.float().contiguous() for key, value in components.items()})


def decode_scores(body: bytes) -> dict[str, torch.Tensor]:
    """The components of :func:`encode_scores`'s document."""
    return _load(body)[0]


def _load(body: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A safetensors document's tensors and string header (safetensors' own readers give the header of files only)."""
    try:
        size = int.from_bytes(body[:8], "little")
        header = json.loads(body[8 : 8 + size]).get("__metadata__") or {}
        tensors = load_tensors(body)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for a bad document
        raise WireError(f"not a safetensors document ({type(exc).__name__}: {exc})") from exc
    tensors.pop("empty", None)
    return tensors, header


def _json(value: Any, what: str) -> str:
    try:
        return json.dumps(value, allow_nan=True)
    except TypeError as exc:
        raise WireError(
            f"{what} cannot cross the wire as JSON ({exc}): give numbers, strings, lists and mappings, or tensors"
        ) from exc


@dataclass
class _Request:
    media: Media
    prompts: list[Prompt]
    answer: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


def _joinable(a: Media, b: Media) -> bool:
    """Whether two requests' media can be scored as one batch (same kind, meta and per-sample shape)."""
    if a.kind != b.kind or set(a.meta) != set(b.meta):
        return False
    if any(not _same(a.meta[k], b.meta[k]) for k in a.meta):
        return False
    if isinstance(a.data, list) or isinstance(b.data, list):
        return isinstance(a.data, list) and isinstance(b.data, list)
    return a.data.shape[1:] == b.data.shape[1:] and a.data.dtype == b.data.dtype


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
    return x == y


def _join(media: list[Media]) -> Media:
    if isinstance(media[0].data, list):
        return Media(media[0].kind, [item for m in media for item in m.data], dict(media[0].meta))
    return Media(media[0].kind, torch.cat([cast(torch.Tensor, m.data) for m in media]), dict(media[0].meta))


class RewardService:
    """One reward, its batching queue and what ``/health`` reports."""

    def __init__(self, name: str, reward: Any, max_batch: int = 64, batch_wait: float = 0.005) -> None:
        self.name, self.reward, self.max_batch, self.batch_wait = name, reward, max_batch, batch_wait
        self.kinds = sorted(getattr(reward, "kinds", ()) or ())
        self.components: set[str] = {"score"}
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="gyremedia-served-reward")
        self.queue: asyncio.Queue[_Request] | None = None
        self.held: _Request | None = None  # a request that could not join the last batch: it starts the next

    def health(self) -> dict[str, Any]:
        return {
            "status": "ready",
            "reward": self.name,
            "kinds": self.kinds,
            "batch_size": getattr(self.reward, "batch_size", None),
            "metrics": [f"{self.name}/{key}" for key in sorted(self.components)],
        }

    async def score(self, media: Media, prompts: list[Prompt]) -> dict[str, torch.Tensor]:
        if self.queue is None:
            self.queue = asyncio.Queue()
            asyncio.get_running_loop().create_task(self._serve())
        request = _Request(media, prompts)
        await self.queue.put(request)
        return await request.answer

    async def _serve(self) -> None:
        loop, queue = asyncio.get_running_loop(), cast("asyncio.Queue[_Request]", self.queue)
        while True:
            batch = [self.held or await queue.get()]
            self.held = None
            size, deadline = len(batch[0].prompts), loop.time() + self.batch_wait
            while size < self.max_batch:
                try:
                    request = await asyncio.wait_for(queue.get(), max(deadline - loop.time(), 0))
                except asyncio.TimeoutError:
                    break
                if not _joinable(batch[0].media, request.media) or size + len(request.prompts) > self.max_batch:
                    self.held = request
                    break
                batch.append(request)
                size += len(request.prompts)
            prompts: list[str] = [p for request in batch for p in request.prompts]
            try:
                scores = await loop.run_in_executor(
                    self.worker, call_reward, self.reward, _join([r.media for r in batch]), prompts
                )
            except Exception as exc:  # noqa: BLE001 - every waiting request gets the reward's own error
                for request in batch:
                    request.answer.set_exception(exc)
                continue
            self.components.update(scores)
            begin = 0
            for request in batch:
                end = begin + len(request.prompts)
                request.answer.set_result({key: value[begin:end] for key, value in scores.items()})
                begin = end


def build_app(service: RewardService) -> Any:
    """The Starlette application serving ``service``: ``GET /health``, ``POST /score``."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def health(request: Request) -> JSONResponse:
        return JSONResponse(service.health())

    async def score(request: Request) -> Response:
        try:
            media, prompts = decode_batch(await request.body())
        except WireError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        try:
            scores = await service.score(media, prompts)
        except MalformedRewardOutput as exc:
            return JSONResponse({"error": f"reward {service.name!r} {exc}", "contract": True}, status_code=422)
        except Exception as exc:  # noqa: BLE001 - reported to the caller, whose failure policy decides
            logger.warning(
                "reward %r raised on a batch of %d: %s: %s", service.name, len(prompts), type(exc).__name__, exc
            )
            return JSONResponse(
                {"error": f"reward {service.name!r} raised {type(exc).__name__}: {exc}"}, status_code=500
            )
        return Response(encode_scores(scores), media_type=CONTENT_TYPE)

    return Starlette(routes=[Route("/health", health), Route("/score", score, methods=["POST"])])


def listen(host: str = "127.0.0.1", port: int = 8000) -> socket.socket:
    """A socket bound to ``host:port`` (``port`` 0: any free one); ``url(sock)`` is the root a client calls."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)  # clients that connect before the server loop starts wait in the backlog instead of refused
    return sock


def url(sock: socket.socket) -> str:
    """The http root of a bound socket."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"


def server(service: RewardService) -> Any:
    """A uvicorn server of ``service``'s application: ``.run(sockets=[listen(...)])`` serves until interrupted (or
    until its ``should_exit`` is set)."""
    import uvicorn

    return uvicorn.Server(uvicorn.Config(build_app(service), log_level="warning"))

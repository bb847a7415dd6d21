"""The co-executor's serving front: an OpenAI-compatible HTTP API (aiohttp).

``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON, or SSE with ``stream`` ending
in ``data: [DONE]``; ``stream_options.include_usage`` adds a usage chunk), ``GET /v1/models``;
``usage`` on every answer; vLLM's ``ignore_eos``, ``min_tokens`` and ``stop_token_ids``
extensions, and ``seed``. Works with the official ``openai`` client
(tests/integration/test_openai_api.py).

Without ``max_tokens`` (``max_completion_tokens`` wins when both are given, as in vLLM) a
completion is 16 tokens and a chat answer the rest of the context. Streamed text is decoded
incrementally (``IncrementalDecoder``), so it equals the whole answer's.

Bad input gets a 400 whose message names the field (malformed JSON, wrong types, an unknown
model, an empty or unencodable prompt, prompt + max_tokens over the context, max_tokens <= 0, a
NaN or negative temperature, top_p outside (0, 1], n > 1, stop strings, stop_token_ids not
ids of the vocabulary); a body over ``max_body_bytes`` a 413; a full server a 503 with
``Retry-After`` (serving is never shed for rollout), and so does a stopped engine (a stream
already under way gets an error event instead). Every error, a bug's 500 included, uses
OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``. A client that disconnects
aborts its request; a slow SSE reader never blocks the engine (``serving_backend.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from rlharvest.common import tls
from rlharvest.common.engine_types import SamplingParams
from rlharvest.common.errors import InvalidArgument, quoted
from rlharvest.models.model_tokenizer import ModelTokenizer, TokenizerError, check_messages
from rlharvest.services.coexecutor import metrics
from rlharvest.services.coexecutor.serving_backend import (
    EngineServingBackend,
    Generation,
    ServingParams,
    ServingQueueFull,
    ServingStopped,
)

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
_MAX_BODY = web.AppKey("max_body_bytes", int)
_BODY_TIMEOUT = web.AppKey("body_timeout_s", float)
# Without max_tokens a completion is 16 tokens and a chat answer may fill the rest of the
# context, as with OpenAI and vLLM.
_COMPLETION_MAX_TOKENS = 16


class BadRequest(InvalidArgument):
    """A 400: ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class BodyTimeout(BadRequest):
    """A 408: the body did not arrive in time (a stalled or slowloris client)."""


class ModelNotFound(BadRequest):
    """A 404 with OpenAI's (and vLLM's) code ``model_not_found``: the body names a model this
    server does not serve."""


# JSON nesting a request body may have. OpenAI's deepest (a chat message's content parts, a
# tool's JSON schema) is well under it; Python's parser fails past ~1,000 levels with a
# RecursionError, which was a 500.
MAX_JSON_DEPTH = 64


@dataclass(frozen=True)
class ApiConfig:
    model: str  # the name clients ask for
    context_len: int  # prompt + max_tokens must fit
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 30.0  # a body not wholly arrived by then is a 408


@dataclass(frozen=True)
class _Request:
    prompt_ids: list[int]
    params: ServingParams
    stream: bool
    include_usage: bool


async def serve_api(runner: web.AppRunner, host: str, port: int) -> tuple[int, str]:
    """Serve ``runner``'s app on ``host:port`` (0: a free port): over HTTPS with the service's
    certificate under mutual TLS, asking no client certificate, since serving clients are not
    peers of the CA (authenticate them at your gateway). Returns the port and the scheme."""
    await web.TCPSite(runner, host, port, ssl_context=tls.server_ssl_context()).start()
    return runner.addresses[0][1], tls.http_scheme()


def make_app(backend: EngineServingBackend, tokenizer: ModelTokenizer,
             config: ApiConfig) -> web.Application:
    api = _Api(backend, tokenizer, config)
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[_errors])
    app[_MAX_BODY] = config.max_body_bytes
    app[_BODY_TIMEOUT] = config.body_timeout_s
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat)
    app.router.add_get("/v1/models", api.models)
    return app


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None,
                   kind: str = "invalid_request_error", code: str | None = None) -> web.Response:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return web.json_response(error_body(message, param, kind, code), status=status,
                             headers=headers)


@dataclass(frozen=True)
class _Failure:
    """How the API answers one exception: the HTTP status, OpenAI's error type, the field it
    names, and the requests counter's outcome."""

    status: int
    message: str
    kind: str = "invalid_request_error"
    param: str | None = None
    outcome: str = "error"
    code: str | None = None

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.param, self.kind, self.code)

    def response(self) -> web.Response:
        return error_response(self.status, self.message, self.param, self.kind, self.code)


def _failure(exc: Exception, request: web.Request) -> _Failure:
    """The one mapping of exceptions to answers, for a JSON status (the middleware) and for an
    error event once a stream's status is sent (``_Api._stream``) alike. A bug is logged with
    its traceback."""
    if isinstance(exc, BodyTimeout):
        return _Failure(408, str(exc), outcome="bad_request", code="request_timeout")
    if isinstance(exc, ModelNotFound):
        return _Failure(404, str(exc), param=exc.param, outcome="bad_request",
                        code="model_not_found")
    if isinstance(exc, BadRequest):
        return _Failure(400, str(exc), param=exc.param, outcome="bad_request")
    if isinstance(exc, InvalidArgument):  # the engine refused the request
        return _Failure(400, str(exc), outcome="bad_request")
    if isinstance(exc, ServingQueueFull):
        return _Failure(503, str(exc), "server_overloaded", outcome="overloaded")
    if isinstance(exc, ServingStopped):  # shutting down, or the engine failed: try elsewhere
        return _Failure(503, str(exc), "service_unavailable", outcome="unavailable")
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return _Failure(413, f"the request body is over {request.app[_MAX_BODY]} bytes, the "
                        "most this server reads", outcome="too_large")
    if isinstance(exc, web.HTTPException):
        return _Failure(exc.status, exc.reason)
    # A bug: still OpenAI's shape, so clients parse it as an error.
    log.error("%s %s failed", request.method, request.path, exc_info=exc)
    return _Failure(500, f"internal error: {exc!r}", "server_error")


# What a handler that sent its status already (a stream) ended with, for the requests counter.
# A typed key where aiohttp has them (3.14; a plain key warns there), a plain one before.
_OUTCOME: Any = (web.RequestKey("outcome", str) if hasattr(web, "RequestKey")
                 else "rlharvest.outcome")


@web.middleware
async def _errors(request: web.Request,
                  handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                  ) -> web.StreamResponse:
    outcome = "error"
    try:
        response = await handler(request)
        outcome = request.get(_OUTCOME, "ok")
        return response
    except (asyncio.CancelledError, ConnectionResetError):
        outcome = "aborted"  # the client went away
        raise
    except Exception as exc:
        if isinstance(exc, web.HTTPException) and exc.status < 400:
            raise  # a redirect, no error: aiohttp answers it
        failure = _failure(exc, request)
        outcome = failure.outcome
        return failure.response()
    finally:
        metrics.REQUESTS.labels(outcome).inc()


class _Api:
    def __init__(self, backend: EngineServingBackend, tokenizer: ModelTokenizer,
                 config: ApiConfig) -> None:
        self._backend = backend
        self._tok = tokenizer
        self._config = config

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self._config.model, "object": "model", "created": 0,
            "owned_by": "rlharvest"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:  # a tokenizer may still add BOS: an empty text is no prompt
                raise BadRequest("the prompt is empty", "prompt")
            try:
                ids = self._tok.encode(prompt)
            except (TokenizerError, ValueError, TypeError) as exc:  # text it cannot encode
                raise BadRequest(f"prompt: {exc}", "prompt") from None
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                              for t in prompt):
            ids = list(prompt)
        else:
            raise BadRequest("prompt must be a string or a list of token ids (one prompt: "
                             "batches are not supported)", "prompt")
        if any(not 0 <= t < self._tok.vocab_size for t in ids):
            raise BadRequest(f"prompt token ids must be in [0, {self._tok.vocab_size})",
                             "prompt")
        return await self._answer(request, body, ids, _COMPLETION)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        try:
            raw = body.get("messages")
            if not isinstance(raw, list):
                raise BadRequest("messages must be a list of {role, content} objects",
                                 "messages")
            messages = check_messages(raw)
            ids = self._tok.encode_prompt(messages)
        except (TokenizerError, ValueError, TypeError) as exc:
            raise BadRequest(f"messages: {exc}", "messages") from None
        return await self._answer(request, body, ids, _CHAT)

    # ---- the shared parts ----------------------------------------------------------------------

    async def _answer(self, request: web.Request, body: dict[str, Any], ids: list[int],
                      shape: _Shape) -> web.StreamResponse:
        parsed = self._parse(body, ids, shape)
        head = {"id": f"{shape.id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self._config.model}
        if parsed.stream:
            return await self._stream(request, parsed, shape, head)
        text, reason, count = await self._collect(parsed)
        return web.json_response({**head, "object": shape.object,
                                  "choices": [_choice(shape.content(text), reason)],
                                  "usage": _usage(len(ids), count)})

    def _parse(self, body: dict[str, Any], ids: list[int], shape: _Shape) -> _Request:
        model = body.get("model")
        if model != self._config.model:
            named = quoted(model) if isinstance(model, str) else repr(type(model).__name__)
            raise ModelNotFound(f"the model {named} does not exist here; this server serves "
                                f"{self._config.model!r} (GET /v1/models)", "model")
        if not ids:
            raise BadRequest("the prompt is empty", shape.prompt_param)
        max_tokens = self._max_tokens(body, ids, shape)
        temperature = _number(body, "temperature", 1.0)
        if temperature < 0:
            raise BadRequest(f"temperature must be >= 0, got {temperature}", "temperature")
        top_p = _number(body, "top_p", 1.0)
        if not 0 < top_p <= 1:
            raise BadRequest(f"top_p must be in (0, 1], got {top_p}", "top_p")
        if _integer(body, "n", 1) != 1:
            raise BadRequest("n must be 1: one completion per request", "n")
        if body.get("stop") not in (None, [], ""):
            raise BadRequest("stop strings are not supported; give stop_token_ids", "stop")
        min_tokens = _integer(body, "min_tokens", 0)
        if not 0 <= min_tokens <= max_tokens:
            raise BadRequest(f"min_tokens must be in [0, max_tokens], got {min_tokens}",
                             "min_tokens")
        stops = () if _flag(body, "ignore_eos") else tuple(self._tok.stop_ids)
        extra = self._stop_token_ids(body)
        seed = _integer(body, "seed", uuid.uuid4().int & 0x7FFFFFFF)
        sampling = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                  stop_token_ids=tuple(dict.fromkeys([*stops, *extra])),
                                  seed=seed)
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise BadRequest("stream_options must be an object", "stream_options")
        return _Request(ids, ServingParams(sampling, min_tokens), _flag(body, "stream"),
                        bool(options.get("include_usage")))

    def _max_tokens(self, body: dict[str, Any], ids: list[int], shape: _Shape) -> int:
        # max_completion_tokens (OpenAI's newer name) wins over max_tokens, as in vLLM; errors
        # name the one the client gave.
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
            else "max_tokens"
        context = self._config.context_len
        if body.get(key) is None and shape.default_max_tokens is None:
            if len(ids) >= context:  # the rest of the context, and there is none
                raise BadRequest(f"the prompt ({len(ids)} tokens) fills the model's context of "
                                 f"{context} tokens", shape.prompt_param)
            return context - len(ids)
        max_tokens = _integer(body, key, shape.default_max_tokens or 0)
        if max_tokens <= 0:
            raise BadRequest(f"{key} must be > 0, got {max_tokens}", key)
        if len(ids) + max_tokens > context:
            raise BadRequest(f"the prompt ({len(ids)} tokens) plus {key} ({max_tokens}) is "
                             f"over the model's context of {context} tokens", key)
        return max_tokens

    def _stop_token_ids(self, body: dict[str, Any]) -> list[int]:
        extra = body.get("stop_token_ids")
        if extra is None:
            return []
        if not isinstance(extra, list):
            raise BadRequest("stop_token_ids must be a list of token ids, got "
                             f"{type(extra).__name__}", "stop_token_ids")
        vocab = self._tok.vocab_size
        for i, token in enumerate(extra):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                raise BadRequest(f"stop_token_ids[{i}] = {token!r} is not a token id in "
                                 f"[0, {vocab})", "stop_token_ids")
        return extra

    async def _collect(self, parsed: _Request) -> tuple[str, str, int]:
        tokens: list[int] = []
        reason = "length"
        steps = self._backend.generate(parsed.prompt_ids, parsed.params)
        try:
            async for step in steps:
                tokens.extend(step.token_ids)
                reason = step.finish_reason or reason
        finally:
            await steps.aclose()  # the handler cancelled (client gone): abort the request
        return self._tok.decode(tokens), reason, len(tokens)

    async def _stream(self, request: web.Request, parsed: _Request, shape: _Shape,
                      head: dict[str, Any]) -> web.StreamResponse:
        steps = self._backend.generate(parsed.prompt_ids, parsed.params)
        first = await anext(steps)  # refusals (queue full, engine) are still a JSON status
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        head = {**head, "object": shape.chunk_object}
        count = 0
        text = IncrementalDecoder(self._tok)
        try:
            try:
                async for i, step in _numbered(first, steps):
                    count += len(step.token_ids)
                    piece = text.add(step.token_ids)
                    if step.finish_reason is not None:
                        piece += text.flush()
                    delta = shape.delta(piece, i == 0)
                    await _send(response, {**head, "choices": [_choice(delta,
                                                                       step.finish_reason)]})
            except ConnectionResetError:
                raise  # the client went away: nobody to tell
            except Exception as exc:
                # The status is sent: the error goes as an event (as vLLM does), which the
                # openai client raises as an APIError, rather than as a cut connection; the
                # same mapping as a JSON status, and counted with its outcome.
                failure = _failure(exc, request)
                request[_OUTCOME] = failure.outcome
                await _send(response, failure.body())
                await response.write(b"data: [DONE]\n\n")
                return response
            if parsed.include_usage:
                await _send(response, {**head, "choices": [],
                                       "usage": _usage(len(parsed.prompt_ids), count)})
            await response.write(b"data: [DONE]\n\n")
        finally:
            await steps.aclose()  # a client gone mid-stream aborts its request
        return response


class IncrementalDecoder:
    """A stream's text, piece by piece, equal when joined to the whole answer decoded at once.

    A byte-level BPE spreads one character over several tokens (é, ✓, CJK, emoji), and a
    token decoded on its own is then U+FFFD. As vLLM's detokenizer does, each piece is the text
    of a window of recent tokens less that of the window without the new ones, and a piece that
    ends in an incomplete character waits for the tokens that complete it (``flush`` at the
    end hands over whatever is left)."""

    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # the window's start: context, so a piece's leading space is right
        self._read = 0  # tokens up to here are handed over as text

    def add(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        before, text = self._texts()
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""  # nothing new yet, or a character whose remaining bytes come later
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before):]

    def flush(self) -> str:
        before, text = self._texts()
        self._prefix = self._read = len(self._ids)
        return text[len(before):]

    def _texts(self) -> tuple[str, str]:
        window = self._ids[self._prefix:]
        return self._tok.decode(window[:self._read - self._prefix]), self._tok.decode(window)


async def _numbered(first: Generation, rest: AsyncIterator[Generation]
                    ) -> AsyncIterator[tuple[int, Generation]]:
    """``first`` (already taken, so a refusal was still a JSON status), then the rest, numbered."""
    yield 0, first
    i = 1
    async for step in rest:
        yield i, step
        i += 1


async def _send(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")


def _choice(fields: dict[str, Any], reason: str | None) -> dict[str, Any]:
    return {"index": 0, **fields, "logprobs": None, "finish_reason": reason}


def _chat_delta(text: str, first: bool) -> dict[str, Any]:
    delta: dict[str, str] = {"role": "assistant"} if first else {}
    if text:
        delta["content"] = text
    return {"delta": delta}


@dataclass(frozen=True)
class _Shape:
    """How one endpoint's requests and answers look (OpenAI's completion or chat objects): the
    object names, the id prefix, the default max_tokens, the field that holds the prompt, a
    whole answer's choice fields and a streamed chunk's."""

    object: str
    chunk_object: str
    id_prefix: str
    default_max_tokens: int | None  # None: the rest of the context
    prompt_param: str
    content: Callable[[str], dict[str, Any]]
    delta: Callable[[str, bool], dict[str, Any]]  # (text, first chunk?)


_COMPLETION = _Shape("text_completion", "text_completion", "cmpl", _COMPLETION_MAX_TOKENS,
                     "prompt", lambda text: {"text": text}, lambda text, first: {"text": text})
_CHAT = _Shape("chat.completion", "chat.completion.chunk", "chatcmpl", None, "messages",
               lambda text: {"message": {"role": "assistant", "content": text}}, _chat_delta)


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


async def _json_body(request: web.Request) -> dict[str, Any]:
    limit = request.app[_BODY_TIMEOUT]
    try:
        raw = await asyncio.wait_for(request.read(), limit)
    except asyncio.TimeoutError:
        raise BodyTimeout(f"the request body did not arrive within {limit:g} s") from None
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest(f"the body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not valid JSON: {quoted(str(exc), 200)}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if _nested_deeper(body, MAX_JSON_DEPTH):
        raise BadRequest(f"the body nests deeper than {MAX_JSON_DEPTH} levels")
    return body


def _nested_deeper(value: Any, limit: int) -> bool:
    """Whether ``value`` holds containers more than ``limit`` levels deep (iterative: a walk
    of a hostile body must not recurse either)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))
    return False


def _number(body: dict[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{key} must be a number, got {type(value).__name__}", key)
    if not math.isfinite(value):
        raise BadRequest(f"{key} must be a finite number, got {value}", key)
    return float(value)


def _integer(body: dict[str, Any], key: str, default: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key} must be an integer, got {type(value).__name__}", key)
    return value


def _flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be true or false, got {type(value).__name__}", key)
    return value

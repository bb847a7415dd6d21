"""The co-executor's OpenAI-compatible API over real HTTP on loopback, served by the torch
engine, used through the official ``openai`` client: completions and chat, streamed and not,
usage, vLLM's extensions, precise 400s, 413, 503 with Retry-After, and a client that goes away
freeing its request."""

from __future__ import annotations

import asyncio
import json
import re

import ssl

import aiohttp
import openai
import pytest
from aiohttp import web

from tests.slow_headers import trickle_until_closed
from rlharvest.common import tls
from rlharvest.models.hf_checkpoint import build_checkpoint
from rlharvest.common.local_etcd import free_port
from rlharvest.models.model_tokenizer import load_tokenizer
from rlharvest.common.worker_core.engine_pump import EnginePump
from rlharvest.services.coexecutor.openai_api import ApiConfig, make_app, serve_api
from rlharvest.services.coexecutor.serving_backend import (
    EngineServingBackend,
    Generation,
    ServingStopped,
)
from rlharvest.services.rollout_worker.torch_engine import TorchEngine

MODEL = "tiny-serving"


async def serve(max_waiting: int = 8, step_delay_s: float = 0.0, body_timeout_s: float = 30.0,
                idle_timeout_s: float = 75.0):
    engine = TorchEngine("tiny", seed=0, max_running=4, max_len=256)
    backend = EngineServingBackend(engine, max_waiting=max_waiting, step_delay_s=step_delay_s)
    backend.start()
    app = make_app(backend, load_tokenizer("tiny"), ApiConfig(
        MODEL, context_len=256, max_body_bytes=64 << 10, body_timeout_s=body_timeout_s))
    runner = web.AppRunner(app, handler_cancellation=True, keepalive_timeout=idle_timeout_s)
    await runner.setup()
    port, scheme = await serve_api(runner, "127.0.0.1", free_port())
    return runner, backend, engine, f"{scheme}://127.0.0.1:{port}"


@pytest.fixture
async def server():
    runner, backend, engine, url = await serve()
    yield backend, engine, url
    await runner.cleanup()
    await backend.close()


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def test_completions_streamed_and_not_give_the_same_seeded_text_and_usage(server):
    _, _, url = server
    api = client(url)
    whole = await api.completions.create(model=MODEL, prompt="12+34=", max_tokens=8, seed=7,
                                         extra_body={"ignore_eos": True})
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 8 and whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 8
    pieces, usage = [], None
    stream = await api.completions.create(model=MODEL, prompt="12+34=", max_tokens=8, seed=7,
                                          stream=True, stream_options={"include_usage": True},
                                          extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        usage = chunk.usage or usage
    assert "".join(pieces) == whole.choices[0].text  # sampling is keyed by (seed, position)
    assert usage is not None and usage.completion_tokens == 8
    models = await api.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_chat_completions_streamed_and_not(server):
    _, _, url = server
    api = client(url)
    messages = [{"role": "user", "content": "2+2="}]
    whole = await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                              seed=3, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 6
    stream = await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                               seed=3, stream=True,
                                               extra_body={"ignore_eos": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_chat_defaults_to_the_rest_of_the_context_and_completions_to_16_tokens(server):
    _, _, url = server
    api = client(url)
    chat = await api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "7" * 200}],
        extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 256 - chat.usage.prompt_tokens > 16
    assert chat.choices[0].finish_reason == "length"
    done = await api.completions.create(model=MODEL, prompt="1", extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 16


async def test_max_completion_tokens_wins_over_max_tokens_even_when_that_is_null(server):
    _, _, url = server
    async with aiohttp.ClientSession() as http:
        for max_tokens in (None, 9):
            body = {"model": MODEL, "prompt": "1", "max_tokens": max_tokens,
                    "max_completion_tokens": 3, "ignore_eos": True}
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                assert (await resp.json())["usage"]["completion_tokens"] == 3


async def test_stop_tokens_end_a_completion_only_after_min_tokens(server):
    _, engine, url = server
    api = client(url)
    every_id = list(range(engine.vocab_size))  # any token stops it
    first = await api.completions.create(model=MODEL, prompt="1+1=", max_tokens=10,
                                         extra_body={"stop_token_ids": every_id})
    assert first.choices[0].finish_reason == "stop" and first.usage.completion_tokens == 0
    later = await api.completions.create(model=MODEL, prompt="1+1=", max_tokens=10,
                                         extra_body={"stop_token_ids": every_id,
                                                     "min_tokens": 4})
    assert later.choices[0].finish_reason == "stop" and later.usage.completion_tokens == 4


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"model": MODEL, "prompt": ""}, "prompt", "the prompt is empty"),
    ({"model": MODEL, "prompt": "1", "max_tokens": 0}, "max_tokens", "must be > 0"),
    ({"model": MODEL, "prompt": "1", "max_tokens": "5"}, "max_tokens", "must be an integer"),
    ({"model": MODEL, "prompt": "1", "max_tokens": 300}, "max_tokens", "over the model's context"),
    ({"model": MODEL, "prompt": "1", "temperature": -1}, "temperature", "must be >= 0"),
    ({"model": MODEL, "prompt": "1", "top_p": 0}, "top_p", r"must be in \(0, 1\]"),
    ({"model": MODEL, "prompt": "1", "top_p": 1.5}, "top_p", r"must be in \(0, 1\]"),
    ({"model": MODEL, "prompt": "1", "n": 2}, "n", "n must be 1"),
    ({"model": MODEL, "prompt": "1", "stop": ["\n"]}, "stop", "stop strings"),
    ({"model": MODEL, "prompt": 5}, "prompt", "must be a string or a list of token ids"),
    ({"model": MODEL, "prompt": [1, 10**9]}, "prompt", "token ids must be in"),
    ({"model": MODEL, "prompt": "caf\u00e9"}, "prompt", "not in the built-in vocabulary"),
    ({"model": MODEL, "messages": "hi"}, "messages", "must be a list"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "7" * 300}]}, "messages",
     "fills the model's context of 256 tokens"),
    ({"model": MODEL, "prompt": "1", "max_completion_tokens": 0}, "max_completion_tokens",
     "max_completion_tokens must be > 0"),
    ({"model": MODEL, "prompt": "1", "max_tokens": None, "max_completion_tokens": "3"},
     "max_completion_tokens", "max_completion_tokens must be an integer"),
    ({"model": MODEL, "prompt": "1", "max_tokens": 4, "max_completion_tokens": 300},
     "max_completion_tokens", "plus max_completion_tokens \\(300\\) is over"),
    ({"model": MODEL, "prompt": "1", "stop_token_ids": ""}, "stop_token_ids", "must be a list"),
    ({"model": MODEL, "prompt": "1", "stop_token_ids": 0}, "stop_token_ids", "must be a list"),
    ({"model": MODEL, "prompt": "1", "stop_token_ids": {}}, "stop_token_ids", "must be a list"),
    ({"model": MODEL, "prompt": "1", "stop_token_ids": [1, True]}, "stop_token_ids",
     r"stop_token_ids\[1\] = True is not a token id in \[0, 128\)"),
    ({"model": MODEL, "prompt": "1", "stop_token_ids": [-5]}, "stop_token_ids",
     r"stop_token_ids\[0\] = -5 is not a token id"),
    ({"model": MODEL, "prompt": "1", "stop_token_ids": [2, 10**12]}, "stop_token_ids",
     r"stop_token_ids\[1\] = 1000000000000 is not a token id"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "1"}], "stop_token_ids": ["a"]},
     "stop_token_ids", r"stop_token_ids\[0\] = 'a' is not a token id"),
])
async def test_bad_requests_get_a_400_naming_the_field(server, body, param, message):
    _, _, url = server
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with aiohttp.ClientSession() as http, http.post(url + path, json=body) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert re.search(message, error["message"]), error["message"]


async def test_an_unknown_model_is_openais_404_model_not_found(server):
    _, _, url = server
    with pytest.raises(openai.NotFoundError) as raised:
        await client(url).completions.create(model="gpt-4", prompt="1")
    error = raised.value.body
    assert raised.value.status_code == 404
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'gpt-4' does not exist here" in error["message"]
    async with aiohttp.ClientSession() as http:  # a model name 50 KB long is quoted short
        body = {"model": "m" * 50_000, "messages": [{"role": "user", "content": "1"}]}
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 404
            assert len((await resp.json())["error"]["message"]) < 300


@pytest.mark.parametrize("where", ["messages", "extra"])
async def test_json_nested_deeper_than_the_bound_is_a_400_not_a_500(server, where):
    _, _, url = server
    for depth in (100, 30_000):  # past the bound; past Python's parser's recursion limit
        nested = "[" * depth + "]" * depth
        body = (f'{{"model": "{MODEL}", "messages": {nested}}}' if where == "messages" else
                f'{{"model": "{MODEL}", "prompt": "1", "x": {nested}}}')
        async with aiohttp.ClientSession() as http, \
                http.post(url + "/v1/chat/completions" if where == "messages" else
                          url + "/v1/completions", data=body.encode()) as resp:
            assert resp.status == 400, await resp.text()
            assert "nests deeper than 64 levels" in (await resp.json())["error"]["message"]
    async with aiohttp.ClientSession() as http:  # a sane body still works after them
        async with http.post(url + "/v1/completions",
                             json={"model": MODEL, "prompt": "1", "max_tokens": 2}) as resp:
            assert resp.status == 200


async def test_a_body_that_stalls_is_a_408_and_its_connection_closes():
    runner, backend, _, url = await serve(body_timeout_s=0.5)
    try:
        host, port = url.rsplit("//", 1)[1].split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        # headers promise 100 bytes; 10 come, then nothing (slowloris on the body)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100\r\n\r\n{\"model\": ")
        await writer.drain()
        head = await asyncio.wait_for(reader.read(4096), timeout=30)
        assert head.startswith(b"HTTP/1.1 408"), head[:200]
        assert b"did not arrive within 0.5 s" in head and b"request_timeout" in head
        writer.close()
        async with aiohttp.ClientSession() as http:  # the server serves on
            async with http.post(url + "/v1/completions",
                                 json={"model": MODEL, "prompt": "1", "max_tokens": 2}) as resp:
                assert resp.status == 200
    finally:
        await runner.cleanup()
        await backend.close()


@pytest.mark.parametrize("after_a_request", [False, True])
async def test_headers_that_trickle_in_close_the_connection_within_the_idle_timeout(
        after_a_request):
    """Slowloris on the headers, a line a second, as a connection's first request and after a
    request answered on it: closed once the idle timeout (1 s here, 75 s by default) passes,
    however long the trickle would go on."""
    runner, backend, _, url = await serve(idle_timeout_s=1.0)
    try:
        host, port = url.rsplit("//", 1)[1].split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        if after_a_request:
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 200")
            await asyncio.wait_for(reader.readuntil(MODEL.encode()), timeout=10)
        writer.write(b"GET /v1/models HTTP/1.1\r\n")
        held = await trickle_until_closed(reader, writer, seconds=10, every=0.5)
        assert held < 5, "the trickle held the connection open"
        writer.close()
    finally:
        await runner.cleanup()
        await backend.close()


async def test_malformed_json_nan_and_an_oversized_body_are_refused(server):
    _, _, url = server
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/completions", data=b"{not json") as resp:
            assert resp.status == 400 and "not valid JSON" in (await resp.json())["error"]["message"]
        nan = b'{"model": "%s", "prompt": "1", "temperature": NaN}' % MODEL.encode()
        async with http.post(url + "/v1/completions", data=nan) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "temperature"
        big = json.dumps({"model": MODEL, "prompt": "1" * (100 << 10)})
        async with http.post(url + "/v1/completions", data=big) as resp:
            assert resp.status == 413 and "over 65536 bytes" in (await resp.json())["error"]["message"]


async def test_a_full_server_answers_503_with_retry_after_and_a_gone_client_frees_its_request():
    # 20 ms a step: the 200 tokens take 4 s, so the request is surely mid-way when its client
    # leaves, and only an abort ends it within the second the test then waits.
    runner, backend, engine, url = await serve(max_waiting=1, step_delay_s=0.02)
    try:
        body = {"model": MODEL, "prompt": "9", "max_tokens": 200, "stream": True,
                "ignore_eos": True}
        async with aiohttp.ClientSession() as http:
            held = await http.post(url + "/v1/completions", json=body)
            assert held.status == 200
            await held.content.readline()  # streaming: the request holds its place
            with pytest.raises(openai.APIStatusError) as refused:
                await client(url).completions.create(model=MODEL, prompt="1", max_tokens=2)
            assert refused.value.status_code == 503
            assert refused.value.response.headers["Retry-After"] == "1"
            held.close()  # the client goes away mid-stream
        for _ in range(20):
            if backend.in_flight == 0 and engine.load().executing == 0:
                break
            await asyncio.sleep(0.05)
        assert backend.in_flight == 0 and engine.load().executing == 0  # aborted, not finished
        done = await client(url).completions.create(model=MODEL, prompt="1", max_tokens=2,
                                                    extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 2  # and the place is free again
    finally:
        await runner.cleanup()
        await backend.close()


async def test_serving_latency_and_outcomes_are_exported_as_metrics(server):
    from prometheus_client import REGISTRY

    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    _, _, url = server
    before = {"ttft": value("rlh_coexec_serving_ttft_seconds_count"),
              "tpot": value("rlh_coexec_serving_tpot_seconds_count"),
              "tokens": value("rlh_coexec_serving_tokens_total"),
              "ok": value("rlh_coexec_serving_requests_total", outcome="ok"),
              "bad": value("rlh_coexec_serving_requests_total", outcome="bad_request")}
    await client(url).completions.create(model=MODEL, prompt="7", max_tokens=5,
                                         extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError):
        await client(url).completions.create(model=MODEL, prompt="7", max_tokens=0)
    assert value("rlh_coexec_serving_ttft_seconds_count") == before["ttft"] + 1
    assert value("rlh_coexec_serving_tpot_seconds_count") == before["tpot"] + 1
    assert value("rlh_coexec_serving_tokens_total") == before["tokens"] + 5
    assert value("rlh_coexec_serving_requests_total", outcome="ok") == before["ok"] + 1
    assert value("rlh_coexec_serving_requests_total", outcome="bad_request") == before["bad"] + 1
    assert value("rlh_coexec_serving_in_flight") == 0


async def test_under_mutual_tls_the_api_is_https_and_asks_no_client_certificate(tmp_path):
    """With the service's TLS settings the API is served over HTTPS with its certificate; a
    serving client verifies it with the CA and needs no certificate of its own (it is no peer
    of the CA); plaintext gets no answer."""
    ca = tls.LocalCA(tmp_path / "pki")
    cert, key = ca.issue("coexec-0", "coexecutor")
    tls.configure(str(cert), str(key), str(ca.ca_path))
    try:
        runner, backend, _, url = await serve()
    finally:
        tls.configure("", "", "")  # the listener keeps its context; later tests are plaintext
    try:
        assert url.startswith("https://")
        verify = ssl.create_default_context(cafile=str(ca.ca_path))
        async with openai.DefaultAsyncHttpxClient(verify=verify) as http:
            api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                     http_client=http)
            done = await api.completions.create(model=MODEL, prompt="12+34=", max_tokens=4,
                                                extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 4
        with pytest.raises(aiohttp.ClientError):
            async with aiohttp.ClientSession() as session:
                await session.get(url.replace("https://", "http://") + "/v1/models")
    finally:
        await runner.cleanup()
        await backend.close()


class _SharedPumpSink:
    """What the co-executor's WorkerService and DualEngine do with a shared pump's steps: hand
    the serving outputs to the backend."""

    backend: EngineServingBackend

    def route(self, step):
        return step.outputs

    async def send(self, routed) -> None:
        self.backend.deliver(routed)

    def heartbeat(self, load) -> None:
        pass


async def test_when_a_shared_pump_stops_waiting_requests_fail_at_once_and_new_ones_get_503():
    """As main.py composes it: the backend runs on the service's pump, whose loop the host
    cancels at shutdown (or which ends when the engine fails) before the HTTP server closes."""
    engine = TorchEngine("tiny", seed=0, max_running=4, max_len=256)
    sink = _SharedPumpSink()
    pump = EnginePump(engine, sink, step_delay_s=0.02)  # 200 tokens: 4 s, surely mid-way
    backend = sink.backend = EngineServingBackend(engine, max_waiting=8, pump=pump)
    backend.start()
    engine_loop = asyncio.create_task(backend.run_pump(pump.run))
    runner = web.AppRunner(make_app(backend, load_tokenizer("tiny"), ApiConfig(MODEL, 256)),
                           handler_cancellation=True)
    await runner.setup()
    port, scheme = await serve_api(runner, "127.0.0.1", free_port())
    api = openai.AsyncOpenAI(base_url=f"{scheme}://127.0.0.1:{port}/v1", api_key="unused",
                             max_retries=0, timeout=5)
    long = {"model": MODEL, "prompt": "9", "max_tokens": 200, "extra_body": {"ignore_eos": True}}
    try:
        stream = await api.completions.create(**long, stream=True)
        await anext(aiter(stream))  # streaming: the status is sent
        whole = asyncio.create_task(api.completions.create(**long))
        await asyncio.sleep(0.2)
        engine_loop.cancel()  # the host's "loop cancel" at shutdown
        await asyncio.gather(engine_loop, return_exceptions=True)
        with pytest.raises(openai.APIError, match="the serving engine stopped"):
            async with asyncio.timeout(2):
                async for _ in stream:
                    pass
        with pytest.raises(openai.APIStatusError, match="the serving engine stopped") as failed:
            async with asyncio.timeout(2):
                await whole
        assert failed.value.status_code == 503
        with pytest.raises(openai.APIStatusError) as refused:
            async with asyncio.timeout(2):
                await api.completions.create(model=MODEL, prompt="1", max_tokens=2)
        assert refused.value.status_code == 503
        assert refused.value.body["type"] == "service_unavailable"
        assert backend.in_flight == 0
    finally:
        await runner.cleanup()
        await backend.close()
        pump.close()


class _BrokenDecode:
    """The tiny tokenizer with a decode that raises: a bug escaping a handler."""

    def __init__(self) -> None:
        self._tok = load_tokenizer("tiny")

    def __getattr__(self, name: str):
        return getattr(self._tok, name)

    def decode(self, ids) -> str:
        raise RuntimeError("decode broke")


async def test_an_unexpected_error_in_a_handler_is_still_an_openai_error():
    """Not aiohttp's text/plain 500: a JSON 500 in OpenAI's shape, or, once a stream's status
    is sent, an error event that the openai client raises."""
    engine = TorchEngine("tiny", seed=0, max_running=4, max_len=256)
    backend = EngineServingBackend(engine, max_waiting=8)
    backend.start()
    runner = web.AppRunner(make_app(backend, _BrokenDecode(), ApiConfig(MODEL, 256)),
                           handler_cancellation=True)
    await runner.setup()
    port, scheme = await serve_api(runner, "127.0.0.1", free_port())
    api = openai.AsyncOpenAI(base_url=f"{scheme}://127.0.0.1:{port}/v1", api_key="unused",
                             max_retries=0)
    try:
        with pytest.raises(openai.InternalServerError, match="decode broke") as failed:
            await api.completions.create(model=MODEL, prompt="1", max_tokens=2)
        assert failed.value.response.headers["Content-Type"].startswith("application/json")
        assert failed.value.body["type"] == "server_error"
        stream = await api.completions.create(model=MODEL, prompt="1", max_tokens=2,
                                              stream=True)
        with pytest.raises(openai.APIError, match="decode broke"):
            async for _ in stream:
                pass
    finally:
        await runner.cleanup()
        await backend.close()


class _ScriptedBackend:
    """Generates given token ids, one a step: what an engine that sampled that text hands the
    API (a random-weight checkpoint cannot be made to sample a chosen text)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    async def generate(self, prompt_ids, params):
        for i, token in enumerate(self.ids):
            yield Generation([token], "length" if i == len(self.ids) - 1 else None)


async def test_a_stream_of_a_byte_level_bpe_gives_the_same_text_as_the_whole_answer(tmp_path):
    """é, ✓, CJK and emoji span several tokens each: no U+FFFD in the stream."""
    text = " caf\u00e9 \u2713 \u4f60\u597d \U0001f642"
    tokenizer = load_tokenizer(str(build_checkpoint(tmp_path / "qwen3", family="qwen3", seed=1)))
    ids = tokenizer.encode_plain(text)
    runner = web.AppRunner(make_app(_ScriptedBackend(ids), tokenizer, ApiConfig(MODEL, 256)))
    await runner.setup()
    port, scheme = await serve_api(runner, "127.0.0.1", free_port())
    api = openai.AsyncOpenAI(base_url=f"{scheme}://127.0.0.1:{port}/v1", api_key="unused",
                             max_retries=0)
    try:
        whole = await api.completions.create(model=MODEL, prompt="hi", max_tokens=len(ids))
        assert whole.choices[0].text == text
        stream = await api.completions.create(model=MODEL, prompt="hi", max_tokens=len(ids),
                                              stream=True)
        assert "".join([c.choices[0].text async for c in stream]) == text
        chat = await api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=len(ids),
            stream=True)
        assert "".join([c.choices[0].delta.content or "" async for c in chat]) == text
    finally:
        await runner.cleanup()


class _FailingBackend:
    """Generates one token, then fails with ``error``: a stream that breaks after its status
    was sent."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def generate(self, prompt_ids, params):
        yield Generation([5])
        raise self.error


@pytest.mark.parametrize(("error", "outcome", "kind"), [
    (ServingStopped("the serving engine stopped"), "unavailable", "service_unavailable"),
    (RuntimeError("engine bug"), "error", "server_error"),
])
async def test_a_stream_that_fails_midway_is_counted_as_its_failure_not_as_ok(error, outcome,
                                                                               kind):
    """A failure after a stream's status is sent takes the same mapping as one before it: the
    error event has the JSON answer's type, and the requests counter has its outcome."""
    from prometheus_client import REGISTRY

    def count(label: str) -> float:
        return REGISTRY.get_sample_value("rlh_coexec_serving_requests_total",
                                         {"outcome": label}) or 0.0

    runner = web.AppRunner(make_app(_FailingBackend(error), load_tokenizer("tiny"),
                                    ApiConfig(MODEL, 256)))
    await runner.setup()
    port, scheme = await serve_api(runner, "127.0.0.1", free_port())
    before = {label: count(label) for label in ("ok", outcome)}
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": "1", "max_tokens": 4, "stream": True}
            async with http.post(f"{scheme}://127.0.0.1:{port}/v1/completions",
                                 json=body) as resp:
                assert resp.status == 200
                events = [json.loads(line[len(b"data: "):]) for line in
                          (await resp.read()).split(b"\n\n")
                          if line.startswith(b"data: {")]
        assert events[-1]["error"]["type"] == kind
        assert str(error) in events[-1]["error"]["message"]
        assert count(outcome) == before[outcome] + 1
        assert count("ok") == before["ok"]
    finally:
        await runner.cleanup()

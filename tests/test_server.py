"""The OpenAI-compatible server, through uvicorn on 127.0.0.1 and the real `openai` client.

The engine under the server is the `engine` fixture: a `FakeEngine` (same interface as
`LLMEngine`: echoes the prompt's tokens back, one per step) so these tests need no model. To run
them against the real engine, return an `LLMEngine` from that fixture: tests that depend on the
fake's echo are marked with `fake_only`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import httpx
import pytest

# The server's own packages are optional (the GPU image has none of them): skip, don't error.
pytest.importorskip("fastapi", reason="the server needs fastapi (pip install fastapi)")
uvicorn = pytest.importorskip("uvicorn", reason="the server needs uvicorn (pip install uvicorn)")
openai = pytest.importorskip("openai", reason="these tests use the openai client (pip install openai)")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from vmemkv.cache.config import CacheStats
from vmemkv.engine.serving.async_engine import AsyncEngine, EngineDeadError
from vmemkv.engine.core.detokenizer import IncrementalDetokenizer
from vmemkv.engine.core.metrics import EngineMetrics
from vmemkv.engine.core.outputs import CompletionOutput, RequestOutput
from vmemkv.engine.core.sampling_params import SamplingParams
from vmemkv.errors import RequestTooLongError

from serving import running_server  # noqa: E402

API_KEY = "test-key"
WAIT_S = 10.0  # the longest any test waits for the server to react


# ---- a fake engine ------------------------------------------------------------------------------

def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE trained here (no network), with an <eos> token."""
    corpus = ["Hello world! The quick brown fox jumps over the lazy dog.",
              "alpha beta gamma delta epsilon", "user: assistant: 😀 中文"] * 10
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


@dataclass
class _FakeSequence:
    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None


@dataclass
class _FakeRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[_FakeSequence]


class FakeEngine:
    """The `LLMEngine` interface without a model: sequence i of a request echoes the prompt's
    tokens cyclically, starting at token i. Stop strings, max_tokens and logprobs are honoured."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, max_model_len: int = 512,
                 step_delay_s: float = 0.002) -> None:
        self.tokenizer = tokenizer
        self.model_name = "fake-model"
        self.config = SimpleNamespace(max_model_len=max_model_len)
        self.metrics = EngineMetrics()
        self.step_delay_s = step_delay_s  # so that streams last long enough to be cut
        self.requests: dict[str, _FakeRequest] = {}

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0) -> None:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        limit = self.config.max_model_len
        if len(ids) + params.max_tokens > limit:
            raise RequestTooLongError(f"{len(ids)} prompt tokens + max_tokens {params.max_tokens} "
                                      f"exceed max_model_len {limit}")
        seqs = [_FakeSequence(i, IncrementalDetokenizer.from_params(self.tokenizer, ids, params))
                for i in range(params.n)]
        self.requests[request_id] = _FakeRequest(request_id, ids, params, seqs)
        self.metrics.on_request_added(request_id, len(ids))

    def abort_request(self, request_id: str) -> None:
        if self.requests.pop(request_id, None) is not None:
            self.metrics.on_request_finished(request_id, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def seconds_to_idle_release(self) -> float | None:
        return None  # no KV memory to give back

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_delay_s)
        outputs = []
        for request in list(self.requests.values()):
            for seq in request.seqs:
                if seq.finish_reason is None:
                    self._advance(request, seq)
            finished = all(seq.finish_reason is not None for seq in request.seqs)
            outputs.append(self._output(request, finished))
            if finished:
                del self.requests[request.request_id]
                self.metrics.on_request_finished(request.request_id, request.seqs[0].finish_reason)
        self.metrics.on_step(len(self.requests), 0, 0, 0.5, 0)
        return outputs

    def _advance(self, request: _FakeRequest, seq: _FakeSequence) -> None:
        params, detokenizer = request.params, seq.detokenizer
        token = request.prompt_ids[(seq.index + len(detokenizer.token_ids)) % len(request.prompt_ids)]
        delta = detokenizer.append(token)
        self.metrics.on_step_tokens({request.request_id: 1})
        if params.logprobs is not None:
            top = {t: -1.0 - k for k, t in enumerate(request.prompt_ids[:params.logprobs])}
            seq.logprobs.append({**top, token: -0.5})
        if (matched := detokenizer.check_stop(new_chars=len(delta))) is not None:
            seq.finish_reason, seq.stop_reason = "stop", matched
        elif len(detokenizer.token_ids) >= params.max_tokens:
            detokenizer.flush()
            seq.finish_reason = "length"

    def _output(self, request: _FakeRequest, finished: bool) -> RequestOutput:
        completions = [CompletionOutput(
            index=seq.index, text=seq.detokenizer.output_text(seq.finish_reason is not None),
            token_ids=list(seq.detokenizer.token_ids), finish_reason=seq.finish_reason,
            logprobs=list(seq.logprobs) if request.params.logprobs is not None else None,
            stop_reason=seq.stop_reason) for seq in request.seqs]
        return RequestOutput(request.request_id, None, list(request.prompt_ids), completions,
                             finished)


# ---- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["fake", "real"])
def engine(request):
    """The engine under test: the fake, then the real `LLMEngine` end to end (tiny-llama). After
    the real one's tests, its cache must be consistent and hold no page."""
    if request.param == "fake":
        yield FakeEngine(byte_level_tokenizer())
        return
    from vmemkv.engine import EngineConfig, LLMEngine

    real = LLMEngine(EngineConfig(max_model_len=256, max_num_seqs=8))
    yield real
    deadline = time.monotonic() + WAIT_S
    while real.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)  # aborted streams are cleaned up by the engine thread
    real.manager.check()
    assert real.manager.num_blocks_in_use == 0, "the server leaked KV pages"


fake_only = pytest.mark.usefixtures("_require_fake_engine")


@pytest.fixture
def _require_fake_engine(engine):
    if not isinstance(engine, FakeEngine):
        pytest.skip("checks the fake engine's echoed text")


@pytest.fixture(scope="module")
def aborted(engine) -> list[str]:
    """Request ids the engine was asked to abort (a spy on `engine.abort_request`)."""
    calls: list[str] = []
    original = engine.abort_request

    def spy(request_id: str) -> None:
        calls.append(request_id)
        original(request_id)

    engine.abort_request = spy
    return calls


@pytest.fixture(scope="module")
def base_url(engine, aborted) -> Iterator[str]:
    """The server, in uvicorn on a free port of 127.0.0.1, in a background thread."""
    with running_server(AsyncEngine(engine), engine.model_name, WAIT_S, API_KEY) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=WAIT_S * 3)


@pytest.fixture(scope="module")
def http(base_url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=WAIT_S * 3,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as http_client:
        yield http_client


def _wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {WAIT_S} s waiting for {what}")
        time.sleep(0.01)


def _echo(engine: FakeEngine, prompt: str, count: int, start: int = 0) -> str:
    ids = engine.tokenizer.encode(prompt)
    return engine.tokenizer.decode([ids[(start + i) % len(ids)] for i in range(count)])


def _assert_openai_error(response: httpx.Response, status: int, *message_parts: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    for part in message_parts:
        assert part in body["error"]["message"]


PROMPT = "Hello world! The quick brown fox jumps over the lazy dog."
NO_EOS = {"ignore_eos": True}  # so a real engine also runs to max_tokens


# ---- plain endpoints ----------------------------------------------------------------------------

def test_models(client, engine):
    models_page = client.models.list()
    assert [m.id for m in models_page.data] == [engine.model_name]
    assert models_page.data[0].object == "model"


def test_health(http):
    response = http.get("/health")
    assert response.status_code == 200


def test_metrics_render_prometheus_text(client, http, engine):
    client.completions.create(model=engine.model_name, prompt=PROMPT, max_tokens=3,
                              temperature=0, extra_body=NO_EOS)
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert 'vmemkv_requests_finished_total{finished_reason="length"}' in text
    for name in ("vmemkv_prompt_tokens_total", "vmemkv_generation_tokens_total",
                 "vmemkv_time_to_first_token_seconds_bucket", "vmemkv_e2e_request_latency_seconds_count",
                 "vmemkv_num_requests_running", "vmemkv_kv_cache_usage_ratio"):
        assert name in text


# ---- completions --------------------------------------------------------------------------------

def test_completion(client, engine):
    completion = client.completions.create(model=engine.model_name, prompt=PROMPT, max_tokens=6,
                                           temperature=0, extra_body=NO_EOS)
    assert completion.id.startswith("cmpl-") and completion.object == "text_completion"
    assert completion.model == engine.model_name and completion.created > 0
    [choice] = completion.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    prompt_tokens = len(engine.tokenizer.encode(PROMPT))
    assert completion.usage.prompt_tokens == prompt_tokens
    assert completion.usage.completion_tokens == 6
    assert completion.usage.total_tokens == prompt_tokens + 6
    if isinstance(engine, FakeEngine):
        assert choice.text == _echo(engine, PROMPT, 6)


def test_completion_from_token_ids(client, engine):
    ids = engine.tokenizer.encode(PROMPT)
    completion = client.completions.create(model=engine.model_name, prompt=ids, max_tokens=4,
                                           temperature=0, extra_body=NO_EOS)
    assert completion.usage.prompt_tokens == len(ids)
    text = client.completions.create(model=engine.model_name, prompt=PROMPT, max_tokens=4,
                                     temperature=0, extra_body=NO_EOS).choices[0].text
    assert completion.choices[0].text == text


def test_streamed_completion_matches_the_non_streamed_one(client, engine):
    kwargs = {"model": engine.model_name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
              "extra_body": NO_EOS}
    expected = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    assert len(chunks) >= 2
    assert all(c.id == chunks[0].id and c.id.startswith("cmpl-") for c in chunks)
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == expected
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_ends_with_done(http, engine):
    with http.stream("POST", "/v1/completions", json={
            "model": engine.model_name, "prompt": PROMPT, "max_tokens": 3, "stream": True,
            **NO_EOS}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][len("data: "):])["object"] == "text_completion"


@fake_only
def test_stop_string(client, engine):
    prompt = "alpha beta gamma delta epsilon"
    completion = client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=20,
                                           stop=["gamma"])
    choice = completion.choices[0]
    assert choice.text == "alpha beta " and choice.finish_reason == "stop"
    streamed = client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=20,
                                         stop=["gamma"], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == "alpha beta "


def test_n_completions(client, engine):
    completion = client.completions.create(model=engine.model_name, prompt=PROMPT, max_tokens=4,
                                           n=2, seed=1, extra_body=NO_EOS)
    assert sorted(c.index for c in completion.choices) == [0, 1]
    assert completion.usage.completion_tokens == 8
    if isinstance(engine, FakeEngine):
        assert completion.choices[1].text == _echo(engine, PROMPT, 4, start=1)
    streamed = client.completions.create(model=engine.model_name, prompt=PROMPT, max_tokens=4,
                                         n=2, seed=1, stream=True, extra_body=NO_EOS)
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == {c.index: c.text for c in completion.choices}


def test_completion_logprobs(client, engine):
    completion = client.completions.create(model=engine.model_name, prompt=PROMPT, max_tokens=5,
                                           temperature=0, logprobs=2, extra_body=NO_EOS)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    if isinstance(engine, FakeEngine):  # whole-character tokens: their texts add up
        assert "".join(logprobs.tokens) == completion.choices[0].text
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0


# ---- chat ---------------------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]


def test_chat(client, engine):
    chat = client.chat.completions.create(model=engine.model_name, messages=MESSAGES,
                                          max_tokens=5, temperature=0, extra_body=NO_EOS)
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion"
    [choice] = chat.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert chat.usage.completion_tokens == 5
    if isinstance(engine, FakeEngine):  # no chat template: the fallback format
        prompt = "system: Be brief.\nuser: Hello world!\nassistant: "
        assert chat.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
        assert choice.message.content == _echo(engine, prompt, 5)


def test_streamed_chat_matches_the_non_streamed_one(client, engine):
    kwargs = {"model": engine.model_name, "messages": MESSAGES, "max_completion_tokens": 7,
              "temperature": 0, "extra_body": NO_EOS}
    expected = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in text_chunks) == expected
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 7


def test_chat_logprobs_and_content_parts(client, engine):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello world!"}]}]
    chat = client.chat.completions.create(model=engine.model_name, messages=messages, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body=NO_EOS)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    if isinstance(engine, FakeEngine):
        assert "".join(entry.token for entry in content) == chat.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.bytes == list(entry.token.encode())


def test_chat_default_max_tokens_fills_the_context(client, engine, monkeypatch):
    # No max_tokens: generate up to the context length (the fake never emits EOS).
    if not isinstance(engine, FakeEngine):
        pytest.skip("a real model may stop at EOS first")
    # ~500 steps, none of them cut by a client: no step delay needed to keep the stream alive.
    monkeypatch.setattr(engine, "step_delay_s", 0.0)
    chat = client.chat.completions.create(model=engine.model_name, messages=MESSAGES)
    usage = chat.usage
    assert usage.total_tokens == engine.config.max_model_len


# ---- errors -------------------------------------------------------------------------------------

def test_invalid_json_is_a_400(http):
    response = http.post("/v1/completions", content=b'{"prompt": "x", "max_tokens": ',
                         headers={"Content-Type": "application/json"})
    _assert_openai_error(response, 400, "JSON")


def test_missing_field_is_a_400(http, engine):
    response = http.post("/v1/completions", json={"model": engine.model_name, "max_tokens": 3})
    _assert_openai_error(response, 400, "prompt")


def test_bad_parameter_is_a_400(client, http, engine):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=engine.model_name, prompt=PROMPT, temperature=-1)
    assert "temperature must be >= 0, got -1" in str(raised.value)
    response = http.post("/v1/chat/completions", json={
        "model": engine.model_name, "messages": MESSAGES, "top_p": 2})
    _assert_openai_error(response, 400, "top_p must be <= 1")


def test_too_long_prompt_is_a_400(client, http, engine):
    ids = engine.tokenizer.encode(PROMPT)
    too_long = (ids * (engine.config.max_model_len // len(ids) + 2))[:engine.config.max_model_len + 1]
    response = http.post("/v1/completions", json={"model": engine.model_name, "prompt": too_long,
                                                  "max_tokens": 4})
    _assert_openai_error(response, 400, f"maximum context length is {engine.config.max_model_len} "
                         f"tokens. However, you requested {len(too_long)} tokens in the messages")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=engine.model_name, prompt=too_long, max_tokens=4, stream=True)


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_past_the_context_is_a_400_as_vllm_answers(client, http, engine, stream):
    limit = engine.config.max_model_len
    prompt_len = len(engine.tokenizer.encode(PROMPT))
    expected = (f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + limit} tokens ({prompt_len} in the messages, {limit} in the "
                "completion). Please reduce the length of the messages or completion.")
    response = http.post("/v1/completions", json={"model": engine.model_name, "prompt": PROMPT,
                                                  "max_tokens": limit, "stream": stream})
    _assert_openai_error(response, 400, expected)
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError, match=f"in the messages, {limit} in the completion"):
            client.chat.completions.create(model=engine.model_name, messages=MESSAGES,
                                           stream=stream, **{field: limit})


def test_a_refused_max_tokens_leaves_a_running_stream_alone(base_url, http, engine):
    body = {**_long_request(engine), "temperature": 0, "stream": True}  # long: still running below
    expected = http.post("/v1/completions", json={**body, "stream": False}).json()
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=base_url, timeout=WAIT_S, headers=headers) as other, \
            other.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        text = [json.loads(next(lines)[len("data: "):])["choices"][0]["text"]]
        refused = http.post("/v1/completions", json={**body, "max_tokens": 10**6})
        _assert_openai_error(refused, 400, "maximum context length")
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                text += [choice["text"] for choice in json.loads(line[len("data: "):])["choices"]]
    assert "".join(text) == expected["choices"][0]["text"]


def test_several_prompts_are_a_clear_400(http, engine):
    response = http.post("/v1/completions", json={"model": engine.model_name, "prompt": ["a", "b"]})
    _assert_openai_error(response, 400, "2 prompts is not supported")


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="no-such-model", prompt=PROMPT)


def test_api_key(base_url, engine):
    wrong = openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=engine.model_name, prompt=PROMPT)
    response = httpx.post(f"{base_url}/v1/completions", json={"prompt": PROMPT}, timeout=WAIT_S)
    _assert_openai_error(response, 401, "API key")
    assert httpx.get(f"{base_url}/health", timeout=WAIT_S).status_code == 200  # not under /v1


# ---- client disconnects -------------------------------------------------------------------------

def _long_request(engine) -> dict:
    prompt_len = len(engine.tokenizer.encode(PROMPT))
    return {"model": engine.model_name, "prompt": PROMPT, **NO_EOS,
            "max_tokens": engine.config.max_model_len - prompt_len}


def test_disconnect_mid_stream_aborts_the_request(base_url, engine, aborted):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {**_long_request(engine), "stream": True}
    with httpx.Client(base_url=base_url, timeout=WAIT_S, headers=headers) as http_client, \
            http_client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
            if len(events) == 3:
                break  # leaving the block closes the connection mid-stream
    request_id = events[0]["id"]
    assert all(e["choices"][0]["finish_reason"] is None for e in events)
    _wait_until(lambda: request_id in aborted, f"abort_request({request_id!r})")


def test_disconnect_while_waiting_for_a_full_answer_aborts_the_request(base_url, engine, aborted):
    before = len(aborted)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{base_url}/v1/completions", json=_long_request(engine), timeout=0.05,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    _wait_until(lambda: len(aborted) > before, "abort_request after a client timeout")
    assert aborted[-1].startswith("cmpl-")


_GAUGES = ("vmemkv_num_requests_running", "vmemkv_num_requests_waiting", "vmemkv_kv_cache_usage_ratio")


def _gauges(http: httpx.Client) -> dict[str, float]:
    lines = (line.split(" ") for line in http.get("/metrics").text.splitlines())
    return {parts[0]: float(parts[1]) for parts in lines if parts[0] in _GAUGES}


def test_gauges_are_current_after_the_last_request_is_aborted(base_url, http, engine, aborted):
    # The engine thread steps only while requests are unfinished: aborting the only one must
    # itself refresh the gauges, or /metrics shows it running, holding pages, until the next one.
    if isinstance(engine, FakeEngine):
        pytest.skip("checks the real engine's gauges")
    _wait_until(lambda: not engine.has_unfinished_requests(), "earlier requests to end")
    body = {**_long_request(engine), "stream": True}
    with httpx.Client(base_url=base_url, timeout=WAIT_S,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as http_client, \
            http_client.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and '"id"' in line:
                request_id = json.loads(line[len("data: "):])["id"]
                busy = _gauges(http)
                break  # leaving the block closes the connection: the server aborts the request
    assert busy["vmemkv_num_requests_running"] == 1 and busy["vmemkv_kv_cache_usage_ratio"] > 0
    _wait_until(lambda: request_id in aborted and not engine.has_unfinished_requests(), "the abort")
    deadline = time.monotonic() + 1.0  # abort_request returns just after dropping the request
    while (idle := _gauges(http)) != dict.fromkeys(_GAUGES, 0.0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert idle == dict.fromkeys(_GAUGES, 0.0)


# ---- AsyncEngine on its own (always on a FakeEngine) --------------------------------------------

class _CountingEngine(FakeEngine):
    """Counts steps and aborts; can be made to fail at a given step."""

    def __init__(self, fail_at_step: int | None = None) -> None:
        super().__init__(_shared_tokenizer())
        self.steps = 0
        self.aborted: list[str] = []
        self.fail_at_step = fail_at_step

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.steps == self.fail_at_step:
            raise RuntimeError("injected step failure")
        return super().step()

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)
        super().abort_request(request_id)


_TOKENIZER: list[PreTrainedTokenizerFast] = []


def _shared_tokenizer() -> PreTrainedTokenizerFast:
    if not _TOKENIZER:
        _TOKENIZER.append(byte_level_tokenizer())
    return _TOKENIZER[0]


def _run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, WAIT_S))


@pytest.fixture
def counting_engine() -> Iterator[tuple[AsyncEngine, _CountingEngine]]:
    engine = _CountingEngine()
    async_engine = AsyncEngine(engine)
    yield async_engine, engine
    async_engine.shutdown()


def test_async_engine_streams_until_finished_then_sleeps(counting_engine):
    async_engine, engine = counting_engine

    async def collect() -> list[RequestOutput]:
        return [out async for out in async_engine.generate("r1", PROMPT, SamplingParams(max_tokens=5))]

    outputs = _run(collect())
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 2, 3, 4, 5]
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    steps = engine.steps
    time.sleep(0.2)
    assert engine.steps == steps  # idle: the thread waits, it does not step
    assert engine.aborted == []


def test_async_engine_add_errors_raise_before_any_output(counting_engine):
    async_engine, engine = counting_engine

    async def first(request_id: str, prompt) -> RequestOutput:
        return await anext(async_engine.generate(request_id, prompt, SamplingParams(max_tokens=4)))

    with pytest.raises(RequestTooLongError):
        _run(first("long", list(range(1, 600))))
    with pytest.raises(ValueError, match="empty"):
        _run(first("empty", []))
    assert engine.aborted == []  # a refused request is not aborted


def test_async_engine_duplicate_request_id(counting_engine):
    async_engine, engine = counting_engine

    async def two_with_one_id() -> None:
        running = async_engine.generate("same", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
        await anext(running)
        try:
            await anext(async_engine.generate("same", PROMPT, SamplingParams()))
        finally:
            await running.aclose()

    with pytest.raises(ValueError, match="already in use"):
        _run(two_with_one_id())
    _wait_until(lambda: "same" in engine.aborted, "the first request's abort")
    assert set(engine.aborted) == {"same"}


def test_async_engine_consumer_that_stops_aborts_the_request(counting_engine):
    async_engine, engine = counting_engine

    async def read_two_then_stop() -> None:
        outputs = async_engine.generate("r2", PROMPT, SamplingParams(max_tokens=400))
        await anext(outputs)
        await anext(outputs)
        await outputs.aclose()

    _run(read_two_then_stop())
    # Aborting twice is allowed (the engine ignores unknown ids): a step may find the stream's
    # event loop closed and abort the request before the abort command arrives.
    _wait_until(lambda: "r2" in engine.aborted, "abort_request('r2')")
    assert set(engine.aborted) == {"r2"}
    _wait_until(lambda: not engine.has_unfinished_requests(), "the engine to be idle")


def test_async_engine_step_failure_ends_streams_and_refuses_new_requests():
    async_engine = AsyncEngine(_CountingEngine(fail_at_step=3))

    async def collect(request_id: str) -> list[RequestOutput]:
        return [o async for o in async_engine.generate(request_id, PROMPT, SamplingParams(max_tokens=50))]

    try:
        with pytest.raises(EngineDeadError, match="injected step failure"):
            _run(collect("r3"))
        assert not async_engine.is_running
        with pytest.raises(EngineDeadError):
            _run(collect("r4"))
    finally:
        async_engine.shutdown()


def test_async_engine_shutdown_ends_open_streams():
    async_engine = AsyncEngine(_CountingEngine())

    async def read_until_shutdown() -> None:
        outputs = async_engine.generate("r5", PROMPT, SamplingParams(max_tokens=400))
        await anext(outputs)
        await asyncio.to_thread(async_engine.shutdown)
        async for _ in outputs:
            pass

    with pytest.raises(EngineDeadError, match="shut down"):
        _run(read_until_shutdown())



def test_async_engine_builds_a_built_on_request_engine_on_its_own_thread():
    built_on = []

    def build() -> _CountingEngine:
        built_on.append(threading.current_thread())
        return _CountingEngine()

    async_engine = AsyncEngine(build)
    try:
        assert built_on == [async_engine._thread] and isinstance(async_engine.engine, _CountingEngine)

        async def collect() -> list[RequestOutput]:
            return [o async for o in async_engine.generate("r6", PROMPT, SamplingParams(max_tokens=3))]

        assert [len(o.outputs[0].token_ids) for o in _run(collect())] == [1, 2, 3]
    finally:
        async_engine.shutdown()


def test_async_engine_raises_the_build_error_and_leaves_no_thread():
    def build():
        raise ValueError("no such model")

    before = threading.active_count()
    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(build)
    assert threading.active_count() == before

# ---- EngineMetrics on its own -------------------------------------------------------------------

def test_metrics_hooks_summary_and_render():
    # the hit rate is read from the manager's counters when scraped, not copied each step
    metrics = EngineMetrics(cache_stats=lambda: CacheStats(prefix_queried_tokens=10, prefix_hit_tokens=5))
    EngineMetrics()  # a second one has its own registry: no duplicate-name error
    metrics.on_request_added("a", 10, now=0.0)
    metrics.on_first_token("a", now=0.5)
    for n, now in ((1, 0.5), (1, 0.7), (2, 1.1)):
        metrics.on_step_tokens({"a": n}, now=now)
    metrics.on_request_finished("a", "stop", now=1.2)
    metrics.on_request_added("b", 4, now=1.0)
    metrics.on_request_finished("b", "abort", now=1.5)  # no token: no TTFT, no TPOT
    metrics.on_step(1, 2, 3, 0.25, 4, now=1.5)
    metrics.on_step(1, 2, 3, 0.25, 4, now=1.6)  # a total, not an increment

    summary = metrics.summary()
    assert summary["num_requests_finished"] == {"stop": 1, "abort": 1}
    assert summary["num_prompt_tokens"] == 14 and summary["num_generation_tokens"] == 4
    assert summary["ttft_s"]["count"] == 1 and summary["ttft_s"]["mean"] == pytest.approx(0.5)
    assert summary["tpot_s"]["p50"] == pytest.approx((1.1 - 0.5) / 3)
    assert summary["e2e_latency_s"]["count"] == 2
    assert summary["e2e_latency_s"]["p99"] == pytest.approx(0.5 + (1.2 - 0.5) * 0.99)
    assert summary["generation_throughput_tokens_per_s"] == pytest.approx(4 / 1.1)

    text = metrics.render().decode()
    for line in ('vmemkv_requests_finished_total{finished_reason="stop"} 1.0',
                 'vmemkv_requests_finished_total{finished_reason="abort"} 1.0',
                 "vmemkv_prompt_tokens_total 14.0", "vmemkv_generation_tokens_total 4.0",
                 "vmemkv_num_requests_running 1.0", "vmemkv_num_requests_waiting 2.0",
                 "vmemkv_num_requests_swapped 3.0", "vmemkv_kv_cache_usage_ratio 0.25",
                 "vmemkv_prefix_cache_hit_rate 0.5", "vmemkv_preemptions_total 4.0",
                 "vmemkv_time_to_first_token_seconds_count 1.0",
                 "vmemkv_e2e_request_latency_seconds_count 2.0"):
        assert line in text
    assert "vmemkv_generation_throughput_tokens_per_second" in text


def test_a_client_gone_before_the_first_output_is_answered_without_a_traceback():
    """The handler is still waiting (for a free slot, say) when the client leaves: it is cancelled,
    which aborts its request, and the answer is a quiet 499, not an error of the server's own."""
    from starlette.requests import Request

    from vmemkv.engine.serving.server import _cancel_on_disconnect

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    ended: list[str] = []

    async def waiting_handler():
        try:
            await asyncio.Event().wait()  # no output yet
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    request = Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive)
    response = _run(_cancel_on_disconnect(request, waiting_handler()))
    assert response.status_code == 499 and ended == ["cancelled"]

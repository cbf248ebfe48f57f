"""The server's chat endpoint on the real model (smollm2-135m-instruct) through the real `openai`
client: the chat template formats the messages, the answer is the model's and ends at the
template's end-of-turn token. Also: `/v1/models` flags random-weight built-in models."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi", reason="the server needs fastapi (pip install fastapi)")
uvicorn = pytest.importorskip("uvicorn", reason="the server needs uvicorn (pip install uvicorn)")
openai = pytest.importorskip("openai", reason="the client tests need openai (pip install openai)")

from vmemkv.engine import EngineConfig, LLMEngine  # noqa: E402
from vmemkv.engine.serving.async_engine import AsyncEngine  # noqa: E402
from serving import running_server  # noqa: E402

WAIT_S = 60.0  # a CPU forward pass of the real model is slow on a loaded machine


def serve(engine: LLMEngine, served_name: str) -> Iterator[str]:
    """The server's OpenAI base URL (``.../v1``), for as long as the caller iterates."""
    with running_server(AsyncEngine(engine), served_name, WAIT_S) as url:
        yield f"{url}/v1"


@pytest.fixture(scope="module")
def engine(real_engine_model):
    model, tokenizer = real_engine_model
    engine = LLMEngine(EngineConfig(model="smollm2-135m-instruct", max_num_seqs=4,
                                    max_model_len=256), model=model, tokenizer=tokenizer)
    yield engine
    engine.manager.check()
    assert engine.manager.num_blocks_in_use == 0, "the server leaked KV pages"
    engine.close()


@pytest.fixture(scope="module")
def client(engine) -> Iterator[openai.OpenAI]:
    for base_url in serve(engine, "smollm2-135m-instruct"):
        yield openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=WAIT_S)


def test_chat_answers_a_real_question(client):
    chat = client.chat.completions.create(
        model="smollm2-135m-instruct", temperature=0, max_tokens=24,
        messages=[{"role": "system", "content": "Answer in one short sentence."},
                  {"role": "user", "content": "What is the capital of France?"}])
    [choice] = chat.choices
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"  # at <|im_end|>, which is not in the text
    assert "<|im_end|>" not in choice.message.content
    assert chat.usage.completion_tokens < 24


def test_streamed_chat_matches(client):
    kwargs = dict(model="smollm2-135m-instruct", temperature=0, max_tokens=12,
                  messages=[{"role": "user", "content": "Name a primary color."}])
    expected = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(**kwargs, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected


def test_models_flags_random_weights():
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_num_seqs=2, max_model_len=64))
    for base_url in serve(engine, "tiny-llama"):
        [entry] = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0).models.list().data
        assert entry.random_weights is True and "random weights" in entry.notice
    engine.close()


def test_models_of_the_real_model_has_no_notice(client):
    [entry] = client.models.list().data
    assert entry.id == "smollm2-135m-instruct"
    assert not getattr(entry, "random_weights", False)

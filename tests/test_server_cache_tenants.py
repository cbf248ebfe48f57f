"""The server's prefix cache seen from outside: tenants (a salt per API key, vLLM's per-request
``cache_salt``) never hit each other's pages, and the KV event stream (ZeroMQ, vLLM's format)
lets a subscriber rebuild the cache's contents, hash -> token ids, exactly.

The real engine (tiny-llama) under uvicorn on 127.0.0.1; prompts are token ids.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("fastapi", reason="the server needs fastapi (pip install fastapi)")
pytest.importorskip("uvicorn", reason="the server needs uvicorn (pip install uvicorn)")
httpx = pytest.importorskip("httpx", reason="these tests send requests with httpx")
zmq = pytest.importorskip("zmq", reason="KV events need pyzmq (pip install 'vmemkv[server]')")
msgpack = pytest.importorskip("msgpack", reason="KV events need msgpack (pip install 'vmemkv[server]')")

from vmemkv import CacheKeys
from vmemkv.engine import EngineConfig, LLMEngine
from vmemkv.engine.serving.async_engine import AsyncEngine
from vmemkv.engine.serving.server import tenant_salt
from vmemkv.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

from serving import running_server  # noqa: E402

WAIT_S = 20.0
KEYS = ["key-of-tenant-a", "key-of-tenant-b"]
PROMPT = [(7 * i + 3) % 500 for i in range(40)]  # two full 16-token pages and a partial one


def complete(http: httpx.Client, key: str | None, prompt: list[int], **extra) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = http.post("/v1/completions", headers=headers,
                         json={"prompt": prompt, "max_tokens": 4, "temperature": 0, **extra})
    assert response.status_code == 200, response.text


def hit_tokens(engine: LLMEngine) -> int:
    return engine.manager.cache_stats().prefix_hit_tokens


def test_tenants_hit_only_their_own_pages():
    engine = LLMEngine(EngineConfig(max_model_len=128, max_num_seqs=2))
    options = {"api_keys": KEYS, "cache_salt_per_api_key": True}
    with running_server(AsyncEngine(engine), engine.model_name, WAIT_S, **options) as url, \
            httpx.Client(base_url=url, timeout=WAIT_S) as http:
        complete(http, KEYS[0], PROMPT)
        assert hit_tokens(engine) == 0
        complete(http, KEYS[1], PROMPT)  # the same prompt, the other tenant: no hit
        assert hit_tokens(engine) == 0
        complete(http, KEYS[0], PROMPT)  # the same tenant again: both full pages hit
        assert hit_tokens(engine) == 32
        complete(http, KEYS[0], PROMPT, cache_salt="another")  # a salt partitions further
        assert hit_tokens(engine) == 32
        complete(http, KEYS[0], PROMPT, cache_salt="another")
        assert hit_tokens(engine) == 64
        assert http.post("/v1/completions", json={"prompt": PROMPT, "cache_salt": ""},
                         headers={"Authorization": f"Bearer {KEYS[1]}"}).status_code == 400
    engine.close()


def test_cache_salt_without_keys_separates_requests():
    engine = LLMEngine(EngineConfig(max_model_len=128, max_num_seqs=2))
    with running_server(AsyncEngine(engine), engine.model_name, WAIT_S) as url, \
            httpx.Client(base_url=url, timeout=WAIT_S) as http:
        complete(http, None, PROMPT, cache_salt="a")
        complete(http, None, PROMPT, cache_salt="b")
        complete(http, None, PROMPT)
        assert hit_tokens(engine) == 0
        complete(http, None, PROMPT, cache_salt="b")
        assert hit_tokens(engine) == 32
    engine.close()


def test_salt_per_key_needs_a_key():
    engine = LLMEngine(EngineConfig(max_model_len=64, max_num_seqs=1))
    with pytest.raises(ValueError, match="needs at least one API key"):
        with running_server(AsyncEngine(engine), engine.model_name, WAIT_S,
                            cache_salt_per_api_key=True):
            pass
    assert tenant_salt(KEYS[0]) != tenant_salt(KEYS[1]) and KEYS[0] not in tenant_salt(KEYS[0])


def test_a_subscriber_rebuilds_the_cache_from_the_event_stream():
    # 10 blocks of 16 tokens: five 3-block requests, so later ones evict earlier pages
    engine = LLMEngine(EngineConfig(max_model_len=64, max_num_seqs=2, num_blocks=10,
                                    kv_events_endpoint="tcp://127.0.0.1:*"))
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.connect(engine.kv_event_publisher.endpoint)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(1.0)  # a PUB socket drops what it sends before the subscription arrives
    prompts = [PROMPT] + [[(p + k) % 500 for p in PROMPT] for k in range(1, 5)]
    options = {"api_keys": KEYS, "cache_salt_per_api_key": True}
    with running_server(AsyncEngine(engine), engine.model_name, WAIT_S, **options) as url, \
            httpx.Client(base_url=url, timeout=WAIT_S) as http:
        for i, prompt in enumerate(prompts):
            complete(http, KEYS[i % 2], prompt)
    pool = engine.manager.pool
    rebuilt: dict[bytes, tuple[bytes | None, list[int]]] = {}
    sequences, kinds, multi_block_events = [], set(), 0
    deadline = time.monotonic() + WAIT_S
    while True:  # read until the stream matches the cache and then stays quiet
        matched = set(rebuilt) == set(pool.block_of_hash)
        if not subscriber.poll(300 if matched else int(max(deadline - time.monotonic(), 0) * 1000)):
            assert matched, "the event stream stopped before it matched the cache"
            break
        topic, sequence, payload = subscriber.recv_multipart()
        sequences.append(int.from_bytes(sequence, "big"))
        for event in decode_batch(msgpack.unpackb(payload)).events:
            kinds.add(type(event))
            multi_block_events += isinstance(event, BlockStored) and len(event.block_hashes) > 1
            if isinstance(event, BlockStored):  # a run of blocks, each the next one's parent
                parent = event.parent_block_hash
                for i, block_hash in enumerate(event.block_hashes):
                    rebuilt[block_hash] = (parent, event.token_ids[i * 16:(i + 1) * 16])
                    parent = block_hash
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    del rebuilt[block_hash]
            else:
                assert isinstance(event, AllBlocksCleared)
                rebuilt.clear()
    assert topic == b"" and sequences == list(range(len(sequences)))  # from 0, no gap
    assert kinds == {BlockStored, BlockRemoved} and multi_block_events
    assert set(rebuilt) == set(pool.block_of_hash)
    # each hash is its parent's (or its tenant's root) chained with the tokens the event gives
    roots = {engine.manager.hasher.root(CacheKeys(cache_salt=tenant_salt(key))) for key in KEYS}
    for block_hash, (parent, tokens) in rebuilt.items():
        candidates = [parent] if parent is not None else roots
        assert any(engine.manager.hasher.block_hashes(tokens, 16, CacheKeys(), parent=root)
                   == [block_hash] for root in candidates)
    # and the first block of each prompt still cached holds that prompt's first 16 tokens
    first_blocks = {tuple(tokens) for parent, tokens in rebuilt.values() if parent is None}
    assert first_blocks and first_blocks <= {tuple(p[:16]) for p in prompts}
    subscriber.close(linger=0)
    engine.close()

"""Publish the engine's KV events over ZeroMQ, the way vLLM does, so routers built for vLLM's
``--kv-events-config`` can subscribe to vmemkv unchanged.

A PUB socket bound to ``endpoint`` (e.g. ``tcp://*:5557``) sends one multipart message per
batch: ``[topic, sequence number (8 bytes, big-endian), msgpack payload]``, the payload being
``kv_events.encode_batch``'s ``[ts, [event, ...]]``. The sequence number starts at 0 and grows by
one per batch, so a subscriber sees a gap when it missed one (a PUB socket drops messages for
subscribers that joined late or fell behind; vLLM's replay socket is not offered here).

The engine thread calls ``publish`` once per step (never blocking); a background thread encodes
and sends, so the step never waits on the network.
"""

from __future__ import annotations

import logging
import queue
import threading

from vmemkv.errors import ConfigError
from vmemkv.cache.events import KVEventBatch, encode_batch

logger = logging.getLogger(__name__)


class KVEventPublisher:
    """``publish(batch)`` from one thread; ``close()`` sends what is queued, then stops."""

    def __init__(self, endpoint: str, topic: str = "", max_queue_batches: int = 100_000) -> None:
        try:
            import msgpack
            import zmq
        except ImportError as exc:
            raise ConfigError(f"publishing KV events needs pyzmq and msgpack ({exc}); install "
                              "them with: pip install 'vmemkv[server]'") from exc

        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.set_hwm(max_queue_batches)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self._socket.close(linger=0)
            raise ValueError(f"cannot bind the KV event publisher to {endpoint!r}: {exc}; pass "
                             "an address like tcp://*:5557 whose port is free") from exc
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)  # the port if it was *
        self._topic = topic.encode()
        # (sequence number, batch); numbered by the publishing thread, so a dropped batch leaves
        # a gap that subscribers can see
        self._queue: queue.Queue[tuple[int, KVEventBatch] | None] = queue.Queue(max_queue_batches)
        self.num_dropped = 0  # batches dropped because the queue was full
        self._next_sequence = 0
        self._thread = threading.Thread(target=self._run, name="vmemkv-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        sequence = self._next_sequence
        self._next_sequence += 1
        try:
            self._queue.put_nowait((sequence, batch))
        except queue.Full:
            self.num_dropped += 1

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            sequence, batch = item
            try:
                self._socket.send_multipart(
                    [self._topic, sequence.to_bytes(8, "big"), self._pack(encode_batch(batch))])
            except Exception:  # keep publishing later batches; subscribers see the gap
                logger.exception("could not publish KV event batch %d", sequence)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (up to ``timeout`` seconds), then close the socket."""
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join(timeout)
        self._socket.close(linger=int(timeout * 1000))

"""Drive an ``LLMEngine`` from asyncio code: one engine thread, per-request output queues.

The engine is not thread safe, so exactly one thread (started here) ever touches it. Other
threads hand it commands (add, abort) through a queue guarded by a condition variable; the thread
sleeps on that condition when there is no work. Each request's outputs go to an ``asyncio.Queue``
on the event loop that called ``generate``, via ``loop.call_soon_threadsafe``.

A step that raises stops the engine thread: open streams end with ``EngineDeadError`` and so does
every later request (the server answers 503). ``on_failure``, when given, is then called with the
error on the engine thread, so an owner can stop too (the server exits after a tensor-parallel
rank failed: nothing can run again).

Pass a function that builds the engine rather than the engine, and it is built on the engine
thread: the thread that steps a CPU engine should be the one that built it. OpenMP keeps a pool of
worker threads for each thread that starts parallel work, and the engine's start does (its
kernel timing): built on one thread and stepped on another, the process holds two pools, more
OpenMP threads than cores, and libgomp then stops spinning between parallel regions, so each of
a step's few hundred regions wakes its worker from sleep. A 16-sequence decode step of
SmolLM2-135M at two threads took 44 ms that way against 33 ms built and stepped on one thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from vmemkv.engine.distributed import TensorParallelError
from vmemkv.engine.core.outputs import RequestOutput
from vmemkv.engine.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or a step raised); no request can run."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    keys: Any  # CacheKeys, or None for the engine's default
    stream: _Stream
    accepted: asyncio.Future  # resolved (or failed with add_request's error) by the engine thread


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Run ``fn(engine)`` on the engine thread between steps (sleep, wake_up)."""
    fn: Callable[[Any], Any]
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future  # its result, or its error


class AsyncEngine:
    def __init__(self, engine: Any,
                 on_failure: Callable[[BaseException], None] | None = None) -> None:
        """``engine``: an ``LLMEngine``, or a function of no arguments that builds one, called on
        the engine thread (the module's docstring says why); its error, if any, is raised here."""
        build = engine if callable(engine) and not hasattr(engine, "step") else None
        self.engine = None if build else engine
        self._on_failure = on_failure
        self._commands: deque[_Add | _Abort | _Call] = deque()
        self._wakeup = threading.Condition()
        self._streams: dict[str, _Stream] = {}  # only the engine thread touches it
        self._stopping = False
        self.error: BaseException | None = None  # what killed the engine thread, if anything
        self._engine_closed = False
        self._thread = threading.Thread(target=self._run, args=(build,), name="vmemkv-engine", daemon=True)
        self._built = threading.Event()
        self._thread.start()
        self._built.wait()
        if build is not None and self.engine is None:
            self._thread.join()
            raise self.error

    # ---- read-only facts the server needs ---------------------------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    @property
    def metrics(self):
        return self.engine.metrics

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self.error is None

    # ---- the asyncio side -------------------------------------------------------------------

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       priority: int = 0, keys: Any = None) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs until it finishes.

        ``add_request``'s errors (prompt too long, bad input) raise here before the first output.
        If the consumer stops early (``break``, ``aclose()``, cancellation on client disconnect)
        the request is aborted so its KV pages are freed.
        """
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        accepted = loop.create_future()
        self._submit(_Add(request_id, prompt, params, priority, keys, stream, accepted))
        finished = False
        try:
            await accepted
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            # Abort unless the request ended or add_request refused it. Cancelled while waiting
            # for the add: it may still be added, and the abort is queued behind it.
            if not finished and (accepted.cancelled() or not accepted.done()
                                 or accepted.exception() is None):
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; a no-op if it is unknown or finished."""
        try:
            self._submit(_Abort(request_id))
        except EngineDeadError:
            pass  # nothing runs any more, so nothing is left to free

    def shutdown(self, timeout: float = 10.0, close_engine: bool = False) -> None:
        """Stop the engine thread after its current step; open streams end with EngineDeadError.
        ``close_engine``: then close the engine too, once its thread has stopped, so its KV memory
        and its share of a shared KV budget go back now, not when the process ends."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if close_engine and self.engine is not None and not self._thread.is_alive() \
                and not self._engine_closed:
            self._engine_closed = True
            self.engine.close()

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(engine)`` on the engine thread between steps; its result (or error)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._submit(_Call(fn, loop, done))
        return await done

    def _submit(self, command: "_Add | _Abort | _Call") -> None:
        with self._wakeup:
            if self._stopping or self.error is not None:
                raise EngineDeadError(self._dead_reason())
            self._commands.append(command)
            self._wakeup.notify()

    def _dead_reason(self) -> str:
        if self.error is not None:
            return f"the engine stopped after an error: {self.error!r}"
        return "the engine is shut down"

    # ---- the engine thread ------------------------------------------------------------------

    def _run(self, build: Callable[[], Any] | None) -> None:
        try:
            if build is not None:
                self.engine = build()
        except BaseException as exc:  # raised by __init__, which waits for the engine
            self.error, self._stopping = exc, True
            return
        finally:
            self._built.set()
        try:
            while (commands := self._wait_for_work()) is not None:
                for command in commands:
                    self._apply(command)
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
        except BaseException as exc:  # a step failed: the engine's state can't be trusted
            if isinstance(exc, TensorParallelError):  # its message says which rank and why
                logger.error("vmemkv: the engine stopped: %s", exc)
            else:
                logger.exception("engine step failed; the engine is stopped")
            with self._wakeup:
                self.error = exc
        finally:
            self._close_all()
        if self.error is not None and self._on_failure is not None:
            self._on_failure(self.error)

    def _wait_for_work(self) -> "list[_Add | _Abort | _Call] | None":
        """Sleep until there is a command or a request to step; None when shutting down. An
        idle engine gives its free KV memory back when its idle give-back falls due."""
        with self._wakeup:
            while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                due = self.engine.seconds_to_idle_release()
                if due is not None and due <= 0:
                    self.engine.on_idle()
                    continue
                self._wakeup.wait(due)
            if self._stopping:
                return None
            commands = list(self._commands)
            self._commands.clear()
            return commands

    def _apply(self, command: "_Add | _Abort | _Call") -> None:
        if isinstance(command, _Call):
            try:
                result, error = command.fn(self.engine), None
            except Exception as exc:  # refused (e.g. sleep with requests running): tell the caller
                result, error = None, exc
            _call_in_loop(command.loop, _settle, command.done, error, result)
            return
        if isinstance(command, _Abort):
            self._streams.pop(command.request_id, None)
            self.engine.abort_request(command.request_id)
            return
        if command.request_id in self._streams:
            error: Exception | None = ValueError(f"request id {command.request_id!r} is already in use")
        else:
            try:
                keys = {} if command.keys is None else {"keys": command.keys}  # prefix-cache salt
                self.engine.add_request(command.request_id, command.prompt, command.params,
                                        priority=command.priority, **keys)
                error = None
            except Exception as exc:  # bad input: refuse this request, keep serving the others
                error = exc
        if error is None:
            self._streams[command.request_id] = command.stream
        _call_in_loop(command.stream.loop, _settle, command.accepted, error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted by its consumer, or added to the engine directly
            if output.finished:
                del self._streams[output.request_id]
            if not _call_in_loop(stream.loop, stream.queue.put_nowait, output) and not output.finished:
                del self._streams[output.request_id]  # its event loop is gone: nobody will read
                self.engine.abort_request(output.request_id)

    def _close_all(self) -> None:
        """End every open stream and pending add with EngineDeadError (the thread is exiting)."""
        with self._wakeup:
            self._stopping = True
            pending = list(self._commands)
            self._commands.clear()
        error = EngineDeadError(self._dead_reason())
        for command in pending:
            if isinstance(command, _Add):
                _call_in_loop(command.stream.loop, _settle, command.accepted, error)
            elif isinstance(command, _Call):
                _call_in_loop(command.loop, _settle, command.done, error)
        for stream in self._streams.values():
            _call_in_loop(stream.loop, stream.queue.put_nowait, error)
        self._streams.clear()


def _settle(future: asyncio.Future, error: BaseException | None, result: Any = None) -> None:
    if not future.done():  # the waiter may have been cancelled meanwhile
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


def _call_in_loop(loop: asyncio.AbstractEventLoop, callback, *args) -> bool:
    """Schedule ``callback(*args)`` on ``loop`` from another thread; False if the loop is closed."""
    try:
        loop.call_soon_threadsafe(callback, *args)
        return True
    except RuntimeError:
        return False

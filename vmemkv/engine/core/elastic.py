"""Elastic KV memory in the engine: give free KV memory back after an idle spell, and sleep/wake.

* **Idle give-back.** A loop with nothing to step calls ``LLMEngine.on_idle()``; once the engine
  has had no request for ``EngineConfig.kv_idle_release_s`` seconds, its free KV memory goes back
  (cached blocks too: ``Scheduler.release_free_memory(cached=True)``; the scheduler holds the KV
  cache manager), and with a shared budget (``kv_pool``) its share, so another engine on the
  machine can use it. One give-back per idle spell (the hysteresis: a busy engine never gives back
  between steps).
* **Sleep and wake** (as vLLM's ``LLM.sleep`` / ``wake_up``): ``sleep(level=1)`` gives back every
  KV page, cached ones included; on CUDA it also moves the weights to host memory. ``level=2``
  discards the weights instead; ``wake_up()`` loads them again from the model's source (its name
  or directory), or moves them back. An engine asleep refuses requests.
"""

from __future__ import annotations

import time

import torch

from vmemkv.engine.core.host_malloc import give_back_freed_memory

from vmemkv.errors import ConfigError, VmemkvError


class EngineAsleepError(VmemkvError):
    """The engine is asleep: ``wake_up()`` it before adding requests."""


def check_sleep_level(level) -> None:
    if level not in (1, 2):
        raise ConfigError(f"sleep level must be 1 or 2, got {level!r}")


class ElasticMemory:
    """The idle give-back and sleep state of one engine (its ``scheduler``, which gives KV memory
    back, and its ``model``)."""

    def __init__(self, scheduler, model: torch.nn.Module, idle_release_s: float | None, reload_weights):
        self.scheduler, self.model = scheduler, model
        self.idle_release_s = idle_release_s
        self._reload_weights = reload_weights  # () -> a model with the same weights, or None
        self._idle_since: float | None = time.monotonic()
        self.released_idle = False  # this idle spell's give-back is done
        self.sleep_level = 0  # 0: awake
        self._host_weights: dict[str, torch.Tensor] | None = None
        self.idle_releases = 0
        self.idle_released_bytes = 0

    # --- idle give-back -------------------------------------------------------------------------
    def busy(self) -> None:
        """A request arrived: the idle spell (if any) ends."""
        self._idle_since = None
        self.released_idle = False

    def idle(self, now: float | None = None) -> None:
        """The engine has nothing left to step (from ``now``, unless already idle)."""
        if self._idle_since is None:
            self._idle_since = time.monotonic() if now is None else now

    def seconds_to_release(self, now: float | None = None) -> float | None:
        """How long until the idle give-back is due (0: now), or None if none is to come."""
        if self.idle_release_s is None or self._idle_since is None or self.released_idle:
            return None
        now = time.monotonic() if now is None else now
        return max(0.0, self._idle_since + self.idle_release_s - now)

    def on_idle(self, now: float | None = None) -> int:
        """Give the free KV memory back if the idle give-back is due; returns the bytes."""
        due = self.seconds_to_release(now)
        if due is None or due > 0:
            return 0
        self.released_idle = True
        given = self.scheduler.release_free_memory(cached=True)
        self.idle_releases += 1
        self.idle_released_bytes += given
        return given

    # --- sleep and wake --------------------------------------------------------------------------
    def sleep(self, level: int) -> int:
        """Give back every KV page (level 1 and 2), then offload (level 1, CUDA) or discard
        (level 2) the weights; returns the KV bytes given back."""
        check_sleep_level(level)
        if self.sleep_level:
            return 0
        if level == 2 and self._reload_weights is None:
            raise ConfigError("sleep(level=2) discards the weights, and this engine cannot load "
                              "them again (it was given a model object); use level=1")
        self.scheduler.reset_prefix_cache()  # no request holds blocks: the engine checked
        given = self.scheduler.release_free_memory(cached=True)
        params = dict(self.model.named_parameters())
        if level == 2:  # parameters and buffers (packed CPU weights are buffers)
            for param in params.values():
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            for name, buffer in self.model.named_buffers():
                _set_buffer(self.model, name, torch.empty(0, dtype=buffer.dtype, device=buffer.device))
            give_back_freed_memory()  # the weights' heap pages (the engine keeps freed memory)
        elif next(iter(params.values())).device.type == "cuda":
            self._host_weights = {name: param.data.to("cpu") for name, param in params.items()}
            for param in params.values():
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self.sleep_level = level
        return given

    def wake_up(self) -> None:
        """Bring the weights back (KV pages come back on demand, as requests need them)."""
        if not self.sleep_level:
            return
        params = dict(self.model.named_parameters())
        if self.sleep_level == 2:
            model = self._reload_weights()
            fresh = dict(model.named_parameters())
            device = next(iter(params.values())).device
            for name, param in params.items():
                param.data = fresh[name].data.to(device)
            for name, buffer in model.named_buffers():
                _set_buffer(self.model, name, buffer.to(device))
        elif self._host_weights is not None:
            for name, param in params.items():
                param.data = self._host_weights[name].to(param.device)
            self._host_weights = None
        self.sleep_level = 0
        self.idle()  # awake with nothing to do: the idle clock runs again

    def check_awake(self) -> None:
        if self.sleep_level:
            raise EngineAsleepError(f"the engine is asleep (level {self.sleep_level}); call "
                                    "wake_up() (POST /wake_up on the server) before sending requests")


def _set_buffer(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace the buffer ``name`` (dotted, as ``named_buffers`` gives it) of ``model``."""
    owner, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(owner), attribute, tensor)

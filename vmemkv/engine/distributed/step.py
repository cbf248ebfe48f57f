"""What every rank builds the same way, and what travels from rank 0 each step.

Every rank builds its KV cache manager from the same configuration and the same sharded model
config, with its backend wrapped in a ``BackendRecorder`` (``shard_manager``): layouts, page counts
and reservations then agree, so rank 0's log names the same pages everywhere. A model mixing local
and global layers gets a manager of several layer groups on every rank (``make_kv_manager``: the
engine's rule), each group's backend recorded into one ``Recording``. Each forward, rank 0
broadcasts a ``StepMessage``: the log since the last one, the packed batch's token ids and
positions, the rows to take logits of, and each sequence's span (slot, rows, cached length, block
table); a worker replays the log and rebuilds the step's attention from the spans with its own
addressing.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from vmemkv.attention import SequenceSpan
from vmemkv.cache.config import CacheConfig
from vmemkv.cache.metrics import KVMetricsCollector
from vmemkv.cache.memory import backend_pages
from vmemkv.memory.vmm import create_backend
from vmemkv.engine.core.config import EngineConfig
from vmemkv.cache.manager import KVCacheManager
from vmemkv.engine.core.kv_manager import make_kv_manager
from vmemkv.engine.distributed.recorder import BackendRecorder, Recording, SwapRecorder
from vmemkv.engine.distributed.group import Groups, TensorParallelError


HEADER_BYTES = 1024  # the first broadcast of every step: the size, and the message when it fits


@dataclass
class StepMessage:
    """A forward's message; one with no ``input_ids`` carries only the log (memory given back
    while idle), and no forward runs."""
    log: list
    input_ids: list[int]
    positions: list[int]
    logit_rows: list[int] | None
    spans: list[SequenceSpan | tuple[SequenceSpan, ...]]  # one per layer group: several groups, block tables
    digest: int | None  # rank 0's state_digest after the log, when every step is checked
    # CPU slot runs rank 0 read in one call ((slots, tokens) its batched reads made readable; the
    # filler pages that took arrive through the log): a worker batches those runs, and no others
    batched_reads: list[tuple[tuple[int, ...], int]] = field(default_factory=list)


def batched_reads_of(attention) -> list[tuple[tuple[int, ...], int]]:
    """The slot runs ``attention`` reads in one call on CPU, as ``(slots, tokens)`` its batched
    reads made readable (none for block tables, GPU kernels or a hybrid model on block tables)."""
    if getattr(attention, "reads", None) is None:
        return []
    return [(tuple(attention.spans[i].slot for i in batch.members), batch.read_len)
            for batch in attention.batches]


def shard_manager(config: EngineConfig, model, rank: int, metrics: KVMetricsCollector | None = None,
                  **manager_options) -> tuple[KVCacheManager, Recording]:
    """Rank ``rank``'s manager over its share of the KV heads (``model`` is sharded already), every
    group's backend and swap space recorded; the construction's own calls are not part of any
    step. ``manager_options`` go to the manager (one group's or the hybrid's) as they are (rank 0's own,
    such as its event sink). With a shared KV budget (``kv_pool``) rank 0 is the engine's one
    member and pays for every rank's blocks; the others replay its page decisions and never ask."""
    # On this rank's own device (cuda:<local rank>; the config says only "cuda").
    cache = replace(config.cache_config(model), device=str(next(model.parameters()).device))
    if cache.kv_pool is not None:
        cache = replace(cache, kv_pool_ranks=config.tensor_parallel_size) if rank == 0 else \
            replace(cache, kv_pool=None, kv_pool_bytes=None)
    recording = Recording()
    manager = make_kv_manager(cache, model.config, max_model_len=config.max_model_len,
                              chunk_tokens=config.max_num_batched_tokens,
                              release_behind_window=config.release_behind_window, metrics=metrics,
                              **manager_options, backends=lambda group: _recorded_backend(group, recording))
    for memory, recorder in zip(manager.memories, recording.recorders):  # one backend each
        memory.swap = memory.host_tier.store = SwapRecorder(memory.swap, recorder)  # one store
    recording.take_log()
    return manager, recording


def _recorded_backend(cache: CacheConfig, recording: Recording) -> BackendRecorder:
    """A backend for a manager of ``cache``, sized as the manager sizes its own (the pool, filler
    pages for batched reads on CPU, the hole page behind windows on CUDA:
    ``kv_memory.backend_pages``), recorded into ``recording``."""
    layout = cache.make_layout()
    return BackendRecorder(create_backend(cache.device, layout.page_size, backend_pages(cache, layout)[0]),
                           recording)


def broadcast(message: StepMessage | None, groups: Groups) -> int:
    """Rank 0 sends ``message`` (None: stop) to every rank; returns its pickled size in bytes.

    One collective for a usual step: a fixed ``HEADER_BYTES`` buffer holds the size and, when it
    fits, the message itself (a few hundred bytes for a decode step); a longer message follows in
    a second broadcast on the ``steps`` group."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    header[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
    inline = len(payload) <= HEADER_BYTES - 8
    if inline:
        header[8:8 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    dist.broadcast(header, src=0, group=groups.idle)
    if not inline:
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0,
                       group=groups.steps)
    return len(payload)


def receive(groups: Groups) -> StepMessage | None:
    header = torch.empty(HEADER_BYTES, dtype=torch.uint8)
    dist.broadcast(header, src=0, group=groups.idle)  # as long as the engine is idle
    size = int(header[:8].view(torch.int64).item())
    if size <= HEADER_BYTES - 8:
        return pickle.loads(header[8:8 + size].numpy().tobytes())
    payload = torch.empty(size, dtype=torch.uint8)
    dist.broadcast(payload, src=0, group=groups.steps)
    return pickle.loads(payload.numpy().tobytes())


def check_digests(digest: int, groups: Groups, step: int) -> None:
    """Every rank passes its state digest; all raise TensorParallelError unless they agree."""
    mine = torch.tensor([digest], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine, group=groups.steps)
    digests = [int(d.item()) for d in everyone]
    if len(set(digests)) > 1:
        raise TensorParallelError(
            f"the ranks' KV mapping state differs at step {step} (digests by rank: "
            f"{', '.join(f'{d:016x}' for d in digests)}): a page operation was not replayed alike; "
            "the engine has stopped")

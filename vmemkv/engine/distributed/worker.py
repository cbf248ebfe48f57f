"""A worker rank (1..N-1): its shard of the model and of the KV cache, driven by rank 0's steps.

It schedules nothing and decides nothing: it waits for a ``StepMessage``, replays rank 0's page
operations on its own pool (every layout group's, for a hybrid model), optionally checks that its memory state matches rank 0's, and runs the
same forward on its shard (the model's all-reduces pair with rank 0's). It stops when rank 0 sends
the stop message, and exits with an error when rank 0 is gone or a collective times out, so no
rank keeps running alone.
"""

from __future__ import annotations

import gc
import sys

import torch

from vmemkv.engine.models.hf_support import text_config
from vmemkv.engine.core.addressing import choose_addressing
from vmemkv.engine.core.config import EngineConfig
from vmemkv.engine.core.kv_manager import KVManager
from vmemkv.engine.core.model_runner import ModelRunner
from vmemkv.engine.models.zoo import load_model
from vmemkv.engine.distributed.group import Rendezvous, join, leave, rank_device
from vmemkv.engine.distributed.recorder import replay, state_digest
from vmemkv.engine.distributed.sharding import shard_model
from vmemkv.engine.distributed.step import check_digests, receive, shard_manager
from vmemkv.memory.protect import protect_kv_memory


def run_worker(config: EngineConfig, rendezvous: Rendezvous) -> None:
    """Serve rank 0's steps until it stops the engine (returns) or fails (raises)."""
    if config.protect_kv:  # a started process is dumpable again: each rank protects its own KV
        protect_kv_memory()
    device = rank_device(config.device, rendezvous.local_rank)
    # The model first (it may take minutes): rank 0 has its own loaded before the ranks meet.
    model, _ = load_model(config.model, config.torch_dtype, device, config.seed)
    config = config.for_model(model.config)  # under torchrun, max_model_len may be unset here
    groups = join(rendezvous, device, config.tensor_parallel_timeout)
    try:
        shard_model(model, rendezvous.rank, rendezvous.world_size)
        manager, recording = shard_manager(config, model, rendezvous.rank)
        runner = ModelRunner(model)
        reads = _ReplayedReads(manager)
        addressing = choose_addressing(config, reads, runner.device,
                                       text_config(model.config).num_attention_heads)
        block_windows, step = [memory.block_window() for memory in manager.memories], 0
        while (message := receive(groups)) is not None:
            replay(message.log, recording, block_windows)
            recording.take_log()  # this rank's own calls are not replayed anywhere
            if message.digest is not None:
                check_digests(state_digest(recording), groups, step)
            if message.input_ids:  # else only the log: memory rank 0 gave back while idle
                reads.runs = set(message.batched_reads)
                runner.forward(message.input_ids, message.positions, addressing.attention(message.spans),
                               message.logit_rows)
                step += 1
        del addressing, runner, block_windows  # views of the cache, which close() refuses to cut
        gc.collect()
        manager.close()
    finally:
        leave()


class _ReplayedReads:
    """This rank's manager as its attention sees it (``KVViews``), with rank 0's batched CPU reads: a run of
    slots is read in one call exactly when rank 0 read it so (``StepMessage.batched_reads``).
    Rank 0's reads mapped filler pages where the run needed them, by its slot mapper's own
    state; those mappings arrive through the log, so this rank maps nothing of its own and the
    page tables stay equal (a run rank 0 did not batch is read sequence by sequence here). This
    rank asks only for runs its own ``worth_batching`` picks, with its share of the KV heads: the
    rule batches more rows as a row gets smaller, so it picks at least rank 0's runs."""

    def __init__(self, manager: KVManager):
        self._manager, self.runs = manager, set()
        reads = manager.batched_reads()
        self.num_layers = reads.num_layers if reads is not None else 0
        self._has_reads = reads is not None
        # the rest of KVViews: the manager's own
        self.config, self.layout, self.tokens_per_page = manager.config, manager.layout, manager.tokens_per_page
        self.layer_group, self.kv_views, self.block_views = manager.layer_group, manager.kv_views, manager.block_views
        self.kv_scale_views, self.block_scale_views = manager.kv_scale_views, manager.block_scale_views

    @property
    def layout_groups(self):
        return self._manager.layout_groups

    def batched_reads(self) -> "_ReplayedReads | None":
        return self if self._has_reads else None

    def make_readable(self, slots: list[int], num_tokens: int) -> bool:
        return (tuple(slots), num_tokens) in self.runs

    def release_reads(self) -> None:
        pass


def spawned_worker(rank: int, config: EngineConfig, rendezvous: Rendezvous) -> None:
    """The entry point of a worker vmemkv spawns (``torch.multiprocessing``): one torch thread per
    rank unless configured, and a one-line error instead of a traceback when rank 0 is gone."""
    torch.set_num_threads(max(1, torch.get_num_threads() // rendezvous.world_size))
    try:
        run_worker(config, Rendezvous(rank, rendezvous.world_size, rank, rendezvous.address,
                                      rendezvous.port, False))
    except Exception as e:  # noqa: BLE001 - reported, then the process exits non-zero
        print(f"vmemkv tensor-parallel rank {rank}: stopping: {type(e).__name__}: {e}",
              file=sys.stderr)
        sys.exit(1)

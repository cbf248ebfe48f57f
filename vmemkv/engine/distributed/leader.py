"""Rank 0 of a tensor-parallel engine: starts or joins the other ranks, shards its model, records
its manager's page operations, and sends each forward's inputs before running its own shard.

``LLMEngine`` asks for three things (``start``, ``shard_manager``, ``model_runner``) and closes
it; the scheduler, the manager and the postprocessing do not know the engine is distributed.
Under ``torchrun`` every rank runs the same program: on ranks other than 0, ``start`` serves as a
worker until rank 0 closes the engine, then exits the process.
"""

from __future__ import annotations

import atexit
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vmemkv.engine.core.config import EngineConfig
from vmemkv.engine.core.model_runner import ModelRunner
from vmemkv.engine.distributed.group import (TensorParallelError, join, launched_by_torchrun, leave, local_rendezvous,
                                             rank_device, torchrun_rendezvous)
from vmemkv.engine.distributed.sharding import check_shardable, shard_model
from vmemkv.engine.distributed.step import StepMessage, batched_reads_of, broadcast, check_digests, shard_manager
from vmemkv.engine.distributed.worker import run_worker, spawned_worker

STOP_WAIT_S = 10.0  # how long close() waits for spawned workers to stop by themselves
TERMINATE_WAIT_S = 2.0  # then how long for SIGTERM before SIGKILL


class TensorParallelLeader:
    def __init__(self, config: EngineConfig, model, groups, processes: list):
        self.config = config
        self.size = config.tensor_parallel_size
        self.groups = groups
        self.processes = processes  # spawned workers; empty under torchrun
        self.recording = None  # every layout group's recorder and their log
        self.failure: TensorParallelError | None = None
        self.num_steps = 0
        self.broadcast_seconds = 0.0  # rank 0 taking the log, pickling and sending step messages
        self.broadcast_bytes = 0
        self.batched_read_runs = 0  # CPU slot runs rank 0 read in one call, and every worker with it
        self.closed = False
        # A program that never closes its engine still stops its workers cleanly on exit.
        atexit.register(self.close)

    @classmethod
    def start(cls, config: EngineConfig, model) -> "TensorParallelLeader":
        """Start (or, under torchrun, join) the other ranks and shard ``model`` in place."""
        size = config.tensor_parallel_size
        check_shardable(model.config, size)
        if dist.is_initialized():
            raise TensorParallelError("this process already belongs to a process group (another "
                                      "tensor-parallel engine?): close() that engine first; a "
                                      "process runs one tensor-parallel engine at a time")
        if launched_by_torchrun():
            rendezvous = torchrun_rendezvous(size)
            if rendezvous.rank != 0:
                run_worker(config, rendezvous)
                sys.exit(0)
            processes = []
        else:
            rendezvous = local_rendezvous(size)
            context = _worker_context()
            processes = [context.Process(target=spawned_worker, args=(rank, config, rendezvous),
                                         daemon=True, name=f"vmemkv-tp-rank{rank}")
                         for rank in range(1, size)]
            for process in processes:
                process.start()
        device = rank_device(config.device, rendezvous.local_rank)
        try:
            groups = join(rendezvous, device, config.tensor_parallel_timeout)
            model.to(device)
            shard_model(model, 0, size)
        except Exception as e:
            _terminate(processes)
            leave()
            raise TensorParallelError(f"starting {size} tensor-parallel ranks failed: "
                                      f"{type(e).__name__}: {e}") from e
        return cls(config, model, groups, processes)

    def shard_manager(self, model, metrics, **manager_options):
        """Rank 0's manager, built exactly as every worker builds its own (one layout group, or
        two for a hybrid model: ``kv_manager.make_kv_manager``), ``manager_options``: what only rank 0's
        manager gets, such as an event sink."""
        manager, self.recording = shard_manager(self.config, model, 0, metrics, **manager_options)
        return manager

    def model_runner(self, model) -> "LeaderModelRunner":
        return LeaderModelRunner(model, self)

    def send_step(self, input_ids, positions, attention, logit_rows) -> None:
        """Broadcast this forward's message (and check the ranks' digests when configured)."""
        self.raise_if_failed()
        check = self.config.tensor_parallel_check
        start = time.perf_counter()
        log, digest = self.recording.take_log(digest=check)
        message = StepMessage(log, list(input_ids), list(positions), logit_rows,
                              list(attention.spans), digest, batched_reads_of(attention))
        self.batched_read_runs += len(message.batched_reads)
        with self.collective("sending the step"):
            self.broadcast_bytes += broadcast(message, self.groups)
            self.broadcast_seconds += time.perf_counter() - start
            if check:
                check_digests(digest, self.groups, self.num_steps)
        self.num_steps += 1

    def send_log(self) -> None:
        """Send the page operations logged since the last step with no forward (memory given
        back while idle), so every rank gives it back now, not at the next step."""
        self.raise_if_failed()
        log, _ = self.recording.take_log()
        if not log:
            return
        with self.collective("sending memory given back"):
            self.broadcast_bytes += broadcast(StepMessage(log, [], [], None, [], None), self.groups)

    def collective(self, what: str):
        return _Collective(self, what)

    def raise_if_failed(self) -> None:
        """Raise the failure, or fail now if a rank this leader started has exited: a broadcast
        to a dead rank need not fail (gloo's send can wait on it without a deadline)."""
        if self.failure is None and any(process.exitcode is not None for process in self.processes):
            self.fail("checking the ranks before a collective", RuntimeError("a rank process exited"))
        if self.failure is not None:
            raise self.failure

    def fail(self, what: str, error: BaseException) -> TensorParallelError:
        """Stop every rank and describe why; every later step raises the same error."""
        if isinstance(error, TensorParallelError):
            self.failure = error
        else:
            time.sleep(0.2)  # a rank that died: let its exit code show
            dead = [(rank, p.exitcode) for rank, p in enumerate(self.processes, 1)
                    if p.exitcode is not None]
            cause = (", ".join(f"rank {rank} exited with code {code}" for rank, code in dead)
                     if dead else f"a rank did not answer within {self.config.tensor_parallel_timeout:g} s "
                                  "or closed its connection")
            self.failure = TensorParallelError(
                f"tensor-parallel engine stopped while {what}: {cause} ({type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}); no rank keeps running; build a "
                "new engine")
        _terminate(self.processes)
        try:  # closes our connections: ranks torchrun started, waiting for a step, see it and exit
            leave()
        except Exception:  # noqa: BLE001 - the group is already broken; nothing more to stop
            pass
        return self.failure

    def close(self) -> None:
        """Stop the workers (cleanly when they still answer) and leave the process group."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        if self.failure is None and all(process.exitcode is None for process in self.processes):
            try:
                broadcast(None, self.groups)
            except Exception:  # noqa: BLE001 - a worker already gone: terminate below
                pass
            for process in self.processes:
                process.join(STOP_WAIT_S)
        _terminate(self.processes)
        leave()

    def stats(self) -> dict:
        return {"tensor_parallel_size": self.size, "tp_broadcast_seconds": self.broadcast_seconds,
                "tp_broadcast_bytes": self.broadcast_bytes, "tp_steps": self.num_steps,
                "tp_batched_read_runs": self.batched_read_runs}


class _Collective:
    """Turns any error inside a collective into the leader's TensorParallelError."""

    def __init__(self, leader: TensorParallelLeader, what: str):
        self.leader, self.what = leader, what

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if error is not None and isinstance(error, Exception):
            raise self.leader.fail(self.what, error) from error
        return False


class LeaderModelRunner(ModelRunner):
    """Rank 0's model runner: each forward first sends the step to the workers, whose shards
    then join the same collectives."""

    def __init__(self, model, leader: TensorParallelLeader):
        super().__init__(model)
        self.leader = leader

    def forward(self, input_ids, positions, attention, logit_rows=None) -> torch.Tensor:
        self.leader.send_step(input_ids, positions, attention, logit_rows)
        with self.leader.collective("running the forward"):
            return super().forward(input_ids, positions, attention, logit_rows)


def _worker_context():
    """Workers start from a fork server that imported vmemkv's engine (torch, transformers) once
    per process: the next engine's workers start without importing it again (seconds on a small
    machine; the tests start several engines). The fork server is a fresh process that never ran a
    model, a CUDA call or a thread pool, so its children start as clean as spawned ones."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["vmemkv.engine.distributed.worker"])
    return context


def _terminate(processes: list) -> None:
    """End spawned workers: SIGTERM, then SIGKILL for any still there (a stopped or hung process
    does not act on SIGTERM)."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(TERMINATE_WAIT_S)
        if process.is_alive():
            process.kill()
            process.join(TERMINATE_WAIT_S)

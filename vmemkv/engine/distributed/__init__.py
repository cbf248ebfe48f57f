"""Tensor parallelism: one model split across ranks (processes on one machine or several), each
rank's KV heads in its own vmemkv pool; the scheduler and the manager run once, on rank 0, and the
other ranks replay rank 0's page operations (``recorder.py``). See ``leader.py`` and ``worker.py``."""

from vmemkv.engine.distributed.group import TensorParallelError
from vmemkv.engine.distributed.leader import TensorParallelLeader

__all__ = ["TensorParallelError", "TensorParallelLeader"]

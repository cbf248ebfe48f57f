"""Why the last refused call was refused.

``admit``, ``fork`` and ``swap_in`` return None / None / False, and ``allocate`` False, changing
nothing, when the slots or the blocks are not there. Their contract stays that plain value; the
manager also keeps what stopped the call in ``last_refusal`` (a :class:`Refusal`), so an engine, a
log line or a person at a prompt can tell a full slot table from a short pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RefusalReason = Literal["no_free_slot", "slot_taken", "out_of_blocks"]


@dataclass(frozen=True)
class Refusal:
    """What a refused ``operation`` on ``request_id`` lacked.

    ``reason``: ``"no_free_slot"`` (every slot is bound to a request), ``"slot_taken"`` (the
    ``slot`` asked for is bound), or ``"out_of_blocks"`` (the pool has ``blocks_available``
    blocks it can hand out, clean or cached, and the call needed ``blocks_needed`` fresh ones;
    ``group`` names the layer group's pool when the model has several, else None)."""

    operation: str
    request_id: str
    reason: RefusalReason
    slot: int | None = None
    blocks_needed: int = 0
    blocks_available: int = 0
    group: str | None = None

    def __str__(self) -> str:
        what = f"{self.operation}({self.request_id!r}) was refused"
        if self.reason == "no_free_slot":
            return (f"{what}: no free slot (every one of the max_num_seqs slots holds a request); "
                    "free or preempt a request, or raise CacheConfig.max_num_seqs")
        if self.reason == "slot_taken":
            return f"{what}: slot {self.slot} holds another request; pass a free slot or none"
        pool = f"the pool of {self.group}" if self.group else "the pool"
        return (f"{what}: it needs {self.blocks_needed} fresh KV blocks and {pool} can hand out "
                f"{self.blocks_available}; free or preempt a request, or raise CacheConfig.num_blocks")

"""Groups of decoding sequences that share a prefix: the same physical blocks at the start of
their block tables (a cached system prompt, the forks of parallel sampling). The native CPU decode
routine reads such a prefix once for the whole group (``cpu_decode``'s ``shared_prefix``) where it
would otherwise read it once per sequence.

A shared block is never written this step (a sequence writes only blocks it holds alone:
copy-on-write), so its rows are the same for every holder up to the shortest one's length.
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_SHARED_TOKENS = 64  # one tile of the native routine: a shorter prefix saves next to nothing


def common_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading entries ``a`` and ``b`` have in common."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


def shared_prefixes(tables: Sequence[Sequence[int]], lengths: Sequence[int],
                    tokens_per_block: int) -> tuple[list[int], list[int]] | None:
    """Each sequence's group leader (the first sequence with its first block) and the tokens it
    reads from the leader's rows: the blocks every member shares with the leader, capped at the
    shortest member. A member that shares fewer than ``MIN_SHARED_TOKENS`` with its leader reads
    alone (leads itself, 0 tokens); so does a group left with one sequence. None: no group."""
    leaders = list(range(len(tables)))
    first_holder: dict[int, int] = {}
    for i, table in enumerate(tables):
        if table and table[0] >= 0:  # RELEASED (-1): a window left no prefix
            leaders[i] = first_holder.setdefault(table[0], i)
    groups: dict[int, list[int]] = {}
    for i, leader in enumerate(leaders):
        if leader != i:
            if common_blocks(tables[leader], tables[i]) * tokens_per_block >= MIN_SHARED_TOKENS:
                groups.setdefault(leader, [leader]).append(i)
            else:
                leaders[i] = i
    if not groups:
        return None
    shared = [0] * len(tables)
    for leader, group in groups.items():
        blocks = min(common_blocks(tables[leader], tables[i]) for i in group[1:])
        tokens = min(blocks * tokens_per_block, min(lengths[i] for i in group))
        for i in group:
            if tokens >= MIN_SHARED_TOKENS:
                shared[i] = tokens
            else:
                leaders[i] = i
    return (leaders, shared) if any(shared) else None

"""Block-table addressing (the vLLM-style baseline): K/V live in block tensors
``[num_blocks, tokens_per_page, kv_head, dim]``; token ``t`` of a sequence is at block
``block_table[t // tokens_per_page]``, offset ``t % tokens_per_page``. SDPA needs a contiguous
sequence, so reading gathers the sequence's blocks (a copy) — the honest CPU baseline."""

from __future__ import annotations

from typing import Callable

import torch

from .packed import PackedAttention, SequenceSpan


class BlockTableAttention(PackedAttention):
    """``block_views(layer)`` gives that layer's K and V block tensors."""

    def __init__(self, spans: list[SequenceSpan],
                 block_views: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                 tokens_per_page: int, device: torch.device, decode_kernel: bool = False):
        super().__init__(spans, device, decode_kernel)
        self.block_views = block_views
        owners, positions = self.token_positions(spans)
        blocks = [spans[i].block_table[p // tokens_per_page] for i, p in zip(owners, positions)]
        self.write_blocks = torch.tensor(blocks, dtype=torch.long, device=device)
        self.write_offsets = torch.tensor([p % tokens_per_page for p in positions], dtype=torch.long,
                                          device=device)
        self.read_blocks = [
            torch.tensor(span.block_table[: -(-span.length // tokens_per_page)], dtype=torch.long,
                         device=device) for span in spans]
        if self.decodes:  # the decode sequences' block tables, padded with block 0 (never read)
            tables = [self.read_blocks[i] for i in self.decodes]
            width = max(len(t) for t in tables)
            self.decode_tables = torch.zeros((len(tables), width), dtype=torch.int32, device=device)
            for row, table in enumerate(tables):
                self.decode_tables[row, :len(table)] = table

    def write(self, layer, key, value):
        k_blocks, v_blocks = self.block_views(layer)
        k_blocks[self.write_blocks, self.write_offsets] = key.to(k_blocks.dtype)
        v_blocks[self.write_blocks, self.write_offsets] = value.to(v_blocks.dtype)

    def read(self, layer, index):
        k_blocks, v_blocks = self.block_views(layer)
        blocks, length = self.read_blocks[index], self.spans[index].length
        k = k_blocks.index_select(0, blocks).flatten(0, 1)[:length]
        v = v_blocks.index_select(0, blocks).flatten(0, 1)[:length]
        return k, v

    def decode(self, layer, q, scale):
        from .triton_decode import decode_attention_paged

        k_blocks, v_blocks = self.block_views(layer)
        return decode_attention_paged(q, k_blocks, v_blocks, self.decode_tables, self.decode_lens,
                                      scale, max_seq_len=self.decode_max_len)

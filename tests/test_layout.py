"""KVLayout: geometry of the token-major and per-layer layouts, and views that address the right
bytes of a real manager's memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vmemkv import CacheConfig, ConfigError, KVCacheManager, KVLayout
from vmemkv.memory.layout import default_page_size

MiB = 1 << 20


def llama3_8b(kind: str, page_size: int = 2 * MiB) -> KVLayout:
    return KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                    page_size=page_size, kind=kind)


def test_token_major_llama3_8b_geometry():
    layout = llama3_8b("token_major")
    assert layout.itemsize == 2
    assert layout.token_bytes == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert layout.row_bytes == layout.token_bytes
    assert layout.tokens_per_page == 16
    assert layout.pages_per_block == 1  # one map call per growth by a page
    assert layout.block_bytes == 2 * MiB
    assert layout.logical_pages_for(16) == 1 and layout.logical_pages_for(17) == 2
    assert layout.slot_pages(8192) == 512
    assert layout.describe() == {"kind": "token_major", "page_size": 2 * MiB,
                                 "token_bytes": 128 * 1024, "tokens_per_page": 16,
                                 "row_data_bytes": 128 * 1024, "token_stride_bytes": 128 * 1024,
                                 "padding_fraction": 0.0, "map_calls_per_growth": 1}


def test_per_layer_llama3_8b_geometry():
    layout = llama3_8b("per_layer")
    assert layout.row_bytes == 8 * 128 * 2
    assert layout.tokens_per_page == 1024
    assert layout.pages_per_block == 64  # 32 layers x K and V: 64 map calls per growth
    assert layout.block_bytes == 64 * 2 * MiB
    assert layout.slot_pages(8192) == 8 * 64
    assert layout.describe()["map_calls_per_growth"] == 64


def test_default_page_size():
    args = (32, 8, 128, torch.bfloat16)
    assert default_page_size(*args, tokens_per_page=16, granularity=2 * MiB) == 2 * MiB
    assert default_page_size(*args, tokens_per_page=16, granularity=4096) == 2 * MiB
    # per-layer rows are 2 KiB: 16 tokens need 32 KiB, rounded up to the 2 MiB granularity
    assert default_page_size(*args, tokens_per_page=16, granularity=2 * MiB, kind="per_layer") == 2 * MiB
    assert default_page_size(*args, tokens_per_page=16, granularity=4096, kind="per_layer") == 32 * 1024
    # a row that does not divide the granularity: the page is a multiple of both
    size = default_page_size(3, 1, 8, torch.float32, tokens_per_page=16, granularity=4096)
    assert size % 4096 == 0 and size % (2 * 3 * 8 * 4) == 0
    layout = KVLayout(3, 1, 8, torch.float32, size)
    assert layout.tokens_per_page >= 16


@pytest.mark.parametrize("page_size", [2 * MiB + 4096, 3 * 64 * 1024 + 1, 1000])
def test_page_sizes_that_do_not_hold_whole_tokens_are_refused(page_size):
    with pytest.raises(ConfigError, match="not a multiple of one token"):
        llama3_8b("token_major", page_size)


def test_bad_layouts_are_refused():
    with pytest.raises(ConfigError, match="positive"):
        KVLayout(0, 8, 128, torch.float16, 2 * MiB)
    with pytest.raises(ConfigError, match="layout kind"):
        KVLayout(32, 8, 128, torch.float16, 2 * MiB, kind="layer_major")
    with pytest.raises(ConfigError, match="not a multiple"):
        llama3_8b("per_layer", 2 * MiB + 1024)
    layout = llama3_8b("token_major")
    with pytest.raises(ConfigError, match="no layer 32"):
        layout.slot_view_geometry(32, 0, 1024)
    with pytest.raises(ConfigError, match="kv 2"):
        layout.block_view_geometry(0, 2)


def test_virtual_and_physical_pages_pair_up():
    token_major = llama3_8b("token_major")
    assert token_major.virtual_pages(np.array([3, 4]), 8192).tolist() == [3, 4]
    assert token_major.physical_pages(np.array([7, 2])).tolist() == [7, 2]
    layout = KVLayout(2, 1, 64, torch.float32, 4096, "per_layer")  # 4 tensors, 16 tokens a page
    assert layout.pages_per_block == 4
    per_tensor = layout.logical_pages_for(64)  # 4 logical pages per tensor
    virtual = layout.virtual_pages(np.array([1, 2]), 64)
    physical = layout.physical_pages(np.array([5, 9]))
    assert virtual.tolist() == [1, 2, 5, 6, 9, 10, 13, 14]
    assert per_tensor == 4
    assert physical.tolist() == [20, 36, 21, 37, 22, 38, 23, 39]


def test_view_geometry():
    layout = llama3_8b("token_major")
    strides, offset = layout.slot_view_geometry(layer=3, kv=1, max_tokens=4096)
    assert strides == (2 * 32 * 8 * 128, 128, 1)
    assert offset == (2 * 3 + 1) * 8 * 128
    block_strides, block_offset = layout.block_view_geometry(3, 1)
    assert block_strides == (MiB, 2 * 32 * 8 * 128, 128, 1)
    assert block_offset == offset
    per_layer = llama3_8b("per_layer")
    strides, offset = per_layer.slot_view_geometry(layer=3, kv=1, max_tokens=4096)
    tensor_elems = 4 * MiB  # 4 pages of 1024 tokens per tensor, 2 MiB / 2 B each
    assert strides == (8 * 128, 128, 1) and offset == 7 * tensor_elems
    block_strides, block_offset = per_layer.block_view_geometry(3, 1)
    assert block_strides == (64 * MiB, 8 * 128, 128, 1)
    assert block_offset == 7 * MiB


def test_padded_stride_geometry():
    """SmolLM2-135M's 23,040 B rows padded to 24,576 B: 256 tokens in a 6 MiB page; every view
    steps from token to token by the padded stride, so the 1,536 padding bytes are never touched."""
    layout = KVLayout(30, 3, 64, torch.bfloat16, 6 * MiB, token_stride_bytes=24576)
    assert (layout.row_data_bytes, layout.row_bytes, layout.token_stride) == (23040, 24576, 12288)
    assert layout.tokens_per_page == 256 and layout.padding_fraction == pytest.approx(1536 / 23040)
    strides, offset = layout.slot_view_geometry(layer=29, kv=1, max_tokens=1024)
    assert strides == (12288, 64, 1) and offset == 59 * 3 * 64
    assert offset + 3 * 64 == 23040 // 2  # the last layer's V ends where the padding starts
    assert layout.block_view_geometry(29, 1) == ((3 * MiB, 12288, 64, 1), offset)
    per_layer = KVLayout(2, 3, 20, torch.float32, 4096, "per_layer", token_stride_bytes=256)
    assert per_layer.tokens_per_page == 16 and per_layer.slot_view_geometry(1, 0, 64)[0] == (64, 20, 1)
    assert per_layer.block_view_geometry(1, 0)[0] == (4 * 1024, 64, 20, 1)
    with pytest.raises(ConfigError, match="at least one token"):
        KVLayout(30, 3, 64, torch.bfloat16, 6 * MiB, token_stride_bytes=20480)
    with pytest.raises(ConfigError, match="padded token stride"):
        KVLayout(30, 3, 64, torch.bfloat16, 2 * MiB, token_stride_bytes=24576)


def block_views(manager: KVCacheManager, layer: int) -> list[torch.Tensor]:
    """Layer ``layer``'s K and V in the pool window, ``[num_blocks, tokens_per_page, heads, dim]``."""
    layout = manager.layout
    flat = manager.backend.pool_window().reshape(-1).view(layout.dtype)
    shape = (manager.num_blocks, layout.tokens_per_page, layout.num_kv_heads, layout.head_dim)
    views = []
    for kv in (0, 1):
        strides, offset = layout.block_view_geometry(layer, kv)
        views.append(flat.as_strided(shape, strides, offset))
    return views


@pytest.mark.parametrize("kind", ["token_major", "per_layer"])
def test_slot_views_and_block_views_address_the_same_bytes(kind):
    config = CacheConfig(num_layers=3, num_kv_heads=2, head_dim=32, dtype=torch.float32,
                         num_blocks=12, max_num_seqs=3, max_model_len=64, tokens_per_page=4,
                         layout=kind)
    with KVCacheManager(config) as manager:
        layout = manager.layout
        tpp = layout.tokens_per_page
        assert layout.kind == kind
        assert tpp == (8 if kind == "token_major" else 16)  # 1536 B rows in 12 KiB pages; 256 B rows in 4 KiB
        lengths = {"a": 2 * tpp + 1, "b": tpp - 1, "c": 3 * tpp}
        for i, (request_id, length) in enumerate(lengths.items()):
            assert manager.admit(request_id, [1000 * i + t for t in range(length)]) == 0
        values = {}
        for i, (request_id, length) in enumerate(lengths.items()):
            slot = manager.slot_of(request_id)
            for layer in range(layout.num_layers):
                for kv, view in enumerate(manager.kv_views(layer)):
                    assert view.shape == (3, 64, 2, 32)
                    data = torch.randn(length, 2, 32)
                    view[slot, :length] = data
                    values[request_id, layer, kv] = data
            manager.commit(request_id)
        for request_id, length in lengths.items():
            blocks = manager.block_table(request_id)
            for layer in range(layout.num_layers):
                for kv, view in enumerate(block_views(manager, layer)):
                    gathered = view[blocks].reshape(-1, 2, 32)[:length]
                    assert torch.equal(gathered, values[request_id, layer, kv])
        # the per-layer layout keeps each tensor in its own physical page of the block
        if kind == "per_layer":
            block = manager.block_table("a")[0]
            page = manager.backend.pool_window()[block * layout.pages_per_block + 2 * 1 + 1]
            expected = values["a", 1, 1][:tpp].reshape(-1)
            assert torch.equal(page.view(torch.float32)[: expected.numel()], expected)
            del page
        manager.check()
        del view  # close() refuses while views of the memory are held

"""The prefix cache's lossy cold tier: cached blocks the device pool lets go are kept compressed
(int8 or int4 per group of a row, ``block_codec.py``) and decompressed on a hit; a request that
demands exact reuse never reads a lossy block, nor one computed after reading one.

K/V is written as float values that are a function of the token prefix and the position in the
row (``float_kv``), so a promoted block reads back close to what was written (within the codec's
bound), an exact request's reads back bit-exact, and one that crossed prompts reads far off.
"""

from __future__ import annotations

import pytest
import torch

from conftest import check_and_close, manager_state, prefix_keys, tiny_config
from vmemkv import BlockStored, CacheKeys, ConfigError, InvalidInputError, KVCacheManager, KVEventBuffer, KVRequest
from vmemkv.cache.block_codec import BlockCodec, QuantizedBlockCodec
from vmemkv.cache.events import MEDIUM_COLD, MEDIUM_DEVICE_LOSSY, is_lossy_key, lossy_key
from vmemkv.memory.quantized_rows import dequantize, quantize, write_rows

TOKENS_PER_PAGE = 4
SHAPE = dict(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float32, tokens_per_page=TOKENS_PER_PAGE)
BLOCK_BYTES = 2 * 2 * 2 * 64 * 4 * TOKENS_PER_PAGE  # layers, K and V, heads, dim, bytes, tokens
GROUP = 32
A_PROMPT = list(range(1, 10))  # two full blocks and one token
OTHER = list(range(20, 33))  # three full blocks and one token


# --- the codec ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,levels", [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_block_comes_back_within_half_a_step_of_its_groups_scale(fmt, levels, dtype):
    codec = BlockCodec(fmt, dtype, 4096, head_dim=64, token_stride_elems=128)
    torch.manual_seed(0)
    x = (torch.randn(3, 4096 // x_size(dtype)) * torch.logspace(-3, 2, 4096 // x_size(dtype))).to(dtype)
    x[1, :GROUP] = 0  # an all-zero group stays zero
    packed = codec.compress(x.view(torch.uint8))
    assert packed.nbytes == 3 * codec.compressed_bytes
    assert codec.compressed_bytes == x[0].numel() * codec.bits // 8 + x[0].numel() // GROUP * 4
    back = codec.decompress(packed).view(dtype).float()
    groups = x.float().view(3, -1, GROUP)
    step = groups.abs().amax(-1, keepdim=True) / levels
    error = (back.view(3, -1, GROUP) - groups).abs()
    rounding = groups.abs() * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10 if dtype == torch.float16 else 0)
    assert (error <= step / 2 + rounding + 1e-12).all()
    assert (back[1, :GROUP] == 0).all()
    # what was decompressed compresses to the same integers: a lossy block loses no more
    again = codec.compress(codec.decompress(packed))
    assert torch.equal(again.values, packed.values)


def x_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def test_a_codec_refuses_what_it_cannot_compress():
    with pytest.raises(ConfigError, match="int8, int4"):
        BlockCodec("fp8", torch.float16, 4096, 64, 64)
    with pytest.raises(ConfigError, match="floating-point"):
        BlockCodec("int8", torch.int32, 4096, 64, 64)


@pytest.mark.parametrize("layout", ["token_major", "per_layer", "latent"])
@pytest.mark.parametrize("kv_cache_dtype,fmt", [("int8", "int8"), ("int8", "int4"), ("fp8", "int8"), ("fp8", "int4")])
def test_a_quantized_block_comes_back_as_its_rows_quantized_again(kv_cache_dtype, fmt, layout):
    """Blocks of quantized live KV (int8 / fp8 bytes, their scales beside them): the codec reads
    every layer's K and V rows (an MLA layout's one latent row) where the layout puts them,
    compresses their values, and writes a decompressed block back as rows of the live format
    (padding zero). int8 rows under the int8 cold format come back byte for byte; the others within
    the two quantizations' steps."""
    shape = dict(layout="token_major", latent=True, num_kv_heads=1) if layout == "latent" else dict(layout=layout)
    m = KVCacheManager(tiny_config(kv_cache_dtype=kv_cache_dtype, dtype=torch.float32, max_model_len=128, **shape))
    tokens = 128 if m.tokens_per_page > 32 else 2 * m.tokens_per_page  # whole blocks (two token-major ones)
    heads, kinds = m.layout.num_kv_heads, (0,) if layout == "latent" else (0, 1)  # latent: K and V one row
    m.admit("a", list(range(tokens)))
    slot, written = m.slot_of("a"), {}
    torch.manual_seed(1)
    for layer in range(2):
        for kv in kinds:
            values, scales = m.kv_views(layer)[kv], m.kv_scale_views(layer)[kv]
            rows = torch.randn(tokens, heads, 64) * torch.logspace(-2, 1, 64)
            values[slot, :tokens], scales[slot, :tokens] = quantize(rows, values.dtype)
            written[layer, kv] = dequantize(values[slot, :tokens], scales[slot, :tokens], torch.float32)
        del values, scales
    layout_of, blocks = m.layout, m.block_table("a")
    n = len(blocks)
    window = m.memories[0].backend.pool_window().view(-1, layout_of.block_bytes)
    codec = QuantizedBlockCodec(fmt, layout_of)
    packed = codec.compress(window[blocks])
    assert packed.nbytes == n * codec.compressed_bytes < n * layout_of.block_bytes
    back = codec.decompress(packed)
    assert back.shape == (n, layout_of.block_bytes)
    covered = torch.zeros_like(back)
    for row, ((values, scales), (old_values, old_scales)) in enumerate(zip(codec.row_views(back),
                                                                          codec.row_views(window[blocks]))):
        layer, kv = codec.rows[row]
        got = dequantize(values, scales, torch.float32).reshape(tokens, heads, 64)
        if (kv_cache_dtype, fmt) == ("int8", "int8"):
            assert torch.equal(values.view(torch.uint8), old_values.view(torch.uint8))
            assert torch.equal(scales, old_scales)
        cold_step = written[layer, kv].unflatten(-1, (2, 32)).abs().amax(-1, keepdim=True) / (127 if fmt == "int8" else 7)
        live_step = scales.reshape(tokens, heads, 2, 1)  # the live format's step (fp8: a value's own rounding, below)
        bound = cold_step / 2 + (live_step / 2 if kv_cache_dtype == "int8" else written[layer, kv].unflatten(
            -1, (2, 32)).abs() * 2 ** -3 + cold_step)
        assert ((got - written[layer, kv]).abs().unflatten(-1, (2, 32)) <= bound + 1e-6).all()
        for view, of in ((values.view(torch.uint8), covered), (scales, covered.view(torch.int32))):
            of.as_strided(view.shape, view.stride(), view.storage_offset()).fill_(-1)  # what the rows cover
        del values, scales, old_values, old_scales
    assert not back[covered == 0].any()  # padding between and after the rows: zero
    del window
    m.free("a")
    check_and_close([m])


# --- a manager with a cold tier -------------------------------------------------------------------
def float_kv(token_ids: list[int], dim: int) -> torch.Tensor:
    """``[len(token_ids), dim]`` float32 values, each row a function of its token prefix."""
    keys = torch.tensor(prefix_keys(token_ids), dtype=torch.float64).unsqueeze(1)
    return torch.sin(keys * 0.37 + torch.arange(dim, dtype=torch.float64) * 0.11).float() * 4


def kv_rows(m, layer: int):
    """The layer's K and V as (values, scales or None): a quantized manager's rows and their scales."""
    scales = m.kv_scale_views(layer) or (None, None)
    return list(zip(m.kv_views(layer), scales))


def write(m, request_id: str, start: int, end: int) -> None:
    """Write positions [start, end) of every layer's K and V (as a forward pass would; quantized
    rows with their scales in a quantized manager)."""
    tokens, slot = m.token_ids(request_id)[:end], m.slot_of(request_id)
    for layer in range(SHAPE["num_layers"]):
        for index, (view, scales) in enumerate(kv_rows(m, layer)):
            rows = float_kv(tokens, 2 * 64 * (layer + 1) + index)[start:, -2 * 64:].view(end - start, 2, 64)
            if scales is None:
                view[slot, start:end] = rows
            else:
                write_rows(view, scales, (slot, slice(start, end)), rows)


def kv_error(m, request_id: str) -> float:
    """The largest difference between the request's computed K/V and what ``write`` writes (in a
    quantized manager: its rows dequantized against what ``write`` stores, dequantized)."""
    length, slot = m.num_computed_tokens(request_id), m.slot_of(request_id)
    tokens, worst = m.token_ids(request_id)[:length], 0.0
    for layer in range(SHAPE["num_layers"]):
        for index, (view, scales) in enumerate(kv_rows(m, layer)):
            expected = float_kv(tokens, 2 * 64 * (layer + 1) + index)[:, -2 * 64:].view(length, 2, 64)
            got = view[slot, :length]
            if scales is not None:
                got = dequantize(got, scales[slot, :length], torch.float32)
                expected = dequantize(*quantize(expected, view.dtype), torch.float32)
            worst = max(worst, (got - expected).abs().max().item())
    return worst


def compute(m, request, tokens=None) -> int:
    """Admit, write every position not hit, commit; returns the hit."""
    cached = m.admit(request, tokens)
    assert cached is not None
    name = request if isinstance(request, str) else request.request_id
    write(m, name, cached, m.num_tokens(name))
    m.commit(name)
    return cached


def prompt_gone_cold(m) -> None:
    """``A_PROMPT`` computed, then pushed to the cold tier by a request that needs the whole pool."""
    compute(m, "a", A_PROMPT)
    m.free("a")
    compute(m, "b", list(range(100, 100 + m.pool.num_blocks * TOKENS_PER_PAGE - 3)))
    m.free("b")


@pytest.fixture
def made():
    managers = []

    def make(num_blocks=4, cold_blocks=4, host_blocks=0, fmt="int8", **overrides):
        codec = BlockCodec(fmt, torch.float32, BLOCK_BYTES, 64, 2 * 2 * 2 * 64)
        config = tiny_config(**{**SHAPE, "num_blocks": num_blocks, "max_model_len": 32,
                                "cold_tier": fmt, "cold_cache_bytes": cold_blocks * codec.compressed_bytes,
                                "host_cache_bytes": host_blocks * BLOCK_BYTES, **overrides})
        m = KVCacheManager(config, events=KVEventBuffer())
        managers.append(m)
        return m

    yield make
    check_and_close(managers)


def test_an_evicted_block_goes_cold_and_a_hit_decompresses_it_close_to_what_was_written(made):
    m = made()
    compute(m, "a", A_PROMPT)
    a_hashes = [m.pool.hash_of[b] for b in m.block_table("a")[:2]]
    assert kv_error(m, "a") == 0
    m.free("a")
    m.events.drain()
    compute(m, "b", OTHER)  # needs all 4 blocks: a's two cached blocks go cold
    cold = [e for e in m.events.drain().events if isinstance(e, BlockStored) and e.medium == MEDIUM_COLD]
    assert sorted(h for e in cold for h in e.block_hashes) == sorted(a_hashes)
    assert {e.token_ids[0] for e in cold} == {1, 5}
    m.free("b")

    assert compute(m, "c", A_PROMPT) == 8  # both blocks decompressed from the cold tier
    assert 0 < kv_error(m, "c") < 4 / 127  # within half a step of int8 over |x| <= 4
    stats = m.cache_stats()
    assert (stats.cold_promotions, stats.prefix_hit_tokens_cold, stats.prefix_hit_tokens_host) == (2, 8, 0)
    assert stats.cold_bytes_stored >= 2 * BlockCodec("int8", torch.float32, BLOCK_BYTES, 64, 256).compressed_bytes
    lossy = [m.pool.hash_of[b] for b in m.block_table("c")[:2]]
    assert all(map(is_lossy_key, lossy))  # keyed lossy on the device: exact requests miss them
    stored = [e for e in m.events.drain().events if isinstance(e, BlockStored)]
    assert sorted(h for e in stored if e.medium == MEDIUM_DEVICE_LOSSY for h in e.block_hashes) == sorted(a_hashes)


def test_an_exact_request_never_reads_a_lossy_block_nor_one_computed_after_it(made):
    m = made()
    compute(m, "a", A_PROMPT)
    m.free("a")
    compute(m, "b", OTHER)  # a's two blocks go cold
    m.free("b")

    longer = A_PROMPT[:8] + [60, 61, 62, 63, 64]  # a's two blocks, then one more full block
    assert compute(m, "lossy", list(longer)) > 0  # from the cold tier
    table = m.block_table("lossy")
    assert all(is_lossy_key(m.pool.hash_of[b]) for b in table[:3])  # its own third block too
    m.free("lossy")

    exact = KVRequest("exact", list(longer), exact=True)
    assert compute(m, exact) == 0  # neither the lossy hits nor the block computed after them
    assert kv_error(m, "exact") == 0
    assert not any(is_lossy_key(m.pool.hash_of[b]) for b in m.block_table("exact")[:3])
    m.free("exact")
    # a tolerant request now takes the exact copies, and its KV is exact
    assert compute(m, KVRequest("tolerant", list(longer))) == 12
    assert kv_error(m, "tolerant") == 0


def test_a_refused_admission_with_cold_hits_changes_nothing(made):
    m = made(num_blocks=4)
    compute(m, "a", A_PROMPT)
    m.free("a")
    compute(m, "b", OTHER)
    before = (manager_state(m), m.cold_tier.hashes(), m.cache_stats())
    # b holds every block: the two cold hits have nowhere to go
    assert m.admit("c", list(A_PROMPT)) is None
    assert (manager_state(m), m.cold_tier.hashes(), m.cache_stats()) == before
    m.free("b")
    assert compute(m, "c", list(A_PROMPT)) == 8


def test_the_full_host_tier_spills_its_oldest_blocks_to_the_cold_tier(made):
    m = made(num_blocks=4, host_blocks=2, cold_blocks=8)
    compute(m, "a", A_PROMPT)
    m.free("a")
    compute(m, "b", OTHER)  # a's two blocks go to the host tier, exact
    m.free("b")
    assert len(m.host_tier) == 2 and not m.cold_tier.hashes()
    compute(m, "c", [70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82])  # b's blocks push a's out
    m.free("c")
    stats = m.cache_stats()
    assert stats.host_evictions >= 2 and stats.cold_demotions >= 2
    assert not set(m.host_tier.hashes()) & set(m.cold_tier.hashes())
    exact = KVRequest("exact", list(A_PROMPT), exact=True)
    assert m.admit(exact) == 0  # a's blocks are cold now: lossy
    m.free(exact)
    assert compute(m, "lossy", list(A_PROMPT)) == 8
    assert 0 < kv_error(m, "lossy") < 4 / 127


def test_int4_keeps_a_block_in_a_third_of_its_float32_bytes_and_close(made):
    m = made(fmt="int4")
    codec = m.cold_tier.codec
    assert codec.compressed_bytes * 6 < BLOCK_BYTES  # 4.5 bits a value of 32
    compute(m, "a", A_PROMPT)
    m.free("a")
    compute(m, "b", OTHER)
    m.free("b")
    assert compute(m, "c", A_PROMPT) == 8
    assert 0 < kv_error(m, "c") < 4 / 7


def test_the_cold_tier_refuses_layers_it_cannot_hold_and_missing_bytes():
    with pytest.raises(ConfigError, match="one group of full-attention"):
        KVCacheManager(tiny_config(**SHAPE, cold_tier="int8", cold_cache_bytes=1 << 20, sliding_window=8))
    with pytest.raises(ConfigError, match="cold_cache_bytes > 0"):
        KVCacheManager(tiny_config(**SHAPE, cold_tier="int8"))
    with pytest.raises(ConfigError, match="cold_tier"):
        KVCacheManager(tiny_config(**SHAPE, cold_tier="int3", cold_cache_bytes=1 << 20))
    with pytest.raises(ConfigError, match="with cold_tier 'off'"):
        KVCacheManager(tiny_config(**SHAPE, cold_cache_bytes=1 << 20))


def test_an_exact_block_and_its_lossy_copy_evicted_together_go_cold_once(made):
    m = made(num_blocks=6, cold_blocks=12)
    prompt_gone_cold(m)
    compute(m, "lossy", list(A_PROMPT))  # a's blocks decompressed: keyed lossy on the device
    lossy = m.pool.hash_of[m.block_table("lossy")[0]]
    m.free("lossy")
    compute(m, KVRequest("exact", list(A_PROMPT), exact=True))  # computed again, exact, beside them
    exact = m.pool.hash_of[m.block_table("exact")[0]]
    m.free("exact")
    assert lossy == lossy_key(exact) and m.pool.lookup(lossy) is not None  # both copies cached
    m.events.drain()
    compute(m, "c", list(range(200, 221)))  # six blocks: both copies leave in one eviction
    stored = [h for e in m.events.drain().events
              if isinstance(e, BlockStored) and e.medium == MEDIUM_COLD for h in e.block_hashes]
    assert len(stored) == len(set(stored)) and exact in stored  # once each
    assert exact in m.cold_tier


def test_an_exact_request_is_never_given_a_copy_of_lossy_kv(made):
    m = made(num_blocks=8, cold_blocks=8)
    prompt_gone_cold(m)
    lossy = KVRequest("lossy", list(A_PROMPT))
    assert compute(m, lossy) == 8 and lossy.allocation.lossy_from == 0  # from the cold tier
    exact = KVRequest("exact", [50, 51, 52], exact=True)
    compute(m, exact)
    before = (manager_state(m), m.cold_tier.hashes())
    with pytest.raises(InvalidInputError, match="demands exact KV"):
        m.fork(lossy, KVRequest("child", [], exact=True))
    with pytest.raises(InvalidInputError, match="demands exact KV"):
        m.reorder([exact, lossy], [lossy, lossy])
    assert (manager_state(m), m.cold_tier.hashes()) == before
    child = m.fork(lossy, "tolerant-child")  # a child made by the manager is as its parent: not exact
    assert child is not None and not child.exact and child.allocation.lossy_from == 0

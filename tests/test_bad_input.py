"""Bad input at the library boundary: every misuse gets a vmemkv error, raised before anything
changes (a bare TypeError/KeyError/IndexError from inside, a silent acceptance, or a half-done
change all fail here)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import manager_state, tiny_config

from vmemkv import CacheConfig, CacheKeys, KVCacheManager, MultimodalItem, validation
from vmemkv.errors import ConfigError, InvalidInputError, ManagerClosedError, VmemkvError

SWAP = 16 * 4096  # 16 blocks of the tiny config (4 tokens x 1 KiB)


def populate(manager: KVCacheManager, lookahead: bool = False) -> KVCacheManager:
    """a: running, committed, 6 tokens (its page [1, 2, 3, 4] is cached); b: running, shares
    that page; p: running, 6 tokens reserved, none computed; s: swapped out."""
    assert manager.admit("a", [1, 2, 3, 4, 5, 6]) == 0
    manager.commit("a")
    assert manager.admit("b", [1, 2, 3, 4, 9, 9, 9]) == 4
    manager.commit("b")
    assert manager.admit("p", [5, 5, 5, 5, 5, 5]) == 0
    assert manager.admit("s", [7, 7, 7, 7, 7]) == 0
    manager.commit("s")
    assert manager.preempt("s", "swap") == "swap"
    if lookahead:  # "a" holds a mapped block past its reservation, which preempt() would trim
        jobs = manager.allocate_lookahead(["a"], 4)
        assert jobs
        manager.map_lookahead(jobs)
    return manager


def case(method: str, label: str, call, setup: str = "populated"):
    return pytest.param(method, call, setup, id=f"{method}-{label}")


F = [1.9, 2.9, 3.9, 4.9, 5]  # truncated for hashing, these read as [1, 2, 3, 4, 5]
MISUSE = [
    # --- admit
    case("admit", "float_tokens_prefix_mixup", lambda m: m.admit("n", F)),
    case("admit", "str_tokens", lambda m: m.admit("n", ["a", "b"])),
    case("admit", "none_token", lambda m: m.admit("n", [None, 1])),
    case("admit", "negative_token", lambda m: m.admit("n", [-1, 2])),
    case("admit", "token_2_pow_63", lambda m: m.admit("n", [1, 2, 3, 4, 2 ** 63])),
    case("admit", "bool_tokens", lambda m: m.admit("n", [True, False])),
    case("admit", "numpy_float_array", lambda m: m.admit("n", np.array([1.0, 2.0, 3.0, 4.0, 5.0]))),
    case("admit", "torch_float_tensor", lambda m: m.admit("n", torch.tensor([1.0, 2.0]))),
    case("admit", "2d_array", lambda m: m.admit("n", np.array([[1, 2], [3, 4]]))),
    case("admit", "tokens_not_a_sequence", lambda m: m.admit("n", 5)),
    case("admit", "tokens_a_string", lambda m: m.admit("n", "abcd")),
    case("admit", "keys_not_cachekeys", lambda m: m.admit("n", [1, 2], keys="user-42")),
    case("admit", "keys_bad_multimodal_hash", lambda m: m.admit(
        "n", [1, 2, 3, 4, 5], keys=CacheKeys(multimodal=(MultimodalItem(0, 2, "not-bytes"),)))),
    case("admit", "slot_out_of_range", lambda m: m.admit("n", [1, 2], slot=99)),
    case("admit", "slot_negative", lambda m: m.admit("n", [1, 2], slot=-1)),
    case("admit", "slot_float", lambda m: m.admit("n", [1, 2], slot=3.0)),
    case("admit", "num_new_tokens_float", lambda m: m.admit("n", [1, 2], num_new_tokens=1.5)),
    case("admit", "num_new_tokens_negative", lambda m: m.admit("n", [1, 2], num_new_tokens=-1)),
    case("admit", "num_new_tokens_too_large", lambda m: m.admit("n", [1, 2], num_new_tokens=100)),
    case("admit", "token_budget_float", lambda m: m.admit("n", [1, 2, 3], token_budget=1.5)),
    case("admit", "token_budget_negative", lambda m: m.admit("n", [1, 2], token_budget=-1)),
    case("admit", "too_long", lambda m: m.admit("n", list(range(41)))),
    case("admit", "already_admitted", lambda m: m.admit("a", [1, 2])),
    case("admit", "id_unhashable", lambda m: m.admit(["n"], [1, 2])),
    case("admit", "id_not_str", lambda m: m.admit(7, [1, 2])),
    # --- can_admit / match_prefix (queries: must refuse, not answer about other tokens)
    case("can_admit", "float_tokens", lambda m: m.can_admit(F)),
    case("can_admit", "str_tokens", lambda m: m.can_admit(["x", "y"])),
    case("can_admit", "not_a_sequence", lambda m: m.can_admit(5)),
    case("can_admit", "keys_not_cachekeys", lambda m: m.can_admit([1, 2], keys={"salt": 1})),
    case("match_prefix", "float_tokens", lambda m: m.match_prefix(F)),
    # --- allocate / can_allocate / blocks_needed
    case("allocate", "size_float", lambda m: m.allocate("a", 1.5)),
    case("allocate", "size_negative", lambda m: m.allocate("a", -1)),
    case("allocate", "size_str", lambda m: m.allocate("a", "1")),
    case("allocate", "size_bool", lambda m: m.allocate("a", True)),
    case("allocate", "size_too_large", lambda m: m.allocate("a", 100)),
    case("allocate", "new_ids_not_a_sequence", lambda m: m.allocate("a", 1, 5)),
    case("allocate", "new_ids_float", lambda m: m.allocate("a", 1, [1.5])),
    case("allocate", "new_ids_str", lambda m: m.allocate("a", 1, ["x"])),
    case("allocate", "new_ids_none", lambda m: m.allocate("a", 1, [None])),
    case("allocate", "new_ids_negative", lambda m: m.allocate("a", 1, [-1])),
    case("allocate", "new_ids_2_pow_63", lambda m: m.allocate("a", 1, [2 ** 63])),
    case("allocate", "new_ids_numpy_float", lambda m: m.allocate("a", 1, np.array([1.5]))),
    case("allocate", "unknown_id", lambda m: m.allocate("nope", 1)),
    case("allocate", "swapped_id", lambda m: m.allocate("s", 1)),
    case("can_allocate", "unknown_id", lambda m: m.can_allocate("nope", 1)),
    case("can_allocate", "size_float", lambda m: m.can_allocate("a", 1.5)),
    case("can_allocate", "size_negative", lambda m: m.can_allocate("a", -1)),
    case("can_allocate", "size_none", lambda m: m.can_allocate("a", None)),
    case("blocks_needed", "unknown_id", lambda m: m.blocks_needed("nope", 1)),
    case("blocks_needed", "size_float", lambda m: m.blocks_needed("a", 2.5)),
    case("blocks_needed", "size_negative", lambda m: m.blocks_needed("a", -8)),
    # --- commit / truncate
    case("commit", "unknown_id", lambda m: m.commit("nope")),
    case("commit", "float", lambda m: m.commit("p", 2.5)),
    case("commit", "str", lambda m: m.commit("p", "2")),
    case("commit", "negative", lambda m: m.commit("p", -1)),
    case("commit", "past_reserved", lambda m: m.commit("p", 99)),
    case("truncate", "unknown_id", lambda m: m.truncate("nope", 1)),
    case("truncate", "float", lambda m: m.truncate("a", 2.5)),
    case("truncate", "str", lambda m: m.truncate("a", "2")),
    case("truncate", "negative", lambda m: m.truncate("a", -1)),
    case("truncate", "past_end", lambda m: m.truncate("a", 99)),
    # --- allocate_lookahead
    case("allocate_lookahead", "ids_a_bare_string", lambda m: m.allocate_lookahead("a", 4)),
    case("allocate_lookahead", "unknown_id_after_known", lambda m: m.allocate_lookahead(["a", "nope"], 4)),
    case("allocate_lookahead", "margin_float", lambda m: m.allocate_lookahead(["a"], 4.5)),
    case("allocate_lookahead", "margin_negative", lambda m: m.allocate_lookahead(["a"], -4)),
    case("allocate_lookahead", "keep_free_negative", lambda m: m.allocate_lookahead(["a"], 4, keep_free=-1)),
    # --- fork / reorder
    case("fork", "unknown_parent", lambda m: m.fork("nope", "c")),
    case("fork", "swapped_parent", lambda m: m.fork("s", "c")),
    case("fork", "child_exists", lambda m: m.fork("a", "b")),
    case("fork", "child_unhashable", lambda m: m.fork("a", ["c"])),
    case("fork", "slot_out_of_range", lambda m: m.fork("a", "c", slot=99)),
    case("fork", "slot_negative", lambda m: m.fork("a", "c", slot=-1)),
    case("fork", "slot_float", lambda m: m.fork("a", "c", slot=3.0)),
    case("reorder", "bare_strings", lambda m: m.reorder("a", "b")),
    case("reorder", "unknown_source", lambda m: m.reorder(["a"], ["nope"])),
    case("reorder", "length_mismatch", lambda m: m.reorder(["a", "b"], ["a"])),
    case("reorder", "unhashable_id", lambda m: m.reorder([["a"]], ["b"])),
    # --- free / preempt / estimate_preemption / swap_in
    case("free", "unknown_id", lambda m: m.free("nope")),
    case("free", "unhashable_id", lambda m: m.free(["a"])),
    case("preempt", "unknown_id", lambda m: m.preempt("nope")),
    case("preempt", "swapped_id", lambda m: m.preempt("s")),
    case("preempt", "uncommitted", lambda m: m.preempt("p")),
    case("preempt", "bad_mode", lambda m: m.preempt("a", "bogus"), setup="lookahead"),
    case("preempt", "mode_none", lambda m: m.preempt("a", None), setup="lookahead"),
    case("estimate_preemption", "unknown_id", lambda m: m.estimate_preemption("nope")),
    case("estimate_preemption", "swapped_id", lambda m: m.estimate_preemption("s")),
    case("estimate_preemption", "unhashable_id", lambda m: m.estimate_preemption(["a"])),
    case("swap_in", "unknown_id", lambda m: m.swap_in("nope")),
    case("swap_in", "running_id", lambda m: m.swap_in("a")),
    case("swap_in", "unhashable_id", lambda m: m.swap_in(["s"])),
    # --- views
    case("kv_views", "layer_negative", lambda m: m.kv_views(-1)),
    case("kv_views", "layer_too_large", lambda m: m.kv_views(99)),
    case("kv_views", "layer_float", lambda m: m.kv_views(1.0)),
    case("kv_views", "layer_str", lambda m: m.kv_views("0")),
    case("kv_views", "layer_none", lambda m: m.kv_views(None)),
    case("kv_views", "paged_backend", lambda m: m.kv_views(0), setup="paged"),
    case("block_views", "layer_negative", lambda m: m.block_views(-1)),
    case("block_views", "layer_too_large", lambda m: m.block_views(99)),
    case("block_views", "layer_float", lambda m: m.block_views(0.5)),
    # --- per-request queries
    case("slot_of", "unknown_id", lambda m: m.slot_of("nope")),
    case("slot_of", "swapped_id", lambda m: m.slot_of("s")),
    case("slot_of", "unhashable_id", lambda m: m.slot_of(["a"])),
    case("num_tokens", "unknown_id", lambda m: m.num_tokens("nope")),
    case("num_tokens", "unhashable_id", lambda m: m.num_tokens(["a"])),
    case("num_computed_tokens", "unknown_id", lambda m: m.num_computed_tokens("nope")),
    case("num_computed_tokens", "unhashable_id", lambda m: m.num_computed_tokens(["a"])),
    case("block_table", "unknown_id", lambda m: m.block_table("nope")),
    case("block_table", "swapped_id", lambda m: m.block_table("s")),
    case("token_ids", "unknown_id", lambda m: m.token_ids("nope")),
    case("token_ids", "unhashable_id", lambda m: m.token_ids(["a"])),
    case("is_swapped", "unhashable_id", lambda m: m.is_swapped(["s"])),
]


@pytest.mark.parametrize("method, call, setup", MISUSE)
def test_misuse_is_refused_before_any_change(make_manager, method, call, setup):
    overrides = {"kv_backend": "paged"} if setup == "paged" else {}
    manager = populate(make_manager(swap_space_bytes=SWAP, **overrides), lookahead=setup == "lookahead")
    state = manager_state
    try:
        before = state(manager)
    except AttributeError:  # a block table has no page table for conftest to read
        state = raw_state
        before = state(manager)
    try:
        result = call(manager)
    except VmemkvError as error:
        problem = None
        assert "\n" not in str(error), f"the message is not one line: {error}"
    except Exception as error:  # noqa: BLE001 - what leaked from inside is the finding
        problem = f"raised a bare {type(error).__name__} ({error}), not a vmemkv error"
    else:
        # only the type: printing K/V views would read memory that may not be mapped
        problem = f"was accepted (returned a {type(result).__name__}) instead of raising a vmemkv error"
        if method == "allocate_lookahead":
            manager.map_lookahead(result)  # as an engine would: the leak check wants them mapped
        del result
    changed = state(manager) != before
    assert problem is None and not changed, (
        f"{problem or 'raised a vmemkv error'}" + ("; and the manager's state changed" if changed else ""))


def test_a_lookahead_margin_past_max_model_len_stops_at_the_slot_end(make_manager):
    """Not a misuse: a large margin is clamped to max_model_len, never mapped into the next slot."""
    manager = populate(make_manager(swap_space_bytes=SWAP))
    manager.map_lookahead(manager.allocate_lookahead(["a"], 10 ** 6))
    pages = manager.config.max_model_len // manager.config.tokens_per_page
    assert len(manager.block_table("a")) <= pages
    manager.check()


def test_float_tokens_never_share_a_cached_page(make_manager):
    """[1.9, 2.9, 3.9, 4.9, 5] truncated for hashing would hit the page of [1, 2, 3, 4, 6]."""
    manager = make_manager()
    assert manager.admit("ints", [1, 2, 3, 4, 6]) == 0
    manager.commit("ints")
    with pytest.raises(InvalidInputError):
        manager.admit("floats", [1.9, 2.9, 3.9, 4.9, 5])
    assert manager.request_ids() == ["ints"]


@pytest.mark.skipif("vocab_size" not in CacheConfig.__dataclass_fields__,
                    reason="CacheConfig has no vocab_size yet: token ids are checked against 2**63")
def test_token_ids_at_or_past_the_vocabulary_are_refused(make_manager):
    manager = make_manager(vocab_size=50)
    before = manager_state(manager)
    for call in (lambda: manager.admit("n", [1, 2, 50]), lambda: manager.can_admit([50])):
        with pytest.raises(InvalidInputError):
            call()
    assert manager_state(manager) == before
    assert manager.admit("n", [0, 49]) == 0


# --- calls after close() ---------------------------------------------------------------------------
AFTER_CLOSE = {
    "admit": lambda m: m.admit("n", [1, 2]),
    "can_admit": lambda m: m.can_admit([1, 2]),
    "match_prefix": lambda m: m.match_prefix([1, 2, 3, 4, 5]),
    "allocate": lambda m: m.allocate("a", 1, [7]),
    "can_allocate": lambda m: m.can_allocate("a", 1),
    "blocks_needed": lambda m: m.blocks_needed("a", 1),
    "commit": lambda m: m.commit("p"),
    "truncate": lambda m: m.truncate("a", 2),
    "allocate_lookahead": lambda m: m.allocate_lookahead(["a"], 4),
    "fork": lambda m: m.fork("a", "c"),
    "reorder": lambda m: m.reorder(["a", "b"], ["b", "a"]),
    "free": lambda m: m.free("a"),
    "preempt": lambda m: m.preempt("a", "swap"),
    "estimate_preemption": lambda m: m.estimate_preemption("a"),
    "swap_in": lambda m: m.swap_in("s"),
    "reset_prefix_cache": lambda m: m.reset_prefix_cache(),
    "kv_views": lambda m: m.kv_views(0),
    "block_views": lambda m: m.block_views(0),
    "slot_of": lambda m: m.slot_of("a"),
    "num_tokens": lambda m: m.num_tokens("a"),
    "num_computed_tokens": lambda m: m.num_computed_tokens("a"),
    "block_table": lambda m: m.block_table("a"),
    "token_ids": lambda m: m.token_ids("a"),
    "is_swapped": lambda m: m.is_swapped("s"),
    "request_ids": lambda m: m.request_ids(),
    "snapshot_stats": lambda m: m.snapshot_stats(),
    "usage": lambda m: m.usage(),
    "num_free_slots": lambda m: m.num_free_slots,
    "check": lambda m: m.check(),
}


def raw_state(manager: KVCacheManager) -> tuple:
    """What a call on a closed manager must not change, read without the manager's methods."""
    pool = manager.pool
    return (list(pool.ref), list(pool.hash_of), pool.free_queue(), sorted(pool._clean),
            manager.slots.free_slots(), manager.swap.num_free)


@pytest.mark.parametrize("call", list(AFTER_CLOSE.values()), ids=list(AFTER_CLOSE))
def test_call_after_close_is_refused(call):
    manager = populate(KVCacheManager(tiny_config(swap_space_bytes=SWAP)))
    manager.close()
    before = raw_state(manager)
    with pytest.raises(ManagerClosedError):
        call(manager)
    assert raw_state(manager) == before


def test_close_twice_does_nothing():
    manager = KVCacheManager(tiny_config())
    manager.close()
    manager.close()


# --- CacheConfig misuse at construction --------------------------------------------------------------
BAD_CONFIGS = {
    "swap_space_negative": dict(swap_space_bytes=-1),
    "swap_space_float": dict(swap_space_bytes=4096.5),
    "dtype_str": dict(dtype="float16"),
    "dtype_numpy": dict(dtype=np.float16),
    "dtype_none": dict(dtype=None),
    "dtype_bool": dict(dtype=torch.bool),
    "num_layers_zero": dict(num_layers=0),
    "num_kv_heads_negative": dict(num_kv_heads=-1),
    "head_dim_zero": dict(head_dim=0),
    "num_blocks_zero": dict(num_blocks=0),
    "num_blocks_float": dict(num_blocks=10.5),
    "max_num_seqs_zero": dict(max_num_seqs=0),
    "max_model_len_negative": dict(max_model_len=-5),
    "max_model_len_float": dict(max_model_len=40.0),
    "tokens_per_page_zero": dict(tokens_per_page=0),
    "tokens_per_page_float": dict(tokens_per_page=2.5),
    "page_size_negative": dict(page_size=-4096),
    "page_size_not_a_row_multiple": dict(page_size=1000),
    "layout_unknown": dict(layout="bogus"),
    "kv_backend_unknown": dict(kv_backend="bogus"),
    "hash_algorithm_unknown": dict(hash_algorithm="md5"),
    "hash_seed_str": dict(hash_seed="seed"),
    "device_unknown": dict(device="tpu"),
    "enable_prefix_caching_str": dict(enable_prefix_caching="yes"),
    "swap_rate_zero": dict(swap_bytes_per_second=0),
    "prefill_rate_negative": dict(prefill_tokens_per_second=-1.0),
}


@pytest.mark.parametrize("overrides", list(BAD_CONFIGS.values()), ids=list(BAD_CONFIGS))
def test_bad_config_is_refused_at_construction(overrides):
    try:
        manager = KVCacheManager(tiny_config(**overrides))
    except ConfigError:
        return
    except Exception as error:  # noqa: BLE001
        pytest.fail(f"raised {type(error).__name__} ({error}), not a vmemkv ConfigError")
    manager.close()
    pytest.fail(f"CacheConfig({overrides}) was accepted")


def test_config_not_a_cacheconfig_is_refused():
    with pytest.raises(ConfigError):
        KVCacheManager({"num_layers": 2})


# --- the checks themselves ----------------------------------------------------------------------
def test_token_ids_accepts_integer_forms_and_returns_a_list():
    for ids in ([5], (5, 6), range(3), [np.int64(5)], np.array([5, 6], dtype=np.int32),
                np.array([5], dtype=np.uint8), torch.tensor([5, 6]), [], [2 ** 63 - 1]):
        out = validation.token_ids(ids, "ids")
        assert type(out) is list and all(type(t) is int for t in out)
        assert out == [int(t) for t in ids]


@pytest.mark.parametrize("ids", [[1.0], [1.5], ["1"], [None], [True], [np.bool_(True)], [-1],
                                 [2 ** 63], np.array([1.0]), np.array([True]), torch.tensor([1.0]),
                                 torch.tensor([[1]]), 5, "12", b"12", None, {1, 2}, iter([1])],
                         ids=lambda ids: type(ids).__name__ if isinstance(ids, type(iter([]))) else repr(ids))
def test_token_ids_refuses(ids):
    with pytest.raises(InvalidInputError):
        validation.token_ids(ids, "ids")


def test_token_ids_vocabulary_limit():
    assert validation.token_ids([0, 49], "ids", vocab_size=50) == [0, 49]
    with pytest.raises(InvalidInputError, match="50"):
        validation.token_ids([0, 50], "ids", vocab_size=50)


def test_count_and_indices():
    assert validation.count(np.int32(3), "n") == 3
    assert validation.count(None, "n", optional=True) is None
    for bad in (1.0, True, None, "1", -1):
        with pytest.raises(InvalidInputError):
            validation.count(bad, "n")
    with pytest.raises(InvalidInputError):
        validation.count(5, "n", maximum=4)
    assert validation.layer_index(np.int64(1), 2) == 1
    assert validation.slot_index(None, 4) is None
    for bad in (-1, 2, 1.0, None):
        with pytest.raises(InvalidInputError):
            validation.layer_index(bad, 2)
    with pytest.raises(InvalidInputError):
        validation.slot_index(4, 4)


def test_keys_ids_and_choices():
    keys = CacheKeys(cache_salt="x", multimodal=(MultimodalItem(0, 2, b"h"),))
    assert validation.cache_keys(keys) is keys
    for bad in ("x", None, CacheKeys(multimodal=(MultimodalItem(0, 2, "h"),)),
                CacheKeys(multimodal=(MultimodalItem(-1, 2, b"h"),))):
        with pytest.raises(InvalidInputError):
            validation.cache_keys(bad)
    assert validation.request_id_list(("a", "b"), "ids") == ["a", "b"]
    for bad in ("ab", ["a", 1], None):
        with pytest.raises(InvalidInputError):
            validation.request_id_list(bad, "ids")
    with pytest.raises(InvalidInputError):
        validation.choice("bogus", "mode", validation.PREEMPT_MODES)
    with pytest.raises(ManagerClosedError):
        validation.require_open(True, "admit")


def test_config_check_passes_the_test_config():
    config = tiny_config()
    assert validation.config(config) is config

"""The packed attention's Triton decode path gives what its SDPA path gives, plain and with a
layer's sliding window, soft-capping and sinks.

On CPU the kernel runs under Triton's interpreter, which must be switched on before triton is
first imported (tests/conftest.py does so without a GPU) and which copies each argument's whole
storage: so this runs over the block-table views (the pool window is fully mapped; a slot view's
reservation is not), in this process when Triton interprets here, else in a child process.
The CUDA runs of both addressings are in tests/test_gpu_engine.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="needs triton for the decode kernel")

CHILD = textwrap.dedent("""
    import torch
    from vmemkv import CacheConfig, KVCacheManager
    from vmemkv.attention import BlockTableAttention, SequenceSpan

    torch.manual_seed(0)
    config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=32, num_blocks=24, max_num_seqs=4,
                         max_model_len=128, dtype=torch.float32, tokens_per_page=8, kv_backend="paged")
    manager = KVCacheManager(config)
    lengths = [5, 17, 40]  # cached tokens before this step
    spans, start = [], 0
    for index, cached in enumerate(lengths):
        manager.admit(str(index), list(range(1, cached + 2)))  # cached tokens + the one decoded now
        table = tuple(manager.block_table(str(index)))
        spans.append(SequenceSpan(manager.slot_of(str(index)), start, 1, cached, table))
        start += 1
    # one prefill span too, which keeps going through SDPA
    manager.admit("p", list(range(1, 12)))
    spans.append(SequenceSpan(manager.slot_of("p"), start, 11, 0, tuple(manager.block_table("p"))))
    total = start + 11
    for layer in range(2):  # fill the cached positions with known values
        k_blocks, v_blocks = manager.block_views(layer)
        k_blocks.copy_(torch.randn_like(k_blocks))
        v_blocks.copy_(torch.randn_like(v_blocks))
    query, key, value = (torch.randn(1, h, total, 32) for h in (8, 2, 2))
    sinks = torch.randn(8)
    for variant in ({}, dict(window=6), dict(softcap=0.7, sinks=sinks), dict(window=6, softcap=0.7, sinks=sinks)):
        outputs = []
        for kernel in (False, True):
            attention = BlockTableAttention(spans, manager.block_views, 8, torch.device("cpu"), kernel)
            outputs.append(attention(1, query, key, value, None, **variant))
        assert attention.decodes == [0, 1, 2]
        torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-4)
    print("decode path ok")
""")


def test_triton_decode_path_matches_sdpa_path(capsys):
    from vmemkv.attention.triton_decode import triton_interprets

    if triton_interprets():
        exec(compile(CHILD, "decode path check", "exec"), {"__name__": "__decode_path__"})
        assert "decode path ok" in capsys.readouterr().out
        return
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    child = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    assert "decode path ok" in child.stdout

"""What a layer's attention may ask beyond plain causal softmax, as transformers passes it to the
attention interface: a sliding window, logit soft-capping, attention sinks; and chunked local
attention, which the model's config sets per layer (``hf_support.layer_chunks``).

Which keys a query reads is its layer kind's rule (``vmemkv.cache.kv_spec``: ``first_read``),
the one the cache releases blocks by; the functions below ask it.

* **Sliding window** ``W`` (``sliding_window``): the query at position ``p`` sees keys
  ``max(0, p - W + 1) .. p`` (``masking_utils.sliding_window_overlay``: ``kv > q - W``). Every
  path reads from the window start (``window_start``) rather than masking the whole prefix, so
  positions wholly behind every query's window are never touched.
* **Chunked local attention** ``C`` (Llama-4's ``attention_chunk_size``): the query at ``p`` sees
  keys ``p // C * C .. p``, its own chunk (``chunk_start``); read from the chunk start likewise.
* **Soft-capping** ``c`` (``softcap``, Gemma-2): scores become ``c * tanh(scores / c)`` before
  the mask and softmax.
* **Sinks** (``s_aux``, GPT-OSS): one learned logit per query head joins the softmax's
  denominator and is dropped from its output (attention may go "nowhere").

SDPA has neither soft-capping nor sinks, so layers with them take ``explicit_attention`` (scores,
cap, mask, softmax in float32, as transformers' eager attention); every other layer keeps SDPA.
"""

from __future__ import annotations

import torch

from vmemkv.cache.kv_spec import KVCacheSpec, local_spec


def window_start(first_position: int, window: int | None) -> int:
    """The first key position a query at ``first_position`` (or later) can see (the spec's rule)."""
    return local_spec(window).first_read(first_position)


def chunk_start(first_position: int, chunk: int) -> int:
    """The first key position a query at ``first_position`` can see under chunks of ``chunk``."""
    return local_spec(chunk=chunk).first_read(first_position)


def needs_explicit(softcap: float | None, sinks: torch.Tensor | None) -> bool:
    """Whether these scores need ``explicit_attention`` (SDPA cannot apply them)."""
    return softcap is not None or sinks is not None


def causal_window_mask(num_cached: int, num_queries: int, start: int, window: int | None,
                       device: torch.device) -> torch.Tensor:
    """``[num_queries, length - start]`` bool, True where a query sees a key: the queries sit at
    positions ``num_cached ..``, the keys at ``start .. num_cached + num_queries``."""
    return causal_spec_mask(num_cached, num_queries, start, local_spec(window), device)


def causal_chunk_mask(num_cached: int, num_queries: int, start: int, chunk: int,
                      device: torch.device) -> torch.Tensor:
    """``causal_window_mask`` for chunked local attention: a query sees the keys of its own chunk
    up to itself."""
    return causal_spec_mask(num_cached, num_queries, start, local_spec(chunk=chunk), device)


def causal_spec_mask(num_cached: int, num_queries: int, start: int, spec: KVCacheSpec,
                     device: torch.device) -> torch.Tensor:
    """``causal_window_mask`` for any kind: a query sees the keys from ``spec.first_read`` of its
    position up to itself."""
    queries = torch.arange(num_queries, device=device)[:, None] + num_cached
    keys = torch.arange(start, num_cached + num_queries, device=device)[None, :]
    visible = keys <= queries
    if spec.releases:
        visible &= keys >= spec.first_read(queries)
    return visible


def explicit_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                       mask: torch.Tensor | None, softcap: float | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``query`` ``[B, Hq, M, D]``, ``key``/``value`` ``[B, Hk, N, D]``, ``mask`` bool ``[M, N]``
    or broadcastable to ``[B, 1, M, N]`` (True: seen) or None; returns ``[B, Hq, M, D]`` in
    query's dtype. Grouped heads are folded (``[B, Hk, G, M, D]``): K/V are never repeated."""
    batch, num_heads, num_queries, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    dtype = torch.promote_types(query.dtype, torch.float32)  # at least float32, as eager attention
    q = query.reshape(batch, num_kv_heads, group, num_queries, head_dim).to(dtype)
    scores = (q @ key[:, :, None].to(dtype).transpose(-1, -2)) * scale  # [B, Hk, G, M, N]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # [M, N] -> [1, 1, M, N]
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    if sinks is not None:
        sink = sinks.to(dtype).reshape(1, num_kv_heads, group, 1, 1).expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1)
    out = weights @ value[:, :, None].to(dtype)
    return out.reshape(batch, num_heads, num_queries, head_dim).to(query.dtype)

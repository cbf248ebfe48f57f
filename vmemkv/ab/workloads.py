"""The A/B harness's workloads: seeded, deterministic request sets, each with the engine sizes it
needs (pool, slots, step budget), identical for every variant.

Token ids are drawn from ``[1, 250]`` (bytes of the built-in models' byte vocabulary; the special
ids 256/257 never appear) and every request sets ``ignore_eos=True``, so prompt and output lengths
are exactly as drawn. ``quick=True`` gives a much smaller version of each workload for smoke runs
and tests.

Everything a check depends on is sized in pages of ``tokens_per_page`` tokens, the engine's real
page (16 on CPU by default; 2 MiB CUDA pages hold 1024 tokens of tiny-llama in fp32): the shared
system prompt spans whole pages, and the pressure workload's prompts end just short of a page
boundary on a pool that cannot give every request its next page.

``window`` needs a sliding-window model (``--model tiny-mistral``; the runner refuses others):
its pool holds each request's window, not its whole length. ``hybrid`` needs a model mixing
local and global layers (``--model tiny-gemma2``): its pool holds the global layers' whole
lengths and the local layers' windows.

``chat-real`` is the exception to the random ids: real text stored in the package
(``data/chat_prompts.json``: four assistants' system prompts, each with its own user questions),
rendered through the model's tokenizer and its chat template, so every request of an assistant
starts with the same system-prompt tokens and hits its pages in the prefix cache. It needs the
model's tokenizer (``make_workload(..., tokenizer=...)``; the runner passes it); without one the
text is taken as bytes, the built-in random-weight models' vocabulary.

A workload is a ``Workload`` (``workload.py``); the stored chat text is read in ``chat_text.py``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from vmemkv.ab.chat_text import CHAT_PROMPTS, load_chat_prompts, render_chat
from vmemkv.ab.workload import (DEFAULT_TOKENS_PER_PAGE, TOKEN_MAX, TOKEN_MIN, Request, Workload,
                                full_length_pages, pages)
from vmemkv.engine.core.chat import has_chat_template
from vmemkv.cache.window import peak_blocks
from vmemkv.engine.core.sampling_params import SamplingParams


# --- helpers ----------------------------------------------------------------------------------------
def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randint(TOKEN_MIN, TOKEN_MAX) for _ in range(count)]


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    """A log-normal length with the given median, clipped to ``[low, high]``."""
    return int(min(max(round(rng.lognormvariate(math.log(median), sigma)), low), high))


def _roomy_pool(requests: list[Request], tokens_per_page: int, min_tokens: int = 8192) -> int:
    """A pool with no pressure: every sequence at full length at once (nothing shared), and at
    least ``min_tokens`` tokens (512 pages of 16, as these workloads always had)."""
    return max(sum(full_length_pages(requests, tokens_per_page)), pages(min_tokens, tokens_per_page))


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# --- the workloads ----------------------------------------------------------------------------------
def chat(seed: int = 0, quick: bool = False,
         tokens_per_page: int = DEFAULT_TOKENS_PER_PAGE) -> Workload:
    """Chat-like traffic: log-normal prompt and output lengths (long tails, clipped), greedy."""
    rng = random.Random(f"chat-{seed}")
    count, prompt_cap, output_cap = (8, 128, 24) if quick else (24, 512, 96)
    requests = []
    for i in range(count):
        prompt = _lognormal(rng, 96, 0.8, 8, prompt_cap)
        output = _lognormal(rng, 24, 0.7, 4, output_cap)
        requests.append((f"chat-{i}", _tokens(rng, prompt), _greedy(output)))
    return Workload("chat", "mixed chat-like lengths: prompts log-normal (median 96, clipped to "
                    f"{prompt_cap}), outputs log-normal (median 24, clipped to {output_cap}), greedy",
                    requests, {"max_num_seqs": 16, "max_model_len": 1024,
                               "num_blocks": _roomy_pool(requests, tokens_per_page),
                               "max_num_batched_tokens": 512}, tokens_per_page=tokens_per_page)


def shared_prefix(seed: int = 0, quick: bool = False,
                  tokens_per_page: int = DEFAULT_TOKENS_PER_PAGE) -> Workload:
    """Groups of requests that share a long system prompt, each with its own question."""
    rng = random.Random(f"shared-prefix-{seed}")
    groups, per_group, output = (2, 3, 8) if quick else (3, 6, 16)
    # Whole pages, or nothing can hit: 4 (quick) to 16 pages (at most 1024 tokens when pages allow).
    system_pages = 4 if quick else max(4, min(16, 1024 // tokens_per_page))
    system_len = system_pages * tokens_per_page
    requests = []
    for g in range(groups):
        system = _tokens(rng, system_len)
        for q in range(per_group):
            question = _tokens(rng, rng.randint(8, 40))
            requests.append((f"prefix-{g}-{q}", system + question, _greedy(output)))
    return Workload("shared-prefix", f"{groups} groups x {per_group} questions (8-40 tokens) after "
                    f"a shared {system_len}-token system prompt ({system_pages} pages), {output} "
                    "output tokens, greedy",
                    requests, {"max_num_seqs": 16, "max_model_len": max(1024, system_len + 64),
                               "num_blocks": _roomy_pool(requests, tokens_per_page),
                               # a step budget of one system prompt: a group's first prefill
                               # fills (and caches) the shared pages before the rest of the
                               # group is admitted, so they hit
                               "max_num_batched_tokens": system_len},
                    tokens_per_page=tokens_per_page)


def parallel_n4(seed: int = 0, quick: bool = False,
                tokens_per_page: int = DEFAULT_TOKENS_PER_PAGE) -> Workload:
    """Parallel sampling, n=4: copy-on-write forks of one prompt, seeded temperature sampling."""
    rng = random.Random(f"parallel-n4-{seed}")
    count, output = (3, 12) if quick else (6, 32)
    requests = []
    for i in range(count):
        params = SamplingParams(n=4, temperature=0.8, top_p=0.95, max_tokens=output,
                                seed=seed * 1000 + i, ignore_eos=True)
        requests.append((f"n4-{i}", _tokens(rng, rng.randint(48, 160)), params))
    return Workload("parallel-n4", f"{count} prompts (48-160 tokens) x n=4 completions of {output} "
                    "tokens, temperature 0.8, top-p 0.95, seeded per request", requests,
                    {"max_num_seqs": 32, "max_model_len": 1024,
                     "num_blocks": _roomy_pool(requests, tokens_per_page),
                     "max_num_batched_tokens": 512}, greedy=False, tokens_per_page=tokens_per_page)


def pressure(seed: int = 0, quick: bool = False,
             tokens_per_page: int = DEFAULT_TOKENS_PER_PAGE) -> Workload:
    """A pool smaller than the working set: running requests must be preempted (swap or
    recompute, the scheduler's "auto" choice) to let others grow.

    Each prompt fills 3-4 (quick) or 4-8 pages and ends a few tokens short of a page boundary, so
    every request needs a new page early in its decode, whatever the page size. The pool holds
    every prompt plus a page for only half of the requests, and the step budget prefills every
    prompt in the first step: the second half must preempt someone.
    """
    rng = random.Random(f"pressure-{seed}")
    if quick:
        count, page_range, output = 6, (3, 4), 48
    else:
        count, page_range, output = 12, (4, 8), 64
    slack = max(1, min(output, tokens_per_page) // 2)  # a boundary within the first output/2 tokens
    requests = []
    for i in range(count):
        length = rng.randint(*page_range) * tokens_per_page - rng.randint(1, slack)
        requests.append((f"pressure-{i}", _tokens(rng, length), _greedy(output)))
    prompt_pages = sum(pages(len(ids), tokens_per_page) for _, ids, _ in requests)
    num_blocks = prompt_pages + count // 2
    prompt_tokens = sum(len(ids) for _, ids, _ in requests)
    working_set = sum(full_length_pages(requests, tokens_per_page))
    low, high = (n * tokens_per_page for n in page_range)
    return Workload("pressure", f"{count} requests of {low - slack}-{high - 1} prompt + "
                    f"{output} output tokens ({working_set} pages of {tokens_per_page} tokens at "
                    f"full length) on a {num_blocks}-page pool: forces preemption, greedy", requests,
                    {"max_num_seqs": count, "max_model_len": max(1024, high + output),
                     "num_blocks": num_blocks,
                     "max_num_batched_tokens": max(512, prompt_tokens), "preemption_mode": "auto"},
                    expect_preemption=True, tokens_per_page=tokens_per_page)


def long_context(seed: int = 0, quick: bool = False,
                 tokens_per_page: int = DEFAULT_TOKENS_PER_PAGE) -> Workload:
    """Few requests with long prompts and long decodes: attention over long contexts dominates."""
    rng = random.Random(f"long-context-{seed}")
    if quick:
        count, prompt_range, output, max_len = 2, (300, 400), 24, 512
    else:
        count, prompt_range, output, max_len = 3, (600, 800), 96, 1024
    requests = [(f"long-{i}", _tokens(rng, rng.randint(*prompt_range)), _greedy(output))
                for i in range(count)]
    return Workload("long-context", f"{count} requests of {prompt_range[0]}-{prompt_range[1]} "
                    f"prompt tokens, {output} output tokens each, greedy", requests,
                    {"max_num_seqs": count, "max_model_len": max_len,
                     "num_blocks": count * pages(max_len, tokens_per_page),
                     "max_num_batched_tokens": 1024}, tokens_per_page=tokens_per_page)


def prefix_groups(seed: int = 0, quick: bool = False,
                  tokens_per_page: int = DEFAULT_TOKENS_PER_PAGE) -> Workload:
    """Many groups sharing long system prompts, arriving interleaved (one request of each group in
    turn), on a pool smaller than the groups' working set: the running requests plus about two
    groups' system prompts. Which group runs next decides what the prefix cache keeps: the
    workload that ``--policy lpm`` is for (FCFS cycles through the groups, evicting each prefix
    before its group comes back)."""
    rng = random.Random(f"prefix-groups-{seed}")
    groups, per_group, slots, output = (6, 3, 2, 8) if quick else (8, 6, 4, 16)
    system_pages = max(2, min(4 if quick else 8, 1024 // tokens_per_page))
    system_len = system_pages * tokens_per_page
    systems = [_tokens(rng, system_len) for _ in range(groups)]
    requests = []
    for q in range(per_group):
        for g in range(groups):
            question = _tokens(rng, rng.randint(8, 24))
            requests.append((f"group-{g}-{q}", systems[g] + question, _greedy(output)))
    longest = max(full_length_pages(requests, tokens_per_page))
    num_blocks = slots * longest + 2 * system_pages
    return Workload("prefix-groups", f"{groups} groups x {per_group} questions (8-24 tokens) after "
                    f"each group's {system_len}-token system prompt ({system_pages} pages), groups "
                    f"taking turns, {output} output tokens, greedy, on a {num_blocks}-page pool "
                    f"({slots} requests running plus about 2 of the {groups} system prompts)",
                    requests, {"max_num_seqs": slots, "max_model_len": max(1024, system_len + 64),
                               "num_blocks": num_blocks,
                               "max_num_batched_tokens": slots * system_len},
                    tokens_per_page=tokens_per_page)


def multi_turn(seed: int = 0, quick: bool = False,
               tokens_per_page: int = DEFAULT_TOKENS_PER_PAGE) -> Workload:
    """Multi-turn chat, the workload the prefix cache's host tier is for (``--host-cache-bytes``):
    conversations take turns, each turn re-sends its whole conversation (its own system prompt,
    the earlier user messages and answers) plus a new user message, and between two rounds of
    turns one-off traffic (fresh prompts) passes through a pool too small to keep every
    conversation's pages: a conversation's pages are evicted before its next turn. Without the
    tier its next turn recomputes them; with it they come back from host memory.

    The requests are an offline batch (every turn known up front), so the answers a turn re-sends
    are recorded tokens of the conversation, as a client replaying a chat log would send, not the
    tokens the model generates: a turn can hit the whole pages of the previous turn's prompt. FCFS
    admits in the order below (each round of turns, then its traffic), and the running requests
    fit the pool, so the traffic, not the turns, does the evicting."""
    rng = random.Random(f"multi-turn-{seed}")
    if quick:
        chats, turns, traffic, message, output = 2, 3, 3, 16, 8
    else:
        chats, turns, traffic, message, output = 4, 4, 4, 24, 16
    system_pages = max(2, min(4 if quick else 8, 1024 // tokens_per_page))
    system_len = system_pages * tokens_per_page
    traffic_len = (system_pages + 2) * tokens_per_page - 1  # about one conversation's pages each
    history = [_tokens(rng, system_len) for _ in range(chats)]
    requests = []
    for turn in range(turns):
        for chat in range(chats):
            prompt = history[chat] + _tokens(rng, message)
            requests.append((f"turn-{chat}-{turn}", prompt, _greedy(output)))
            history[chat] = prompt + _tokens(rng, message)  # the recorded answer
        requests += [(f"traffic-{turn}-{i}", _tokens(rng, traffic_len), _greedy(4))
                     for i in range(traffic)]
    slots = 2
    longest = max(full_length_pages(requests, tokens_per_page))
    num_blocks = slots * longest + system_pages  # the running requests, little else
    return Workload("multi-turn", f"{chats} conversations x {turns} turns, each turn re-sending "
                    f"its conversation ({system_len}-token system prompt, then {message}-token "
                    f"user messages and recorded answers) plus a new message, {output} output "
                    f"tokens; {traffic} one-off requests of {traffic_len} tokens after each round "
                    f"of turns; greedy, on a {num_blocks}-page pool ({slots} requests running): "
                    "the traffic evicts the conversations' pages between turns",
                    requests, {"max_num_seqs": slots,
                               "max_model_len": max(1024, 256 * pages(longest * tokens_per_page,
                                                                      256)),
                               "num_blocks": num_blocks,
                               "max_num_batched_tokens": max(512, longest * tokens_per_page)},
                    tokens_per_page=tokens_per_page)


def window(seed: int = 0, quick: bool = False,
           tokens_per_page: int = DEFAULT_TOKENS_PER_PAGE) -> Workload:
    """Long generations on a sliding-window model (``--model tiny-mistral``, window
    ``TINY_MISTRAL_WINDOW`` 128): every output is several windows long, and the pool holds each
    request's window pages plus three (the partial page at the window start, the page being
    written, a lookahead page), not its whole length, so all requests run at once only if the
    blocks behind the window go back to the pool. Both kinds of variant give them back (the
    block-table baseline as vLLM's hybrid manager does): the A/B compares peak KV per request and
    preemptions (none may happen), and the greedy tokens."""
    from vmemkv.engine.models.zoo import TINY_MISTRAL_WINDOW

    rng = random.Random(f"window-{seed}")
    count, output = (3, 384) if quick else (6, 768)
    requests = [(f"window-{i}", _tokens(rng, rng.randint(24, 40)), _greedy(output))
                for i in range(count)]
    held = pages(TINY_MISTRAL_WINDOW, tokens_per_page) + 3
    num_blocks = count * held
    longest = max(len(ids) + p.max_tokens for _, ids, p in requests)
    return Workload("window", f"{count} requests of 24-40 prompt + {output} output tokens on a "
                    f"model with a {TINY_MISTRAL_WINDOW}-token sliding window, on a "
                    f"{num_blocks}-page pool ({held} pages a request; "
                    f"{pages(longest, tokens_per_page)} at full length): fits only with release "
                    "behind the window, greedy", requests,
                    {"max_num_seqs": count, "max_model_len": max(1024, 256 * pages(longest, 256)),
                     "num_blocks": num_blocks, "max_num_batched_tokens": 512},
                    tokens_per_page=tokens_per_page, sliding_window=TINY_MISTRAL_WINDOW)


def hybrid(seed: int = 0, quick: bool = False,
           tokens_per_page: int = DEFAULT_TOKENS_PER_PAGE) -> Workload:
    """Long generations on a model mixing local and global layers (``--model tiny-gemma2``: half
    its layers local, window ``TINY_GEMMA2_WINDOW`` 128, alternating with global ones). The engine
    keeps the two kinds in two layout groups: the global layers hold every block, the local ones
    their window. The pool is sized for exactly that: every request at full length in the global
    layers (and a lookahead page each), plus the local group's share (``layer_groups.split_blocks``:
    each slot's window and a chunk), so all requests run at once only when the local layers give
    back their blocks behind the window; a variant keeping every block (``vmem-keep``,
    ``paged-keep``) fits fewer at once and preempts. The A/B compares KV per request, how many
    requests ran at once, and the greedy tokens."""
    from vmemkv.engine.models.zoo import TINY_GEMMA2_WINDOW

    rng = random.Random(f"hybrid-{seed}")
    count, output = (3, 384) if quick else (6, 768)
    requests = [(f"hybrid-{i}", _tokens(rng, rng.randint(24, 40)), _greedy(output))
                for i in range(count)]
    longest = max(len(ids) + p.max_tokens for _, ids, p in requests)
    max_model_len, chunk = max(1024, 256 * pages(longest, 256)), 128
    # split_blocks' local share, and the global layers' blocks: both groups' blocks are half a
    # whole-model block (two of tiny-gemma2's four layers), so the pool is half their sum
    local = count * (peak_blocks(max_model_len, 1, TINY_GEMMA2_WINDOW, tokens_per_page) + 1) + pages(
        chunk, tokens_per_page)
    global_ = sum(full_length_pages(requests, tokens_per_page)) + count
    num_blocks = -(-(local + global_) // 2)
    return Workload("hybrid", f"{count} requests of 24-40 prompt + {output} output tokens on a "
                    f"model with local ({TINY_GEMMA2_WINDOW}-token window) and global layers, on "
                    f"a {num_blocks}-page pool (every request's global layers at full length, the "
                    f"local layers' windows; {max(full_length_pages(requests, tokens_per_page))} "
                    "pages a request keeping every block): fits only with release behind the "
                    "window, greedy", requests,
                    {"max_num_seqs": count, "max_model_len": max_model_len,
                     "num_blocks": num_blocks, "max_num_batched_tokens": chunk},
                    tokens_per_page=tokens_per_page, sliding_window=TINY_GEMMA2_WINDOW, hybrid=True)


def chat_real(seed: int = 0, quick: bool = False, tokens_per_page: int = DEFAULT_TOKENS_PER_PAGE,
              tokenizer=None) -> Workload:
    """Shared-system-prompt chat traffic in real text: every assistant's questions (12 each;
    quick: 2 assistants x 3) after its system prompt, the assistants taking turns so traffic is
    mixed, rendered with ``tokenizer``'s chat template. Outputs are log-normal lengths (median 32,
    clipped to 8-96; quick 4-12), greedy, ``ignore_eos`` so every variant generates the same
    number of tokens.

    The step budget is the longest prompt: the first request of each assistant prefills (and
    caches) the system prompt's pages before that assistant's next request is admitted, which then
    hits every whole page of it."""
    rng = random.Random(f"chat-real-{seed}")
    assistants = load_chat_prompts()["assistants"]
    if quick:
        assistants, per_assistant, out_median, out_range = assistants[:2], 3, 8, (4, 12)
    else:
        per_assistant, out_median, out_range = None, 32, (8, 96)
    order = list(range(len(assistants)))
    rng.shuffle(order)
    queues = []
    for a in order:
        questions = list(assistants[a]["questions"])
        rng.shuffle(questions)
        queues.append([(assistants[a], q) for q in questions[:per_assistant]])
    requests, templated = [], tokenizer is not None and has_chat_template(tokenizer)
    turn = 0
    while any(queues):
        for queue in queues:
            if queue:
                assistant, question = queue.pop(0)
                ids = render_chat(tokenizer, assistant["system"], question)
                output = _lognormal(rng, out_median, 0.6, *out_range)
                requests.append((f"chat-real-{assistant['name']}-{turn}", ids, _greedy(output)))
        turn += 1
    longest = max(len(ids) + p.max_tokens for _, ids, p in requests)
    names = ", ".join(assistants[a]["name"] for a in order)
    how = ("through the tokenizer's chat template" if templated else
           "as plain text through the tokenizer (no chat template)" if tokenizer is not None else
           "as UTF-8 bytes (no tokenizer given)")
    return Workload("chat-real", f"real text ({CHAT_PROMPTS}): {len(requests)} questions to "
                    f"{len(assistants)} assistants ({names}) taking turns, each after its "
                    f"assistant's system prompt, rendered {how}; outputs log-normal (median "
                    f"{out_median}, {out_range[0]}-{out_range[1]}), greedy",
                    requests, {"max_num_seqs": 16,
                               "max_model_len": max(1024, 256 * pages(longest, 256)),
                               "num_blocks": _roomy_pool(requests, tokens_per_page),
                               "max_num_batched_tokens": max(len(ids) for _, ids, _ in requests)},
                    tokens_per_page=tokens_per_page)


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "chat": chat,
    "shared-prefix": shared_prefix,
    "parallel-n4": parallel_n4,
    "pressure": pressure,
    "long-context": long_context,
    "chat-real": chat_real,
    "prefix-groups": prefix_groups,
    "multi-turn": multi_turn,
    "window": window,  # on a sliding-window model only: --model tiny-mistral
    "hybrid": hybrid,  # on a model with local and global layers only: --model tiny-gemma2
}
# Workloads built from text: make_workload passes them the model's tokenizer.
TEXT_WORKLOADS = frozenset({"chat-real"})
# What `vmemkv ab` runs when --workloads is not given: the random-id workloads on the built-in
# random-weight models (their tokens are bytes, not words), the real-text chat workload (and the
# preemption check) on a real model with a tokenizer.
DEFAULT_WORKLOADS = ("chat", "shared-prefix", "parallel-n4", "pressure", "long-context")
REAL_MODEL_WORKLOADS = ("chat-real", "pressure")


def default_workloads(model_name: str) -> tuple[str, ...]:
    from vmemkv.engine.models.zoo import is_random_weight

    return DEFAULT_WORKLOADS if is_random_weight(model_name) else REAL_MODEL_WORKLOADS


def make_workload(name: str, seed: int = 0, quick: bool = False,
                  tokens_per_page: int = DEFAULT_TOKENS_PER_PAGE, tokenizer=None) -> Workload:
    """Workload ``name`` sized for pages of ``tokens_per_page`` tokens (the engine's
    ``manager.tokens_per_page``; the runner measures it). ``tokenizer``: the model's, for the
    text workloads (``TEXT_WORKLOADS``); the others ignore it."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if not isinstance(tokens_per_page, int) or tokens_per_page < 1:
        raise ValueError(f"tokens_per_page must be a positive int, got {tokens_per_page!r}")
    if name in TEXT_WORKLOADS:
        return WORKLOADS[name](seed=seed, quick=quick, tokens_per_page=tokens_per_page,
                               tokenizer=tokenizer)
    return WORKLOADS[name](seed=seed, quick=quick, tokens_per_page=tokens_per_page)

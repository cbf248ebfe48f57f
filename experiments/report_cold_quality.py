"""How far a lossy prefix hit moves the model: the cold tier's formats on real chat prompts.

For each of ``--prompts`` real ``chat-real`` prompts (a system prompt and one user question, in
SmolLM2's chat template), the system prompt's full pages (the blocks a prefix hit would reuse)
are computed exactly, then kept as they are (the reference) or compressed and decompressed by
the cold tier's codec (``vmemkv/cache/block_codec.py``: int8 or int4, one float32 scale per 32
values of a row). From there the model runs the rest of the prompt and ``--new-tokens`` greedy
tokens on top, as a request after a cold hit does (its own KV computed attending to the lossy
prefix). Reported per format: the mean KL divergence of the next-token distributions from the
reference's over every position after the prefix (the reference's tokens fed to both, so the
positions line up), how many of the greedy answers are identical to the reference's, and where
the others first differ. No timing: the numbers are the model's.

    python experiments/report_cold_quality.py                              # table
    python experiments/report_cold_quality.py --out experiments/results    # cold_quality.md/.json
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from vmemkv.ab.chat_text import render_chat
from vmemkv.cache.block_codec import BlockCodec
from vmemkv.engine.models.hub import ensure_real_model
from machine import write_results  # experiments/machine.py
from quality import chat_questions, format_row, mean_kl, quality_table  # experiments/quality.py

FORMATS = ("int8", "int4")
PAGE = 16  # tokens per page: the prefix a hit reuses is whole pages


def compressed(tensor: torch.Tensor, fmt: str) -> torch.Tensor:
    """``tensor`` ([..., head_dim]) through the codec, as one block of its bytes."""
    rows = tensor.contiguous().reshape(1, -1).view(torch.uint8)
    codec = BlockCodec(fmt, tensor.dtype, rows.shape[1], tensor.shape[-1], tensor.shape[-1])
    return codec.decompress(codec.compress(rows)).view(tensor.dtype).reshape(tensor.shape)


def prefix_cache(model, ids: torch.Tensor, fmt: str | None) -> DynamicCache:
    """The KV of ``ids`` (exact, or through the codec)."""
    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    if fmt is not None:
        for layer in cache.layers:
            layer.keys = compressed(layer.keys, fmt)
            layer.values = compressed(layer.values, fmt)
    return cache


def run(model, prompt: list[int], prefix_len: int, new_tokens: int, fmt: str | None,
        forced: list[int] | None) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after ``prompt`` on top of its first ``prefix_len`` tokens' cache (or, with
    ``forced``, those tokens fed instead of the greedy ones), and the log-probabilities at every
    position from ``prefix_len`` on."""
    cache = prefix_cache(model, torch.tensor([prompt[:prefix_len]]), fmt)
    logprobs, tokens = [], []
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt[prefix_len:]]), past_key_values=cache, use_cache=True)
        logits = out.logits[0]
        for step in range(new_tokens):
            logprobs.append(torch.log_softmax(logits.float(), dim=-1))
            token = forced[step] if forced is not None else int(logits[-1].argmax())
            tokens.append(token)
            if step + 1 == new_tokens:
                break
            logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0]
    return tokens, torch.cat(logprobs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = ensure_real_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    prompts = []
    for system_prompt, question in chat_questions(args.prompts):
        prompt = render_chat(tokenizer, system_prompt, question)
        system = render_chat(tokenizer, system_prompt, "")
        shared = next((i for i, (a, b) in enumerate(zip(prompt, system)) if a != b), len(system))
        prompts.append((prompt, shared // PAGE * PAGE))  # the system prompt's whole pages
    rows = []
    references = [run(model, prompt, prefix, args.new_tokens, None, None) for prompt, prefix in prompts]
    for fmt in FORMATS:
        kls, answers = [], []
        for (prompt, prefix), (tokens, exact) in zip(prompts, references):
            _, lossy = run(model, prompt, prefix, args.new_tokens, fmt, tokens)  # the reference's tokens
            kls.append(mean_kl(lossy, exact))
            answers.append(run(model, prompt, prefix, args.new_tokens, fmt, None)[0])
        rows.append(format_row(fmt, kls, answers, [tokens for tokens, _ in references]))
        print(f"{fmt}: KL {rows[-1]['mean_kl']:.5f}, identical {rows[-1]['identical']}/{len(prompts)}",
              file=sys.stderr)
    results = {"command": "python experiments/report_cold_quality.py " + " ".join(sys.argv[1:]),
               "date": datetime.date.today().isoformat(), "model": args.model, "dtype": args.dtype,
               "prompts": len(prompts), "new_tokens": args.new_tokens,
               "prefix_tokens": [prefix for _, prefix in prompts], "rows": rows}
    text = quality_table(
        "A lossy prefix hit's effect on the model (the cold tier's formats)",
        f"`{results['command']}` ({results['date']}; {args.model} in {args.dtype}; {len(prompts)} chat-real "
        f"prompts, the system prompt's whole pages ({min(results['prefix_tokens'])}-"
        f"{max(results['prefix_tokens'])} tokens) through the codec, then the rest of the prompt and "
        f"{args.new_tokens} greedy tokens).", "format", rows, len(prompts))
    print(text)
    if args.out:
        write_results(args.out, "cold_quality", results, text)


if __name__ == "__main__":
    main()

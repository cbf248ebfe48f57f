"""How far quantized live KV (``kv_cache_dtype`` int8 / fp8) moves the model, on real chat prompts.

Two measurements per format, on ``--prompts`` real ``chat-real`` prompts (a system prompt and one
user question in SmolLM2's chat template), ``--new-tokens`` greedy tokens each:

* agreement, from vmemkv's engine itself (its kernels reading the quantized rows): how many greedy
  answers are identical to the engine's exact run (``kv_cache_dtype="auto"``), and where the
  others first differ;
* the mean KL divergence of the next-token distributions from the exact ones, from Hugging Face
  ``generate``'s model with every K/V row stored as the format stores it (quantized and
  dequantized per token and head as ``memory/quantized_rows.py`` does, the token's own row
  included), the exact run's tokens fed to both so the positions line up.

With ``--vllm-python`` (vLLM's venv, as bench_vs_vllm.py makes it), the same prompts through vLLM's
CPU build too, ``kv_cache_dtype="fp8"`` against its own exact run (``experiments/vllm_greedy.py``):
agreement only, as vLLM returns a few top log-probabilities, not the distribution.

No timing: the numbers are the model's.

    python experiments/report_live_kv_quality.py                              # table
    python experiments/report_live_kv_quality.py --out experiments/results    # live_kv_quality.md/.json
    python experiments/report_live_kv_quality.py --vllm-python /work/vllm_venv/bin/python
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from vmemkv.ab.chat_text import render_chat
from vmemkv.engine import LLM, SamplingParams
from vmemkv.engine.models.hub import ensure_real_model
from vmemkv.memory.quantized_rows import STORAGE, dequantize, quantize
from machine import write_results  # experiments/machine.py
from quality import chat_questions, format_row, mean_kl, quality_table  # experiments/quality.py

FORMATS = ("int8", "fp8")


class StoredAsCache(DynamicCache):
    """A DynamicCache that keeps every new K/V row as ``dtype`` rows with their scales would give
    it back (``None``: exactly)."""

    def __init__(self, dtype: torch.dtype | None):
        super().__init__()
        self.storage = dtype

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.storage is not None:
            key_states = dequantize(*quantize(key_states, self.storage), key_states.dtype)
            value_states = dequantize(*quantize(value_states, self.storage), value_states.dtype)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def logprobs(model, prompt: list[int], tokens: list[int], storage: torch.dtype | None) -> torch.Tensor:
    """Log-probabilities at every generated position, ``tokens`` fed after ``prompt``."""
    cache = StoredAsCache(storage)
    out = []
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits[0, -1:]
        for token in tokens:
            out.append(torch.log_softmax(logits.float(), dim=-1))
            logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0]
    return torch.cat(out)


def vllm_answers(python: Path, model: Path, dtype: str, prompts: list[list[int]], new_tokens: int, threads: int,
                 kv_cache_dtype: str) -> list[list[int]]:
    """vLLM's greedy answers, from experiments/vllm_greedy.py run by vLLM's Python."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, result = Path(tmp, "spec.json"), Path(tmp, "answers.json")
        spec.write_text(json.dumps({"model": str(model), "dtype": dtype, "kv_cache_dtype": kv_cache_dtype,
                                    "prompts": prompts, "max_tokens": new_tokens,
                                    "max_model_len": max(map(len, prompts)) + new_tokens + 16}))
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else f"0-{threads - 1}",
                   VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING")
        subprocess.run([str(python), str(Path(__file__).with_name("vllm_greedy.py")), str(spec), str(result)],
                       env=env, cwd=tmp, check=True)
        return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--vllm-python", type=Path, help="vLLM's venv Python: its fp8 KV's agreement too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = ensure_real_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [render_chat(tokenizer, system, question) for system, question in chat_questions(args.prompts)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    answers = {}
    for kv in ("auto", *FORMATS):
        llm = LLM(str(path), dtype=args.dtype, kv_cache_dtype=kv, max_num_seqs=args.prompts,
                  max_model_len=max(map(len, prompts)) + args.new_tokens + 16, threads=args.threads)
        answers[kv] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
        llm.engine.close()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    exact = [logprobs(model, prompt, tokens, None) for prompt, tokens in zip(prompts, answers["auto"])]
    rows = []
    for fmt in FORMATS:
        kls = [mean_kl(logprobs(model, prompt, tokens, STORAGE[fmt]), reference)
               for prompt, tokens, reference in zip(prompts, answers["auto"], exact)]
        rows.append(format_row(fmt, kls, answers[fmt], answers["auto"]))
        print(f"{fmt}: KL {rows[-1]['mean_kl']:.5f}, identical {rows[-1]['identical']}/{len(prompts)}",
              file=sys.stderr)
    if args.vllm_python:
        vllm = {kv: vllm_answers(args.vllm_python, path, args.dtype, prompts, args.new_tokens, args.threads, kv)
                for kv in ("auto", "fp8")}
        rows.append(format_row("vLLM fp8 (against vLLM's own exact run)", None, vllm["fp8"], vllm["auto"]))
        rows.append(format_row("vLLM's exact run (against vmemkv's)", None, vllm["auto"], answers["auto"]))
    results = {"command": "python experiments/report_live_kv_quality.py " + " ".join(sys.argv[1:]),
               "date": datetime.date.today().isoformat(), "model": args.model, "dtype": args.dtype,
               "prompts": len(prompts), "new_tokens": args.new_tokens,
               "prompt_tokens": [len(p) for p in prompts], "rows": rows}
    text = quality_table(
        "Quantized live KV's effect on the model",
        f"`{results['command']}` ({results['date']}; {args.model} in {args.dtype}; {len(prompts)} chat-real "
        f"prompts of {min(results['prompt_tokens'])}-{max(results['prompt_tokens'])} tokens, "
        f"{args.new_tokens} greedy tokens; answers from vmemkv's engine, KL from the HF model with "
        "its K/V rows stored in the format).", "kv_cache_dtype", rows, len(prompts))
    print(text)
    if args.out:
        write_results(args.out, "live_kv_quality", results, text)


if __name__ == "__main__":
    main()

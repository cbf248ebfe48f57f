"""vLLM's greedy answers for report_live_kv_quality.py, run by vLLM's own Python (its venv, where
vmemkv is not installed):

    V/bin/python experiments/vllm_greedy.py SPEC RESULT

SPEC: a JSON object (model, dtype, kv_cache_dtype, prompts as token ids, max_tokens,
max_model_len); RESULT: the answers' token ids, a JSON list per prompt."""

import json
import sys


def main() -> None:
    from vllm import LLM, SamplingParams

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    llm = LLM(model=spec["model"], dtype=spec["dtype"], kv_cache_dtype=spec["kv_cache_dtype"],
              max_model_len=spec["max_model_len"], max_num_seqs=len(spec["prompts"]), enable_prefix_caching=False,
              seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in spec["prompts"]], params, use_tqdm=False)
    with open(sys.argv[2], "w") as f:
        json.dump([list(o.outputs[0].token_ids) for o in outputs], f)


if __name__ == "__main__":  # vLLM's engine core starts processes of its own
    main()

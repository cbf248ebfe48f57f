"""Tensor parallelism: what rank 0's per-step message costs against the step.

For each batch size ``B``, an engine with ``tensor_parallel_size`` ranks decodes ``B`` requests
(seeded prompts, greedy, no end of sequence); each decode step is timed on rank 0 as a whole and,
inside it, the time to take the page-operation log, pickle the step message and broadcast it
(``TensorParallelLeader.broadcast_seconds``; with ``--check`` the digest all-gather counts too).
One rank (no message) is timed on the same workload for reference. CPU: gloo over localhost, the
ranks sharing the machine's cores; on GPUs pass ``--device cuda`` (NCCL for the model, gloo for
the message).

    python experiments/bench_tp_broadcast.py                       # tiny-llama, B = 1, 8, 32
    python experiments/bench_tp_broadcast.py --batch-sizes 1 8 --steps 20 --check
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiments.machine import cpu_model  # noqa: E402
from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402


def measure(model: str, device: str, tp: int, batch: int, steps: int, check: bool) -> dict:
    engine = LLMEngine(EngineConfig(model=model, device=device, max_num_seqs=batch, max_model_len=512,
                                    tensor_parallel_size=tp, tensor_parallel_check=check),
                       stream=False)
    try:
        params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(str(i), [(17 * i + 5 * j) % 250 + 1 for j in range(32)], params)
        for _ in range(3):  # prefill and the first decodes
            engine.step()
        leader = engine.tensor_parallel
        step_s, send_s, sent = [], [], []
        for _ in range(steps):
            before = (leader.broadcast_seconds, leader.broadcast_bytes) if leader else (0.0, 0)
            start = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - start)
            if leader:
                send_s.append(leader.broadcast_seconds - before[0])
                sent.append(leader.broadcast_bytes - before[1])
        step_ms = statistics.median(step_s) * 1e3
        row = {"model": model, "tensor_parallel_size": tp, "batch": batch, "check": check,
               "step_ms": round(step_ms, 3)}
        if leader:
            send_ms = statistics.median(send_s) * 1e3
            row.update(broadcast_ms=round(send_ms, 3), broadcast_share=round(send_ms / step_ms, 4),
                       message_bytes=int(statistics.median(sent)))
        return row
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps per case")
    parser.add_argument("--check", action="store_true", help="compare the ranks' digests every step")
    parser.add_argument("--out", default="experiments/results/tp_broadcast_cpu",
                        help="write <out>.json and <out>.md ('' for stdout only)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for batch in args.batch_sizes:
        for tp in (1, args.tensor_parallel_size):
            rows.append(measure(args.model, args.device, tp, batch, args.steps, args.check and tp > 1))
            print(json.dumps(rows[-1]), flush=True)
    result = {"machine": cpu_model(), "torch": torch.__version__, "threads_per_rank": 1,
              "command": " ".join(sys.argv), "rows": rows}
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
        lines = ["| B | ranks | step ms | broadcast ms | share of step | message bytes |",
                 "|---|---|---|---|---|---|"]
        for row in rows:
            sent = (f"{row['broadcast_ms']:.3f} | {100 * row['broadcast_share']:.1f} % | "
                    f"{row['message_bytes']}" if "broadcast_ms" in row else "– | – | –")
            lines.append(f"| {row['batch']} | {row['tensor_parallel_size']} | {row['step_ms']:.2f} | "
                         f"{sent} |")
        Path(args.out + ".md").write_text(
            f"Tensor-parallel step message, {args.model}, {args.device} ({result['machine']}), one "
            f"torch thread per rank, median of {args.steps} decode steps.\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

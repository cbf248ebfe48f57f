"""What the lossy formats' quality reports share (report_cold_quality.py, report_live_kv_quality.py):
the real chat prompts, a format's row of numbers against the exact run, and the table."""

from __future__ import annotations

import torch

from vmemkv.ab.chat_text import load_chat_prompts


def chat_questions(count: int) -> list[tuple[str, str]]:
    """``count`` (system prompt, question) pairs of the A/B's ``chat-real`` assistants, taking
    the assistants in turn and each one's questions in order."""
    assistants = load_chat_prompts()["assistants"]
    pairs = []
    for index in range(count):
        assistant = assistants[index % len(assistants)]
        pairs.append((assistant["system"],
                      assistant["questions"][index // len(assistants) % len(assistant["questions"])]))
    return pairs


def mean_kl(logprobs: torch.Tensor, reference: torch.Tensor) -> float:
    """The mean over positions of KL(reference || logprobs), both log-probabilities ``[positions, vocab]``."""
    return torch.nn.functional.kl_div(logprobs, reference, log_target=True, reduction="none").sum(-1).mean().item()


def format_row(name: str, kls: list[float] | None, answers: list[list[int]], exact: list[list[int]]) -> dict:
    """A format's numbers: its prompts' mean KL (mean and worst; None when not measured), how many
    greedy answers equal the exact ones, and where the others first differ."""
    firsts = sorted(next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
                    for got, want in zip(answers, exact) if got != want)
    return {"format": name, "mean_kl": sum(kls) / len(kls) if kls else None, "max_kl": max(kls) if kls else None,
            "identical": len(exact) - len(firsts), "first_difference": firsts}


def quality_table(title: str, what: str, column: str, rows: list[dict], prompts: int) -> str:
    """The report: ``title``, the sentence ``what`` (the command and how it measured), one table row
    per format (``column``: the formats' column heading)."""
    lines = [f"# {title}", "", what, "",
             f"| {column} | mean KL (nats / token) | worst prompt's mean KL | greedy answers identical | first difference at |",
             "|---|---:|---:|---:|---|"]
    for r in rows:
        kl = ("-", "-") if r["mean_kl"] is None else (f"{r['mean_kl']:.5f}", f"{r['max_kl']:.5f}")
        lines.append(f"| {r['format']} | {kl[0]} | {kl[1]} | {r['identical']} / {prompts} | "
                     f"{', '.join(map(str, r['first_difference'])) or '-'} |")
    return "\n".join(lines) + "\n"

"""What the engine hands back each step: per-request outputs with cumulative text and tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

# OpenAI's finish reasons plus ours: "abort" (the client went away or the request was cancelled)
# and "error" (the request failed; RequestOutput.error says why).
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class CompletionOutput:
    """One of a request's ``n`` sequences, cumulative since the request started.

    ``text`` is the text that is safe to show: it never shrinks between two outputs of the same
    request (text that could still turn into a stop string, or an incomplete UTF-8 character,
    is held back until it is settled).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    # One dict per generated token: {token_id: logprob}, the top-``logprobs`` tokens plus the
    # sampled one; None when the request did not ask for logprobs.
    logprobs: list[dict[int, float]] | None = None
    # The stop string or stop token id that ended the sequence; None for any other ending.
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after one engine step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: str | None = None
    # Prompt tokens served from the prefix cache instead of being computed.
    num_cached_tokens: int = 0

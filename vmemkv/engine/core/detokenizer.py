"""Incremental detokenization of one sequence, with stop strings.

Decoding token by token is not the same as decoding each token alone: byte-level BPE splits one
character over several tokens, and SentencePiece decoders drop a leading space at the start of a
decode. So each step decodes a short window of recent tokens twice, with and without the new
tokens, and emits the difference (the method of vLLM's ``detokenize_incrementally`` and TGI's
``decode_token``):

    prefix_text = decode(ids[prefix_offset:read_offset])
    new_text    = decode(ids[prefix_offset:])
    delta       = new_text[len(prefix_text):]   unless new_text ends in U+FFFD (an unfinished
                                                character), in which case wait for more tokens

The window is reset after each emitted delta, so a step costs two decodes of a few tokens,
independent of the output length (it grows only while text is held back: a long run of skipped
special tokens or of bytes of one character).
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded before the first output token, so that it decodes in context (its
# leading space, a character it completes).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text of one sequence's output tokens, built one token at a time.

    ``text`` is everything decoded so far (already cut at a matched stop string); ``token_ids``
    the output tokens. ``output_text(finished)`` is what may be shown to a client now: it holds
    back a tail that could still become the start of a stop string.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, lazy: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        if lazy and self.stop:
            raise ValueError("a lazy detokenizer cannot look for stop strings")
        self.lazy = lazy
        self.token_ids: list[int] = []
        self.text = ""
        self._context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # Offsets index into self._context + self.token_ids.
        self._prefix_offset = 0
        self._read_offset = len(self._context)
        self._stopped = False

    @classmethod
    def from_params(cls, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: Sequence[int],
                    params, final_only: bool = False) -> IncrementalDetokenizer:
        """Built from a request's ``SamplingParams`` (skip_special_tokens, stop, include); lazy
        when only the final text is wanted and there are no stop strings to watch for."""
        return cls(tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                   params.include_stop_str_in_output, lazy=final_only and not params.stop)

    def append(self, token_id: int) -> str:
        """Add one output token; return the text it settled (possibly "", while held back).
        A ``lazy`` detokenizer (no stop strings, only the final text wanted) just records the
        token: ``flush()`` decodes everything at the end, two decodes instead of two per token."""
        self.token_ids.append(token_id)
        if self._stopped or self.lazy:  # text ends at the stop string; later tokens add no text
            return ""
        ids = self._context + self.token_ids
        prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing new yet (a skipped special token, or half a character)
        delta = new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the sequence: emit text still held back as an unfinished character.

        Its bytes will never be completed, so they decode to U+FFFD, as a full decode shows them.
        """
        if self._stopped:
            return ""
        ids = self._context + self.token_ids
        prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(ids[self._prefix_offset:])
        delta = new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        self.text += delta
        return delta

    def check_stop(self, stop: Sequence[str] | None = None, include: bool | None = None,
                   new_chars: int | None = None) -> str | None:
        """Look for a stop string in the text; on a match, cut the text there and return it.

        The text is cut before the stop string, or after it when ``include``. Only the last
        ``new_chars`` characters (default: all) plus one stop string's length are searched, so
        calling it after each ``append`` with the delta's length costs O(delta + stop length).
        ``stop`` and ``include`` default to the values given to the constructor.
        """
        stop = self.stop if stop is None else list(stop)
        include = self.include_stop_str_in_output if include is None else include
        if self._stopped or not stop:
            return None
        best: tuple[int, str] | None = None  # the earliest match wins
        for stop_str in stop:
            start = 0 if new_chars is None else max(0, len(self.text) - new_chars - len(stop_str) + 1)
            index = self.text.find(stop_str, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop_str)
        if best is None:
            return None
        index, stop_str = best
        self.text = self.text[:index + len(stop_str) if include else index]
        self._stopped = True
        return stop_str

    def output_text(self, finished: bool) -> str:
        """Text safe to show now: all of it when finished; otherwise without a tail that a stop
        string (which is cut from the output) could still begin in, so shown text never shrinks."""
        if finished or self._stopped or self.include_stop_str_in_output or not self.stop:
            return self.text
        hold_back = max(len(s) for s in self.stop) - 1
        return self.text[:max(0, len(self.text) - hold_back)]

    def _decode(self, ids: list[int]) -> str:
        # clean_up_tokenization_spaces rewrites " ." to "." depending on what follows, which an
        # incremental decode cannot undo; keep the text as the tokens spell it.
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

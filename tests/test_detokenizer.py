"""Incremental detokenization: equals a full decode (multi-byte UTF-8 included), and stop strings.

The tokenizers are trained here, in a few milliseconds, with the `tokenizers` library: nothing
comes from the network.
"""

import itertools

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from vmemkv.engine.core.detokenizer import IncrementalDetokenizer
from vmemkv.engine.core.sampling_params import SamplingParams

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "stop END here ### done; the end is near, END of story.",
    "日本語のテキスト、中文文本 café naïve résumé",
] * 10

TEXTS = [
    "Hello world! The quick brown fox.",
    "Emoji 😀🎉 in the middle, and at the end 🦊",
    "中文文本 and 日本語のテキスト mixed with café",
    "   spaces   and\nnewlines\n\n",
    "🎉",
]


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A GPT-2 style byte-level BPE: a character outside the merges is split into byte tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>", "<bos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", bos_token="<bos>")


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer: '▁' marks spaces and a decode drops its leading space."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"],
                                  show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", unk_token="<unk>")


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return byte_level_tokenizer()


def _feed(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    return [detokenizer.append(token_id) for token_id in token_ids]


# ---- equality with a full decode ----------------------------------------------------------------

def test_the_corpus_splits_multibyte_characters_across_tokens(tokenizer):
    # The premise of the tests below: some single tokens are not whole characters.
    pieces = [tokenizer.decode([t]) for t in tokenizer.encode("😀🦊")]
    assert any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", ["", "A prompt with 中文 😀", "The end"])
def test_incremental_text_equals_full_decode(tokenizer, text, prompt):
    prompt_ids = tokenizer.encode(prompt)
    output_ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = _feed(detokenizer, output_ids)
    assert "".join(deltas) == detokenizer.text == tokenizer.decode(output_ids) == text
    assert detokenizer.token_ids == output_ids
    assert all("\ufffd" not in delta for delta in deltas)  # partial characters were held back


def test_text_is_held_back_until_a_character_is_complete(tokenizer):
    output_ids = tokenizer.encode("a😀")
    assert len(output_ids) > 2  # "a" plus several byte tokens
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    deltas = _feed(detokenizer, output_ids)
    assert deltas[0] == "a"
    assert deltas[1:-1] == [""] * (len(deltas) - 2)
    assert deltas[-1] == "😀"


def test_flush_emits_an_unfinished_character_as_a_full_decode_shows_it(tokenizer):
    output_ids = tokenizer.encode("ok😀")[:-1]  # cut the emoji's last byte
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    _feed(detokenizer, output_ids)
    assert detokenizer.text == "ok"
    detokenizer.flush()
    assert detokenizer.text == tokenizer.decode(output_ids)
    assert detokenizer.text.startswith("ok\ufffd")
    assert detokenizer.flush() == ""  # nothing left


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_skipped_or_kept(tokenizer, skip):
    eos = tokenizer.eos_token_id
    output_ids = tokenizer.encode("before ") + [eos] + tokenizer.encode("after 😀") + [eos]
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi"), skip_special_tokens=skip)
    _feed(detokenizer, output_ids)
    detokenizer.flush()
    assert detokenizer.text == tokenizer.decode(output_ids, skip_special_tokens=skip)


@pytest.mark.parametrize("prompt, output", [("Hello", " world"), ("the end", " is near"),
                                            ("Hello world!", " The quick")])
def test_output_decodes_in_the_context_of_the_prompt(prompt, output):
    # SentencePiece decoders drop the leading space of a decode: the first output token must be
    # decoded after the prompt to keep it.
    tokenizer = metaspace_tokenizer()
    prompt_ids, output_ids = tokenizer.encode(prompt), tokenizer.encode(output)
    assert tokenizer.decode(output_ids) == output.lstrip()  # alone, the space is lost
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    _feed(detokenizer, output_ids)
    assert tokenizer.decode(prompt_ids) + detokenizer.text == tokenizer.decode(prompt_ids + output_ids)
    assert detokenizer.text == output


# ---- stop strings -------------------------------------------------------------------------------

def _run_with_stops(tokenizer, text: str, stop: list[str], include: bool
                    ) -> tuple[IncrementalDetokenizer, str | None, list[str]]:
    """Feed `text` token by token as the engine does; return the detokenizer, the matched stop
    string and the successive visible texts."""
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=stop, include_stop_str_in_output=include)
    visible, matched = [], None
    for token_id in tokenizer.encode(text):
        delta = detokenizer.append(token_id)
        matched = detokenizer.check_stop(new_chars=len(delta))
        visible.append(detokenizer.output_text(finished=matched is not None))
        if matched is not None:
            break
    return detokenizer, matched, visible


@pytest.mark.parametrize("include, expected", [(False, "stop "), (True, "stop END")])
def test_stop_string_truncates_the_text(tokenizer, include, expected):
    detokenizer, matched, _ = _run_with_stops(tokenizer, "stop END here ### done", ["END"], include)
    assert matched == "END"
    assert detokenizer.text == expected


def test_stop_string_split_across_tokens(tokenizer):
    text = "Hello world! The quick brown fox."
    stop = "ld! Th"  # no single token spans it
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert not any(stop in piece for piece in pieces)
    detokenizer, matched, _ = _run_with_stops(tokenizer, text, [stop], include=False)
    assert matched == stop
    assert detokenizer.text == "Hello wor"
    detokenizer, _, _ = _run_with_stops(tokenizer, text, [stop], include=True)
    assert detokenizer.text == "Hello world! Th"


def test_stop_string_inside_a_multibyte_sequence(tokenizer):
    detokenizer, matched, _ = _run_with_stops(tokenizer, "Emoji 😀🎉 in the middle", ["🎉"], False)
    assert matched == "🎉"
    assert detokenizer.text == "Emoji 😀"


def test_the_earliest_stop_string_wins(tokenizer):
    detokenizer, matched, _ = _run_with_stops(
        tokenizer, "Hello world! The quick brown fox.", ["quick", "world", "The"], False)
    assert matched == "world"
    assert detokenizer.text == "Hello "


def test_visible_text_never_shrinks_and_never_shows_a_stop_prefix(tokenizer):
    text = "stop END here ### done; the end is near, END of story."
    for stop in (["END"], ["###", "near"], ["the end is"]):
        _, matched, visible = _run_with_stops(tokenizer, text, stop, include=False)
        assert matched is not None
        for before, after in itertools.pairwise(visible):
            assert after.startswith(before)
        assert not any(s in v for s in stop for v in visible)


def test_no_stop_means_no_hold_back(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    _feed(detokenizer, tokenizer.encode("Hello world"))
    assert detokenizer.check_stop() is None
    assert detokenizer.output_text(finished=False) == "Hello world"


def test_tokens_after_a_stop_add_no_text(tokenizer):
    detokenizer, matched, _ = _run_with_stops(tokenizer, "stop END here", ["END"], False)
    assert matched == "END"
    assert detokenizer.append(tokenizer.encode(" more")[0]) == ""
    assert detokenizer.text == "stop "
    assert detokenizer.check_stop() is None  # reported once


def test_from_params(tokenizer):
    params = SamplingParams(stop="###", include_stop_str_in_output=True, skip_special_tokens=False)
    detokenizer = IncrementalDetokenizer.from_params(tokenizer, [], params)
    assert detokenizer.stop == ["###"]
    assert detokenizer.include_stop_str_in_output and not detokenizer.skip_special_tokens

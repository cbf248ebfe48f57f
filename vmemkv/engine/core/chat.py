"""Chat prompts through the tokenizer's own chat template, and the tokens that end a turn."""

from __future__ import annotations

from vmemkv.errors import ConfigError

# End-of-turn markers of common templates (ChatML, Llama 3, Gemma, Phi-3). A template's turn can
# end with a token other than the config's eos (Qwen2: eos <|endoftext|>, turns end <|im_end|>).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


class NoChatTemplateError(ConfigError):
    """The model's tokenizer has no chat template, so chat messages cannot be formatted."""


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def end_of_turn_token_ids(tokenizer) -> list[int]:
    """Ids of the end-of-turn tokens the tokenizer's chat template writes (none without one)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):  # no template, or a dict of named templates
        return []
    vocab = tokenizer.get_vocab()
    return [vocab[token] for token in END_OF_TURN_TOKENS if token in template and token in vocab]


def chat_prompt_ids(tokenizer, messages: list[dict], model_name: str = "the model") -> list[int]:
    """Token ids of ``messages`` formatted by the chat template, ending with the assistant's
    generation prompt."""
    if not has_chat_template(tokenizer):
        raise NoChatTemplateError(f"{model_name} has no chat template, so chat messages cannot be "
                                  "formatted; send a plain prompt (no --chat) or use a chat model "
                                  "such as smollm2-135m-instruct")
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded  # 5.x returns a BatchEncoding
    return list(ids)

"""Text in the model's chat template, for calibration and for a custom task's prompts."""

from __future__ import annotations

from typing import Any

from ..errors import UsageError


def in_chat_template(
    tokenizer: Any, messages: list[dict[str, str]], *, generation_prompt: bool, where: str
) -> str:
    """`messages` rendered by the tokenizer's chat template, as text. A leading BOS is
    dropped: the tokenizer (and lm-eval) adds it when the text is encoded, and twice would
    be a sequence the model never saw."""
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(
            "the model's tokenizer has no chat template, but one was asked for",
            path=where,
            hint="set chat_template: false, or use a model whose tokenizer_config.json "
            "carries a chat_template (an instruct model)",
        )
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    bos = tokenizer.bos_token
    return text[len(bos) :] if bos and text.startswith(bos) else text

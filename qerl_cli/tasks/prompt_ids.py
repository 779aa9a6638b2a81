"""A prompt's token ids within a token limit, without handing the tokenizer a text that cannot fit.

Tokenizing is at best linear in the text, and a pathological prompt (megabytes with no whitespace) stalls a BPE
tokenizer for minutes and gigabytes. So a prompt is first held to ``PROMPT_CHARS_PER_TOKEN`` characters per token
it may have: text runs 3-5 characters per token, so a prompt past that bound is far over its token limit. Training
(``--max-prompt-length``) refuses a longer prompt, or with ``--truncate-prompts`` keeps its end; `qerl eval` refuses
prompts past what the model's context leaves after ``--max-tokens``.
"""

from __future__ import annotations

from typing import Any

from qerl_cli.errors import QerlError

PROMPT_CHARS_PER_TOKEN = 16


def char_limit(max_tokens: int) -> int:
    """The most characters a prompt of at most ``max_tokens`` tokens may have before it is tokenized."""
    return PROMPT_CHARS_PER_TOKEN * max(1, max_tokens)


def _leading_bos(tokenizer: Any, text: str, ids: list[int], add_bos: bool) -> tuple[list[int], list[int]]:
    """(the BOS that starts the prompt, or nothing; the ids after it): a cut keeps the BOS, as a tokenizer puts it."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return [], ids
    if ids and ids[0] == bos:
        return [bos], ids[1:]
    bos_text = getattr(tokenizer, "bos_token", None)
    return ([bos], ids) if add_bos or (bos_text and text.startswith(bos_text)) else ([], ids)


def encode_prompt(tokenizer: Any, prompt: str, *, max_tokens: int, add_bos: bool, truncate: bool,
                  where: str = "a prompt") -> list[int]:
    """``prompt``'s token ids (after a BOS when ``add_bos`` and the text has none), at most ``max_tokens``.

    A longer prompt raises a QerlError naming ``where`` and its length, or with ``truncate`` keeps the BOS and the
    last tokens; a prompt over ``char_limit(max_tokens)`` characters is cut to its tail before tokenizing."""
    limit = char_limit(max_tokens)
    text = prompt
    if len(prompt) > limit:
        if not truncate:
            raise QerlError(f"{where} has {len(prompt)} characters, over the {limit} that --max-prompt-length "
                            f"{max_tokens} allows ({PROMPT_CHARS_PER_TOKEN} per token): raise --max-prompt-length, "
                            "shorten the prompt, or pass --truncate-prompts to keep its end")
        text = prompt[-limit:]
    head, ids = _leading_bos(tokenizer, prompt, tokenizer(text, add_special_tokens=False).input_ids, add_bos)
    if len(head) + len(ids) <= max_tokens:
        return head + ids
    if not truncate:
        raise QerlError(f"{where} has {len(head) + len(ids)} tokens, over --max-prompt-length {max_tokens}: raise "
                        f"--max-prompt-length, shorten the prompt, or pass --truncate-prompts to keep its last "
                        f"{max_tokens} tokens")
    keep = max_tokens - len(head)
    return (head + ids[len(ids) - keep:]) if keep > 0 else head[:max_tokens]

"""What `qerl eval`'s harnesses share: generating with the builtin engine and cutting at stop strings, and
running an external library offline. The builtin harness (harness.py) and the adapters (lm_eval_adapter.py,
lighteval_adapter.py) import this module; none of them imports another.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from qerl_cli.errors import QerlError


def truncate_at_stop(text: str, stops: Sequence[str]) -> str:
    """Text before the first occurrence of any stop string (lm-eval's `until` post-processing)."""
    for s in stops:
        if s:
            text = text.split(s)[0]
    return text




def _refuse_unfittable(prompts: list[str], context: int, max_tokens: int) -> None:
    """Refuse, before tokenizing it, a prompt with more characters than the context left after ``max_tokens`` can
    hold (tasks/prompt_ids.py: a megabyte prompt would stall the tokenizer for minutes to be refused anyway)."""
    from qerl_cli.tasks.prompt_ids import PROMPT_CHARS_PER_TOKEN, char_limit

    room = context - max_tokens - 1
    if room < 1:  # no prompt fits: the token check after says what to lower
        return
    cap = char_limit(room)
    for i, p in enumerate(prompts):
        if len(p) > cap:
            raise QerlError(f"prompt {i} (0-based) has {len(p)} characters, over the {cap} that the model's context "
                            f"of {context} tokens leaves after --max-tokens {max_tokens} ({PROMPT_CHARS_PER_TOKEN} "
                            "per token): shorten it, or lower --max-tokens or --shots")


def generate_texts(model: Any, tokenizer: Any, prompts: list[str], sampling: Any, batch_slots: int,
                   episodes: Any = None) -> list[dict]:
    """Generate with the builtin engine; one dict per sample (prompt_index, sample_index, text, ...).

    The engine keeps the token that completed a stop string, so `text` may run past it; callers cut it
    with `truncate_at_stop`. With ``episodes`` (tools/episodes.py: a tool or an environment answers the turns)
    each dict also has ``answer`` (what the model wrote outside its calls: what is scored), ``turns`` (the
    episode's record) and ``env_reward``.
    """
    from qerl_cli.rollout import BuiltinEngine

    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if limit is not None:
        _refuse_unfittable(prompts, int(limit), sampling.max_tokens)
    ids = [list(tokenizer(p)["input_ids"]) for p in prompts]
    longest = max(len(i) for i in ids)
    need = longest + sampling.max_tokens + 1
    if limit is not None and need > int(limit):
        raise QerlError(f"the longest prompt has {longest} tokens; with --max-tokens {sampling.max_tokens} that "
                        f"exceeds the model's context of {limit}: lower --max-tokens or --shots")
    engine = BuiltinEngine(model, tokenizer, max_batch_slots=batch_slots, max_model_len=need)
    try:
        if episodes is None:
            result = engine.generate(ids, sampling)
        else:
            result = episodes.generate(engine, ids, prompts, sampling,
                                       lambda t: list(tokenizer(t, add_special_tokens=False)["input_ids"]) if t else [])
    finally:
        engine.release()
    out = []
    for s in result.samples:
        row = {"prompt_index": s.prompt_index, "sample_index": s.sample_index,
               "text": tokenizer.decode(s.token_ids, skip_special_tokens=True),
               "finish_reason": s.finish_reason, "tokens": len(s.token_ids)}
        if episodes is not None:
            def decode(t: list[int]) -> str:
                return tokenizer.decode(t, skip_special_tokens=True)

            row.update(answer=episodes.answer_text(s, decode), turns=episodes.record(s, decode),
                       env_reward=episodes.env_reward(s), steps=len(s.steps),
                       tool_errors=sum(1 for st in s.steps if st.error is not None))
        out.append(row)
    return out


# ------------------------------------------------------------------------------------------- table




@contextlib.contextmanager
def hf_offline() -> Iterator[None]:
    """HF datasets/hub offline (the data files are local) and no datasets progress bars, restored after."""
    import datasets

    from qerl_cli.env_info import temporary_env

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        with temporary_env({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}):
            yield
    finally:
        if bars:
            datasets.enable_progress_bars()

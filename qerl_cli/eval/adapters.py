"""The external evaluation harnesses `qerl eval --harness NAME` can run, by name.

Each entry names the task it runs (its own task definition over qerl's bundled data), the adapter module and
that module's two entry points: ``require`` (a clear QerlError when the library is missing or broken; returns
its version) and ``run(model, tokenizer, task, *, max_tokens, temperature, seed, batch_slots)`` ->
(records, extra). The adapter is imported only when its harness is used, so neither library is needed
otherwise. To add a harness: write its adapter module (start from lm_eval_adapter.py) and add a line here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from qerl_cli.errors import QerlError


@dataclass(frozen=True)
class ExternalHarness:
    name: str
    task: str  # the canonical qerl task it runs (gsm8k, math500)
    module: str
    require_fn: str
    run_fn: str
    engine: str  # what the result's protocol says generated the text

    def require(self) -> str:
        return getattr(importlib.import_module(self.module), self.require_fn)()

    def run(self, model: Any, tokenizer: Any, task: Any, **kwargs: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return getattr(importlib.import_module(self.module), self.run_fn)(model, tokenizer, task, **kwargs)


EXTERNAL_HARNESSES: dict[str, ExternalHarness] = {
    "lm-eval": ExternalHarness("lm-eval", "gsm8k", "qerl_cli.eval.lm_eval_adapter", "require_lm_eval",
                               "run_lm_eval_gsm8k", "qerl builtin rollout engine behind lm_eval.api.model.LM"),
    "lighteval": ExternalHarness("lighteval", "math500", "qerl_cli.eval.lighteval_adapter", "require_lighteval",
                                 "run_lighteval_math500",
                                 "qerl builtin rollout engine behind lighteval LightevalModel"),
}


def external_harness(name: str) -> ExternalHarness:
    try:
        return EXTERNAL_HARNESSES[name]
    except KeyError:
        raise QerlError(f"unknown harness {name!r}: use builtin or one of {', '.join(EXTERNAL_HARNESSES)}") from None

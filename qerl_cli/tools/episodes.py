"""The episode bookkeeping the trainer and ``qerl eval`` share: which tool or environment answers a turn, the
per-call sessions the rollout engine asks (rollout/episode.py's ``EpisodeHooks``), and what an episode is once
it ended: its model turns, the text the answer graders score, its environment reward, its JSONL record and the
step's metrics (docs/tools.md).

An episode is one sample: it gets one reward and one advantage, which every model token of every turn shares;
observation tokens are masked from the loss (``Sample.model_mask``).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable
from typing import Any

import torch

from qerl_cli.errors import QerlError
from qerl_cli.rollout.episode import StepResult
from qerl_cli.tools import make_tool
from qerl_cli.tools.base import Tool
from qerl_cli.tools.chat import chat_observation
from qerl_cli.tools.environment import check_reset, check_step, load_env
from qerl_cli.tools.sandbox import SandboxLimits

Decode = Callable[[list[int]], str]


class Episodes:
    """A run's episodes: a built-in ``tool`` or a user environment class ``env_cls`` (one of the two)."""

    def __init__(self, tool: Tool | None = None, env_cls: type | None = None, *, env_name: str = "",
                 max_turns: int = 4, workers: int = 8, render: Callable[[str], str] | None = None) -> None:
        if (tool is None) == (env_cls is None):
            raise QerlError("an episode needs a tool or an environment, not both: use --tools or --env")
        if max_turns < 1:
            raise QerlError(f"--max-turns must be >= 1, got {max_turns}")
        self.tool = tool
        self.env_cls = env_cls
        self.env_name = env_name or getattr(env_cls, "__name__", "")
        self.max_turns = max_turns
        self.workers = max(1, workers)
        self.render = render  # a tool's output as the chat template's tool turn (tools/chat.py), or its own format
        # called (from the step's worker thread) with the number of steps this generate call has run: progress
        # for the console, whose rollout phase otherwise says nothing until every episode ended
        self.on_step: Callable[[int], None] | None = None

    @property
    def stop(self) -> tuple[str, ...]:
        """Strings that end a model turn, beside the task's stops and EOS."""
        if self.tool is not None:
            return tuple(self.tool.stop)
        return tuple(getattr(self.env_cls, "stop", ()))

    @property
    def kind(self) -> str:
        return self.tool.name if self.tool is not None else f"env:{self.env_name}"

    def default_budget(self, per_turn: int, encode: Callable[[str], list[int]] | None = None) -> int:
        """An episode's token budget when none is given: ``per_turn`` model tokens for each of ``max_turns`` turns,
        plus the tool's observation allowance for each call between them (the budget counts observation tokens
        too, so without it a tool's answer is cut before the model can copy it). With a chat template the tool
        turn's own framing (``encode(render(""))``) is added per call. An environment's observations have no
        known size: its default is the model's turns only."""
        calls = self.max_turns - 1  # the last turn's step is never appended
        room = int(getattr(self.tool, "observation_tokens", 0)) if self.tool is not None else 0
        if self.tool is not None and self.render is not None and encode is not None:
            room += len(encode(self.render("")))
        return self.max_turns * per_turn + calls * room

    # ----- rollouts -----------------------------------------------------------------------------------

    def generate(self, engine: Any, prompt_ids: list[list[int]], prompt_texts: list[str], sampling: Any,
                 encode: Callable[[str], list[int]], **kwargs: Any) -> Any:
        """``engine.generate`` with this run's episodes. An environment's reset() text is appended to its own
        episode's prompt: the prompts are then one per sample (same noise keys as ``n`` samples per prompt)."""
        session = EpisodeSession(self, prompt_texts, sampling.n)
        resets = session.prepare()
        if not any(r for row in resets for r in row):
            return engine.generate(prompt_ids, sampling, episodes=session, **kwargs)
        n = sampling.n
        expanded = [list(ids) + encode(r) for ids, row in zip(prompt_ids, resets, strict=True) for r in row]
        session.per_sample = True
        one = dataclasses.replace(sampling, n=1, prompt_offset=sampling.prompt_offset * n)
        result = engine.generate(expanded, one, episodes=session, **kwargs)
        for s in result.samples:
            s.prompt_index, s.sample_index = divmod(s.prompt_index, n)
        return result

    # ----- a finished episode -------------------------------------------------------------------------

    @staticmethod
    def model_spans(sample: Any) -> list[tuple[int, int]]:
        """[start, end) of each model turn in ``sample.token_ids`` (what is not an observation)."""
        spans, pos = [], 0
        for start, end in sample.observation_spans:
            spans.append((pos, start))
            pos = end
        spans.append((pos, len(sample.token_ids)))
        return spans

    def answer_text(self, sample: Any, decode: Decode) -> str:
        """What the model wrote, observations left out and, with a tool, its calls too: what graders score."""
        text = "".join(decode(sample.token_ids[a:b]) for a, b in self.model_spans(sample))
        return self.tool.strip_calls(text) if self.tool is not None else text

    @staticmethod
    def env_reward(sample: Any) -> float:
        return float(sum(getattr(step, "reward", 0.0) for step in sample.steps))

    def rewards(self, samples: list[Any], prompts: list[str], answers: list[str], score: Callable[..., Any],
                decode: Decode, *, graded: bool = True) -> torch.Tensor:
        """One reward per episode: ``score(prompts, answer_texts, answer=answers)`` (a checked reward, such as
        ``partial(safe_rewards, reward_fn)``) when ``graded``, plus its environment's rewards."""
        out = torch.zeros(len(samples), dtype=torch.float32)
        if graded:
            texts = [self.answer_text(s, decode) for s in samples]
            out += torch.tensor(score(prompts, texts, answer=answers), dtype=torch.float32)
        if self.env_cls is not None:
            out += torch.tensor([self.env_reward(s) for s in samples], dtype=torch.float32)
        return out

    def record(self, sample: Any, decode: Decode) -> list[dict[str, Any]]:
        """One dict per model turn for the rollouts JSONL: its text, and the step that followed it if any."""
        out = []
        spans = self.model_spans(sample)
        for i, (a, b) in enumerate(spans):
            turn: dict[str, Any] = {"text": decode(sample.token_ids[a:b])}
            if i < len(sample.steps):
                step = sample.steps[i]
                obs = (decode(sample.token_ids[slice(*sample.observation_spans[i])])
                       if i < len(sample.observation_spans) else None)
                turn.update(action=step.action, observation=obs, error=step.error, reward=step.reward,
                            done=step.done, seconds=round(step.seconds, 4), truncated=step.truncated)
            out.append(turn)
        return out

    def metrics(self, samples: list[Any]) -> dict[str, float]:
        """The step's episode metrics: turns and tool calls per episode, tool errors, observation share."""
        if not samples:
            return {}
        steps = [st for s in samples for st in s.steps]
        tokens = sum(len(s.token_ids) for s in samples)
        obs = sum(e - b for s in samples for b, e in s.observation_spans)
        errors = sum(1 for st in steps if st.error is not None)
        return {
            "episodes/turns_mean": sum(len(s.observation_spans) + 1 for s in samples) / len(samples),
            "episodes/steps_mean": len(steps) / len(samples),
            "episodes/tool_errors": float(errors),
            "episodes/tool_error_rate": errors / len(steps) if steps else 0.0,
            "episodes/observation_token_frac": obs / tokens if tokens else 0.0,
            "episodes/step_seconds_mean": sum(st.seconds for st in steps) / len(steps) if steps else 0.0,
        }


class EpisodeSession:
    """One generate call's episodes (rollout/episode.py's ``EpisodeHooks``): an environment instance per
    (prompt, sample) with its reset() done, or the run's tool."""

    def __init__(self, episodes: Episodes, prompt_texts: list[str], n: int) -> None:
        self.episodes = episodes
        self.prompt_texts = prompt_texts
        self.n = n
        self.stop = episodes.stop
        # an environment may end every turn after a fixed number of tokens (a game's fixed-size action)
        self.turn_tokens: int | None = getattr(episodes.env_cls, "turn_tokens", None)
        self.max_turns = episodes.max_turns
        self.workers = episodes.workers
        self.per_sample = False  # the engine's prompts are one per (prompt, sample): its index is p * n + s
        self.envs: dict[tuple[int, int], Any] = {}
        self.steps_run = 0
        self._count = threading.Lock()

    def prepare(self) -> list[list[str]]:
        """Build the environments and reset them; their reset() texts per prompt and sample ("" for a tool)."""
        if self.episodes.env_cls is None:
            return [[""] * self.n for _ in self.prompt_texts]
        out = []
        name = self.episodes.env_name
        for p, text in enumerate(self.prompt_texts):
            row = []
            for s in range(self.n):
                try:
                    env = self.episodes.env_cls()
                    reset = env.reset(text)
                except Exception as exc:
                    raise QerlError(f"environment {name}: building or resetting it raised {type(exc).__name__}: "
                                    f"{exc}") from exc
                self.envs[(p, s)] = env
                row.append(check_reset(name, reset))
            out.append(row)
        return out

    def _key(self, prompt_index: int, sample_index: int) -> tuple[int, int]:
        return divmod(prompt_index, self.n) if self.per_sample else (prompt_index, sample_index)

    def wants_step(self, prompt_index: int, sample_index: int, turn: int, text: str) -> bool:
        tool = self.episodes.tool
        if tool is None:
            return True  # every turn is an environment action
        # the last turn's call would never be answered: the episode ends there
        return turn < self.max_turns and tool.find_call(text) is not None

    def step(self, prompt_index: int, sample_index: int, turn: int, text: str) -> StepResult:
        result = self._step(prompt_index, sample_index, turn, text)
        with self._count:
            self.steps_run += 1
            done = self.steps_run
        if self.episodes.on_step is not None:
            self.episodes.on_step(done)
        return result

    def _step(self, prompt_index: int, sample_index: int, turn: int, text: str) -> StepResult:
        tool = self.episodes.tool
        if tool is not None:
            call = tool.find_call(text) or ""
            out = tool.run(call)
            render = self.episodes.render
            return StepResult(observation=out.observation if render is None else render(out.text), error=out.error,
                              action=call)
        env = self.envs[self._key(prompt_index, sample_index)]
        name = self.episodes.env_name
        try:
            value = env.step(text)
        except Exception as exc:
            raise QerlError(f"environment {name}.step raised {type(exc).__name__}: {exc}") from exc
        obs, done, reward = check_step(name, value)
        return StepResult(observation=obs, done=done, reward=reward, action=text)


def make_episodes(tools: str | None, env: str | None, *, max_turns: int = 4, workers: int = 8,
                  limits: SandboxLimits | None = None, chat_tokenizer: Any = None) -> Episodes | None:
    """A run's episodes from its options (``--tools``, ``--env``), or None for single-turn rollouts;
    ``chat_tokenizer`` (with ``--chat-template``): a tool's output comes back as that template's tool turn."""
    if tools and env:
        raise QerlError("--tools and --env both given: an episode has one tool or one environment")
    if tools:
        render = None if chat_tokenizer is None else chat_observation(chat_tokenizer)
        return Episodes(make_tool(tools, limits), max_turns=max_turns, workers=workers, render=render)
    if env:
        return Episodes(env_cls=load_env(env), env_name=env, max_turns=max_turns, workers=workers)
    return None


def episodes_from_config(cfg: Any, tokenizer: Any = None) -> Episodes | None:
    """A run's episodes from its TrainConfig (``tools``, ``env``, ``max_turns``, the tool limits, whether prompts
    use the chat template), or None."""
    limits = SandboxLimits(cpu_s=math.ceil(cfg.tool_timeout_s), wall_s=cfg.tool_timeout_s,
                           memory_mb=cfg.tool_memory_mb)
    return make_episodes(cfg.tools, cfg.env, max_turns=cfg.max_turns, workers=cfg.tool_workers, limits=limits,
                         chat_tokenizer=tokenizer if cfg.chat_template else None)

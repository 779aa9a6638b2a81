"""Multi-turn episodes: the builtin engine pauses a sequence for a tool and resumes it in the same KV cache
(log-probs equal one forward over the whole episode), observations are masked from the loss, an episode is one
sample with one advantage, and `qerl train` / `qerl eval` / `qerl bench rollout` run them end to end."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from qerl_cli.rollout import BuiltinEngine, SamplingParams
from qerl_cli.rollout.engine import Sample
from qerl_cli.rollout.episode import StepResult
from qerl_cli.train.batch import build_batch
from qerl_cli.train.corrections import mismatch_metrics
from qerl_cli.train.losses import policy_loss
from tests.helpers import qerl_exit_code

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch intra-op thread


@pytest.fixture(scope="module")
def smol():
    from qerl_cli.models import load_model

    return load_model(None, dtype=torch.float32)


def teacher_forced(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


class ScriptedTurns:
    """Turns of 4 tokens, 3 per episode; sample (0, 0)'s first tool call returns only once sample (1, 1) -- which
    gets a slot only after others finished -- made its second call: the test hangs (then fails) unless the other
    slots decode while a tool runs."""

    stop: tuple[str, ...] = ()
    max_turns = 3
    turn_tokens = 4
    workers = 4

    def __init__(self) -> None:
        self.release = threading.Event()

    def wants_step(self, prompt_index: int, sample_index: int, turn: int, text: str) -> bool:
        return True

    def step(self, prompt_index: int, sample_index: int, turn: int, text: str) -> StepResult:
        if (prompt_index, sample_index, turn) == (0, 0, 1) and not self.release.wait(120):
            raise AssertionError("no other sequence reached its second tool call while this one waited")
        if (prompt_index, sample_index, turn) == (1, 1, 2):
            self.release.set()
        return StepResult(observation=f" [tool {prompt_index}.{sample_index}.{turn}: {len(text)} chars]", action=text)


def test_pause_and_resume_in_one_slot_equals_one_forward_over_the_episode(smol) -> None:
    model, tok = smol
    ids = [tok(p)["input_ids"] for p in ("2 + 3 = 5\n8 + 9 =", "The capital of France is")]
    # 3 slots for 4 episodes: the fourth is admitted while another is parked; parked K/V moves between slots
    engine = BuiltinEngine(model, tok, max_batch_slots=3, max_model_len=128)
    hooks = ScriptedTurns()
    res = engine.generate(ids, SamplingParams(n=2, temperature=1.0, max_tokens=80, stop_token_ids=[], seed=5),
                          episodes=hooks)
    assert res.stats["steps"] == 12 and res.stats["resumes"] == 8 and res.stats["parked_max"] == 3
    for s in res.samples:
        assert len(s.steps) == 3 and len(s.observation_spans) == 2 and s.finish_reason == "stop"
        for (start, end), step in zip(s.observation_spans, s.steps, strict=False):
            assert s.token_ids[start:end] == tok(step.observation, add_special_tokens=False)["input_ids"]
            assert s.logprobs[start:end].abs().sum() == 0.0
        mask = s.model_mask().bool()
        assert int(mask.sum()) == 12  # 3 turns x 4 model tokens
        ref = teacher_forced(model, s.prompt_token_ids, s.token_ids)
        # the turns after an observation were decoded on the kept cache; one forward over everything agrees
        assert torch.allclose(s.logprobs[mask], ref[mask], atol=1e-4), (s.logprobs[mask] - ref[mask]).abs().max()
    assert res.timings["tokens"] == 4 * 12  # generated tokens: observations were prefilled, not sampled


def test_calculator_episodes_on_the_embedded_model(smol) -> None:
    from qerl_cli.tasks import load_task
    from qerl_cli.tasks.rewards import arith_reward
    from qerl_cli.tools.episodes import make_episodes

    model, tok = smol
    task = load_task("arith", split="test", tools="calculator", limit=4, level="1")
    episodes = make_episodes("calculator", None, max_turns=3)
    ids = [tok(e.prompt)["input_ids"] for e in task.examples]
    engine = BuiltinEngine(model, tok, max_batch_slots=4, max_model_len=max(map(len, ids)) + 32)

    def encode(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    res = episodes.generate(engine, ids, task.prompts,
                            SamplingParams(n=1, temperature=0.0, max_tokens=24, stop=list(task.stop)), encode)

    def decode(t: list[int]) -> str:
        return tok.decode(t, skip_special_tokens=True)

    called = [s for s in res.samples if s.steps]
    assert len(called) >= 3  # the few-shot prompt makes SmolLM2 call the calculator
    for s in called:
        step = s.steps[0]
        assert step.observation.startswith(" <result>") and step.error is None
        assert decode(s.token_ids[slice(*s.observation_spans[0])]) == step.observation
    answers = [episodes.answer_text(s, decode) for s in res.samples]
    assert all("<calc>" not in a and "<result>" not in a for a in answers)
    golds = [task.examples[s.prompt_index].answer for s in res.samples]
    rewards = episodes.rewards(res.samples, task.prompts, golds, arith_reward, decode)
    assert rewards.tolist() == arith_reward(task.prompts, answers, answer=golds)


def test_eval_default_budget_leaves_room_for_the_tools_answer(run_dir: Path) -> None:
    # the budget counts observation tokens: 2 turns of arith's 8 tokens cut " <result>7</result>" before the model
    # could copy it (0/2); the default adds the calculator's 16-token allowance for the one call between the turns
    from qerl_cli.eval.harness import run_eval
    from qerl_cli.tools.episodes import make_episodes

    episodes = make_episodes("calculator", None, max_turns=2)
    assert episodes.default_budget(8) == 2 * 8 + 16
    assert make_episodes("calculator", None, max_turns=4).default_budget(8) == 4 * 8 + 3 * 16
    result = run_eval(run_dir, "arith", checkpoint="base", limit=2, tools="calculator", max_turns=2)
    assert result["protocol"]["max_tokens"] == 32 and result["notices"] == []
    # the default budget is no setting of the user's: the file is named by the limit and the turns only
    assert result["settings"] == {"limit": 2, "max_turns": 2}
    assert result["scores"]["arith"]["accuracy"]["mean"] == 1.0 and result["episodes"]["steps"] == 2
    cut = run_eval(run_dir, "arith", checkpoint="base", limit=2, tools="calculator", max_turns=2, max_tokens=16)
    assert cut["scores"]["arith"]["accuracy"]["mean"] == 0.0 and cut["settings"]["max_tokens"] == 16
    assert cut["notices"] == ["2 of 2 episodes ran out of the 16-token budget (model and observation tokens "
                              "together), 2 with the tool's answer cut; raise --max-tokens"]


def test_observations_are_masked_from_the_loss_and_the_mismatch_statistics(tiny_source) -> None:
    from transformers import AutoModelForCausalLM

    from qerl_cli.train.advantages import group_advantages
    from qerl_cli.train.logprobs import sampled_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(tiny_source), torch_dtype=torch.float32).eval()
    prompt = [5, 6, 7]
    # episode 0: model [10, 11], observation [20, 21, 22], model [12, 13, 14]; episode 1: one turn of 4 tokens
    ep0 = Sample(0, 0, prompt, [10, 11, 20, 21, 22, 12, 13, 14], torch.tensor([-1.0, -2.0, 0, 0, 0, -1.5, -0.5, -3.0]),
                 "stop", observation_spans=[(2, 5)])
    ep1 = Sample(0, 1, prompt, [15, 16, 17, 18], torch.tensor([-0.2, -0.4, -0.6, -0.8]), "stop")
    batch = build_batch([prompt, prompt], [ep0.token_ids, ep1.token_ids], [ep0.logprobs, ep1.logprobs],
                        [False, False], pad_id=0, model_masks=[ep0.model_mask(), ep1.model_mask()])
    assert batch.mask.tolist() == [[1, 1, 0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0]]
    assert torch.equal(batch.sampled, batch.mask)
    with torch.no_grad():
        logp, _ = sampled_logprobs(model, batch, 1.0)
    ref = teacher_forced(model, prompt, ep0.token_ids)
    # the second turn's log-probs are read after the observation; the observation's own are never computed
    assert torch.allclose(logp[0, 5:], ref[5:], atol=1e-5) and logp[0, 2:5].abs().sum() == 0.0
    adv, _ = group_advantages(torch.tensor([1.0, 0.0]), 2, "group")  # one reward and advantage per episode
    x = logp.clone().requires_grad_(True)
    loss, _ = policy_loss("grpo", x, logp, adv, batch.mask, epsilon=0.2, epsilon_high=0.2)
    loss.backward()
    a = 0.5 / (2 ** -0.5 + 1e-4)  # (1 - 0.5) / (the group's unbiased std + eps)
    # GRPO at ratio 1: d loss / d logp_t = -A_i / (model tokens of episode i) / episodes, for every model token of
    # every turn; zero on observation tokens
    want = torch.tensor([[-a / 5 / 2] * 2 + [0.0] * 3 + [-a / 5 / 2] * 3, [a / 4 / 2] * 4 + [0.0] * 4])
    assert torch.allclose(x.grad, want, atol=1e-6)
    # mismatch statistics see model tokens only: garbage at observation positions changes nothing
    noisy = batch.rollout_logp.clone()
    noisy[0, 2:5] = -50.0
    assert mismatch_metrics(logp, noisy, batch.sampled) == mismatch_metrics(logp, batch.rollout_logp, batch.sampled)
    assert mismatch_metrics(logp, batch.rollout_logp, batch.sampled)["sampling/k3"] > 0


run_cli = qerl_exit_code


TINY = ["--batch-prompts", "2", "--num-generations", "2", "--lora-rank", "4", "--precision", "fp32",
        "--micro-batch-size", "8", "--seed", "1", "--steps", "1", "--save-steps", "1"]


def rollouts(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "train/rollouts/step_00001.jsonl").read_text().splitlines()]


def last_metrics(run: Path) -> dict:
    return json.loads((run / "train/metrics.jsonl").read_text().splitlines()[-1])


ENV = '''
class TwoSteps:
    """Two model turns of 3 tokens; the reward depends on what the model wrote."""
    turn_tokens = 3

    def reset(self, prompt):
        self.n = 0
        return " [start]"

    def step(self, action):
        self.n += 1
        return " ok.", self.n >= 2, (len(action) % 5) / 4
'''


def test_train_with_a_user_environment_end_to_end(tiny_run: Path, tmp_path: Path) -> None:
    env = tmp_path / "two_steps.py"
    env.write_text(ENV)
    assert run_cli("train", "--run", str(tiny_run), "--env", f"{env}:TwoSteps", "--max-completion-length", "16",
                   *TINY) == 0
    m = last_metrics(tiny_run)
    assert m["episodes/turns_mean"] == 2.0 and m["episodes/steps_mean"] == 2.0 and m["episodes/tool_errors"] == 0
    lines = rollouts(tiny_run)
    assert len(lines) == 4
    for line in lines:
        first, second = line["turns"]
        assert first["observation"] == " ok." and first["done"] is False and second["done"] is True
        want = (len(first["action"]) % 5) / 4 + (len(second["action"]) % 5) / 4
        assert line["reward"] == pytest.approx(want)  # the sum of the environment's step rewards
    assert (tiny_run / "train/checkpoints/step_1").is_dir()
    from qerl_cli.report import build_report

    report = build_report(tiny_run)  # the report shows turns per episode and tool errors, and plots them
    numbers = report["numbers"]
    assert numbers["train/episodes/turns_mean"] == 2.0 and numbers["train/episodes/tool_errors"] == 0
    assert "train_episodes" in report["plots"] and "last turns per episode" in report["html"].read_text()


def test_train_and_eval_arith_with_the_calculator(tiny_run: Path) -> None:
    assert run_cli("train", "--run", str(tiny_run), "--task", "arith", "--task-level", "1", "--tools", "calculator",
                   "--max-completion-length", "12", *TINY) == 0
    m = last_metrics(tiny_run)
    assert "episodes/turns_mean" in m and all("turns" in line for line in rollouts(tiny_run))
    assert "<calc>2 + 3</calc> <result>5</result> 5" in rollouts(tiny_run)[0]["prompt"]
    assert run_cli("eval", "arith", "--run", str(tiny_run), "--tools", "calculator", "--limit", "2",
                   "--max-tokens", "10") == 0
    result = json.loads((tiny_run / "eval/arith-step_1-calculator-limit2-max10.json").read_text())
    assert result["protocol"]["episodes"]["kind"] == "calculator" and result["episodes"]["turns_mean"] >= 1.0
    assert result["scores"]["arith"]["accuracy"]["n"] == 2


def test_train_gsm8k_with_the_python_tool(tiny_run: Path) -> None:
    assert run_cli("train", "--run", str(tiny_run), "--task", "gsm8k", "--tools", "python",
                   "--max-completion-length", "8", "--max-prompt-length", "400", *TINY) == 0
    line = rollouts(tiny_run)[0]
    assert "```python block" in line["prompt"] and line["turns"][0]["text"]


def test_bad_episode_options_are_refused(tiny_run: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "noenv.py").write_text("class Env:\n    def reset(self, prompt):\n        return ''\n")
    for args, message in [(["--tools", "bash"], "--tools must be one of python, calculator"),
                          (["--tools", "python", "--env", "x:Y"], "--tools and --env both given"),
                          (["--env", f"{tmp_path / 'noenv.py'}:Env"], "has no step method"),
                          (["--task", "arith", "--tools", "python"], "use --tools calculator")]:
        capsys.readouterr()
        assert run_cli("train", "--run", str(tiny_run), *args, *TINY) == 2
        assert message in capsys.readouterr().err


def test_bench_rollout_episodes_on_the_tiny_shape(tmp_path: Path) -> None:
    from qerl_cli.bench.rollout import bench_rollout

    res = bench_rollout(shape="tiny", formats=("bf16",), batches=(3,), prompt_len=4, new_tokens=8, lora_rank=4,
                        out_dir=tmp_path, log=lambda m: None, episodes=2, tool_latency_ms=5.0, observation_tokens=3)
    (cell,) = res["results"]
    ep = cell["episodes"]
    assert cell["status"] == "ok" and ep["turns_mean"] == 2.0 and ep["turn_tokens"] == 4
    assert ep["single_turn_e2e_tok_s"] > 0 and ep["loss_pct"] == pytest.approx(
        100 * (1 - ep["episode_e2e_tok_s"] / ep["single_turn_e2e_tok_s"]))
    assert cell["tokens"] == 3 * 8  # model tokens only

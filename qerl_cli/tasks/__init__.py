"""Tasks: datasets (GSM8K, MATH-500, arith, jsonl), prompts, answer extraction and rewards."""

from qerl_cli.tasks.datasets import Example, Task, load_task
from qerl_cli.tasks.rewards import get_reward, safe_rewards

__all__ = ["Example", "Task", "get_reward", "load_task", "safe_rewards"]

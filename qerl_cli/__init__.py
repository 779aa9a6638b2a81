"""qerl: reinforcement learning of LLMs on low-bit weights."""

__version__ = "0.1.0"

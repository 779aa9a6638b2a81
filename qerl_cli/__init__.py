"""qerl: reinforcement learning of LLMs on low-bit weights."""

import logging as _logging

__version__ = "0.1.0"

# bitsandbytes (imported by peft when installed) warns on every CPU start that it cannot fetch an optional
# kernel from a hub; qerl never uses that kernel, so the warning is only noise in qerl's output.
_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)

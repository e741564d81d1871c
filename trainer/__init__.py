"""trainer package."""

import os

PARENT_AT_START = os.getppid()
"""This process's parent when the package was first imported: for ``python -m trainer`` under
torchrun, its agent, read before anything else loads (trainer/agent_death.py)."""

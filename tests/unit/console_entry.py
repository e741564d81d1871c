"""``python -m tests.unit.console_entry MODULE:FUNC PROG ARGS...``: calls ``FUNC`` as the
console script ``PROG`` that pyproject.toml installs for it would (``sys.argv[0]`` is
``PROG``); tests/unit/launch/test_help.py runs every console script through it."""

import importlib
import sys

if __name__ == "__main__":
    target, prog, *args = sys.argv[1:]
    module, func = target.split(":")
    sys.argv = [prog, *args]
    getattr(importlib.import_module(module), func)()

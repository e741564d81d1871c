"""``python -m env_server.verifiers ENV_ID [flags]`` from any interpreter: makes sure the
verifiers venv exists (``venv.py``, built once under a file lock), then replaces this process
with the same command in that venv, which runs the service (``run.py``; same PID, so a
parent-death request or a launcher's stop by PID still reaches it). ``--help`` and config
errors answer here, fast."""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> None:
    from env_server.verifiers.config import parse_config
    from env_server.verifiers.venv import ensure_venv, venv_environ

    args = list(sys.argv[1:] if argv is None else argv)
    parse_config(args)  # fail fast, before the venv is built
    py = ensure_venv()
    if os.path.realpath(sys.prefix) == os.path.realpath(py.parent.parent):
        from env_server.verifiers.run import main as run

        run(args)
        return
    os.execve(str(py), [str(py), "-m", "env_server.verifiers", *args], venv_environ())


if __name__ == "__main__":
    main()

"""Process helpers shared by the launcher, the tests and the benchmarks.

Every process we start is started in its own process group and stopped by the PID we got
back from ``Popen`` -- never by pattern (``pkill -f`` would hit a neighbour's run). It also
dies with the process that started it, however that one dies (SIGKILL included): a
parent-death signal and a reaper that stops its process group (``launch.lifeline``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from launch.lifeline import die_with_parent, lifeline, signal_group

if TYPE_CHECKING:
    from launch.forked import ForkedPopen

REPO_ROOT = Path(__file__).resolve().parent.parent


def tail(path: Path | str, n: int = 40) -> str:
    """Last ``n`` lines of a log file ('' if it does not exist)."""
    p = Path(path)
    if not p.exists():
        return ""
    lines = p.read_text(errors="replace").splitlines()
    return "\n".join(lines[-n:])


class ManagedProcess:
    """A child process with its own log file, stopped by its PID (process group), that dies
    with us (``launch.lifeline``)."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path | str,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
        forked: bool | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.env = dict(os.environ if env is None else env)
        self.cwd = str(cwd or REPO_ROOT)
        self.forked = forked
        """``python -m`` forked from a template that imported vLLM once (``launch.forked``);
        None: as the starting process's ``launch.forked.forking`` says (default: plainly)."""
        self.popen: subprocess.Popen[bytes] | ForkedPopen | None = None

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"{self.name} was not started"
        return self.popen.pid

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        from launch.forked import fork_module, forks

        if forks(self.argv, self.forked):  # own session, parent-death signal: launch.forked
            self.popen = fork_module(self.argv, self.env, self.cwd, self.log_path)
        else:
            log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
            try:
                self.popen = subprocess.Popen(
                    self.argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    cwd=self.cwd,
                    start_new_session=True,  # own process group: stop() reaches its children
                    preexec_fn=die_with_parent(),  # SIGKILL when we die (the direct child only)
                )
            finally:
                log.close()
        # If we die, the reaper stops the whole group (vLLM's engine core, workers, ...).
        lifeline().register(self.popen.pid, self.name, self.log_path)
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (and SIGCONT) the process group, wait, then SIGKILL. Returns the exit
        code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            signal_group(self.popen.pid, signal.SIGTERM)
            # A stopped process (SIGSTOP: a frozen server) holds its SIGTERM until woken:
            # wake it, so it shuts down on the SIGTERM rather than on the SIGKILL below.
            signal_group(self.popen.pid, signal.SIGCONT)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                signal_group(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=timeout)
        # The leader exited; children it left in the group (an engine core that outlived
        # its shutdown) may still run.
        signal_group(self.popen.pid, signal.SIGKILL)
        lifeline().unregister(self.popen.pid)
        return self.popen.returncode

    def kill9(self) -> None:
        """Hard kill (fault-injection tests)."""
        if self.popen is not None and self.popen.poll() is None:
            signal_group(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=30)
            lifeline().unregister(self.popen.pid)

    def wait_exit(self, stall: float = 600.0, limit: float = 3600.0) -> int:
        """Wait until the process exits and return its exit code. A busy machine makes this
        slower, not a failure: it gives up (``TimeoutError`` naming the log, with its tail)
        only when the log has not grown for ``stall`` seconds, or after ``limit`` in all."""
        assert self.popen is not None, f"{self.name} was not started"
        start = last_change = time.monotonic()
        size = -1
        while self.popen.poll() is None:
            now = time.monotonic()
            current = self.log_path.stat().st_size if self.log_path.exists() else 0
            if current != size:
                size, last_change = current, now
            if now - last_change > stall or now - start > limit:
                why = f"its log did not grow for {stall:.0f} s"
                if now - start > limit:
                    why = f"it ran past {limit:.0f} s"
                raise TimeoutError(
                    f"{self.name} is stuck ({why}); read {self.log_path}:\n{tail(self.log_path)}"
                )
            time.sleep(0.5)
        return int(self.popen.returncode)

    def run_to_exit(self, stall: float = 600.0, limit: float = 3600.0) -> int:
        """Start, wait for the exit (:meth:`wait_exit`'s ``stall`` and ``limit``) and stop the
        process group whatever happens (a timeout or an interrupt leaves nothing behind); the
        exit code."""
        self.start()
        try:
            return self.wait_exit(stall=stall, limit=limit)
        finally:
            self.stop()

    def wait_http(
        self,
        url: str,
        timeout: float = 300.0,
        interval: float = 0.5,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Wait until ``url`` answers 200, failing early (with the log tail) if we die.

        Polled under the project's retry policy (``api.retry``), backing off to ``interval``
        seconds between tries; the tries are logged at DEBUG (a start takes minutes).
        ``headers`` go with every try (a bearer token: never in the URL, which errors print)."""
        from api.retry import RetryPolicy, retry_call

        def answered() -> None:
            if not self.alive():
                raise RuntimeError(
                    f"{self.name} exited with {self.popen.returncode if self.popen else '?'} "
                    f"before {url} answered; read {self.log_path}:\n{tail(self.log_path)}"
                )
            r = client.get(url)
            if r.status_code != 200:
                raise httpx.HTTPStatusError(f"HTTP {r.status_code}", request=r.request, response=r)

        def not_yet(e: BaseException) -> bool:
            return isinstance(e, httpx.HTTPError)

        policy = RetryPolicy(deadline_s=timeout, base_s=min(0.1, interval), cap_s=interval)
        # one client for every try: each new one builds a TLS context (~35 ms CPU with a
        # system CA bundle), and a start is polled ~50 times
        with httpx.Client(headers=headers, timeout=5.0) as client:
            try:
                retry_call(answered, f"{self.name}: {url}", not_yet, policy, level=logging.DEBUG)
            except httpx.HTTPError as e:
                raise TimeoutError(
                    f"{self.name} did not answer {url} within {timeout:.0f}s ({e!r}); "
                    f"read {self.log_path}:\n{tail(self.log_path)}"
                ) from e

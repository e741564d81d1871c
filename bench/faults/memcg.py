"""A memory cgroup with a limit, to have the kernel's OOM killer kill a process for real (the
OOM tests, docs/FAULT_TOLERANCE.md "An OOM-killed trainer").

``MemoryCgroup(name, limit_bytes)`` creates a child of this process's own memory cgroup
(cgroup v1's ``memory`` controller, else v2 where the parent delegates ``memory``), sets the
limit, and ``add(pid)`` moves a running process into it: its later allocations count against
the limit, and past it the kernel OOM-kills it ("Memory cgroup out of memory: Killed process
..."). Leaving the ``with`` block kills what is still inside and removes the cgroup.
``MemoryCgroup.available()`` says whether this process may do that (root, a writable cgroup
filesystem); where it may not, the tests say so and fall back to a plain SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from launch.exits import memory_cgroup


class MemoryCgroup:
    def __init__(self, name: str, limit_bytes: int) -> None:
        parent = memory_cgroup(os.getpid())
        self.parent = parent
        self.path = None if parent is None else parent / name
        self.limit_bytes = int(limit_bytes)

    @staticmethod
    def available() -> bool:
        try:
            with MemoryCgroup(f"probe-{os.getpid()}", 64 << 20):
                return True
        except OSError:
            return False

    @property
    def v1(self) -> bool:
        return self.path is not None and (self.path.parent / "memory.limit_in_bytes").exists()

    def __enter__(self) -> MemoryCgroup:
        if self.path is None:
            raise OSError("no memory cgroup found for this process")
        self.path.mkdir()
        try:
            if self.v1:
                (self.path / "memory.limit_in_bytes").write_text(str(self.limit_bytes))
                with contextlib.suppress(OSError):  # only with swap accounting
                    (self.path / "memory.memsw.limit_in_bytes").write_text(str(self.limit_bytes))
            else:
                (self.path / "memory.max").write_text(str(self.limit_bytes))
                with contextlib.suppress(OSError):
                    (self.path / "memory.swap.max").write_text("0")
        except OSError:
            self.path.rmdir()
            raise
        return self

    def add(self, pid: int) -> None:
        assert self.path is not None
        (self.path / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        assert self.path is not None
        text = (self.path / "cgroup.procs").read_text()
        return [int(x) for x in text.split()]

    def __exit__(self, *exc: object) -> None:
        if self.path is None or not self.path.exists():
            return
        for _ in range(100):
            left = self.pids()
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if not left:
                with contextlib.suppress(OSError):
                    self.path.rmdir()
                    return
            time.sleep(0.1)
        self.path.rmdir()  # raises, naming the cgroup that could not be removed

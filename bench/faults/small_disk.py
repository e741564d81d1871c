"""A disk that fills up on purpose, for the full-disk tests and the soak (docs/FAULT_TOLERANCE.md).

``SmallDisk(path, size)`` mounts a tmpfs of ``size`` bytes at ``path`` (root or
CAP_SYS_ADMIN needed; ``SmallDisk.can_mount()`` says whether this process may), ``fill()``
writes a filler file until only ``leave`` bytes are free, ``release()`` deletes it (the space
returns), and leaving the ``with`` block unmounts, also when the test failed (lazily, if a
process still holds a file there). Where mounting is not permitted (or ``SHOP_R1_NO_MOUNT=1``), ``limit_file_size`` is
the fallback: ``RLIMIT_FSIZE`` set on a running process (``prlimit``), so that its next write
past that size fails (``EFBIG``, "File too large") as a full disk would.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

CHUNK = 1 << 20
NO_MOUNT_ENV = "SHOP_R1_NO_MOUNT"


class SmallDisk:
    """A tmpfs of ``size_bytes`` at ``path``: ``with SmallDisk(p, 64 << 20) as disk: ...``."""

    def __init__(self, path: Path | str, size_bytes: int) -> None:
        self.path = Path(path)
        self.size_bytes = int(size_bytes)
        self.filler = self.path / ".filler"
        self.mounted = False

    @staticmethod
    def can_mount() -> bool:
        """Whether this process may mount a tmpfs (tries a 1 MB one and unmounts it);
        ``SHOP_R1_NO_MOUNT=1`` says no, to run the fallback where mounting works."""
        if os.environ.get(NO_MOUNT_ENV) == "1":
            return False
        if not shutil.which("mount") or not shutil.which("umount"):
            return False
        with tempfile.TemporaryDirectory(prefix="smalldisk-probe-") as d:
            ok = _run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", d]) == 0
            if ok:
                _run(["umount", d])
            return ok

    def __enter__(self) -> SmallDisk:
        self.path.mkdir(parents=True, exist_ok=True)
        opts = f"size={self.size_bytes},mode=0755"
        rc = _run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(self.path)])
        if rc != 0:
            raise PermissionError(f"cannot mount a tmpfs at {self.path} (mount exited {rc})")
        self.mounted = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.unmount()

    def unmount(self) -> None:
        """Unmount (retried while a process that is being stopped still holds a file)."""
        if not self.mounted:
            return
        for _ in range(20):
            if _run(["umount", str(self.path)]) == 0:
                self.mounted = False
                return
            time.sleep(0.5)
        _run(["umount", "-l", str(self.path)])  # detached now, freed when the last file closes
        self.mounted = False

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def fill(self, leave: int = 0) -> int:
        """Grow the filler until at most ``leave`` bytes are free (0: write until ENOSPC);
        returns the bytes free after."""
        with open(self.filler, "ab") as f:
            while (free := self.free_bytes()) > leave:
                n = min(CHUNK, max(free - leave, 1))
                try:
                    f.write(b"\0" * n)
                    f.flush()
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
        return self.free_bytes()

    def release(self) -> int:
        """Delete the filler: the space is back. Returns the bytes free after."""
        with contextlib.suppress(FileNotFoundError):
            self.filler.unlink()
        return self.free_bytes()


def limit_file_size(pid: int, max_bytes: int | None) -> None:
    """``RLIMIT_FSIZE`` of the running process ``pid`` (``None``: unlimited): its writes past
    ``max_bytes`` in any file fail with ``EFBIG`` (Python ignores the ``SIGXFSZ`` that comes
    with it, so the process lives and sees the error). Only the soft limit moves: the hard one
    stays, so the limit can be lifted again without privileges."""
    _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    value = hard if max_bytes is None else int(max_bytes)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (value, hard))


def _run(argv: list[str]) -> int:
    return subprocess.run(argv, capture_output=True, timeout=60).returncode

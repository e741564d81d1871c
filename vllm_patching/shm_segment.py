"""The shared-memory side of the bridge's data plane: a POSIX shared-memory segment in
/dev/shm that the trainer writes and same-host workers map, the nonce handshake that proves a
worker shares it, and the clean-up of segments whose owner died (docs/BRIDGE.md).

Pure torch, no vLLM import: the trainer imports this module too.
"""

from __future__ import annotations

import mmap
import os
import secrets
import uuid

import torch

SHM_DIR = "/dev/shm"
SHM_PREFIX = "shop_r1_bridge_"
"""Segment names the shared-memory engine accepts (never an arbitrary path)."""


NONCE_BYTES = 16


def write_nonce(segment: ShmSegment) -> str:
    """Write a fresh random nonce at the start of ``segment`` (trainer, before init).

    A worker that reads the same nonce through its own mapping of the segment name is
    proven to share this machine's /dev/shm (same host, same IPC namespace): the broadcast
    can skip the network for it. The packed weights overwrite the nonce later; the
    handshake only happens at init, before the first pack.
    """
    nonce = secrets.token_bytes(NONCE_BYTES)
    segment.buffer[:NONCE_BYTES].copy_(torch.frombuffer(bytearray(nonce), dtype=torch.uint8))
    return nonce.hex()


def shm_handshake(name: str, size: int, nonce_hex: str) -> ShmSegment | None:
    """Map the trainer's segment and check its nonce; None if this worker cannot see it.

    Any failure (no such file: another host or IPC namespace; wrong size; wrong nonce: a
    different segment with the same name) means "use the network"; only a bad name, which
    only a broken or malicious request sends, is an error.
    """
    check_segment_name(name)
    try:
        seg = ShmSegment(name, size, create=False)
    except (OSError, ValueError):
        return None
    if bytes(seg.buffer[:NONCE_BYTES].tolist()) != bytes.fromhex(nonce_hex):
        seg.close()
        return None
    return seg


def new_segment_name() -> str:
    """A fresh trainer-owned segment name that records the owner's PID.

    A trainer killed with SIGKILL cannot unlink its segment; the PID in the name lets the next
    trainer on this host remove segments whose owner is gone (:func:`sweep_stale_segments`).
    """
    return f"{SHM_PREFIX}{os.getpid()}_{uuid.uuid4().hex}"


def sweep_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink our segments whose owning process no longer exists; returns the removed names.

    Only names of the form ``<prefix><pid>_<hex>`` are touched (older unnamed-owner segments
    are left alone), and a PID that exists but belongs to someone else counts as alive.
    """
    removed = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(SHM_PREFIX):
            continue
        pid_part, sep, _ = name[len(SHM_PREFIX) :].partition("_")
        if not sep or not pid_part.isdigit() or _pid_alive(int(pid_part)):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_segment_name(name: str) -> str:
    """Accept only our own flat segment names (no path tricks from an HTTP body)."""
    if not name.startswith(SHM_PREFIX) or "/" in name or not name.replace("_", "").isalnum():
        raise ValueError(f"bad shared-memory segment name {name!r}")
    return name


class ShmSegment:
    """A POSIX shared-memory file in /dev/shm mapped into this process.

    The trainer creates it (``create=True``) and unlinks it on close; a worker maps the
    same name read-only and builds tensor views straight on the mapping, so the bytes the
    trainer wrote are read in place: no second transfer copy.
    """

    def __init__(self, name: str, size: int, create: bool) -> None:
        self.name = check_segment_name(name)
        self.path = os.path.join(SHM_DIR, self.name)
        self.size = size
        self.owner = create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                self._reserve(fd, size)
            elif os.fstat(fd).st_size < size:
                raise ValueError(f"segment {name} is smaller than {size} bytes")
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.buffer = torch.frombuffer(self._mmap, dtype=torch.uint8)

    def _reserve(self, fd: int, size: int) -> None:
        try:
            os.ftruncate(fd, size)
            # Reserve the pages now: a /dev/shm too small for the model fails here with
            # ENOSPC instead of a SIGBUS at the first write into a sparse page.
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            os.unlink(self.path)
            raise OSError(e.errno, f"cannot reserve {size} bytes in {SHM_DIR}: {e.strerror}") from e

    def close(self) -> None:
        # Drop the tensor view first: mmap.close() fails while a buffer export is alive.
        self.buffer = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still referenced elsewhere; the mapping goes with it
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

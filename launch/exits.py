"""Why a supervised process ended, in words the user can act on (docs/FAULT_TOLERANCE.md,
"An OOM-killed trainer"): was it the kernel's OOM killer, what memory it had, what the limit
was, and how to continue the run.

While a process runs, ``MemoryWatch.sample`` (called by the launcher about once a second)
notes every process of its tree: its peak resident memory (``VmHWM``), its memory cgroup and
that cgroup's OOM-kill count. When it has died, ``explain`` looks for the evidence:

- the exit status: ``-9`` (SIGKILL, what the OOM killer sends), or under torchrun a rank's
  ``exitcode: -9`` in the log;
- the kernel's own message, ``... out of memory: Killed process <pid> (...) total-vm:...,
  anon-rss:...``, for a PID of its tree (``/dev/kmsg``, else ``dmesg``, else ``journalctl -k``;
  when none is readable, it says so and how to look);
- the cgroup's OOM-kill count (cgroup v2 ``memory.events``, v1 ``memory.oom_control``) gone
  up since the process was first seen, with the cgroup's limit and peak;
- the machine's memory (``/proc/meminfo``).

A trainer that stopped because a checkpoint could not be written (exit 74, a full disk), or
because a weight sync's phase missed its deadline (exit 75, an inference server that hangs),
is named as such, with its own ``STOPPED:`` line.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from launch.lifeline import descendants, proc_info

EXIT_CHECKPOINT_WRITE = 74
"""The trainer's exit status when a checkpoint could not be written (trainer/__main__.py)."""
EXIT_SYNC_TIMEOUT = 75
"""The trainer's exit status when a weight sync's phase missed its deadline (an inference
server that hangs; trainer/__main__.py, docs/FAULT_TOLERANCE.md)."""
KILLED = re.compile(r"(?:Out of memory|Memory cgroup out of memory): Killed process (\d+)")
OOM_LINE = re.compile(r"oom-kill:.*\bpid=(\d+)")
MEMCG = re.compile(r"\boom_memcg=([^,\s]+)")
KB = re.compile(r"(total-vm|anon-rss|file-rss|shmem-rss):(\d+)kB")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _kb(status: str, key: str) -> int:
    """A ``/proc/<pid>/status`` figure in bytes (0 if absent)."""
    m = re.search(rf"^{key}:\s+(\d+) kB", status, re.M)
    return int(m.group(1)) * 1024 if m else 0


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def memory_cgroup(pid: int) -> Path | None:
    """The directory of ``pid``'s memory cgroup (v1 ``memory`` controller, else v2)."""
    text = _read(Path(f"/proc/{pid}/cgroup"))
    if text is None:
        return None
    v1 = v2 = None
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            v1 = path
        elif controllers == "":
            v2 = path
    return (cgroup_dir(v1) if v1 is not None else None) or (
        cgroup_dir(v2) if v2 is not None else None
    )


def cgroup_dir(rel: str) -> Path | None:
    """The directory of memory cgroup ``rel`` (a path as /proc/<pid>/cgroup and the kernel
    write it), under cgroup v1's memory controller or v2."""
    for root in ("/sys/fs/cgroup/memory", "/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        d = Path(root + rel.rstrip("/"))
        if (d / "memory.events").exists() or (d / "memory.oom_control").exists():
            return d
    return None


def oom_kills(cgroup: Path) -> int | None:
    """The cgroup's count of processes the OOM killer killed (None: unknown)."""
    for name in ("memory.events", "memory.oom_control"):
        text = _read(cgroup / name)
        if text and (m := re.search(r"^oom_kill (\d+)", text, re.M)):
            return int(m.group(1))
    return None


def cgroup_limits(cgroup: Path) -> tuple[int | None, int | None]:
    """(limit, peak usage) in bytes of a memory cgroup; None where unlimited or unknown."""
    values = []
    for names in (
        ("memory.max", "memory.limit_in_bytes"),
        ("memory.peak", "memory.max_usage_in_bytes"),
    ):
        value = None
        for name in names:
            text = (_read(cgroup / name) or "").strip()
            if text.isdigit() and int(text) < 2**60:  # v1 says "unlimited" with a huge number
                value = int(text)
                break
        values.append(value)
    return values[0], values[1]


@dataclass
class _Seen:
    starttime: int
    peak_rss: int = 0
    rss: int = 0
    cgroup: Path | None = None
    oom_before: int | None = None


@dataclass
class MemoryWatch:
    """What ``explain`` needs to know of a process tree once it is gone (see the module
    docstring); ``sample`` it while it runs."""

    root: int
    seen: dict[int, _Seen] = field(default_factory=dict)
    peak_tree_rss: int = 0

    def sample(self) -> None:
        pids = [self.root] + [p.pid for p in descendants(self.root)]
        total = 0
        for pid in pids:
            info = proc_info(pid)
            if info is None or info.state in ("Z", "X"):
                continue
            s = self.seen.get(pid)
            if s is None or s.starttime != info.starttime:
                s = self.seen[pid] = _Seen(info.starttime)
            status = _read(Path(f"/proc/{pid}/status")) or ""
            s.peak_rss = max(s.peak_rss, _kb(status, "VmHWM"))
            s.rss = _kb(status, "VmRSS")
            cgroup = memory_cgroup(pid)
            if cgroup is not None and cgroup != s.cgroup:
                s.cgroup, s.oom_before = cgroup, oom_kills(cgroup)
            total += s.rss
        self.peak_tree_rss = max(self.peak_tree_rss, total)


def kernel_log() -> tuple[list[tuple[float, str]], str]:
    """The kernel's log as (seconds since boot, message), and where it came from (or why it
    could not be read)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        why = f"/dev/kmsg: {e.strerror}"
    else:
        out = []
        try:
            while True:
                try:
                    rec = os.read(fd, 8192).decode(errors="replace")
                except BlockingIOError:
                    break
                except BrokenPipeError:  # records overwritten while we read: go on
                    continue
                head, _, msg = rec.partition(";")
                fields = head.split(",")
                if len(fields) >= 3 and fields[2].isdigit():
                    out.append((int(fields[2]) / 1e6, msg.split("\n", 1)[0]))
        finally:
            os.close(fd)
        return out, "/dev/kmsg"
    for argv in (["dmesg"], ["journalctl", "-k", "-q", "--no-pager", "-o", "short-monotonic"]):
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError) as e:
            why += f"; {argv[0]}: {e}"
            continue
        lines = [
            (float(m.group(1)), m.group(2))
            for line in r.stdout.splitlines()
            if (m := re.match(r"\[\s*(\d+\.\d+)\]\s*(?:\S+ kernel: )?(.*)", line))
        ]
        if r.returncode == 0 and lines:
            return lines, argv[0]
        why += f"; {argv[0]}: {(r.stderr.strip() or 'nothing read')[:120]}"
    return [], why


def _oom_evidence(watch: MemoryWatch) -> tuple[list[str], str, list[str]]:
    """Kernel lines about OOM kills of the tree's processes, the log's source, and the
    cgroups whose OOM-kill count went up since first seen."""
    records, source = kernel_log()
    lines = []
    for t, msg in records:
        m = KILLED.search(msg) or OOM_LINE.search(msg)
        if m is None or (s := watch.seen.get(int(m.group(1)))) is None:
            continue
        if t + 5 >= s.starttime / CLK_TCK:  # not an older process that had the same PID
            lines.append(msg.strip())
    grew = []
    for cg in {s.cgroup for s in watch.seen.values() if s.cgroup is not None}:
        before = min(
            (
                s.oom_before
                for s in watch.seen.values()
                if s.cgroup == cg and s.oom_before is not None
            ),
            default=None,
        )
        now = oom_kills(cg)
        if before is not None and now is not None and now > before:
            grew.append(f"{cg} (oom_kill {before} -> {now})")
    return lines, source, grew


def _meminfo() -> str:
    text = _read(Path("/proc/meminfo")) or ""
    kb = {
        k: int(v) * 1024 for k, v in re.findall(r"^(MemTotal|MemAvailable):\s+(\d+) kB", text, re.M)
    }
    if not kb:
        return ""
    return f"this machine has {gib(kb.get('MemTotal', 0))}, {gib(kb.get('MemAvailable', 0))} available now"


def explain(name: str, returncode: int | None, log: Path, watch: MemoryWatch | None) -> str:
    """Why ``name`` ended (several lines; '' when there is nothing to add to its exit status
    and log tail). Looks for an OOM kill whatever the status: under torchrun a rank's kill
    shows as the launcher's exit 1."""
    text = _read(log) or ""
    if returncode == EXIT_CHECKPOINT_WRITE or "STOPPED: checkpoint" in text:
        stop = [line for line in text.splitlines() if "STOPPED: checkpoint" in line]
        if stop:
            return (
                f"{name} stopped because a checkpoint could not be written:\n  {stop[-1].strip()}"
            )
    if returncode == EXIT_SYNC_TIMEOUT or "STOPPED: weight sync" in text:
        stop = [line for line in text.splitlines() if "STOPPED: weight sync" in line]
        if stop:
            return (
                f"{name} stopped because an inference server did not answer a weight sync "
                f"in time:\n  {stop[-1].strip()}\n  the launcher stops the run (the server "
                "may be frozen or overloaded: read its log); every acked batch is in a "
                "checkpoint, so --resume continues without losing or retraining one."
            )
    sigkill = returncode == -9 or bool(re.search(r"exitcode\s*:\s*-9|Signal 9 \(SIGKILL\)", text))
    if watch is None or not (sigkill or returncode):
        return ""
    lines, source, grew = _oom_evidence(watch)
    peak = max(watch.seen.values(), key=lambda s: s.peak_rss, default=None)
    figures = []
    if peak is not None and peak.peak_rss:
        figures.append(f"its resident memory peaked at {gib(peak.peak_rss)}")
        if len(watch.seen) > 1:
            figures.append(
                f"{gib(watch.peak_tree_rss)} for its {len(watch.seen)} processes together"
            )
    cgroups = {s.cgroup for s in watch.seen.values() if s.cgroup is not None}
    for line in lines:  # the cgroup whose limit was hit, as the kernel names it
        if (m := MEMCG.search(line)) and (d := cgroup_dir(m.group(1))) is not None:
            cgroups.add(d)
    for cg in sorted(cgroups):
        limit, top = cgroup_limits(cg)
        if limit is not None:
            at = f", peak {gib(top)}" if top else ""
            figures.append(f"its memory cgroup {cg} allows {gib(limit)}{at}")
    for line in lines:
        kb = dict(KB.findall(line))
        if kb:
            shown = ", ".join(f"{k} {gib(int(v) * 1024)}" for k, v in kb.items())
            figures.append(f"when killed: {shown}")
    if info := _meminfo():
        figures.append(info)
    memory = f"  memory: {'; '.join(figures)}." if figures else ""
    if lines or grew:
        head = f"{name} was killed by the kernel's OOM killer (out of memory)"
        evidence = [f"  kernel ({source}): {line}" for line in lines[-2:]]
        evidence += [f"  cgroup: OOM kills counted in {g}" for g in grew]
        advice = (
            "  what to do: free memory on this machine (other jobs use it), or make the "
            "trainer hold less: --trainer-args='--micro-batch-tokens 4096' (smaller "
            "forward/backward passes), a smaller --batch-size, fewer vLLM servers or a smaller "
            "VLLM_CPU_KVCACHE_SPACE on the same machine."
        )
        return "\n".join([head + ".", *evidence, memory, advice]).replace("\n\n", "\n")
    if not sigkill:
        return ""
    if source.startswith("/dev/kmsg") or source in ("dmesg", "journalctl"):
        why = (
            f"{name} was killed by SIGKILL, but the kernel log ({source}) shows no OOM kill of "
            "its processes: something else killed it (a user, a job scheduler, a time limit)."
        )
    else:
        why = (
            f"{name} was killed by SIGKILL, which is what the kernel's OOM killer sends; the "
            f"kernel log is not readable here ({source}) to confirm it: "
            "`sudo dmesg | grep -i 'killed process'` shows it."
        )
    return "\n".join([why, memory]).rstrip()

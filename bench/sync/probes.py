"""What ``bench/sync/bridge_sync.py`` measures around each sync, besides the bridge's own timings:
the floors (memcpy, the worker's apply), the box (steal time, major faults, freezes) and the
token stream a client sees. Results: docs/results/weight_sync.md, docs/BRIDGE.md.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path


def memcpy_floor(nbytes: int, repeats: int = 7) -> float:
    """Median time of one single-threaded copy of ``nbytes`` between two resident buffers."""
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in first: the floor is the copy, not the mmap
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def steal_s() -> float:
    """CPU time the hypervisor took from this VM so far, all CPUs (``/proc/stat`` steal).

    Recorded around every sync: on a shared cloud VM a multi-second freeze of the whole box
    shows up here, and is not the bridge's doing. 0 where the kernel does not report it.
    """
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def major_faults() -> int:
    """Major page faults so far, whole machine (``/proc/vmstat`` pgmajfault): pages that had
    to be read back from disk. Recorded around every sync -- on a box whose kernel pages out
    cold file pages (this VM runs DAMON's ``pageout`` scheme with no swap: code pages of
    libraries that ran a while ago are dropped), a sync that touches cold code waits for the
    disk, in the trainer and in vLLM's engine loop alike."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("pgmajfault "):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def stream_body(model: str, ids: list[int], n: int) -> dict:
    """An OpenAI completions body: greedy, streamed, exactly ``n`` tokens (EOS ignored), from
    prompt token ``ids``: the request kept in flight through a sync (here and in the bridge
    tests' ``InFlight``)."""
    return {
        "model": model,
        "prompt": ids,
        "max_tokens": n,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }


class FreezeProbe:
    """An idle process that sleeps 10 ms at a time and keeps the longest it overslept inside
    the window opened by the last :meth:`reset`: a freeze of the whole box (every process
    stopped, timers included, as this VM does now and then for seconds without counting it
    as steal time) shows up here at full length, while a busy CPU delays a 10 ms sleep by
    milliseconds. Recorded around every sync, so a stall that the bench sees is told apart
    from one that the bridge or vLLM caused."""

    def __init__(self) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        # [window start (monotonic s), longest oversleep inside the window (s)]
        self._state = ctx.Array("d", [time.monotonic(), 0.0])
        looping = ctx.Event()
        self._proc = ctx.Process(target=_oversleep_loop, args=(self._state, looping), daemon=True)
        self._proc.start()
        # a spawned process takes seconds to start on a busy box: until it loops it sees nothing
        if not looping.wait(120):
            self.close()
            raise RuntimeError("the freeze probe's process did not start within 120 s")

    def reset(self) -> float:
        """Open a new window now; returns its start (monotonic s), the time it counts from."""
        with self._state.get_lock():
            self._state[0], self._state[1] = time.monotonic(), 0.0
            return self._state[0]

    def largest(self) -> float:
        """The longest oversleep since :meth:`reset`, in seconds (the part of a freeze that
        began before the reset does not count)."""
        time.sleep(0.02)  # let the probe wake once more, so a freeze that just ended counts
        return self._state[1]

    def close(self) -> None:
        self._proc.terminate()
        self._proc.join(5)


def _oversleep_loop(state, looping) -> None:
    # measured from the previous wake, not from before the sleep: a stop that lands anywhere in
    # the loop (even between a wake and its update) is inside the next wake's gap
    looping.set()
    woke = time.monotonic()
    while True:
        due = woke + 0.01
        time.sleep(0.01)
        woke = time.monotonic()
        with state.get_lock():
            state[1] = max(state[1], woke - max(due, state[0]))


def _stream_tokens(url: str, body: dict, stop_at, started, out) -> None:
    """Child process of :class:`StreamWatch`: stream, timestamp every token, send the times."""
    import httpx

    times: list[float] = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.perf_counter())
                    started.set()
                    if times[-1] > stop_at.value:
                        break
    except httpx.HTTPError:
        pass  # the server went away (restart mode)
    finally:
        started.set()
    out.send(times)


class StreamWatch:
    """A streaming completion; records token arrival times to measure the stall.

    The client runs in its own process, so that what it measures is the server and not the
    benchmark process (a reader thread there would share the GIL with the sync it times).
    ``time.perf_counter`` is CLOCK_MONOTONIC on Linux, the same clock in both processes.

    It stops reading (closing the stream, so vLLM aborts the request) half a second after
    the sync ended, so a slow model does not keep the benchmark waiting. A stream cut by a
    server restart just ends (no measurement).
    """

    def __init__(self, url: str, model: str, ids: list[int], n: int) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.times: list[float] = []
        self._stop_at = ctx.Value("d", float("inf"))
        self._started = ctx.Event()
        self._recv, send = ctx.Pipe(duplex=False)
        body = stream_body(model, ids, n)
        self.proc = ctx.Process(
            target=_stream_tokens, args=(url, body, self._stop_at, self._started, send), daemon=True
        )
        self.proc.start()
        send.close()

    def wait_streaming(self, timeout: float = 60.0) -> None:
        """Block until the first token arrived (or the stream ended)."""
        self._started.wait(timeout)

    def _collect(self) -> None:
        if self._recv.poll(600):
            try:
                self.times = self._recv.recv()
            except EOFError:
                self.times = []
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()

    def gap_during(self, t0: float, t1: float) -> tuple[float | None, float]:
        """(largest inter-token gap overlapping [t0, t1], median gap overall)."""
        self._stop_at.value = t1 + 0.5
        self._collect()
        gaps = [(b - a, a, b) for a, b in zip(self.times, self.times[1:], strict=False)]
        # Several SSE lines can arrive in one read; the step time is the typical real gap.
        steps = [g for g, _, _ in gaps if g > 5e-4]
        median = statistics.median(steps) if steps else 0.0
        during = [g for g, a, b in gaps if b >= t0 and a <= t1]
        if not during or self.times[0] > t0 or self.times[-1] < t1:
            return None, median  # the stream did not span the sync: no measurement
        return max(during), median


def apply_floor(url: str, token: str, model_dir: Path, repeats: int = 3) -> dict:
    """The worker's apply from an in-memory state dict (the served weights), median."""
    import httpx

    from vllm_patching.protocol import TOKEN_HEADER

    r = httpx.post(
        f"{url}/collective_rpc",
        json={
            "method": "bridge_bench_apply",
            "kwargs": {"path": str(model_dir.resolve()), "repeats": str(repeats)},
        },
        headers={TOKEN_HEADER: token},
        timeout=600,
    )
    r.raise_for_status()
    runs = r.json()["results"][0]
    return {k: statistics.median(run[k] for run in runs) for k in runs[0]} | {"runs": runs}

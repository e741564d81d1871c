"""CUDA transports of the bridge, proven with plain torch (vLLM is not needed).

- CUDA IPC (what ``--single-copy`` uses on GPU, like vLLM's native ``ipc`` engine): a
  trainer process shares a parameter through an IPC handle; a second process maps the same
  device memory, reads it, and writes into it -- the trainer sees the write (one copy).
- NCCL broadcast (vLLM's native ``nccl`` engine, ``shared_vllm`` on GPU) between two
  processes: needs two GPUs; on one GPU NCCL refuses two ranks ("Duplicate GPU detected"),
  which is why same-device transfer uses IPC instead.

Run directly too (no pytest needed): ``python tests/gpu/test_bridge_cuda_transport.py``.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu

IPC_NUMEL = 256 * 1024 * 1024  # 1 GiB of float32: large enough that a copy would show


def _ipc_consumer(handle: bytes, expected_sum: float, conn) -> None:
    """Second process: rebuild the tensor from its IPC handle, check it, write into it."""
    torch.cuda.set_device(0)
    t0 = time.perf_counter()
    rebuild, args = pickle.loads(handle)
    shared = rebuild(*args)
    torch.cuda.synchronize()
    open_s = time.perf_counter() - t0
    free_before, _ = torch.cuda.mem_get_info()
    got = float(shared.sum().item())
    shared[:1024].fill_(7.0)  # visible to the owner if and only if the memory is shared
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    conn.send(
        {
            "sum": got,
            "expected": expected_sum,
            "open_s": open_s,
            "device_ptr": shared.data_ptr(),
            "alloc_delta_bytes": free_before - free_after,
        }
    )
    conn.close()


def run_ipc() -> dict:
    """Share a 1 GiB parameter with another process through a CUDA IPC handle."""
    from torch.multiprocessing.reductions import reduce_tensor

    ctx = mp.get_context("spawn")
    param = torch.nn.Parameter(torch.randn(IPC_NUMEL, device="cuda"), requires_grad=False)
    expected = float(param.sum().item())
    t0 = time.perf_counter()
    handle = pickle.dumps(reduce_tensor(param.data))  # what vLLM's ipc engine ships (b64)
    handle_s = time.perf_counter() - t0
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ipc_consumer, args=(handle, expected, child), daemon=True)
    proc.start()
    if not parent.poll(120):
        raise TimeoutError("IPC consumer did not answer")
    result = parent.recv()
    proc.join(120)
    torch.cuda.synchronize()
    result.update(
        handle_bytes=len(handle),
        handle_s=handle_s,
        tensor_bytes=param.numel() * param.element_size(),
        owner_sees_write=bool((param[:1024] == 7.0).all().item()),
        exitcode=proc.exitcode,
    )
    return result


def _ipc_model_consumer(handles: bytes, conn, rounds: int) -> None:
    """Inference side: open every parameter's handle once, then per sync copy the shared
    tensors into its own weights (what load_weights does) and report the time."""
    torch.cuda.set_device(0)
    shared = [rebuild(*args) for rebuild, args in pickle.loads(handles)]
    own = [torch.empty_like(t) for t in shared]
    times = []
    for _ in range(rounds):
        conn.recv()  # "trainer stepped"
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for dst, src in zip(own, shared, strict=True):
            dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        conn.send(float(sum(float(t.double().sum()) for t in own[:4])))
    conn.send(times)
    conn.close()


def run_ipc_model_sync(hidden: int = 1024, layers: int = 16, rounds: int = 5) -> dict:
    """Single-copy sync of a ~130M-parameter stack through CUDA IPC, vs a device memcpy."""
    from torch.multiprocessing.reductions import reduce_tensor

    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)]
    model = torch.nn.Sequential(*blocks).cuda()
    params = [p.data for p in model.parameters()]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    handles = pickle.dumps([reduce_tensor(p) for p in params])
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ipc_model_consumer, args=(handles, child, rounds), daemon=True)
    proc.start()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, hidden, device="cuda")
    match = True
    for _ in range(rounds):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        parent.send("go")
        if not parent.poll(120):
            raise TimeoutError("IPC consumer did not answer")
        got = parent.recv()
        want = float(sum(float(p.double().sum()) for p in params[:4]))
        match = match and abs(got - want) <= 1e-6 * max(1.0, abs(want))
    times = parent.recv()
    proc.join(60)
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flat_dst = torch.empty_like(flat_src)
    flat_dst.copy_(flat_src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    flat_dst.copy_(flat_src)
    torch.cuda.synchronize()
    memcpy_s = time.perf_counter() - t0
    return {
        "params": sum(p.numel() for p in params),
        "bytes": nbytes,
        "sync_s": times,
        "memcpy_s": memcpy_s,
        "weights_match": match,
        "exitcode": proc.exitcode,
    }


def _nccl_rank(rank: int, world: int, device: int, port: int, numel: int, conn) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(device)
    out: dict = {"rank": rank}
    try:
        dist.init_process_group(
            "nccl", rank=rank, world_size=world, device_id=torch.device("cuda", device)
        )
        t = (
            torch.arange(numel, dtype=torch.float32, device="cuda")
            if rank == 0
            else torch.zeros(numel, device="cuda")
        )
        dist.broadcast(t, src=0)  # warm-up: builds the communicator
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.broadcast(t, src=0)
        torch.cuda.synchronize()
        out.update(ok=True, seconds=time.perf_counter() - t0, check=float(t[-1].item()))
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        out.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
    conn.send(out)
    conn.close()


def run_nccl(
    devices: tuple[int, int], numel: int = 64 * 1024 * 1024, timeout: float = 180
) -> list[dict]:
    """NCCL broadcast from rank 0 to rank 1, each process on the given device."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for rank, dev in enumerate(devices):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_nccl_rank, args=(rank, 2, dev, port, numel, child), daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)
    results = []
    for parent, p in zip(pipes, procs, strict=True):
        if parent.poll(timeout):
            results.append(parent.recv())
        else:
            results.append({"ok": False, "error": "timeout"})
        p.join(10)
        if p.is_alive():
            p.kill()
    return results


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_shares_parameter_between_processes() -> None:
    r = run_ipc()
    assert r["exitcode"] == 0
    assert r["sum"] == pytest.approx(r["expected"], rel=1e-6)
    assert r["owner_sees_write"], "the consumer's write must land in the owner's parameter"
    # One copy: mapping 1 GiB allocates (almost) nothing new in the consumer.
    assert r["alloc_delta_bytes"] < r["tensor_bytes"] // 8
    assert r["handle_bytes"] < 4096


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_model_sync_sees_every_optimizer_step() -> None:
    r = run_ipc_model_sync(hidden=256, layers=2, rounds=3)
    assert r["exitcode"] == 0
    assert r["weights_match"], "the consumer must read the trainer's updated weights"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_refuses_two_ranks_on_one_gpu() -> None:
    results = run_nccl((0, 0), numel=1024, timeout=120)
    assert not all(r.get("ok") for r in results)
    errors = " ".join(r.get("error", "") for r in results)
    assert "Duplicate GPU" in errors or "duplicate" in errors.lower() or "timeout" in errors


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_broadcast_between_two_processes() -> None:
    numel = 64 * 1024 * 1024
    results = run_nccl((0, 1), numel=numel)
    assert all(r.get("ok") for r in results), results
    assert results[1]["check"] == float(numel - 1)


if __name__ == "__main__":
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    report["ipc"] = run_ipc()
    report["ipc_model_sync"] = run_ipc_model_sync()
    report["nccl_same_gpu"] = run_nccl((0, 0), numel=1024, timeout=120)
    if torch.cuda.device_count() >= 2:
        report["nccl_two_gpus"] = run_nccl((0, 1))
    json.dump(report, sys.stdout, indent=2)
    print()

"""Forked gloo ranks for tests and benchmarks: `launch(fn, world, *args)` runs `fn(rank, world, *args)` on
`world` processes (1 torch thread each, gloo over local TCP) and returns their results by rank.

Forking a parent that has already imported torch starts ranks in a fraction of a second; where a GPU is
visible, ranks are spawned instead (a fork inherits CUDA's state and autograd's device threads, which break
in the child). A rank
that raises fails the launch with its traceback; a hang fails it after `timeout` seconds with
every child killed; each rank ends with the clean gloo shutdown (gc, barrier, destroy).
"""

from __future__ import annotations

import gc
import io
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@contextmanager
def rendezvous_port() -> Iterator[int]:
    """The port of a TCPStore server that a helper process holds for the ranks, which connect to it as clients
    (torchrun's agent-store mode). The server binds port 0 itself, so no other process can take the port between
    its choice and its use (a probed "free" port that rank 0 binds later can be: EADDRINUSE). A helper, not this
    process: the server's thread would be forked into every rank, and a child forked while it holds a lock
    can hang in its own store's set-up. Forked even where the ranks are spawned: it touches no CUDA."""
    ctx = mp.get_context("fork")
    ours, theirs = ctx.Pipe()
    helper = ctx.Process(target=_serve_store, args=(theirs,), daemon=True)
    helper.start()
    try:
        if not ours.poll(60):
            raise TimeoutError("the rendezvous store's helper process did not start within 60 s")
        yield ours.recv()
    finally:
        helper.kill()
        helper.join()


def _serve_store(conn: Any) -> None:
    """The helper: serve a store on a port the kernel picks, say which, and live until killed."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    conn.send(store.port)
    while True:
        time.sleep(3600)


def _rank_main(fn: Callable, rank: int, world: int, port: int, q: Any, args: tuple, kwargs: dict,
               init_timeout_s: float) -> None:
    """One forked rank: 1 thread, torchrun-like env, gloo over TCP, `fn(rank, world, *args, **kwargs)`
    serialised with torch.save onto the queue, then the clean shutdown (gc, barrier, destroy)."""
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    ok = False
    try:
        timeout = timedelta(seconds=init_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        buf = io.BytesIO()
        torch.save(fn(rank, world, *args, **kwargs), buf)
        q.put((rank, "ok", buf.getvalue()))
        ok = True
    except BaseException:  # noqa: BLE001  (report everything to the parent, including SystemExit)
        q.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            gc.collect()
            if ok:
                dist.barrier()
            dist.destroy_process_group()
        q.close()
        q.join_thread()  # flush the result through the queue's feeder thread before the hard exit
        os._exit(0)


def start_frozen(procs: list[Any]) -> None:
    """Start `procs` with this process's heap frozen (`gc.freeze`): a forked child's collections — its own and
    the clean shutdown's — then skip the inherited objects instead of touching, and so copying, every page of
    the parent's heap (~0.3 CPU-s per rank forked from a pytest process)."""
    gc.freeze()
    try:
        for proc in procs:
            proc.start()
    finally:
        gc.unfreeze()


def start_method() -> str:
    """fork (fast) unless CUDA is visible: then spawn (`torch.cuda.is_available` initialises no context)."""
    return "spawn" if torch.cuda.is_available() else "fork"


def launch(fn: Callable, world: int, *args: Any, timeout: float = 900.0, init_timeout_s: float = 300.0,
           method: str | None = None, **kwargs: Any) -> list[Any]:
    """Run `fn(rank, world, *args, **kwargs)` on `world` forked gloo ranks; their results by rank.

    `fn` must be importable by name (a module-level function). Raises with the rank's traceback
    when a rank fails, and TimeoutError (every child killed) after `timeout` seconds. `method`: the
    multiprocessing start method (default `start_method()`).
    """
    with rendezvous_port() as port:
        return _run(fn, world, port, args, kwargs, timeout, init_timeout_s, mp.get_context(method or start_method()))


def _run(fn: Callable, world: int, port: int, args: tuple, kwargs: dict, timeout: float, init_timeout_s: float,
         ctx: Any) -> list[Any]:
    """Start the ranks, gather their results, and reap every child whatever happened."""
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, q, args, kwargs, init_timeout_s), daemon=True)
             for r in range(world)]
    start_frozen(procs)
    try:
        return _collect(q, procs, timeout)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _collect(q: Any, procs: list[Any], timeout: float) -> list[Any]:
    """Each rank's result off the queue, by rank; a rank's error, a dead rank or the deadline raise."""
    world, results = len(procs), {}
    deadline = time.monotonic() + timeout
    while len(results) < world:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{world - len(results)} rank(s) did not finish within {timeout:.0f} s")
        try:
            rank, status, payload = q.get(timeout=min(left, 1.0))
        except queue.Empty:
            dead = [proc.exitcode for proc in procs if proc.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a rank process died with exit code {dead[0]}") from None
            continue
        if status == "error":
            raise RuntimeError(f"rank {rank} failed:\n{payload}")
        results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    return [results[r] for r in range(world)]

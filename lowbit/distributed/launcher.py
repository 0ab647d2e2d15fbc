"""Start one process per GPU and run a command on rank 0.

`lowbit generate MODEL PROMPT --tensor-parallel-size N [--expert-parallel-size M]` calls
`run_parallel`: the calling process becomes rank 0 and spawns ranks 1..W-1
(W = lcm(N, M), torch.multiprocessing, spawn). Under torchrun (RANK and WORLD_SIZE already
set, one process per rank, any number of nodes) nothing is spawned: each process takes
its role from the environment.

Rank 0 runs the command; the command's engine gets its model from
lowbit.distributed.loading.engine_model, a DriverModel on rank 0. Every other rank loads
its shard the same way, with the same arguments, reports whether that worked, then follows
rank 0 (lowbit.distributed.driver.worker_loop) until told to stop.

Lifetimes of spawned ranks: a worker ignores SIGINT and SIGTERM (a Ctrl-C or a stop sent to
the whole process group reaches rank 0, which stops the workers once its command is done)
and exits when rank 0 dies. Rank 0 watches the workers: one that exits before it is told
to stop is lost; rank 0 then calls the command's `driver.on_workers_lost` hooks (the
server shuts down, exit 1) and, if it is still alive LOST_GRACE_S later, exits 1.
"""

from __future__ import annotations

import argparse
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import threading
import traceback
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

from lowbit.config import EngineConfig
from lowbit.distributed import driver
from lowbit.distributed import parallel_state as ps
from lowbit.distributed.loading import engine_model
from lowbit.errors import LowbitError

log = logging.getLogger("lowbit")

JOIN_TIMEOUT_S = 60.0
LOST_GRACE_S = 60.0  # after a worker is lost, rank 0 gets this long to stop on its own


def parallel_sizes(args: argparse.Namespace) -> tuple[int, int]:
    return getattr(args, "tensor_parallel_size", 1) or 1, getattr(args, "expert_parallel_size", 1) or 1


def run_parallel(main: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run `main(args)` on rank 0 of a TP x EP world; returns rank 0's exit status."""
    tp, ep = parallel_sizes(args)
    if ps.current_layout() is not None:  # already a rank (a launched command calling this again)
        return main(args)
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return _run_rank(main, args, tp, ep)
    world = ps.ParallelLayout.checked(tp, ep).world
    if getattr(args, "device", None) not in (None, "cpu") and not str(args.device) == "cuda":
        raise LowbitError(f"--device {args.device}: with tensor/expert parallelism rank r uses cuda:r; "
                          "pass --device cuda (or cpu) and pick GPUs with CUDA_VISIBLE_DEVICES")
    if _uses_cuda(args) and torch.cuda.device_count() < world:
        raise LowbitError(f"tensor parallel {tp} x expert parallel {ep} needs {world} GPUs, "
                          f"this host shows {torch.cuda.device_count()}")
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(world)}
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=_spawned, args=(main, args, tp, ep, rank, env), daemon=True)
               for rank in range(1, world)]
    for w in workers:
        w.start()
    os.environ.update(env, RANK="0", LOCAL_RANK="0")
    done = threading.Event()  # rank 0 finished its command: workers may exit from now on
    threading.Thread(target=_watch_workers, args=(workers, done), name="lowbit-workers", daemon=True).start()
    wait = JOIN_TIMEOUT_S
    try:
        rc = _run_rank(main, args, tp, ep, done)
    except BaseException:
        wait = 5.0  # released workers exit at once; stuck ones are ended
        raise
    finally:
        done.set()
        for w in workers:
            w.join(wait if not driver.workers_lost() else 5.0)
            if w.is_alive():
                w.terminate()
    bad = [f"rank {r} exited with {w.exitcode}" for r, w in enumerate(workers, 1) if w.exitcode != 0]
    if bad:
        log.error("workers failed: %s", "; ".join(bad))
    return rc or int(bool(bad))


def _watch_workers(workers: list, done: threading.Event) -> None:
    """Rank 0's watch: a worker that exits while rank 0 still drives it is lost."""
    sentinels = {w.sentinel: rank for rank, w in enumerate(workers, 1)}
    while not done.is_set():
        ready = multiprocessing.connection.wait(list(sentinels), timeout=0.5)
        if ready and not done.is_set():
            rank = sentinels[ready[0]]
            driver.lose_workers(f"rank {rank} exited with status {workers[rank - 1].exitcode}")
            if not done.wait(LOST_GRACE_S):
                log.error("rank 0 did not stop within %.0f s of losing a worker; exiting", LOST_GRACE_S)
                os._exit(1)
            return


def _spawned(main, args: argparse.Namespace, tp: int, ep: int, rank: int, env: dict) -> None:
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides when workers stop
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, name="lowbit-parent", daemon=True).start()
    raise SystemExit(_run_rank(main, args, tp, ep))


def _exit_with_parent() -> None:
    multiprocessing.parent_process().join()
    log.error("rank 0 is gone; this worker exits")
    os._exit(1)


def _run_rank(main, args: argparse.Namespace, tp: int, ep: int, done: threading.Event | None = None) -> int:
    device = "cuda" if _uses_cuda(args) else "cpu"
    layout = ps.init_distributed(tp, ep, device)
    if device == "cpu":  # ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // layout.world))
    if layout.rank != 0:
        rc = _follow(args)
        ps.destroy_distributed()
        return rc
    driver.begin_driving()
    try:
        rc = main(args)
    except BaseException:
        _finish(done)
        raise
    _finish(done)
    return rc


def _finish(done: threading.Event | None) -> None:
    if done is not None:
        done.set()
    if driver.release_workers():  # else a worker is lost or inside a collective; see run_parallel
        ps.destroy_distributed()


def _follow(args: argparse.Namespace) -> int:
    try:
        model = engine_model(EngineConfig.from_cli(args)).model
    except Exception as e:  # tell rank 0, which raises it
        driver.report_loaded(f"rank {ps.current_layout().rank}: {type(e).__name__}: {e}")
        log.debug("worker load failed:\n%s", traceback.format_exc())
        return 1
    if not driver.report_loaded(None):
        return 1  # rank 0 gave up before driving
    driver.worker_loop(model)
    return 0


def _uses_cuda(args: argparse.Namespace) -> bool:
    dev = getattr(args, "device", None)
    return (dev is None and torch.cuda.is_available()) or str(dev).startswith("cuda")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world_size(args: argparse.Namespace) -> int:
    tp, ep = parallel_sizes(args)
    return math.lcm(tp, ep)

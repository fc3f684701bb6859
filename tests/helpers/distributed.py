"""Run a function on N gloo ranks on CPU: the one multi-process launcher of the test suite.

Ranks are *forked* from the pytest process, which ``tests/conftest.py`` has already made
single-threaded and pre-loaded with torch, dynamo, DTensor and Lightning, so a rank starts in
milliseconds instead of the seconds a spawned interpreter needs.

Failure handling follows the "nothing hangs" rule: a rank that raises sends its traceback and leaves
at once with ``os._exit(1)`` (no teardown collectives, so its peers see "connection closed" within
about a second); the parent kills the remaining ranks as soon as the first failure arrives and
re-raises that rank's traceback. A run that outlives ``timeout`` is killed and reported with the ranks
still running. Successful ranks destroy their process group before ``os._exit(0)`` (gloo's destructor
can deadlock at interpreter exit).

NCCL's rules, on gloo: ``run_distributed(..., comm_check=True)`` (or ``LP_COMM_CHECK=1`` in the environment, for
every launch) records each rank's communication (``tests/helpers/comm_check.py``) and raises ``AssertionError``
listing what NCCL would break once every rank succeeded. ``LP_COMM_LOG_DIR=<dir>`` only writes the ranks' logs.
"""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class RankFailed(RuntimeError):
    """A rank raised; the message holds that rank's traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 90.0,
    init_process_group: bool = True,
    comm_check: bool | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` forked ranks; return their results.

    With ``init_process_group=False`` the rank only gets the torchrun-style environment
    (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``NODE_RANK``), which is
    what Lightning's external-launch detection needs: a ``Trainer(devices=world_size)`` built inside
    ``fn`` then joins the group without relaunching anything.

    ``comm_check=True`` (default: ``LP_COMM_CHECK=1`` in the environment) checks the ranks' communication
    against NCCL's rules after they all succeeded (``tests/helpers/comm_check.verify``).
    """
    if comm_check is None:
        comm_check = os.environ.get("LP_COMM_CHECK") == "1"
    comm_dir = tempfile.mkdtemp(prefix="lp-comm-") if comm_check else None
    try:
        results = _launch(fn, world_size, args, kwargs, timeout, init_process_group, comm_dir)
        if comm_dir is not None:
            from tests.helpers import comm_check as checker

            checker.verify(checker.load(comm_dir), world_size)
        return results
    finally:
        if comm_dir is not None:
            shutil.rmtree(comm_dir, ignore_errors=True)


def _launch(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    kwargs: dict,
    timeout: float,
    init_process_group: bool,
    comm_dir: str | None,
) -> list[Any]:
    ctx = multiprocessing.get_context("fork")
    port = free_port()
    readers, procs = {}, {}
    logs = [tempfile.TemporaryFile() for _ in range(world_size)]  # each rank's stderr
    sys.stdout.flush()
    sys.stderr.flush()
    for rank in range(world_size):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_rank_main,
            args=(
                rank,
                world_size,
                port,
                fn,
                args,
                kwargs,
                writer,
                init_process_group,
                timeout,
                logs[rank].fileno(),
                comm_dir,
            ),
            daemon=True,
        )
        proc.start()
        writer.close()
        readers[reader] = rank
        procs[rank] = proc

    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    ok = False
    try:
        while readers:
            remaining = deadline - time.monotonic()
            ready = multiprocessing.connection.wait(list(readers), timeout=max(remaining, 0))
            if not ready:
                running = sorted(readers.values())
                raise TimeoutError(f"ranks {running} of {world_size} did not finish within {timeout:.0f} s")
            for reader in ready:
                rank = readers.pop(reader)
                status, payload = _receive(reader, procs[rank])
                if status != "ok":
                    tail = _read(logs[rank])[-4000:]
                    raise RankFailed(
                        f"rank {rank} of {world_size} failed:\n{payload}\n--- its stderr (tail) ---\n{tail}"
                    )
                results[rank] = payload
        ok = True
    finally:
        _reap(procs.values(), grace=5.0 if ok else 0.0)
        for rank, log in enumerate(logs):  # hand the ranks' stderr to pytest's capture
            text = _read(log)
            if text:
                sys.stderr.write(f"--- rank {rank} stderr ---\n{text}")
            log.close()
    return [results[r] for r in range(world_size)]


def _receive(reader: Any, proc: Any) -> tuple[str, Any]:
    try:
        return pickle.loads(reader.recv_bytes())
    except EOFError:
        proc.join(5)
        return "error", f"the process exited with code {proc.exitcode} without reporting a result"


def _read(log: Any) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")


def _reap(procs: Any, grace: float) -> None:
    """Join finished ranks; kill the rest (at once after a failure, so nothing waits on a dead peer)."""
    for proc in procs:
        proc.join(timeout=grace)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    writer: Any,
    init_process_group: bool,
    timeout: float,
    stderr_fd: int,
    comm_dir: str | None = None,
) -> None:
    torch.set_num_threads(1)  # first: a forked child of a multi-threaded parent hangs otherwise
    os.dup2(stderr_fd, 2)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    faulthandler.enable(sys.stderr, all_threads=True)  # a crash (SIGSEGV) prints every thread's stack to the log
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
    comm_dir = comm_dir or os.environ.get("LP_COMM_LOG_DIR")
    try:
        if comm_dir:  # record every communication op (and host tensors) for NCCL's rules
            from tests.helpers import comm_check

            comm_check.start(rank, host=os.environ.get("LP_COMM_HOST", "1") != "0")
        if init_process_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        payload: tuple[str, Any] = ("ok", fn(rank, world_size, *args, **kwargs))
        if comm_dir:
            comm_check.finish(comm_dir)
        data = pickle.dumps(payload)
    except BaseException:
        traceback.print_exc()
        writer.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        os._exit(1)  # no teardown: peers blocked on us see "connection closed" at once
    writer.send_bytes(data)
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0)

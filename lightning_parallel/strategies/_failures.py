"""Ending a job cleanly: SIGTERM without a collective in the signal handler (:func:`stop_on_sigterm`), and
naming a rank that died (instead of raising) when its peers fail on its broken connections.

At set-up every rank records every rank's host and process id. When a collective or message fails with a
connection error (gloo: "Connection reset by peer" / "closed by peer"; NCCL: "remote process exited"), the
failing rank looks up which peers on its own host are no longer running (gone, or a zombie waiting for its
parent) and says so in the first line it prints: the traceback that follows is only the consequence.
Peers on other hosts cannot be checked from here; they are listed as not checked. A rank that fails by
raising leaves a marker file (:func:`mark_raised`) before it exits, so its peers do not call it dead.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import tempfile
import threading
import time
import traceback
from typing import Any

log = logging.getLogger(__name__)

_CONNECTION_ERRORS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "remote process exited",
    "ECONNRESET",
    "Connection refused",
)


def whoami() -> tuple[str, int]:
    return socket.gethostname(), os.getpid()


def _marker(peers: list[tuple[str, int]], rank: int) -> str:
    job = f"{peers[0][0]}-{peers[0][1]}"  # rank 0's host and pid name the job
    return os.path.join(tempfile.gettempdir(), f"lightning_parallel-{job}-rank{rank}.raised")


def mark_raised(peers: list[tuple[str, int]] | None, rank: int) -> None:
    """Record that this rank fails by raising (its peers then do not report it as killed)."""
    if peers:
        try:
            with open(_marker(peers, rank), "w") as f:
                f.write(str(os.getpid()))
        except OSError:
            pass


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")  # a zombie has died and waits for its parent
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def is_connection_failure(exception: BaseException) -> bool:
    text = "".join(traceback.format_exception(exception))
    return any(marker in text for marker in _CONNECTION_ERRORS)


def dead_peers_line(peers: list[tuple[str, int]], rank: int) -> str | None:
    """One line naming the ranks whose process is gone, or ``None`` if none could be found."""
    host = socket.gethostname()
    dead: list[int] = []
    deadline = time.monotonic() + 10.0  # the broken connection can be seen before the killed process is gone
    while not dead and time.monotonic() < deadline:
        dead = [
            r
            for r, (h, pid) in enumerate(peers)
            if r != rank and h == host and not _running(pid) and not os.path.exists(_marker(peers, r))
        ]
        if not dead:
            time.sleep(0.1)
    if not dead:
        return None
    unchecked = [r for r, (h, _) in enumerate(peers) if h != host]
    named = ", ".join(f"rank {r} (pid {peers[r][1]} on {peers[r][0]})" for r in dead)
    more = f"; ranks {unchecked} on other hosts were not checked" if unchecked else ""
    return (
        f"[rank {rank}] {named} died: its process is no longer running (killed, e.g. by SIGKILL or the"
        f" out-of-memory killer); it did not raise an exception here. The connection error below is the"
        f" consequence{more}.\n"
    )


def stop_on_sigterm(strategy: Any) -> None:
    """Replace Lightning's SIGTERM handler, which runs a ``dist.broadcast`` inside the signal handler: on a
    rank blocked in a pipeline receive that collective never meets its peers' (a hang until the process
    group's timeout). This one only records the signal and forwards it to the launched ranks; Lightning's
    loop then stops at a batch boundary (its check after the batch on a signalled rank, its per-batch
    broadcast from rank 0 on the others), so no rank is left inside a pipeline step waiting for a peer,
    and the strategy's ``on_exception`` ends the job with exit code 143 (128 + SIGTERM)."""
    lm = strategy.lightning_module
    trainer = lm.trainer if lm is not None else None
    if trainer is None or threading.current_thread() is not threading.main_thread():
        return
    connector = trainer._signal_connector

    def on_sigterm(signum: int, frame: Any) -> None:
        log.info(f"[rank {strategy.global_rank}] received SIGTERM: stopping after this step")
        if not connector.received_sigterm and strategy.launcher is not None:
            strategy.launcher.kill(signum)
        connector.received_sigterm = True

    signal.signal(signal.SIGTERM, on_sigterm)

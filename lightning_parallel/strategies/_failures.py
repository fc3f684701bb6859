"""Ending a job cleanly: SIGTERM without a collective in the signal handler (:func:`stop_on_sigterm`), and
naming a rank that died (instead of raising) when its peers fail on its broken connections.

At set-up every rank records every rank's host and process id. When a collective or message fails with a
connection error (gloo: "Connection reset by peer" / "closed by peer"; NCCL: "remote process exited"), the
failing rank looks up which peers on its own host are no longer running (gone, or a zombie waiting for its
parent) and says so in the first line it prints: the traceback that follows is only the consequence.
Peers on other hosts cannot be checked from here; they are listed as not checked. A rank that fails by
raising leaves a marker file (:func:`mark_raised`) before it exits, so its peers do not call it dead.

Under Lightning's script launcher the launching process (local rank 0) also watches its children, and kills
the whole job a few seconds after one of them dies: often before rank 0's own collective has failed. Our
launcher (:class:`NamingScriptLauncher`) watches them with :class:`_NamingObserver`, which names a child
that a signal ended before it ends the job, so the line never depends on which of the two sees the death
first; each dead rank is named once (:func:`_claim`).
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from typing_extensions import override

log = logging.getLogger(__name__)

_CONNECTION_ERRORS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "remote process exited",
    "ECONNRESET",
    "Connection refused",
)


_named: set[int] = set()  # ranks already reported dead by this process
_named_lock = threading.Lock()


def _claim(ranks: list[int]) -> list[int]:
    """The ranks of ``ranks`` not yet reported dead by this process; they count as reported from now on."""
    with _named_lock:
        new = [r for r in ranks if r not in _named]
        _named.update(new)
        return new


def whoami() -> tuple[str, int]:
    return socket.gethostname(), os.getpid()


def _job_prefix(host: str, pid: int | str = "") -> str:
    """The path prefix of the marker files of the job that rank 0's host and pid name (with no pid: of every
    job on ``host``)."""
    return os.path.join(tempfile.gettempdir(), f"lightning_parallel-{host}-{pid}")


def _marker(peers: list[tuple[str, int]], rank: int) -> str:
    return f"{_job_prefix(*peers[0])}-rank{rank}.raised"


def mark_raised(peers: list[tuple[str, int]] | None, rank: int) -> None:
    """Record that this rank fails by raising (its peers then do not report it as killed)."""
    if peers:
        try:
            with open(_marker(peers, rank), "w") as f:
                f.write(str(os.getpid()))
        except OSError:
            pass


def remove_stale_markers() -> None:
    """Remove the marker files of jobs whose launching process (it names the job) no longer runs: every job's
    markers are gone once it has ended, whichever way it was launched (the script launcher also removes its
    own at exit, :meth:`NamingScriptLauncher.launch`)."""
    every = _job_prefix(socket.gethostname())
    for path in glob.glob(f"{glob.escape(every)}*-rank*.raised"):
        pid = path[len(every) :].split("-rank")[0]
        if pid.isdigit() and not _running(int(pid)):
            with contextlib.suppress(OSError):
                os.remove(path)


def _remove_job_markers(children: list[subprocess.Popen], wait: float = 20.0) -> None:
    """At the launching process's exit: once its children have ended (they read the markers when their
    connections break), remove this job's marker files."""
    deadline = time.monotonic() + wait
    while any(c.poll() is None for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    for path in glob.glob(f"{glob.escape(_job_prefix(*whoami()))}-rank*.raised"):
        with contextlib.suppress(OSError):
            os.remove(path)


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
    """One line naming the ranks whose process is gone, or ``None`` if none could be found; ``""`` if every
    one of them was already named (by :class:`_NamingObserver`)."""
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
    dead = _claim(dead)
    if not dead:
        return ""
    unchecked = [r for r, (h, _) in enumerate(peers) if h != host]
    more = f"; ranks {unchecked} on other hosts were not checked" if unchecked else ""
    return _died_line(rank, [(r, *peers[r]) for r in dead], f"The connection error below is the consequence{more}.")


def _died_line(rank: int, dead: list[tuple[int, str, int]], then: str) -> str:
    named = ", ".join(f"rank {r} (pid {pid} on {host})" for r, host, pid in dead)
    return (
        f"[rank {rank}] {named} died: its process is no longer running (killed, e.g. by SIGKILL or the"
        f" out-of-memory killer); it did not raise an exception here. {then}\n"
    )


class _NamingObserver(_ChildProcessObserver):
    """Lightning's child watcher (it kills the job when a child ends with a non-zero code), checking every
    second, which first names a child that a signal ended (a negative return code; one that raised exits
    with a positive code and prints its own traceback)."""

    def __init__(self, main_pid: int, child_processes: list[subprocess.Popen], first_rank: int) -> None:
        super().__init__(main_pid=main_pid, child_processes=child_processes, sleep_period=1)
        self._first_rank = first_rank  # the global rank of the launching process

    @override
    def _run(self) -> bool:
        """Lightning's check, on one poll of the children (a child that ends between two polls is named too)."""
        codes = [proc.poll() for proc in self._child_processes]
        if all(code == 0 for code in codes):
            return True
        host = socket.gethostname()
        children = enumerate(zip(self._child_processes, codes))
        killed = [(self._first_rank + 1 + i, p, -c) for i, (p, c) in children if (c or 0) < 0]
        dead = _claim([r for r, _, _ in killed])
        if dead:
            names = ", ".join(f"rank {r}: {_signal_name(n)}" for r, _, n in killed if r in dead)
            line = _died_line(
                self._first_rank,
                [(r, host, p.pid) for r, p, _ in killed if r in dead],
                f"Ended by signal ({names}); the job ends now.",
            )
            sys.stderr.write(line)
            sys.stderr.flush()
        for i, (proc, code) in enumerate(zip(self._child_processes, codes)):
            if code:
                log.info(
                    f"[rank {self._first_rank + 1 + i}] Child process with PID {proc.pid} terminated with code {code}."
                    " Forcefully terminating all other processes to avoid zombies"
                )
                self._terminate_all()
                return True
        return False


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal
        return f"signal {number}"


class NamingScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher (``start_method="popen"``) with :class:`_NamingObserver` as its watcher."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            first_rank = self.cluster_environment.node_rank() * self.num_processes
            _NamingObserver(os.getpid(), self.procs, first_rank).start()
            atexit.register(_remove_job_markers, self.procs)
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


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

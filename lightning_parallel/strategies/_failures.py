"""Ending a job cleanly: SIGTERM without a collective in the signal handler (:func:`stop_on_sigterm`), and
naming a rank that died (instead of raising) when its peers fail on its broken connections.

At set-up every rank records every rank's host and process id. When a collective or message fails with a
connection error (gloo: "Connection reset by peer" / "closed by peer"; NCCL: "remote process exited"), the
failing rank looks up which peers on its own host are no longer running (gone, or a zombie waiting for its
parent) and says so in the first line it prints: the traceback that follows is only the consequence.
Peers on other hosts cannot be checked from here; they are listed as not checked.

Only a rank that ended without saying so is named. Every rank that fails by its own hand leaves a marker
file before it exits: one that raises (:func:`mark_raised`), one that fails after a peer broke its
connection (:func:`dead_peers_line` leaves it before it looks), and one the launcher stops. So when rank 3
of 4 is killed, ranks 0-2 each name rank 3 alone, even if the others have already exited when one looks.

Under Lightning's script launcher the launching process (local rank 0) also watches its children, and ends
the whole job within about a second of one of them ending with a non-zero status: often before rank 0's own
collective has failed. Our launcher (:class:`NamingScriptLauncher`) watches them with
:class:`_NamingObserver`, which names a child that a signal ended, stops the other children, and ends the
job itself; rank 0, when it fails after a child a signal ended, leaves the job's end to it
(:func:`_leave_to_observer`). So the line and the exit status never depend on which of the two sees the
death first, and each dead rank is named once (:func:`_claim`).

The job's exit status (the launching process's) is that of the rank that ended first: ``128 + N`` when
signal ``N`` ended it (137 for SIGKILL, the out-of-memory killer's signal; the status a shell reports for a
process a signal ended, so the same as when the launching process itself is killed), its own exit code
when it exited (1 when it raised; 143 when it stopped on SIGTERM). If several ended at once, the lowest
rank a signal ended decides. Under torchrun or SLURM every rank's status is its own (the killed rank's is
its signal's, a rank failing after it exits 1), and which one the job reports is that launcher's rule.
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
_observer: _NamingObserver | None = None  # in the launching process: the watcher of its children


def _claim(ranks: list[int]) -> list[int]:
    """The ranks of ``ranks`` not yet reported dead by this process; they count as reported from now on."""
    with _named_lock:
        new = [r for r in ranks if r not in _named]
        _named.update(new)
        return new


def whoami() -> tuple[str, int]:
    """This process's host and process id, as every rank records them at set-up."""
    return socket.gethostname(), os.getpid()


def _job_prefix(host: str, pid: int | str = "") -> str:
    """The path prefix of the marker files of the job that its lowest rank on ``host`` names by its process id
    (with no pid: of every job on ``host``)."""
    return os.path.join(tempfile.gettempdir(), f"lightning_parallel-{host}-{pid}")


def _job_key(peers: list[tuple[str, int]]) -> tuple[str, int]:
    """The host and pid that name the job on this host: its lowest rank here (rank 0 on rank 0's host; under
    the script launcher, the launching process on every host, whose watcher writes markers too)."""
    host = socket.gethostname()
    return next(((h, pid) for h, pid in peers if h == host), peers[0])


def _marker_path(key: tuple[str, int], rank: int) -> str:
    return f"{_job_prefix(*key)}-rank{rank}.ended"


def _marker(peers: list[tuple[str, int]], rank: int) -> str:
    """The marker file that says ``rank`` of the job ``peers`` describes ended by its own hand."""
    return _marker_path(_job_key(peers), rank)


def _write_marker(path: str, why: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(f"{os.getpid()} {why}")
    except OSError:
        pass


def mark_raised(peers: list[tuple[str, int]] | None, rank: int) -> None:
    """Record that this rank fails by raising (its peers then do not report it as killed). In the launching
    process, after a child that a signal ended, the job's end is left to the watcher
    (:func:`_leave_to_observer`): this rank's error is then only the consequence."""
    if peers:
        _write_marker(_marker(peers, rank), "raised")
    _leave_to_observer(wait_for_death=0.0)


def remove_stale_markers() -> None:
    """Remove the marker files of jobs whose naming process (the job's lowest rank on this host) no longer
    runs: every job's markers are gone once it has ended, whichever way it was launched (the script launcher
    also removes its own at exit, :meth:`NamingScriptLauncher.launch`)."""
    every = _job_prefix(socket.gethostname())
    for path in glob.glob(f"{glob.escape(every)}*-rank*.ended"):
        pid = path[len(every) :].split("-rank")[0]
        if pid.isdigit() and not _running(int(pid)):
            with contextlib.suppress(OSError):
                os.remove(path)


def _remove_job_markers(
    children: list[subprocess.Popen], wait: float = 20.0, key: tuple[str, int] | None = None
) -> None:
    """At the launching process's exit: once its children have ended (they read the markers when their
    connections break), remove this job's marker files (those ``key`` names; by default this process's)."""
    deadline = time.monotonic() + wait
    while any(c.poll() is None for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    for path in glob.glob(f"{glob.escape(_job_prefix(*(key or whoami())))}-rank*.ended"):
        with contextlib.suppress(OSError):
            os.remove(path)


def _running(pid: int) -> bool:
    """Whether process ``pid`` on this host still runs (a zombie, dead and waiting for its parent, does not)."""
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
    """Whether ``exception`` (or one in its chain) is a broken connection to a peer."""
    text = "".join(traceback.format_exception(exception))
    return any(marker in text for marker in _CONNECTION_ERRORS)


def _leave_to_observer(wait_for_death: float, timeout: float = 10.0) -> None:
    """In the launching process, once one of its children has been ended by a signal (looked for during
    ``wait_for_death`` seconds: the broken connection can arrive before the child is gone): wait for the
    watcher, which names the child and ends the job with its status (:class:`_NamingObserver`), instead of
    exiting with this rank's own status. Returns at once anywhere else, and after ``timeout`` if the job
    has not ended by then."""
    observer = _observer
    if observer is None or observer._main_pid != os.getpid() or not observer.is_alive():
        return
    deadline = time.monotonic() + wait_for_death
    while not observer.signalled():
        if time.monotonic() >= deadline:
            return
        time.sleep(0.1)
    sys.stderr.flush()
    observer.join(timeout)  # the watcher ends this process (os._exit) within about a second


def dead_peers_line(peers: list[tuple[str, int]], rank: int) -> str | None:
    """One line naming the ranks whose process is gone without a marker (they neither raised nor failed
    after a peer), or ``None`` if none could be found; ``""`` if every one of them was already named (by
    :class:`_NamingObserver`). Leaves this rank's own marker first: it fails after a peer, it was not
    killed. In the launching process, a child that a signal ended is left to the watcher."""
    _write_marker(_marker(peers, rank), "followed")  # its peers do not report it as killed once it has exited
    host = socket.gethostname()
    dead: list[int] = []
    deadline = time.monotonic() + 10.0  # the broken connection can be seen before the killed process is gone
    while not dead and time.monotonic() < deadline:
        _leave_to_observer(wait_for_death=0.0)
        dead = [
            r
            for r, (h, pid) in enumerate(peers)
            if r != rank and h == host and not _running(pid) and not os.path.exists(_marker(peers, r))
        ]
        if not dead:
            time.sleep(0.1)
    if not dead:
        return None
    _leave_to_observer(wait_for_death=2.0)  # a dead child of the launching process: the watcher ends the job
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


def exit_status(code: int) -> int:
    """The job's exit status for a child's return code ``code`` (``subprocess``'s: ``-N`` when signal ``N``
    ended it): ``128 + N`` for a signal (as a shell reports it), else the code itself."""
    return 128 - code if code < 0 else code


class _NamingObserver(_ChildProcessObserver):
    """Lightning's child watcher (it ends the job when a child ends with a non-zero code), checking every
    second, which first names a child that a signal ended (a negative return code; one that raised exits
    with a positive code and prints its own traceback), then stops the other children and ends the
    launching process with the job's status (:func:`exit_status` of the lowest rank a signal ended, else
    of the first that exited non-zero), the same whichever process noticed first."""

    def __init__(self, main_pid: int, child_processes: list[subprocess.Popen], first_rank: int) -> None:
        super().__init__(main_pid=main_pid, child_processes=child_processes, sleep_period=1)
        self._first_rank = first_rank  # the global rank of the launching process

    def signalled(self) -> bool:
        """Whether a child has been ended by a signal (the launching process then leaves the job's end here)."""
        return any((proc.poll() or 0) < 0 for proc in self._child_processes)

    @override
    def _run(self) -> bool:
        """Lightning's check, on one poll of the children (a child that ends between two polls is named too)."""
        codes = [proc.poll() for proc in self._child_processes]
        if all(code == 0 for code in codes):
            return True
        ended = [(self._first_rank + 1 + i, p, c) for i, (p, c) in enumerate(zip(self._child_processes, codes)) if c]
        if not ended:
            return False
        host = socket.gethostname()
        killed = [(r, p, -c) for r, p, c in ended if c < 0]
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
        rank, proc, code = next((e for e in ended if e[2] < 0), ended[0])  # the lowest rank a signal ended
        log.info(
            f"[rank {rank}] Child process with PID {proc.pid} terminated with code {code}."
            f" Stopping all other processes; the job exits with status {exit_status(code)}"
        )
        self._end_job(exit_status(code))
        return True

    def _end_job(self, status: int) -> None:
        """Stop every child still running (each marked first, so that no peer names it as killed), then the
        launching process, with ``status``."""
        key = (socket.gethostname(), self._main_pid)  # the job's lowest rank on this host: the launching process
        running = [(self._first_rank + 1 + i, p) for i, p in enumerate(self._child_processes) if p.poll() is None]
        for r in [self._first_rank] + [r for r, _ in running]:
            _write_marker(_marker_path(key, r), "stopped")
        for _, proc in running:  # SIGKILL: SIGTERM does not end a process blocked in a collective
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(self._termination_signal)
        _remove_job_markers([p for _, p in running], wait=5.0, key=key)
        self._end_main(status)

    def _end_main(self, status: int) -> None:
        """End the launching process with ``status`` (one that is not this process, as Lightning does, by
        its termination signal)."""
        if self._main_pid != os.getpid():
            os.kill(self._main_pid, self._termination_signal)
            return
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(status)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal
        return f"signal {number}"


class NamingScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher (``start_method="popen"``) with :class:`_NamingObserver` as its watcher."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        global _observer
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            first_rank = self.cluster_environment.node_rank() * self.num_processes
            _observer = _NamingObserver(os.getpid(), self.procs, first_rank)
            _observer.start()
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

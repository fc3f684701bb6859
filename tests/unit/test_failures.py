"""The marker files a failing rank leaves for its peers (lightning_parallel/strategies/_failures.py) are removed
once their job has ended; only a peer that ended without one is named as killed; the launcher's watcher ends
the job with the status of the child that ended (128 + its signal when a signal ended it)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile

import pytest

from lightning_parallel.strategies import _failures


def _marker(pid: int, rank: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"lightning_parallel-{socket.gethostname()}-{pid}-rank{rank}.ended")


def test_markers_of_ended_jobs_are_removed_and_a_running_jobs_kept():
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    paths = {"ended": _marker(ended.pid, 1), "running": _marker(os.getpid(), 1)}
    for path in paths.values():
        with open(path, "w") as f:
            f.write("1")
    try:
        _failures.remove_stale_markers()
        assert not os.path.exists(paths["ended"]) and os.path.exists(paths["running"])
        _failures._remove_job_markers([ended])  # the launching process at its exit: this job's markers
        assert not os.path.exists(paths["running"])
    finally:
        for path in paths.values():
            if os.path.exists(path):
                os.remove(path)


def test_a_marker_names_the_job_by_rank_0s_host_and_pid():
    peers = [(socket.gethostname(), os.getpid()), (socket.gethostname(), 1)]
    assert _failures._marker(peers, 1) == _marker(os.getpid(), 1)


def test_a_marker_names_the_job_by_its_lowest_rank_on_this_host():
    """On a host without rank 0 (a second node), the job's lowest rank there names its markers: its launching
    process under the script launcher, whose watcher writes and removes them."""
    peers = [("another-host", 1), ("another-host", 2), (socket.gethostname(), os.getpid()), (socket.gethostname(), 3)]
    assert _failures._marker(peers, 3) == _marker(os.getpid(), 3)


def _ended(*args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", *args])
    proc.wait(timeout=30)
    return proc


def test_only_a_peer_that_ended_without_a_marker_is_named():
    """Rank 3 of 4 fails after its peers' connections broke: rank 1 (which failed after a peer, and has exited)
    left its marker, rank 2 (killed) did not: rank 2 alone is named, and rank 3 leaves its own marker."""
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.kill()
    killed.wait(timeout=30)
    followed = _ended("pass")
    host = socket.gethostname()
    peers = [(host, os.getpid()), (host, followed.pid), (host, killed.pid), (host, os.getpid())]
    try:
        _failures._write_marker(_failures._marker(peers, 1), "followed")  # rank 1 failed after a peer
        line = _failures.dead_peers_line(peers, 3)
        assert line is not None and re.match(rf"\[rank 3\] rank 2 \(pid {killed.pid} on .*\) died: ", line), line
        assert "rank 1 " not in line and "rank 0 " not in line
        assert os.path.exists(_failures._marker(peers, 3))  # rank 3 failed after a peer: not killed
    finally:
        _failures._remove_job_markers([], wait=0)
        _failures._named.clear()


class _Recording(_failures._NamingObserver):
    """The watcher, recording the status it would end the launching process with."""

    status: int | None = None

    def _end_main(self, status: int) -> None:
        self.status = status


@pytest.mark.parametrize(
    "children,status,named",
    [
        (["raise SystemExit(1)", "KILL"], 137, [6]),  # a signal decides, whichever child ended first
        (["raise SystemExit(1)", "pass"], 1, []),  # a rank that raised: its code, and no one is named
        (["raise SystemExit(143)", "pass"], 143, []),  # a rank stopped by SIGTERM exits 143 itself
        (["TERM", "KILL"], 143, [5, 6]),  # several signals: the lowest rank's
    ],
)
def test_the_watcher_ends_the_job_with_the_status_of_the_child_that_ended(children, status, named, capsys):
    procs = []
    for child in children:
        if child in ("KILL", "TERM"):
            proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            proc.send_signal(getattr(__import__("signal"), f"SIG{child}"))
            proc.wait(timeout=30)
        else:
            proc = _ended(child)
        procs.append(proc)
    try:
        watcher = _Recording(os.getpid(), procs, first_rank=4)
        assert watcher._run() is True
        assert watcher.status == status
        err = capsys.readouterr().err
        assert re.findall(r"rank (\d+) \(pid", err) == [str(r) for r in named], err
    finally:
        _failures._named.clear()


def test_the_watcher_marks_the_children_it_stops_before_it_stops_them():
    """Peers must not name a child the watcher stops as killed: each is marked before its SIGKILL."""
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.kill()
    killed.wait(timeout=30)
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    seen: list[bool] = []

    class Watching(_Recording):
        def _end_job(self, status: int) -> None:
            send = running.send_signal

            def checked(sig: int) -> None:
                seen.append(os.path.exists(_marker(os.getpid(), 6)))
                send(sig)

            running.send_signal = checked  # type: ignore[method-assign]
            super()._end_job(status)

    try:
        watcher = Watching(os.getpid(), [killed, running], first_rank=4)
        assert watcher._run() is True and watcher.status == 137
        assert seen == [True] and running.wait(timeout=30) == -9
        assert not os.path.exists(_marker(os.getpid(), 6))  # the job's markers are removed once it has ended
    finally:
        running.kill()
        _failures._named.clear()


def test_exit_status():
    assert [_failures.exit_status(c) for c in (-9, -15, 1, 143)] == [137, 143, 1, 143]

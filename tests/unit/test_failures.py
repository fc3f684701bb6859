"""The marker files a raising rank leaves for its peers (lightning_parallel/strategies/_failures.py) are removed
once their job has ended."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile

from lightning_parallel.strategies import _failures


def _marker(pid: int, rank: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"lightning_parallel-{socket.gethostname()}-{pid}-rank{rank}.raised")


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

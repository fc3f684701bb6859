"""A bound on the phases that can hang: the first training step and a block's verification.

A block a strategy cannot honour should be refused at verification, and a refusal is raised on every rank.
What no check foresees (a mixer that waits on a collective only some ranks enter, a peer stuck in a kernel)
would leave every rank waiting in a collective for the process group's timeout (30 minutes by default), with
no word. So the phases where such a wait starts run under a timer: when one lasts longer than the bound, this
rank prints what it was doing (the phase, the notes it took, the main thread's stack) and ends with status 1.
Its peers then fail on its closed connections and say so (``strategies/_failures.py``), or their own timers
end them. A later phase is not bounded: a steady step's time is the user's to judge.

One timer per process; phases nest (the first step contains verification), the innermost named.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Optional

_seconds: Optional[float] = None  # the bound (None: unbounded), set by the strategy at set-up
_rank = 0
_before_exit: Callable[[], None] = lambda: None  # noqa: E731  (the strategy's: leave the "raised" marker)
_phases: list[str] = []
_notes: list[str] = []
_timer: Optional[threading.Timer] = None
_lock = threading.Lock()


def configure(seconds: Optional[float], rank: int, before_exit: Callable[[], None] = lambda: None) -> None:
    """Set the bound of every later phase (``None`` turns the watchdog off), this process's rank, and what to
    do before this rank ends on an expired phase."""
    global _seconds, _rank, _before_exit
    _seconds, _rank, _before_exit = seconds, rank, before_exit


def arm(phase: str) -> None:
    """Start bounding ``phase`` (until :func:`disarm`); a phase already armed keeps its timer and is renamed."""
    global _timer
    with _lock:
        _phases.append(phase)
        if _timer is None and _seconds is not None:
            _timer = threading.Timer(_seconds, _expired)
            _timer.daemon = True
            _timer.start()


def disarm() -> None:
    """End every armed phase and stop the timer."""
    global _timer
    with _lock:
        if _timer is not None:
            _timer.cancel()
        _timer = None
        _phases.clear()
        _notes.clear()


@contextmanager
def bounded(phase: str) -> Iterator[None]:
    """Run the body as ``phase``, inside the phase already armed or under a timer of its own."""
    outer = _timer is not None
    arm(phase)
    try:
        yield
    finally:
        if outer:
            with _lock:
                if _phases:
                    _phases.pop()
        else:
            disarm()


def note(text: str) -> None:
    """Something this rank saw during the armed phase that explains a hang (printed only if the phase expires)."""
    if _timer is not None:
        _notes.append(text)


def _expired() -> None:
    phase = _phases[-1] if _phases else "the first training step"
    frame = sys._current_frames().get(threading.main_thread().ident)
    stack = "".join(traceback.format_stack(frame)) if frame is not None else "(not available)\n"
    seen = "".join(f"  - {n}\n" for n in _notes) or "  (nothing)\n"
    sys.stderr.write(
        f"[rank {_rank}] lightning_parallel.ConfigurationError: {phase} did not finish within {_seconds:g} s;"
        f" a collective that only some ranks entered, or a block a strategy cannot honour, waits forever."
        f" This rank ends now (its peers follow). What this rank noted:\n{seen}"
        f"Where its main thread was:\n{stack}"
        "If the phase is only slow (a large model, compilation), raise the strategy's first_step_timeout="
        " (or pass None).\n"
    )
    try:
        _before_exit()
    except Exception as err:  # noqa: BLE001  (the rank ends either way)
        sys.stderr.write(f"[rank {_rank}] (while ending: {err!r})\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)

"""Loop tests under load until one crashes, and keep the crash's stacks.

Each round runs the given pytest node ids in a fresh pytest process (``-m ""``, so slow tests run too) beside
``--busy`` processes spinning on the CPU (a fresh-clone CI run on 2 cores meets its tests that way), with
``PYTHONFAULTHANDLER=1`` and ``TORCH_SHOW_CPP_STACKTRACES=1``, core dumps enabled and written to ``--cores``
(``/proc/sys/kernel/core_pattern``, where writable). A round that fails keeps its log; for every core file the
C++ stacks of all threads are printed with ``gdb -batch -ex "thread apply all bt"``. It stops at the first
failure (``--keep-going``: counts them all) and prints how many rounds passed in a row.

    .venv/bin/python benchmarks/crash_loop.py --rounds 30 --busy 3 \\
        "tests/strategies/test_tensor_parallel.py::test_tp2_with_sequence_parallelism_matches_one_device" \\
        "tests/strategies/test_tensor_parallel.py::test_pp2_x_tp2_with_sequence_parallelism"
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _spin() -> None:
    while True:
        pass


def _cores_to(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    try:
        Path("/proc/sys/kernel/core_pattern").write_text(f"{directory}/core.%e.%p\n")
    except OSError:
        print(f"core_pattern not writable: cores land in each process's working directory ({os.getcwd()})")


def _stacks(core: Path) -> str:
    gdb = subprocess.run(
        ["gdb", "-batch", "-ex", "thread apply all bt 40", sys.executable, str(core)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return gdb.stdout[-60000:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tests", nargs="+", help="pytest node ids")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--busy", type=int, default=3, help="processes spinning beside the tests")
    parser.add_argument("--cores", type=Path, default=Path("/tmp/lp-cores"))
    parser.add_argument("--logs", type=Path, default=Path("/tmp/lp-crash-logs"))
    parser.add_argument("--keep-going", action="store_true")
    parser.add_argument("--pytest-args", default="", help="more pytest arguments, e.g. '-p some_plugin'")
    args = parser.parse_args()
    _cores_to(args.cores)
    args.logs.mkdir(parents=True, exist_ok=True)
    import multiprocessing

    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    env = dict(os.environ, PYTHONFAULTHANDLER="1", TORCH_SHOW_CPP_STACKTRACES="1")
    passed = failed = streak = best = 0
    try:
        for round_ in range(1, args.rounds + 1):
            before = set(args.cores.glob("core*"))
            t0 = time.perf_counter()
            run = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-x", "-m", "", "-p", "no:cacheprovider",
                 *args.pytest_args.split(), *args.tests],
                cwd=ROOT, env=env, capture_output=True, text=True,
            )  # fmt: skip
            seconds = time.perf_counter() - t0
            cores = sorted(set(args.cores.glob("core*")) - before)
            if run.returncode == 0 and not cores:
                passed, streak = passed + 1, streak + 1
                best = max(best, streak)
                print(f"round {round_}: passed in {seconds:.0f} s ({streak} in a row)", flush=True)
                continue
            failed, streak = failed + 1, 0
            log = args.logs / f"round{round_}.log"
            log.write_text(run.stdout + run.stderr + "".join(f"\n==== {c}\n{_stacks(c)}" for c in cores))
            print(f"round {round_}: FAILED (exit {run.returncode}, {len(cores)} core files); log: {log}", flush=True)
            if not args.keep_going:
                break
    finally:
        for p in spinners:
            p.terminate()
    print(f"\n{passed} rounds passed, {failed} failed; longest run of passes: {best}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

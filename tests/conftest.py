"""Test-session set-up: one thread, heavy imports done once, so forked ranks start in milliseconds."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# A forked rank of a parent that ran multi-threaded work hangs in its first parallel op:
# keep the pytest process itself single-threaded, and each rank sets one thread first as well.
torch.set_num_threads(1)

# Pre-import what ranks would otherwise import lazily (dynamo alone costs 1-2 s per process).
import lightning.pytorch  # noqa: E402,F401
import torch._dynamo  # noqa: E402,F401
import torch.distributed.pipelining  # noqa: E402,F401
import torch.distributed.tensor  # noqa: E402,F401
import torch.distributed.tensor.parallel  # noqa: E402,F401
import torchmetrics  # noqa: E402,F401

import lightning_parallel  # noqa: E402,F401


@pytest.fixture(autouse=True)
def _no_process_group_in_parent():
    """The pytest process itself must never hold a process group (ranks are forked from it)."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        pytest.fail("a test initialized torch.distributed in the pytest process")


def pytest_collection_modifyitems(config, items):
    """GPU tests are skipped, not failed, where there is no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_addoption(parser):
    parser.addoption("--coverage-table", default=None, help="write the coverage matrix's Markdown table to this file")


_COVERAGE: dict = {}


@pytest.fixture
def coverage_table():
    """The coverage matrix's results, written as a table at the end of the session with --coverage-table."""
    return _COVERAGE


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--coverage-table")
    if path and _COVERAGE:
        from tests.helpers.coverage import markdown

        with open(path, "w") as f:
            f.write(markdown(_COVERAGE))

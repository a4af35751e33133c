"""Shared pytest set-up: import moespec from the source tree even without ./build.sh's .pth."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT / "python") not in sys.path:
    sys.path.insert(0, str(ROOT / "python"))



import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is as fast, and immune to the spin-waits of an oversubscribed
    OpenMP pool when other jobs share the cores (seen: 20x slower runs with 2 threads). Modules opt in
    with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# test_virtual_cuda's emulated kernel run beside the other tests (its EmulatedRun), and the intra-op
# threads those take meanwhile: one (two on a core another process keeps busy spin, see one_thread).
_early: dict = {}


def pytest_collection_finish(session) -> None:
    for item in session.items:
        if item.name == "test_the_gpu_tests_of_the_kernels_and_the_runtime_pass_on_the_emulated_kernels":
            _early["run"], _early["threads"] = item.module.EMULATED_RUN, torch.get_num_threads()
            _early["run"].start()
            torch.set_num_threads(1)
            return


def pytest_runtest_setup(item) -> None:
    if "threads" in _early and not _early["run"].running():
        torch.set_num_threads(_early.pop("threads"))


def pytest_sessionfinish(session) -> None:
    if "run" in _early:
        _early["run"].stop()  # (a session stopped before its test)

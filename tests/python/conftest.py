"""Shared pytest set-up: import moespec from the source tree even without ./build.sh's .pth."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT / "python") not in sys.path:
    sys.path.insert(0, str(ROOT / "python"))



import pytest  # noqa: E402
import torch  # noqa: E402


# The intra-op threads a test takes: one in a one_thread module, and one while test_virtual_cuda's emulated
# kernel run (its EmulatedRun) goes on beside the other tests on the second core (two threads on a core
# another process keeps busy spin, see one_thread); else the session's own.
_threads: dict = {}  # "session": the session's threads, "run": the emulated run, "one": in a one_thread module


def _set_threads() -> None:
    run = _threads.get("run")
    want = 1 if _threads.get("one") or (run is not None and run.running()) else _threads["session"]
    if torch.get_num_threads() != want:
        torch.set_num_threads(want)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is as fast, and immune to the spin-waits of an oversubscribed
    OpenMP pool when other jobs share the cores (seen: 20x slower runs with 2 threads). Modules opt in
    with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    _threads["one"] = True
    _set_threads()
    yield
    _threads["one"] = False
    _set_threads()


def pytest_collection_finish(session) -> None:
    _threads["session"] = torch.get_num_threads()
    for item in session.items:
        if item.name == "test_the_gpu_tests_of_the_kernels_and_the_runtime_pass_on_the_emulated_kernels":
            _threads["run"] = item.module.EMULATED_RUN
            _threads["run"].start()
            break
    _set_threads()


def pytest_runtest_setup(item) -> None:
    if "run" in _threads:
        _set_threads()  # (back to the session's threads once the emulated run has ended)


def pytest_sessionfinish(session) -> None:
    if "run" in _threads:
        _threads["run"].stop()  # (a session stopped before its test)

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

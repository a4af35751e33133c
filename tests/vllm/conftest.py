"""tests/vllm run in .venv-vllm (./build.sh test-vllm): vLLM's CPU build with moespec's plugin. They
reuse tests/python's tiny checkpoints and skip cleanly where vLLM is not installed (the main .venv)."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))  # models_fixtures
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: tiny models
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# Engines in the test process (an engine core process re-imports vLLM: 47 s an eager engine instead of 13 s);
# test_plugin.generate(..., own_process=True) starts one as vLLM does by default.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm", reason="vLLM is not installed here (./build.sh test-vllm makes .venv-vllm)")


def pytest_configure(config):
    config.addinivalue_line("markers", "budget_runs(*runs): the budget_run.py runs a test reads "
                                       "(the test_plugin.budget_runs fixture)")

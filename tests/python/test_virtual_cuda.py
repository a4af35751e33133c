"""tests/python/virtual_cuda.py: the CUDA device played on the CPU refuses and counts what a GPU would,
and the GPU tests of the runtime and the draft tree (tests/gpu/test_runtime_cuda.py,
test_draft_tree_cuda.py) pass on it, so that a device mistake in moespec's CUDA branches (a host
tensor in a device op, a read back inside a captured graph, a synchronisation too many a step) fails
here, not in a GPU session. (Until 2026-12-06 MOESPEC_FUSED_STEP=0's draft round read its packing
back inside the capture: the first GPU run would have failed on it; this finds it.) And the kernel
tests of tests/gpu pass on it with the kernels' CUDA source run by the block emulator
(MOESPEC_VIRTUAL_KERNELS=emulated: moespec._native_emulated), so that a kernel's logic (indexing,
barriers, shuffles, mma fragments, launch geometry) is held to the CPU ops at every ./build.sh test.
(Until 2026-12-07 test_route_experts_cuda.py's workspace test called the op with one argument too
few: a GPU session would have failed on it; this finds it.)"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile

import pytest
import torch

from virtual_cuda import VirtualCudaTensor, virtual_cuda

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_device_tensors_mixing_and_host_reads():
    with virtual_cuda() as mode:
        a = torch.ones(3, 4, device="cuda")
        assert isinstance(a, VirtualCudaTensor) and a.is_cuda and a.device == torch.device("cuda", 0)
        b = (a * 2).sum(0)
        assert b.is_cuda and b.shape == (4,)
        with pytest.raises(RuntimeError, match="same device"):
            a + torch.zeros(3, 4)
        assert (a + torch.tensor(1.0)).is_cuda  # (a 0-d host tensor is a scalar, as on a GPU)
        with pytest.raises(TypeError, match="numpy"):
            a.numpy()
        assert not mode.syncs
        assert b.tolist() == [6.0] * 4 and int(b[0]) == 6 and not b.cpu().is_cuda
        assert len(mode.syncs) == 3 and all("test_virtual_cuda.py" in s for s in mode.syncs), mode.syncs
        v = a.view(12)
        v[2:5] = 7.0  # (views alias their base, as on a device)
        assert float(a[0, 3]) == 7.0
        del mode.syncs[:]
        assert a[torch.tensor([0, 2])].is_cuda and a[a > 1].is_cuda and a[torch.arange(2, device="cuda")].is_cuda
        assert [s.split(" at ")[0] for s in mode.syncs] == ["a blocking copy to the device (host indices)",
                                                           "indexing with a boolean mask"], mode.syncs


def test_copies_to_the_device_block_unless_pinned_and_asynchronous():
    from moespec._tensor import copy_from_host, to_device

    with virtual_cuda() as mode:
        dest = torch.zeros(3, dtype=torch.long, device="cuda")
        del mode.syncs[:]
        copy_from_host(dest, [1, 2, 3])
        t = to_device([4, 5], "cuda", torch.long)
        assert t.is_cuda and not mode.syncs
        torch.tensor([1, 2], device="cuda")
        dest.copy_(torch.ones(3, dtype=torch.long))
        assert len(mode.syncs) == 2 and all("blocking copy to the device" in s for s in mode.syncs)


def test_a_graph_records_native_launches_and_refuses_a_read_back():
    """A captured moespec op (a native launch) runs at each replay on the graph's memory; a host read
    inside the capture raises, as a real capture does."""
    from moespec.ops import RouterSpec, route_experts
    from moespec.runtime.graphs import capture

    with virtual_cuda():
        logits = torch.zeros(4, 8, device="cuda")
        graph, routing = capture(lambda: route_experts(logits, RouterSpec("softmax", 2, True)))
        logits.copy_(torch.arange(32.0).view(4, 8).to("cuda", non_blocking=True))
        graph.replay()
        assert routing.ids.is_cuda and routing.ids.tolist() == [[7, 6]] * 4
        with pytest.raises(RuntimeError, match="while a CUDA graph is captured"):
            capture(lambda: int(logits.sum()))
        with pytest.raises(ValueError, match="host tensors"):
            route_experts(logits, RouterSpec("softmax", 2, True), token_weights=torch.ones(4, 8))


# The kernel tests of tests/gpu on the emulated kernels, lean enough for CI's two cores (each test
# with its small shapes; the largest, the routing grid, which the routing hypothesis test samples, and
# the variants that launch plainly instead of as programmatic dependents, or release the next kernel
# after their wait instead of early, whose code the default variants run, are left to GPU sessions and
# to the README's command), then the runtime's.
KERNEL_TESTS = ["tests/gpu/test_route_experts_cuda.py", "tests/gpu/test_draft_tree_cuda.py",
                "tests/gpu/test_select_cost_aware_cuda.py", "tests/gpu/test_moe_experts_cuda.py",
                "tests/gpu/test_decoder_ops_cuda.py", "tests/gpu/test_linear_cuda.py"]
EMULATED = ("not 16-2048-768-128-8 and not 300-dtype and not random_trees and not 2048-32000 and not fused-plain "
            "and not no-pdl and not fused-late and not late-release and not test_cuda_equals_cpu[")


def test_native_launches_run_the_emulated_kernels(monkeypatch):
    """With kernels="emulated" a native launch on virtual CUDA tensors reaches moespec._native_emulated
    (the kernel's source, CUDA descriptors of the host memory), and gives the CPU op's result."""
    from moespec import _native_emulated
    from moespec.ops import moe_experts

    calls = []
    real = _native_emulated.moe_experts

    def spy(*args):
        calls.append([a[4] for a in args if isinstance(a, tuple)])  # (the descriptors' device types)
        return real(*args)

    monkeypatch.setattr(_native_emulated, "moe_experts", spy)
    gen = torch.Generator().manual_seed(0)
    x, weights = torch.randn(3, 64, generator=gen).bfloat16(), torch.rand(3, 2, generator=gen)
    ids, experts = torch.tensor([[0, 3], [1, 3], [2, 4]], dtype=torch.int32), torch.randn(4, 3 * 32 * 64).bfloat16()
    want = moe_experts(x, ids, weights, experts, 32)
    with virtual_cuda(kernels="emulated"):
        got = moe_experts(x.cuda(), ids.cuda(), weights.cuda(), experts.cuda(), 32).cpu()
    assert len(calls) == 1 and set(calls[0]) == {1}, calls
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="MOESPEC_VIRTUAL_KERNELS"):
        with virtual_cuda(kernels="gpu"):
            pass


class EmulatedRun:
    """That run: a pytest subprocess of about four minutes on one thread (the block emulator's fibers),
    started by tests/python/conftest.py as soon as the session's tests are known, so that it runs on the
    second core beside the other tests, or else by its test."""

    def __init__(self) -> None:
        self.proc, self.out = None, None

    def start(self) -> None:
        if self.proc is None:
            env = {**os.environ, "MOESPEC_VIRTUAL_KERNELS": "emulated", "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), str(ROOT / "tests" / "python")])}
            self.out = tempfile.TemporaryFile(mode="w+")  # (not a pipe: nothing reads it until the test)
            self.proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "virtual_cuda", "-p",
                                          "no:cacheprovider", "-k", EMULATED, *KERNEL_TESTS,
                                          "tests/gpu/test_runtime_cuda.py"], cwd=ROOT, env=env, stdout=self.out,
                                         stderr=subprocess.STDOUT, text=True)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def result(self) -> tuple[int, str]:
        """Its exit status and output, once it has ended (15 minutes at most)."""
        self.start()
        self.proc.wait(timeout=900)
        self.out.seek(0)
        return self.proc.returncode, self.out.read()

    def stop(self) -> None:
        if self.running():
            self.proc.kill()
            self.proc.wait()


EMULATED_RUN = EmulatedRun()


def test_the_gpu_tests_of_the_kernels_and_the_runtime_pass_on_the_emulated_kernels():
    """tests/gpu's kernel tests (each kernel against the CPU op) and the runtime's (CUDA logits against
    the CPU's, greedy speculation equal to greedy decoding, graph replays equal to eager steps, the
    synchronisations a step) with every native launch running the kernel's CUDA source."""
    returncode, out = EMULATED_RUN.result()
    assert returncode == 0, out[-8000:]
    tail = out.strip().splitlines()[-1]
    assert "passed" in tail and "failed" not in tail and "error" not in tail, out[-3000:]


def test_moespec_bench_runs_on_cuda(tmp_path):
    """`moespec bench throughput --device cuda` with EAGLE-3 and a budget: until 2026-12-06 it failed
    at its expert statistics (the verify steps' [L, 4] stats stayed on the device, and numpy cannot read
    a CUDA tensor; a finished batch's stats now come to the host in one copy), and its report named the
    CPU as the machine; `moespec bench compare --device cuda` failed at its quality proxy (host token ids
    gathered from device log-probabilities); eco's selection runs on the device there since 2026-12-06."""
    import json

    import moespec.models as mm
    from models_fixtures import write_checkpoint
    from moespec import LLM, SamplingParams, SpeculativeConfig
    from moespec.bench.run import main
    from moespec.engine import build_engine
    from test_bench import _head_folder

    from moespec.spec.expert_predictor import ExpertPredictor

    source = write_checkpoint("qwen3_moe", tmp_path / "source")
    draft = _head_folder(tmp_path / "draft", mm.load(source, "bf16"))
    torch.manual_seed(0)
    ExpertPredictor(torch.randn(2, 16, 128), torch.zeros(2, 16), torch.zeros(128), torch.ones(128)).save(tmp_path / "p")
    engine = build_engine(source, tmp_path / "engine", draft=draft, predictor=tmp_path / "p", progress=False,
                          speculation={"depth": 3, "top_k": 3, "total_tokens": 6}).folder
    dataset = tmp_path / "two.jsonl"
    dataset.write_text("".join(json.dumps(x) + "\n" for x in (
        {"task_id": 0, "input_ids": [5, 17, 33, 64, 9], "output_tokens": 9},
        {"task_id": 1, "input_ids": [3, 4, 120, 77, 13, 50, 8], "output_tokens": 12})))
    with virtual_cuda():
        rc = main(["throughput", "--engine", str(engine), "--dataset", str(dataset), "--policy", "eagle3+budget:5",
                   "--max-batch-size", "2", "--warmup", "0", "--device", "cuda", "--report-json",
                   str(tmp_path / "report.json")])
        assert rc == 0
        assert main(["compare", "--engine", str(engine), "--dataset", str(dataset), "--policies", "ar,eagle3+budget:5,eco",
                     "--warmup", "0", "--no-progress", "--device", "cuda", "--out-dir", str(tmp_path / "compare")]) == 0
        config = SpeculativeConfig("eagle3+budget", budget=5, depth=3, top_k=3, total_tokens=6)
        out = LLM(source, dtype="fp32", device="cuda", draft=draft, speculative_config=config).generate(
            [[5, 17, 33]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    report = json.loads((tmp_path / "report.json").read_text())
    compared = json.loads((tmp_path / "compare" / "compare.json").read_text())
    assert compared["machine"]["device"] == "cuda:0" and len(compared["policies"]) == 3
    assert report["expert_statistics"]["verify_steps"] > 0, report["expert_statistics"]
    assert report["machine"]["device"] == "cuda:0" and report["machine"]["name"].startswith("virtual CUDA")
    assert report["engine"]["backend"] == "moespec (torch, cuda)"
    assert out.stats.expert_stats and all(t.device.type == "cpu" for t in out.stats.expert_stats)


def test_the_mla_bench_runs_on_cuda(tmp_path):
    """run.sh's last timing, `python -m moespec.bench.mla --device cuda` (MLA's two forms on a
    DeepSeek-V3 attention layer), on the virtual device with a short context."""
    import json

    from moespec.bench import mla

    with virtual_cuda():
        mla.main(["--device", "cuda", "--contexts", "64", "--tokens", "1", "--repeats", "1", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "mla.json").read_text())

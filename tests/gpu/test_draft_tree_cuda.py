"""The draft tree's device cores on CUDA (moespec.spec.tree_device: what the runtime drafts with on a
GPU), the fused one (a level and a finalize one kernel each, cpp/kernels/draft_tree.cu; the default)
and the torch ops, against the native C++ core on the CPU: the same frontiers at every level and the
same trees, bit for bit (scores are the same float32 sums; the ranking is a stable sort's). Random
batches from fixed seeds, with ties (coarse and all-equal log-probs), -inf and tiny positive values,
draft ids mapped through d2t (in the level kernel, checks deferred); and a value problem reported at
the finalize. Skipped without a CUDA device (the fused core: without moespec's CUDA kernels too)."""

from __future__ import annotations

import gpu_common  # noqa: F401  (the source tree on sys.path)
import pytest
import torch

if not torch.cuda.is_available():  # (the torch core needs no CUDA kernels of moespec's, only a device)
    pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)

from moespec.spec.tree import TreeBuilder  # noqa: E402

CUDA = torch.device("cuda")
FRONTIER = ("index", "tokens", "parent", "parent_slot", "scores")
TREE = ("tokens", "parents", "depth", "mask_words", "paths", "scores", "candidates")


def logprobs(gen, style, *shape):
    x = -8.0 * torch.rand(*shape, generator=gen)
    if style == "coarse":
        x = x.round()
    elif style == "equal":
        x = torch.full(shape, -1.0)
    x[torch.rand(*shape, generator=gen) < 0.05] = -float("inf")
    x[torch.rand(*shape, generator=gen) < 0.05] = 5e-4
    return x


def core_param(core: str):
    from moespec._loader import native

    return pytest.param(core, marks=pytest.mark.skipif(
        core == "fused" and not native().cuda_available(), reason="moespec was built without CUDA kernels"))


CORES = pytest.mark.parametrize("core", [core_param("fused"), core_param("torch")])


@CORES
@pytest.mark.parametrize("seed", range(60))
def test_cuda_core_equals_the_native_core(seed, core):
    gen = torch.Generator().manual_seed(seed)
    B, K = int(torch.randint(1, 9, (), generator=gen)), int(torch.randint(1, 11 if seed % 10 else 21, (), generator=gen))
    D, M = int(torch.randint(1, 8, (), generator=gen)), int(torch.randint(1, 100, (), generator=gen))
    style = ("continuous", "coarse", "equal")[seed % 3]
    d2t = torch.randint(0, 50, (300,), generator=gen)
    cpu = TreeBuilder(B, depth=D, top_k=K, total_tokens=M, d2t=d2t)
    gpu = TreeBuilder(B, depth=D, top_k=K, total_tokens=M, d2t=d2t, device=CUDA, core=core)
    assert gpu._core is not None and gpu._core.device.type == "cuda"
    assert gpu._core.kernels == (core == "fused" and K <= 16)  # (K > 16: the torch ops)
    roots = torch.randint(0, 1000, (B,), generator=gen)
    tok, lp = torch.randint(0, 300, (B, K), generator=gen), logprobs(gen, style, B, K)
    pairs = [(cpu.expand_root(roots, tok, lp).clone(), gpu.expand_root(roots.to(CUDA), tok.to(CUDA), lp.to(CUDA)).clone())]
    for _ in range(D - 1):
        tok, lp = torch.randint(0, 300, (B, K, K), generator=gen), logprobs(gen, style, B, K, K)
        pairs.append((cpu.expand(tok, lp).clone(), gpu.expand(tok.to(CUDA), lp.to(CUDA)).clone()))
    for want, got in pairs:
        for name in FRONTIER:
            assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
    for want, got in zip(cpu.finalize(), gpu.finalize()):
        for name in TREE:
            g = getattr(got, name)
            assert g.device.type == "cuda" and torch.equal(g.cpu(), getattr(want, name)), name
    for b in range(B):
        for w, g in zip(vars(cpu.candidates(b)).values(), vars(gpu.candidates(b)).values()):
            assert torch.equal(g, w)


@CORES
def test_a_bad_value_on_cuda_is_reported_at_the_finalize(core):
    builder = TreeBuilder(1, depth=2, top_k=2, total_tokens=3, device=CUDA, core=core)
    builder.expand_root([1], torch.tensor([[1, 2]], device=CUDA), torch.tensor([[-1.0, float("nan")]], device=CUDA))
    with pytest.raises(ValueError, match="^logprobs: .*checked at finalize on cuda"):
        builder.finalize()


def test_the_default_core_on_cuda_is_the_fused_one(monkeypatch):
    from moespec._loader import native

    want = "fused" if native().cuda_available() else "torch"
    assert TreeBuilder(1, top_k=4, device=CUDA)._core.kernels == (want == "fused")
    monkeypatch.setenv("MOESPEC_TREE_FUSED", "0")
    assert not TreeBuilder(1, top_k=4, device=CUDA)._core.kernels

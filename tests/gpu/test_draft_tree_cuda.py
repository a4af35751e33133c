"""The draft tree's torch core on CUDA (moespec.spec.tree_device: what the runtime drafts with on a
GPU) against the native C++ core on the CPU: the same frontiers at every level and the same trees,
bit for bit (scores are the same float32 sums; the ranking is a stable sort). Random batches from
fixed seeds, with ties (coarse and all-equal log-probs), -inf and tiny positive values; and a value
problem reported at the finalize. Skipped without a CUDA device."""

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


@pytest.mark.parametrize("seed", range(60))
def test_cuda_core_equals_the_native_core(seed):
    gen = torch.Generator().manual_seed(seed)
    B, K = int(torch.randint(1, 9, (), generator=gen)), int(torch.randint(1, 11, (), generator=gen))
    D, M = int(torch.randint(1, 8, (), generator=gen)), int(torch.randint(1, 100, (), generator=gen))
    style = ("continuous", "coarse", "equal")[seed % 3]
    d2t = torch.randint(0, 50, (300,), generator=gen)
    cpu = TreeBuilder(B, depth=D, top_k=K, total_tokens=M, d2t=d2t)
    gpu = TreeBuilder(B, depth=D, top_k=K, total_tokens=M, d2t=d2t, device=CUDA)
    assert gpu._core is not None and gpu._core.device.type == "cuda"
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


def test_a_bad_value_on_cuda_is_reported_at_the_finalize():
    builder = TreeBuilder(1, depth=2, top_k=2, total_tokens=3, device=CUDA)
    builder.expand_root([1], torch.tensor([[1, 2]], device=CUDA), torch.tensor([[-1.0, float("nan")]], device=CUDA))
    with pytest.raises(ValueError, match="^logprobs: .*checked at finalize on cuda"):
        builder.finalize()

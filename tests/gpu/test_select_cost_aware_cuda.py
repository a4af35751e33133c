"""select_cost_aware on CUDA (cpp/kernels/select_cost_aware.cu), a batch in one launch, against the
plain-Python reference applied request after request with one buffer and S, A carried
(python/moespec/spec/cost_aware.py, itself held equal to the C++ CPU function): the same nodes in the
same order, the same buffer bit for bit, S and A within 1e-12. Random batches from fixed seeds (hard
and soft predictions, repeated ids, zero and non-zero costs); a choice may differ from the CPU's only
between two gains within a few ulp (CUDA's double exp), which random inputs do not produce.
Skipped without a CUDA device or a CUDA build."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gpu_common import require_cuda_build

require_cuda_build()

from moespec.spec.cost_aware import SelectionCosts, select_cost_aware, select_cost_aware_cuda  # noqa: E402

CUDA = torch.device("cuda")


def batch(seed: int):
    rng = np.random.default_rng(seed)
    B, C = int(rng.integers(1, 5)), int(rng.integers(1, 40))
    L, K, N = int(rng.integers(1, 4)), int(rng.integers(1, 5)), int(rng.integers(4, 12))
    parents, depth, scores = np.full((B, C), -1, np.int32), np.ones((B, C), np.int32), np.zeros((B, C), np.float32)
    num = rng.integers(0, C + 1, B).astype(np.int32)
    for b in range(B):
        for c in range(C):
            p = int(rng.integers(-1, c)) if c else -1
            parents[b, c] = p
            depth[b, c] = 1 if p < 0 else depth[b, p] + 1
            scores[b, c] = (scores[b, p] if p >= 0 else 0.0) + np.float32(-rng.random() * 3)
    predicted = rng.integers(0, N, (B, C, L, K)).astype(np.int32)
    soft = bool(rng.integers(0, 2))
    predicted_p = rng.random((B, C, L, K)).astype(np.float32) if soft else None
    buffer = (rng.random((L, N)) * (rng.random((L, N)) < 0.3)).astype(np.float32)
    zero = rng.random() < 0.2
    costs = SelectionCosts(0.0 if zero else float(rng.choice([0.0, 0.125, 0.5])),
                           np.zeros(L) if zero else np.full(L, float(rng.choice([0.0625, 0.25]))))
    return parents, depth, scores, num, predicted, predicted_p, buffer, costs, int(rng.integers(1, 30)), \
        float(rng.choice([0.5, 2.0, 8.0])), float(rng.choice([1.0, 2.5]))


@pytest.mark.parametrize("seed", range(200))
def test_batch_on_cuda_equals_the_reference_request_by_request(seed):
    parents, depth, scores, num, predicted, predicted_p, buffer, costs, total, step_s, accepted = batch(seed)
    want_buffer = buffer.copy()
    want, S, A = [], step_s, accepted
    for b in range(len(parents)):
        n = int(num[b])
        chosen, S, A = select_cost_aware(parents[b, :n].tolist(), depth[b, :n].tolist(), scores[b, :n].tolist(),
                                         predicted[b, :n], None if predicted_p is None else predicted_p[b, :n],
                                         want_buffer, costs, total, step_s=S, accepted=A)
        want.append(chosen)
    gpu_buffer = torch.from_numpy(buffer.copy()).to(CUDA)
    state = torch.tensor([step_s, accepted], dtype=torch.float64, device=CUDA)
    t = lambda x: None if x is None else torch.from_numpy(x).to(CUDA)  # noqa: E731
    selected, count = select_cost_aware_cuda(t(parents), t(depth), t(scores), t(num), t(predicted), t(predicted_p),
                                             gpu_buffer, costs, total, state)
    torch.cuda.synchronize()
    got = [selected[b, : int(count[b])].tolist() for b in range(len(parents))]
    assert got == want
    assert all(bool((selected[b, int(count[b]):] == -1).all()) for b in range(len(parents)))
    assert np.array_equal(gpu_buffer.cpu().numpy(), want_buffer)
    s, a = state.tolist()
    assert math.isclose(s, S, rel_tol=1e-12, abs_tol=1e-15) and math.isclose(a, A, rel_tol=1e-12)


@pytest.mark.parametrize("seed", range(50))
def test_trees_on_cuda_equal_tree_from_selection(seed):
    """The GPU trees of the GPU selection equal moespec.spec.tree.tree_from_selection's, request by
    request: tokens, parents, depths and packed masks (rows past the node count empty)."""
    from moespec.spec.cost_aware import tree_from_selection_cuda
    from moespec.spec.tree import Candidates, tree_from_selection

    parents, depth, scores, num, predicted, predicted_p, buffer, costs, total, step_s, accepted = batch(seed)
    B, C = parents.shape
    rng = np.random.default_rng(seed + 1000)
    tokens = rng.integers(0, 1000, (B, C)).astype(np.int32)
    roots = rng.integers(0, 1000, B).astype(np.int32)
    t = lambda x: None if x is None else torch.from_numpy(x).to(CUDA)  # noqa: E731
    state = torch.tensor([step_s, accepted], dtype=torch.float64, device=CUDA)
    selected, count = select_cost_aware_cuda(t(parents), t(depth), t(scores), t(num), t(predicted), t(predicted_p),
                                             torch.from_numpy(buffer.copy()).to(CUDA), costs, total, state)
    got = [x.cpu() for x in tree_from_selection_cuda(selected, count, t(parents), t(tokens), t(roots), total)]
    for b in range(B):
        n = int(num[b])
        cands = Candidates(torch.from_numpy(tokens[b, :n].astype(np.int64)), torch.from_numpy(parents[b, :n]),
                           torch.from_numpy(depth[b, :n]), torch.from_numpy(scores[b, :n]))
        want = tree_from_selection(int(roots[b]), cands, selected[b, : int(count[b])].tolist())
        m = want.num_nodes
        assert int(got[4][b]) == m
        assert got[0][b, :m].tolist() == want.tokens.tolist() and got[1][b, :m].tolist() == want.parents.tolist()
        assert got[2][b, :m].tolist() == want.depth.tolist()
        W = want.mask_words.shape[1]
        assert torch.equal(got[3][b, :m, :W], want.mask_words) and int(got[3][b, m:].abs().sum()) == 0
        assert bool((got[1][b, m:] == -1).all())


@pytest.mark.parametrize("C, L, N, K", [(1024, 48, 128, 8), (64, 16, 4096, 8)],
                         ids=["terms-in-chunks", "buffer-in-global-memory"])
def test_a_batch_too_large_for_shared_memory_chooses_as_the_cpu(C, L, N, K):
    """The kernel's other shared-memory plans (select_cost_aware.cuh, plan_select): 1024 candidates of
    48 layers hold their terms in chunks; a 16 x 4096 buffer (256 KB) stays in global memory. Against
    the C++ CPU function request by request (the rounding is the same: exact)."""
    from moespec.spec.cost_aware import select_cost_aware_native

    rng = np.random.default_rng(C + N)
    B, total = 2, 48
    parents = np.array([[int(rng.integers(-1, c)) if c else -1 for c in range(C)] for _ in range(B)], np.int32)
    depth, scores = np.ones((B, C), np.int32), np.zeros((B, C), np.float32)
    for b in range(B):
        for c in range(C):
            p = parents[b, c]
            depth[b, c] = 1 if p < 0 else depth[b, p] + 1
            scores[b, c] = (scores[b, p] if p >= 0 else 0.0) - np.float32(rng.random() * 1.5)
    predicted = rng.integers(0, N, (B, C, L, K)).astype(np.int32)
    predicted_p = rng.random((B, C, L, K)).astype(np.float32)
    buffer = np.zeros((L, N), np.float32)
    costs = SelectionCosts(1e-7, np.full(L, 2.4e-6))
    want_buffer, want, S, A = buffer.copy(), [], 5e-3 * B, float(B)
    for b in range(B):
        chosen, S, A = select_cost_aware_native(parents[b], depth[b], scores[b], predicted[b], predicted_p[b],
                                                want_buffer, costs, total, step_s=S, accepted=A)
        want.append(chosen)
    assert sum(map(len, want)) > B  # (the case prices some nodes in)
    gpu_buffer = torch.from_numpy(buffer).to(CUDA)
    state = torch.tensor([5e-3 * B, float(B)], dtype=torch.float64, device=CUDA)
    t = lambda x: torch.from_numpy(x).to(CUDA)  # noqa: E731
    selected, count = select_cost_aware_cuda(t(parents), t(depth), t(scores), t(np.full(B, C, np.int32)), t(predicted),
                                             t(predicted_p), gpu_buffer, costs, total, state)
    assert [selected[b, : int(count[b])].tolist() for b in range(B)] == want
    assert np.array_equal(gpu_buffer.cpu().numpy(), want_buffer)
    s, a = state.tolist()
    assert math.isclose(s, S, rel_tol=1e-12) and math.isclose(a, A, rel_tol=1e-12)

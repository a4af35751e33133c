"""The decoder ops' CPU side (moespec.ops.decoder; their CUDA kernels: tests/gpu/test_decoder_ops_cuda.py):
the visible-slot rule against a plain loop over slots, tree_attention on packed requests of unequal
sizes against a per-token softmax written out (with a sliding window and sinks), its block groups, attention_inputs writing exactly its tokens' cache slots, and the native entry points'
argument checks (a message naming the argument; on CPU tensors, that the kernel is CUDA-only)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moespec._loader import native
from moespec._tensor import view
from moespec.ops.decoder import attention_groups, attention_inputs, tree_attention, visible_slots
from moespec.runtime.state import step_geometry


def random_tree_words(rng: random.Random, T: int) -> torch.Tensor:
    parents = [-1] + [rng.randrange(i) for i in range(1, T)]
    return step_geometry([[0] * T], [0], [parents]).mask  # int32 [T, W]


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**20), B=st.integers(1, 3), T=st.integers(1, 70), extra=st.integers(0, 40))
def test_visible_slots_follow_the_rule(seed, B, T, extra):
    rng = random.Random(seed)
    S = T + extra
    start = torch.tensor([rng.randrange(0, S - T + 1) for _ in range(B)])
    words = torch.stack([random_tree_words(rng, T) for _ in range(B)])
    got = visible_slots(start, words, S)
    for b in range(B):
        for t in range(T):
            for s in range(S):
                j = s - int(start[b])
                bit = 0 <= j < T and (int(words[b, t, j // 32]) >> (j % 32)) & 1
                assert bool(got[b, t, s]) == (s < int(start[b]) or bool(bit)), (b, t, s)


@pytest.mark.parametrize("window,sinks,extra", [(0, False, 0), (4, True, 0), (0, False, 5)])
def test_tree_attention_is_each_tokens_softmax_over_what_it_sees(window, sinks, extra):
    """Packed requests of unequal sizes (one with no token): each token's softmax over the committed
    slots and its request's new slots its mask row names, written out; with a sliding window only
    slots whose position (a committed slot's index, a new slot's token position) is less than it
    behind; with sinks (GPT-OSS) the head's sink in the denominator; with spans (``extra`` new slots
    past the tokens', as the draft head's levels see earlier levels' scratch slots) those too."""
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    num, Hq, Hkv, D, S = [6, 0, 3], 4, 2, 8, 24
    B, P = len(num), sum(num)
    offsets = [0]
    for n in num:
        offsets.append(offsets[-1] + n)
    q = torch.randn(P, Hq, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, S, D, generator=gen, dtype=torch.float64) for _ in range(2))
    start = torch.tensor([0, 4, 11])
    trees = [[-1] + [rng.randrange(i) for i in range(1, n)] if n else [] for n in num]
    geo = step_geometry([[0] * n for n in num], start.tolist(), trees)  # tree words, positions start + depth
    words, positions = geo.mask.clone(), geo.positions
    span = [n + extra for n in num]
    for p in range(P):  # bits past the request's own tokens: seen only with spans
        words[p, 0] |= sum(1 << j for j in range(6, 6 + 5) if rng.random() < 0.5)
    sink = torch.randn(Hq, generator=gen, dtype=torch.float64) if sinks else None
    got = tree_attention(q, k, v, start, torch.tensor(offsets), attention_groups(offsets), words, 0.3,
                         spans=torch.tensor(span) if extra else None, positions=positions, window=window, sinks=sink)
    for b in range(B):
        first = offsets[b]
        for p in range(first, offsets[b + 1]):
            def seen(s):
                j = s - int(start[b])
                key = s if j < 0 else int(positions[first + j]) if j < num[b] else None
                bit = j < 0 or (j < span[b] and (int(words[p, j // 32]) >> (j % 32)) & 1)
                return bool(bit) and (not window or int(positions[p]) - key < window)

            slots = [s for s in range(S) if seen(s)]
            assert int(start[b]) + p - first in slots  # a token sees itself
            for h in range(Hq):
                g = h // (Hq // Hkv)
                scores = [float(q[p, h] @ k[b, g, s]) * 0.3 for s in slots]
                extra = [float(sink[h])] if sinks else []
                top = max(scores + extra)
                e = [math.exp(x - top) for x in scores]
                den = sum(e) + sum(math.exp(x - top) for x in extra)
                want = sum(pi * v[b, g, s] for pi, s in zip(e, slots)) / den
                assert torch.allclose(got[p, h], want, atol=1e-12), (b, p, h)


def test_tree_attention_reads_host_bounds_where_given():
    """``bounds`` (the offsets on the host) replace the device offsets in the torch version, which then
    reads nothing back (a captured round's torch attention on a GPU, MOESPEC_FUSED_STEP=0): with the
    device offsets zeroed, the result is still the offsets' own; bounds of another length are refused."""
    gen = torch.Generator().manual_seed(4)
    offsets, Hq, Hkv, D, S = [0, 3, 5], 4, 2, 8, 16
    q = torch.randn(5, Hq, D, generator=gen)
    k, v = (torch.randn(2, Hkv, S, D, generator=gen) for _ in range(2))
    start, words = torch.tensor([2, 6]), torch.full((5, 1), 0b111, dtype=torch.int32)
    want = tree_attention(q, k, v, start, torch.tensor(offsets), attention_groups(offsets), words, 0.3)
    zeroed = torch.zeros(3, dtype=torch.long)  # (what a read of the device would see instead)
    got = tree_attention(q, k, v, start, zeroed, attention_groups(offsets), words, 0.3, bounds=offsets)
    assert torch.equal(got, want)
    assert not torch.equal(tree_attention(q, k, v, start, zeroed, attention_groups(offsets), words, 0.3), want)
    with pytest.raises(ValueError, match="^bounds: 2 host offsets for 3 on the device"):
        tree_attention(q, k, v, start, zeroed, attention_groups(offsets), words, 0.3, bounds=[0, 5])


def test_attention_groups_cover_each_request_in_runs_of_eight():
    assert attention_groups([0, 3, 3, 20]).tolist() == [[0, 0, 3], [2, 3, 8], [2, 11, 8], [2, 19, 1]]
    assert attention_groups([0, 0]).shape == (0, 3)


def test_attention_inputs_write_only_their_slots():
    gen = torch.Generator().manual_seed(0)
    Hq, Hkv, D, B, S = 4, 2, 8, 2, 10
    qkv = torch.randn(3, (Hq + 2 * Hkv) * D, generator=gen)
    k, v = torch.zeros(B, Hkv, S, D), torch.zeros(B, Hkv, S, D)
    rows, slots = torch.tensor([0, 1, 1]), torch.tensor([4, 0, 9])
    cos, sin = torch.ones(3, D), torch.zeros(3, D)  # (rope at position 0: the identity)
    q = attention_inputs(qkv, None, None, cos, sin, k, v, rows, slots, num_heads=Hq, num_kv_heads=Hkv,
                         qk_norm="none", eps=1e-6, clip=None)
    assert torch.equal(q, qkv[:, : Hq * D].view(3, Hq, D))
    for p, (b, s) in enumerate(zip(rows.tolist(), slots.tolist())):
        assert torch.equal(k[b, :, s], qkv[p, Hq * D: (Hq + Hkv) * D].view(Hkv, D))
        assert torch.equal(v[b, :, s], qkv[p, (Hq + Hkv) * D:].view(Hkv, D))
        k[b, :, s], v[b, :, s] = 0, 0
    assert not k.any() and not v.any(), "no other slot written"


def test_native_entry_points_check_their_arguments():
    n = native()
    q = torch.zeros(2, 4, 16, dtype=torch.bfloat16)
    kc = torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16)
    start, words, out = torch.zeros(1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.int32), torch.empty_like(q)
    offsets, groups = torch.tensor([0, 2]), attention_groups([0, 2])

    def attend(q=q, k=kc, v=kc, start=start, words=words, out=out, scale=0.25, positions=None, sinks=None, window=0,
               offsets=offsets, groups=groups, spans=None):
        n.tree_attention(view(q, "q"), view(k, "k_cache"), view(v, "v_cache"), view(start, "start"),
                         view(offsets, "offsets"), view(groups, "groups"), view(spans, "spans"), view(words, "mask"),
                         view(positions, "positions"), view(sinks, "sinks"), view(out, "out"), scale, window, None, 0)

    with pytest.raises(ValueError, match="^start: .*int64"):
        attend(start=start.int())
    with pytest.raises(ValueError, match="^v_cache: .*size 8"):
        attend(v=kc[:, :, :4])
    with pytest.raises(ValueError, match="^q: head dim D must be a multiple of 8"):
        attend(q=torch.zeros(2, 4, 12, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="^mask: expected 1 to 8 words a row"):
        attend(words=torch.zeros(2, 9, dtype=torch.int32))
    with pytest.raises(ValueError, match="^offsets: .*size 2"):
        attend(offsets=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="^groups: .*size 3 in dim 1"):
        attend(groups=torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="^scale: must be > 0"):
        attend(scale=0.0)
    with pytest.raises(ValueError, match="^positions: a tensor is required"):
        attend(window=4)
    with pytest.raises(ValueError, match="^positions: .*size 2 in dim 0"):
        attend(window=4, positions=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="^spans: .*size 1"):
        attend(spans=torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="^spans: not with a sliding window"):
        attend(spans=torch.tensor([2]), window=4, positions=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="^sinks: .*size 4"):
        attend(sinks=torch.zeros(2))
    odd = torch.zeros(1 * 2 * 8 * 16 + 1, dtype=torch.bfloat16)[1:].view(1, 2, 8, 16)  # 2 bytes off 16
    with pytest.raises(ValueError, match="^v_cache: must start on a 16-byte boundary"):
        attend(v=odd)
    with pytest.raises(ValueError, match="^q: tree_attention has a CUDA kernel only"):
        attend()
    x = torch.zeros(3, 32)
    with pytest.raises(ValueError, match="^sum: residual and sum come together"):
        n.rms_norm(view(x, "x"), view(x, "residual"), view(x[0], "weight"), view(x, "out"), None, 1e-6, False, 0)
    with pytest.raises(ValueError, match="^weight: expected size 32"):
        n.rms_norm(view(x, "x"), None, view(x[0, :16], "weight"), view(x, "out"), None, 1e-6, False, 0)
    with pytest.raises(ValueError, match="^x: rms_norm has a CUDA kernel only"):
        n.rms_norm(view(x, "x"), None, view(x[0], "weight"), view(x, "out"), None, 1e-6, False, 0)
    qkv, cache = torch.zeros(2, 64), torch.zeros(1, 2, 4, 8)
    idx, cs = torch.zeros(2, dtype=torch.long), torch.zeros(2, 8)

    def inputs(qkv=qkv, heads=(4, 2), qk_norm=0):
        n.attention_inputs(view(qkv, "qkv"), None, None, view(cs, "cos"), view(cs, "sin"), view(cache, "k_cache"),
                           view(cache, "v_cache"), view(idx, "rows"), view(idx, "slots"),
                           view(torch.empty(2, heads[0], 8), "q"), heads[0], heads[1], qk_norm, 1e-6, 0.0, 0)

    with pytest.raises(ValueError, match=r"^qkv: expected \(Hq \+ 2 Hkv\) D = 64"):
        inputs(qkv=torch.zeros(2, 60))
    with pytest.raises(ValueError, match="^num_heads: expected Hq >= 1 query heads, a multiple of"):
        inputs(heads=(3, 2))
    with pytest.raises(ValueError, match="^q_norm: q_norm and k_norm are given exactly when"):
        inputs(qk_norm=1)
    with pytest.raises(ValueError, match="^qkv: attention_inputs has a CUDA kernel only"):
        inputs()

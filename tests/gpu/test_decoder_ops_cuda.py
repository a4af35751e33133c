"""The decoder ops on CUDA (cpp/kernels/decoder_ops.cu: rms_norm, attention_inputs, tree_attention)
against their plain-torch versions on the CPU (moespec.ops.decoder: the reference forward's own ops).

Sums (a norm's squares, q.k, p.v) run in other orders on the GPU, so values agree within 1e-5 of
the output scale in fp32 and, in bf16, 2e-3 of the scale plus one bf16 ulp of the value (a norm's
factor may round either side); what involves no sum (the residual add's sum, the cache entries of
v) is bit-identical. Also: tree_attention reads no slot at or past start + T (NaN there changes
nothing), splits and no split, a captured graph replayed at other cache lengths (the length is read
on the device) equals eager calls, two calls are bit-identical, and a sliding window and sinks
(GPT-OSS) agree with the torch version too. Skipped without a CUDA device or
a CUDA build.
"""

from __future__ import annotations

import random

import pytest
import torch
from gpu_common import require_cuda_build
from hypothesis import given, settings
from hypothesis import strategies as st

require_cuda_build()

from moespec._loader import native  # noqa: E402
from moespec.ops.decoder import attention_groups, attention_inputs, rms_norm, tree_attention  # noqa: E402
from moespec.runtime.state import step_geometry  # noqa: E402

CUDA = torch.device("cuda")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-3}
DTYPES = [torch.float32, torch.bfloat16]


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, where: str) -> None:
    got, want = got.float().cpu(), want.float().cpu()
    scale = max(float(want.abs().max()) if want.numel() else 0.0, 1e-30)
    bound = TOL[dtype] * scale + (want.abs() * 2.0**-7 if dtype == torch.bfloat16 else 0.0)
    err = (got - want).abs()
    assert bool((err <= bound).all()), f"{where}: max error {float(err.max())} (scale {scale})"


def rand(gen: torch.Generator, *shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("P,H", [(1, 64), (7, 2048), (3, 4100), (2, 12032)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("scale_fp32", [False, True])
def test_rms_norm_matches_torch(P, H, dtype, residual, scale_fp32):
    gen = torch.Generator().manual_seed(P * 31 + H)
    x, r, w = rand(gen, P, H, dtype=dtype), rand(gen, P, H, dtype=dtype), rand(gen, H, dtype=dtype, scale=0.5)
    want_s, want = rms_norm(x, w, 1e-6, residual=r if residual else None, scale_fp32=scale_fp32)
    got_s, got = rms_norm(x.to(CUDA), w.to(CUDA), 1e-6, residual=r.to(CUDA) if residual else None,
                          scale_fp32=scale_fp32)
    assert torch.equal(got_s.cpu(), want_s), "the residual add rounds once, as torch's add"
    assert_close(got, want, dtype, "rms_norm")


def caches(gen, B, Hkv, S, D, dtype):
    return rand(gen, B, Hkv, S, D, dtype=dtype), rand(gen, B, Hkv, S, D, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq,Hkv,D", [(4, 2, 64), (32, 4, 128), (8, 8, 256), (6, 3, 18)])
@pytest.mark.parametrize("qk_norm", ["none", "per_head", "full"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_attention_inputs_match_torch(Hq, Hkv, D, qk_norm, clip, dtype):
    gen = torch.Generator().manual_seed(Hq * 7 + D)
    B, S, P = 2, 40, 5
    qkv = rand(gen, P, (Hq + 2 * Hkv) * D, dtype=dtype)
    full = qk_norm == "full"
    qn = rand(gen, Hq * D if full else D, dtype=dtype) if qk_norm != "none" else None
    kn = rand(gen, Hkv * D if full else D, dtype=dtype) if qk_norm != "none" else None
    angle = torch.rand(P, D, generator=gen) * 6.3
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    kc, vc = caches(gen, B, Hkv, S, D, dtype)
    rows = torch.tensor([0, 0, 1, 1, 1])
    slots = torch.tensor([3, 4, 0, 39, 17])
    kw = dict(num_heads=Hq, num_kv_heads=Hkv, qk_norm=qk_norm, eps=1e-6, clip=clip)
    gpu = [t.to(CUDA) if t is not None else None for t in (qkv, qn, kn, cos, sin, kc, vc, rows, slots)]
    want = attention_inputs(qkv, qn, kn, cos, sin, kc, vc, rows, slots, **kw)
    got = attention_inputs(*gpu, **kw)
    assert_close(got, want, dtype, "q")
    assert_close(gpu[5], kc, dtype, "k cache")
    assert torch.equal(gpu[6].cpu(), vc), "v is copied (clipped) as it is"


def random_parents(rng: random.Random, T: int) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, T)] if T else []


class TreeInputs:
    """Packed requests with ``num[b]`` tree tokens each: q [P, Hq, D], the caches [B, Hkv, S, D],
    start [B], offsets [B + 1] and the blocks' groups, the trees' mask words [P, W] and positions [P]
    (start + depth), on the CPU; ``.cuda()``: the same on the GPU."""

    def __init__(self, seed: int, num: list[int], Hq: int, Hkv: int, D: int, S: int, dtype):
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        B, T = len(num), max(num)
        self.num, self.q = num, rand(gen, sum(num), Hq, D, dtype=dtype)
        self.k, self.v = caches(gen, B, Hkv, S, D, dtype)
        start = [rng.randrange(0, S - T + 1) for _ in range(B)]
        start[0] = 0 if B > 1 else start[0]  # (a request with no committed slot)
        geo = step_geometry([[0] * n for n in num], start, [random_parents(rng, n) for n in num])
        self.start, self.offsets = torch.tensor(start), torch.tensor(geo.offsets)
        self.groups, self.words, self.positions = attention_groups(geo.offsets), geo.mask, geo.positions.long()

    def cuda(self) -> "TreeInputs":
        out = object.__new__(TreeInputs)
        out.__dict__ = {k: v.to(CUDA) if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()}
        return out

    def attend(self, dtype=None, **kw) -> torch.Tensor:
        cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
        return tree_attention(cast(self.q), cast(self.k), cast(self.v), self.start, self.offsets, self.groups,
                              self.words, self.q.shape[-1] ** -0.5, **kw)


def check_tree_attention(seed, num, Hq, Hkv, D, S, dtype, window=0, sinks=False):
    """The kernel against the torch version in fp32 (the kernel's own precision: fp32 scores and
    softmax, the output rounded once)."""
    cpu = TreeInputs(seed, num, Hq, Hkv, D, S, dtype)
    sink = torch.randn(Hq, generator=torch.Generator().manual_seed(seed)) * 2 if sinks else None
    want = cpu.attend(torch.float32, positions=cpu.positions, window=window, sinks=sink)
    gpu = cpu.cuda()
    for b, n in enumerate(num):  # slots no token of request b sees: never read
        gpu.k[b, :, int(cpu.start[b]) + n:] = float("nan")
        gpu.v[b, :, int(cpu.start[b]) + n:] = float("nan")
    kw = dict(positions=gpu.positions, window=window, sinks=sink.to(CUDA) if sinks else None)
    got = gpu.attend(**kw)
    assert_close(got, want, dtype, f"tree_attention num={num} Hq={Hq} Hkv={Hkv} D={D} S={S} window={window} "
                                   f"sinks={sinks}")
    assert torch.equal(got, gpu.attend(**kw)), "deterministic"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num,Hq,Hkv,D,S", [
    ([1], 32, 4, 128, 4096),  # decode at a long cache: many splits
    ([16], 32, 4, 128, 600),  # a verify tree
    ([64] * 8, 32, 4, 128, 300),  # one split: written directly
    ([128, 3], 4, 1, 64, 200),  # 128 tokens: four mask words; unequal requests
    ([256], 4, 2, 64, 300),  # 256 tokens: eight mask words
    ([5, 0, 7], 8, 8, 256, 70),  # a request without tokens
])
@pytest.mark.parametrize("window,sinks", [(0, False), (128, True)])  # (GPT-OSS: a 128-position window, sinks)
def test_tree_attention_matches_torch(num, Hq, Hkv, D, S, dtype, window, sinks):
    if dtype == torch.float32 and D > native().kMaxHeadDim // 2:
        pytest.skip("float32 takes D <= 128")
    check_tree_attention(sum(num) * 7 + len(num), num, Hq, Hkv, D, S, dtype, window, sinks)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**20), num=st.lists(st.integers(0, 70), min_size=1, max_size=3).filter(any),
       heads=st.sampled_from([(4, 1), (8, 2), (4, 4)]), D=st.sampled_from([64, 128]), extra=st.integers(0, 700),
       bf16=st.booleans(), window=st.sampled_from([0, 0, 3, 128]), sinks=st.booleans())
def test_tree_attention_matches_torch_on_random_trees(seed, num, heads, D, extra, bf16, window, sinks):
    check_tree_attention(seed, num, heads[0], heads[1], D, max(num) + extra,
                         torch.bfloat16 if bf16 else torch.float32, window, sinks)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_attention_with_spans_matches_torch(dtype):
    """spans (the draft head's levels): a request's tokens see new slots past their own count, as the
    bits of their mask rows name them."""
    cpu = TreeInputs(11, [4, 4], 8, 2, 128, 300, dtype)
    rng = random.Random(11)
    for p in range(cpu.words.shape[0]):  # slots 4..19 of each request: earlier levels' scratch slots
        cpu.words[p, 0] |= sum(1 << j for j in range(4, 20) if rng.random() < 0.5)
    spans = torch.tensor([20, 12])
    want = cpu.attend(torch.float32, spans=spans)
    gpu = cpu.cuda()
    got = gpu.attend(spans=spans.to(CUDA))
    assert_close(got, want, dtype, "tree_attention with spans")


def test_tree_attention_replayed_at_other_lengths_equals_eager():
    """A captured call reads start on the device: replays after the length changed give the eager
    results at those lengths."""
    S = 2048
    gpu = TreeInputs(5, [8, 8], 8, 2, 128, S, torch.bfloat16).cuda()
    gpu.attend()  # (warm-up)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gpu.attend()
    for lengths in ([0, 1], [100, 1500], [S - 8, 7]):
        gpu.start.copy_(torch.tensor(lengths, device=CUDA))
        graph.replay()
        assert torch.equal(out, gpu.attend()), lengths


def test_bad_arguments_name_the_argument():
    gpu = TreeInputs(1, [2], 4, 2, 64, 16, torch.bfloat16).cuda()
    with pytest.raises(ValueError, match="^start:"):
        tree_attention(gpu.q, gpu.k, gpu.v, gpu.start.int(), gpu.offsets, gpu.groups, gpu.words, 0.1)
    with pytest.raises(ValueError, match="^k_cache:"):
        tree_attention(gpu.q, gpu.k.float(), gpu.v, gpu.start, gpu.offsets, gpu.groups, gpu.words, 0.1)
    with pytest.raises(ValueError, match="^mask:"):
        tree_attention(gpu.q, gpu.k, gpu.v, gpu.start, gpu.offsets, gpu.groups, gpu.words[:1], 0.1)
    with pytest.raises(ValueError, match="^groups:"):
        tree_attention(gpu.q, gpu.k, gpu.v, gpu.start, gpu.offsets, gpu.groups.long(), gpu.words, 0.1)

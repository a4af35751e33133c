"""The expert half of an MoE layer: ``moe_experts`` over a routing (op ``moespec::moe_experts``).

Native kernel: cpp/src/moe_experts.cc (+ per-ISA files), contract in
cpp/include/moespec/moe_experts.h. Plain-torch reference: :func:`moespec.ops.reference.moe_experts_reference`.

Dimensions: T tokens, H hidden, I expert intermediate size, E experts, K top-k.
"""

from __future__ import annotations

import os
from typing import Literal, Optional

import torch

from moespec._loader import native, require_cuda
from moespec._tensor import DTYPE_CODES, view

Activation = Literal["swiglu", "gpt_oss"]
_ACTIVATION_CODES = {"swiglu": 0, "gpt_oss": 1}
# From this many tokens on (prefill), bf16 SwiGLU experts on CUDA run as torch's grouped GEMM
# (moe_experts_grouped) instead of the decode/verify kernel; MOESPEC_GROUPED_MIN_TOKENS overrides it
# (0: never). Set by tests/gpu/bench_moe_experts_cuda.py's crossover at the Qwen3-30B-A3B shape on an
# H200 (2026-12-04): the kernel 734 us against 973 at T = 512, the grouped GEMM 1204 against 1302 at 1024.
GROUPED_MIN_TOKENS = 1024


def grouped_fits(hidden: int, intermediate: int) -> bool:
    """Whether the grouped GEMMs take these sizes (16-byte strides in bf16)."""
    return hidden % 8 == 0 and intermediate % 8 == 0


def moe_experts_grouped(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                        intermediate_size: int) -> torch.Tensor:
    """SwiGLU experts as two grouped GEMMs (``torch.nn.functional.grouped_mm``), for prefill-sized T:
    the slots sorted by expert (dropped slots last, their rows ignored), gate/up then down over the
    experts' weight views (no copy), and each token's K results summed in slot order in fp32
    (deterministic: no atomics). bf16 in and out; the gate/up products are rounded to bf16 before the
    activation (the kernel keeps them in fp32), so results agree with moe_experts to bf16 rounding.
    No host synchronisation. H and I must be multiples of 8 (the GEMMs' 16-byte strides)."""
    T, H = x.shape
    E, I = experts.shape[0], intermediate_size
    if not grouped_fits(H, I):
        raise ValueError(f"moe_experts_grouped: H={H} and I={I} must be multiples of 8 (16-byte strides)")
    block, base = experts.shape[1], experts.storage_offset()
    gate_up = experts.as_strided((E, 2 * I, H), (block, H, 1), base)  # [E, 2I, H]
    down = experts.as_strided((E, H, I), (block, I, 1), base + 2 * I * H)  # [E, H, I]
    flat = ids.reshape(-1).long()  # [T K]
    order = torch.argsort(flat, stable=True)  # by expert, dropped (E) last
    offs = torch.cumsum(torch.bincount(flat, minlength=E + 1)[:E], 0).to(torch.int32)  # [E] group ends
    rows = x[order // ids.shape[1]]  # [T K, H]
    g, u = torch.nn.functional.grouped_mm(rows, gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    h = (torch.nn.functional.silu(g.float()) * u.float()).to(x.dtype)
    y = torch.nn.functional.grouped_mm(h, down.transpose(1, 2), offs=offs)  # [T K, H]
    w = weights.reshape(-1)[order]
    keep = (flat[order] < E) & (w != 0)  # dropped slots' rows lie past the last group: never read
    y = torch.where(keep[:, None], y.float() * w[:, None], 0.0)
    per_slot = torch.empty_like(y).index_copy_(0, order, y)  # back to slot order
    return per_slot.view(T, ids.shape[1], H).sum(dim=1).to(x.dtype)


def _moe_experts_impl(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                      biases: Optional[torch.Tensor], intermediate_size: int, activation: int, limit: float,
                      alpha: float, round_weights: bool) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-d tensor [T, H], got shape {tuple(x.shape)}")
    if x.shape[0] == 0:  # no tokens: any strides (numpy's empty arrays have 0 strides) are fine
        x, ids, weights = x.new_empty(x.shape), ids.new_empty(ids.shape), weights.new_empty(weights.shape)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    workspace, stream = None, 0
    if x.device.type == "cuda":  # cpp/kernels/moe_experts.cu: scratch from torch's allocator, the current stream
        grouped_min = int(os.environ.get("MOESPEC_GROUPED_MIN_TOKENS", GROUPED_MIN_TOKENS))
        if (0 < grouped_min <= x.shape[0] and x.dtype == torch.bfloat16 and activation == 0 and biases is None
                and ids.dim() == 2 and grouped_fits(x.shape[1], intermediate_size)):
            if round_weights:
                weights = weights.to(x.dtype).float()
            return moe_experts_grouped(x, ids, weights, experts, intermediate_size)
        require_cuda()
        nbytes = native().moe_experts_workspace_size(x.shape[0], ids.shape[-1] if ids.dim() == 2 else 0,
                                                     experts.shape[0], x.shape[1], intermediate_size,
                                                     DTYPE_CODES.get(x.dtype, 0))
        workspace = torch.empty((max(nbytes, 1),), dtype=torch.uint8, device=x.device)
        stream = torch.cuda.current_stream(x.device).cuda_stream
    elif x.device.type != "cpu":
        raise ValueError(f"x: moe_experts runs on the CPU or CUDA, got {x.device}")
    native().moe_experts(view(x, "x"), view(ids, "ids"), view(weights, "weights"), view(experts, "experts"),
                         view(biases, "biases"), view(out, "out"), intermediate_size, activation, limit, alpha,
                         round_weights, view(workspace, "workspace"), stream)
    return out


@torch.library.custom_op("moespec::moe_experts", mutates_args=())
def moe_experts_op(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                   biases: Optional[torch.Tensor], intermediate_size: int, activation: int, limit: float,
                   alpha: float, round_weights: bool) -> torch.Tensor:
    """The torch custom op ``moespec::moe_experts`` (flat arguments; see :func:`moe_experts`)."""
    return _moe_experts_impl(x, ids, weights, experts, biases, intermediate_size, activation, limit, alpha,
                             round_weights)


@moe_experts_op.register_fake
def _moe_experts_fake(x, ids, weights, experts, biases, intermediate_size, activation, limit, alpha, round_weights):
    return torch.empty_like(x)


def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    intermediate_size: int,
    *,
    activation: Activation = "swiglu",
    biases: Optional[torch.Tensor] = None,
    limit: float = 7.0,
    alpha: float = 1.702,
    round_weights: bool = False,
) -> torch.Tensor:
    """Runs the routed experts of an MoE layer, reading each active expert's weights once.

    Parameters
    ----------
    x : Tensor [T, H], float32 | bfloat16 (the experts' dtype)
    ids : Tensor int32 [T, K]
        The routing's expert ids; E (the number of experts) marks a dropped slot.
    weights : Tensor float32 [T, K]
    experts : Tensor [E, 3 I H]
        The runtime layout: per expert its gate [I, H], up [I, H] and down [H, I], contiguous.
    intermediate_size : int
        I.
    activation : {"swiglu", "gpt_oss"}
        ``gpt_oss`` clamps gate and up to ``limit`` and uses ``(u + 1) * g * sigmoid(alpha * g)``,
        with ``biases`` [E, 2 I + H] float32 (gate, up, down biases of each expert).
    round_weights : bool
        Round each routing weight to x's dtype before use (as the router of Qwen3-MoE, OLMoE and
        GPT-OSS rounds its weights; a weight that rounds to 0 counts as a zero-weight slot), in the
        kernel: the same result as passing ``weights.to(x.dtype).float()``, without those two casts.

    Returns
    -------
    Tensor [T, H] in x's dtype: sum over each token's slots of weight * expert(x). Accumulated in
    fp32; with bf16 weights, x and the expert's hidden activations are rounded to bf16 first.

    Examples
    --------
    >>> import torch, moespec
    >>> E, H, I = 4, 8, 6
    >>> experts = torch.randn(E, 3 * I * H)
    >>> x, ids = torch.randn(3, H), torch.tensor([[0, 2], [1, 4], [3, 3]], dtype=torch.int32)
    >>> moespec.ops.moe_experts(x, ids, torch.rand(3, 2), experts, I).shape
    torch.Size([3, 8])
    """
    if activation not in _ACTIVATION_CODES:
        raise ValueError(f"activation: expected 'swiglu' or 'gpt_oss', got {activation!r}")
    args = (x, ids, weights, experts, biases, int(intermediate_size), _ACTIVATION_CODES[activation], float(limit),
            float(alpha), bool(round_weights))
    impl = moe_experts_op if torch.compiler.is_compiling() else _moe_experts_impl
    return impl(*args)


def num_threads() -> int:
    """Threads of moespec's CPU thread pool (MOESPEC_NUM_THREADS, default: all cores)."""
    return native().num_threads()


def set_num_threads(n: int) -> None:
    """Sets the number of threads of moespec's CPU thread pool."""
    native().set_num_threads(int(n))


def scratch_bytes() -> int:
    """Bytes the CPU kernels' scratch buffers hold now, over every thread (cpp/include/moespec/scratch.h)."""
    return native().scratch_bytes()


def set_scratch_retain(nbytes: int) -> int:
    """Sets how many bytes a kernel scratch buffer may keep after a call (MOESPEC_SCRATCH_RETAIN_MB,
    default 64 MiB; a buffer above it is freed when its call ends); returns the previous limit."""
    if int(nbytes) < 0:
        raise ValueError(f"set_scratch_retain: expected a byte count >= 0, got {nbytes!r}")
    return native().set_scratch_retain_bytes(int(nbytes))

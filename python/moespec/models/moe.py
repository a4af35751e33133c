"""The MoE feed-forward of a layer: route (with an optional expert budget), then run the experts.

``moe_forward`` is the runtime's entry point; it routes with :func:`moespec.ops.route_experts`,
runs the experts with one of two implementations and adds the shared expert where the model has
one (Qwen2-MoE: ``sigmoid(shared_gate . x) * shared_expert(x)``, every token, never budgeted):
- ``"kernel"`` (default on the CPU): :func:`moespec.ops.moe_experts`, the native kernel that reads
  each active expert once at memory speed (fp32 accumulation);
- ``"reference"``: :func:`experts_reference`, a plain loop over the active experts in ascending id
  that rounds exactly as transformers' ``eager`` experts do (bf16 results bit-identical to them),
  for debugging. ``MOESPEC_MOE_IMPL=reference`` or ``TargetModel.moe_impl`` selects it.

Dimensions: P tokens of the layer, H hidden, E experts, K top-k, I expert intermediate size, Is
shared expert intermediate size.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from moespec.models.config import MoeConfig
from moespec.models.weights import LayerWeights
from moespec.ops import ExpertBudget, Routing, moe_experts, route_experts
from moespec.ops.linear import linear

MOE_IMPLS = ("kernel", "reference")


def experts_reference(x: torch.Tensor, routing: Routing, layer: LayerWeights, moe: MoeConfig) -> torch.Tensor:
    """sum_k weight[t, k] * expert_{ids[t, k]}(x[t]) for every token t; [P, H] in x's dtype."""
    E, K, I = moe.num_experts, moe.top_k, moe.intermediate_size
    if moe.activation == "gpt_oss":  # (the plain-torch semantics of moe_experts: fp32 sums)
        from moespec.ops.reference import moe_experts_reference

        weights = routing.weights.to(x.dtype).float() if moe.weights_in_model_dtype else routing.weights
        return moe_experts_reference(x, routing.ids, weights, layer.experts, I, activation="gpt_oss",
                                     biases=layer.float32("expert_biases"), limit=moe.swiglu_limit,
                                     alpha=moe.swiglu_alpha)
    gate_up, down = layer.expert_gate_up(I), layer.expert_down(I)  # [E, 2I, H], [E, H, I]
    weights = routing.weights.to(x.dtype) if moe.weights_in_model_dtype else routing.weights  # [P, K]
    flat = routing.ids.reshape(-1)  # [P K]
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, ascending id (dropped slots last)
    counts = torch.bincount(flat, minlength=E + 1)[:E].tolist()
    token = order // K  # [P K]
    xs, ws = x[token], weights.reshape(-1)[order]
    out = torch.zeros_like(x)  # [P, H]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        gate, up = F.linear(xs[rows], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * ws[rows, None]
        out.index_add_(0, token[rows], y.to(out.dtype))
        start += n
    return out


def shared_expert(x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
    """down(silu(gate x) * up x), scaled by sigmoid(shared_gate . x) where the layer has that gate
    (Qwen2-MoE; DeepSeek-V3's shared experts have none), as transformers computes it; [P, H]."""
    gate, up = linear(x, layer.shared_gate_up, cpu_kernel=False).chunk(2, dim=-1)  # [P, Is] each
    out = linear(F.silu(gate) * up, layer.shared_down, cpu_kernel=False)
    if layer.shared_gate is None:
        return out
    return torch.sigmoid(linear(x, layer.shared_gate, cpu_kernel=False)) * out


def _kernel_runs_on(device: torch.device) -> bool:
    """Whether moe_experts has a kernel for ``device``: the CPU, and CUDA in a build with the CUDA kernels."""
    if device.type == "cuda":
        from moespec._loader import native

        return bool(native().cuda_available())
    return device.type == "cpu"


def moe_forward(
    x: torch.Tensor, layer: LayerWeights, moe: MoeConfig, budget: Optional[ExpertBudget] = None,
    impl: str = "kernel", trace: Optional[list[Routing]] = None, token_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routes the P tokens of ``x`` [P, H] (together: the budget is per layer per batch) and runs the
    experts. Returns the feed-forward output [P, H] and the routing stats int32 [4]. ``trace``: a
    list the natural (unbudgeted) routing is appended to (moespec.models.trace). ``token_weights``
    float32 [P]: the tokens' weights in the budget's ranking (0: a padding row, a copy of its tree's
    root; default all 1)."""
    if moe.router_fp32:  # DeepSeek-V3: float32 x and weights
        logits = F.linear(x.float(), layer.router.float())
    else:  # [P, E], in the model dtype as transformers computes it
        logits = linear(x, layer.router, layer.router_bias, cpu_kernel=False)
    bias = layer.float32("score_bias")
    # (check_finite=False: a CUDA step never synchronises with the host; the CPU checks in any case.)
    routing = route_experts(logits, moe.router, budget, bias, token_weights=token_weights if budget is not None else None,
                            check_finite=False)
    if trace is not None:
        trace.append(routing if budget is None else route_experts(logits, moe.router, None, bias, check_finite=False))
    if impl == "reference" or not _kernel_runs_on(x.device):
        out = experts_reference(x, routing, layer, moe)
    else:
        biases = layer.float32("expert_biases")
        # (round_weights: rounded to the model dtype as the family's router rounds them, in the kernel)
        out = moe_experts(x, routing.ids, routing.weights, layer.experts, moe.intermediate_size,
                          activation=moe.activation, biases=biases, limit=moe.swiglu_limit, alpha=moe.swiglu_alpha,
                          round_weights=moe.weights_in_model_dtype)
    if layer.shared_down is not None:
        out = out + shared_expert(x, layer)
    return out, routing.stats_tensor

"""moespec's ops: torch custom ops over the native core (one name per op in every layer).

- :func:`route_experts` (op ``moespec::route_experts``): routing for every router family with
  MoE-Spec's expert budget, producing the routing contract (:class:`Routing`).
- :func:`moe_experts` (op ``moespec::moe_experts``): the routed experts of an MoE layer, each
  active expert's weights read once (fast CPU kernel, SIMD + thread pool).
- :func:`linear` (op ``moespec::linear``): a dense projection at decode/verify sizes, weights
  streamed once for all tokens, batch-invariant.
- :mod:`moespec.ops.draft_tree` (ops ``moespec::draft_tree_expand``, ``moespec::draft_tree_finalize``):
  the draft tree core's level and finalize, one kernel each (the fused tree core's).
- :mod:`moespec.ops.reference`: the plain-torch reference implementations the tests hold the
  native ops against.
"""

from moespec.ops.linear import linear, linear_op
from moespec.ops.moe import moe_experts, moe_experts_op, num_threads, scratch_bytes, set_num_threads, set_scratch_retain
from moespec.ops.routing import (
    ExpertBudget,
    Routing,
    RouterSpec,
    RoutingStats,
    route_experts,
    route_experts_op,
    softmax_vector_width,
)

__all__ = [
    "ExpertBudget",
    "linear",
    "linear_op",
    "moe_experts",
    "moe_experts_op",
    "num_threads",
    "scratch_bytes",
    "set_num_threads",
    "set_scratch_retain",
    "Routing",
    "RouterSpec",
    "RoutingStats",
    "route_experts",
    "route_experts_op",
    "softmax_vector_width",
]

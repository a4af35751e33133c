"""moespec's ops: torch custom ops over the native core (one name per op in every layer).

- :func:`route_experts` (op ``moespec::route_experts``): routing for every router family with
  MoE-Spec's expert budget, producing the routing contract (:class:`Routing`).
- :mod:`moespec.ops.reference`: the plain-torch reference implementations the tests hold the
  native ops against.
"""

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
    "Routing",
    "RouterSpec",
    "RoutingStats",
    "route_experts",
    "route_experts_op",
    "softmax_vector_width",
]

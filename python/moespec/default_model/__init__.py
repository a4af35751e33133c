"""The embedded default model: a real MoE with learned routing, derived from SmolLM2-135M-Instruct.

Implements DESIGN.md "Real parts and defaults" (the embedded default, route "derived from SmolLM2"):
:mod:`~moespec.default_model.corpus` holds the fitting corpus and its held-out split,
:mod:`~moespec.default_model.derive` builds the MoE (fixed seeds),
:mod:`~moespec.default_model.pipeline` adds the EAGLE-3 head and the engine folder, each step cached,
:mod:`~moespec.default_model.report` measures the MoE against the dense model.

    python -m moespec.default_model --out build/engines/default          # what ./build.sh runs
    python -m moespec.default_model.report --model build/cache/default-model/moe-<key>
"""

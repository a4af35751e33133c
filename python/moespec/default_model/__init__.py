"""The embedded default model: a real MoE with learned routing, derived from SmolLM2-135M-Instruct.

Implements DESIGN.md "Real parts and defaults" (the embedded default, route "derived from SmolLM2"):
:mod:`~moespec.default_model.derive` builds it (one command, fixed seeds),
:mod:`~moespec.default_model.corpus` holds the fitting corpus and its held-out split,
:mod:`~moespec.default_model.report` measures it against the dense model.

    python -m moespec.default_model.derive --out build/default-moe --cache build/cache/default-model
    python -m moespec.default_model.report --model build/default-moe --cache build/cache/default-model
"""

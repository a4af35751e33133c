"""moespec inside vLLM (``pip install moespec[vllm]``; a ``vllm.general_plugins`` entry point, so
vLLM calls :func:`register` in every process it starts).

- EAGLE-3 for the MoE families vLLM 0.32 lacks it for (Mixtral, Qwen2-MoE, OLMoE;
  :mod:`moespec.integrations.vllm.eagle3`), so moespec's engines and heads serve as they are;
- MoE-Spec's expert budget on verify passes (``MOESPEC_BUDGET``; :mod:`moespec.integrations.vllm.budget`);
- guards for vLLM bugs its use runs into (:mod:`moespec.integrations.vllm.compat`).

Nothing here is imported by the core package; this module imports vLLM only inside functions.
"""

from __future__ import annotations

# vLLM architecture -> (its module, its class, the class of its inner ``model``) for the families this
# plugin gives EAGLE-3
EAGLE3_FAMILIES = {
    "MixtralForCausalLM": ("vllm.model_executor.models.mixtral", "MixtralForCausalLM", "MixtralModel"),
    "Qwen2MoeForCausalLM": ("vllm.model_executor.models.qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeModel"),
    "OlmoeForCausalLM": ("vllm.model_executor.models.olmoe", "OlmoeForCausalLM", "OlmoeModel"),
}


def eagle3_class(architecture: str) -> type:
    """vLLM's class for ``architecture`` with EAGLE-3 (see :func:`moespec.integrations.vllm.eagle3.with_eagle3`)."""
    import importlib

    from moespec.integrations.vllm.eagle3 import with_eagle3

    module, name, inner = EAGLE3_FAMILIES[architecture]
    return with_eagle3(getattr(importlib.import_module(module), name), inner)


def register() -> None:
    """The vLLM plugin entry point: registers the EAGLE-3 classes, the budget hooks and the guards
    (idempotent; vLLM may call it in several processes)."""
    from vllm import ModelRegistry

    from moespec.integrations.vllm.budget import budget_from_env, install
    from moespec.integrations.vllm.compat import guard_onednn_handler_release

    guard_onednn_handler_release()  # (compiled models on vLLM's CPU build)
    budget = budget_from_env()  # a malformed MOESPEC_BUDGET fails here, when vLLM loads the plugin
    for arch in EAGLE3_FAMILIES:
        ModelRegistry.register_model(arch, f"moespec.integrations.vllm.models:{arch}")
    install(budget)

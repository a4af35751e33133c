"""The classes :func:`moespec.integrations.vllm.register` points vLLM at (``module:class`` strings, so
vLLM imports them lazily in its worker processes)."""

from moespec.integrations.vllm import eagle3_class

MixtralForCausalLM = eagle3_class("MixtralForCausalLM")
Qwen2MoeForCausalLM = eagle3_class("Qwen2MoeForCausalLM")
OlmoeForCausalLM = eagle3_class("OlmoeForCausalLM")

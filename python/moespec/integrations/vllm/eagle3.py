"""EAGLE-3 for vLLM's MoE model classes that lack it (vLLM 0.32: Mixtral, Qwen2-MoE, OLMoE), with one
generic wrapper instead of a fork per family.

vLLM's EAGLE-3 proposer asks the target for the residual stream after some layers
(``SupportsEagle3.set_aux_hidden_state_layers``) and expects ``forward`` to return ``(hidden,
[aux...])`` then. :func:`with_eagle3` subclasses a ``*ForCausalLM`` whose inner ``model`` runs
``layers[start_layer:end_layer]`` then ``norm`` (the layout of every vLLM decoder here) so that it
does: the inner model is built as a subclass with vLLM's own ``EagleModelMixin`` and a forward that
collects those states as vLLM's Qwen3-MoE does. (Built as the subclass, not converted afterwards:
vLLM's ``support_torch_compile`` binds ``self.forward`` when the inner model is constructed, so a
compiled model runs the forward the instance was built with.) It also zeroes the parameters a checkpoint does not hold that vLLM's
class always builds (Qwen2-MoE's q/k/v biases when ``qkv_bias`` is false: left uninitialised by
vLLM, NaN on a small model).
"""

from __future__ import annotations

from itertools import islice
from typing import Iterable

import torch

_WRAPPED: dict[type, type] = {}


def _forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
    from vllm.distributed import get_pp_group
    from vllm.sequence import IntermediateTensors

    if get_pp_group().is_first_rank:
        hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        residual = None
    else:
        hidden_states, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
    aux = self._maybe_add_hidden_state([], self.start_layer, hidden_states, residual)
    for index, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer), start=self.start_layer):
        hidden_states, residual = layer(positions, hidden_states, residual)
        self._maybe_add_hidden_state(aux, index + 1, hidden_states, residual)
    if not get_pp_group().is_last_rank:
        return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
    hidden_states, _ = self.norm(hidden_states, residual)
    return (hidden_states, aux) if aux else hidden_states


def _with_mixin(cls: type) -> type:
    """The inner model class ``cls`` with vLLM's EagleModelMixin and the aux-collecting forward."""
    from vllm.model_executor.models.interfaces import EagleModelMixin

    if cls not in _WRAPPED:
        _WRAPPED[cls] = type(f"{cls.__name__}Eagle3", (EagleModelMixin, cls), {"forward": _forward})
    return _WRAPPED[cls]


def with_eagle3(base: type, inner: str) -> type:
    """``base`` (a vLLM ``*ForCausalLM`` class whose module builds its ``model`` from the class named
    ``inner``) with vLLM's EAGLE-3 interface."""
    import sys

    from vllm.model_executor.models.interfaces import SupportsEagle3

    module = sys.modules[base.__module__]

    class Eagle3(base, SupportsEagle3):
        def __init__(self, *, vllm_config, prefix: str = ""):
            original = getattr(module, inner)
            setattr(module, inner, _with_mixin(original))  # base.__init__ builds self.model from it
            try:
                super().__init__(vllm_config=vllm_config, prefix=prefix)
            finally:
                setattr(module, inner, original)
            if not isinstance(self.model, _WRAPPED[original]):
                raise RuntimeError(f"moespec: {base.__name__} did not build its model from {inner}: the EAGLE-3 "
                                   f"wrapper does not fit this vLLM version")

        def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
            L = self.config.num_hidden_layers
            return (2, L // 2, L - 3)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            loaded = super().load_weights(weights)
            for name, param in self.named_parameters():
                if name not in loaded and name.endswith(".bias"):  # built by vLLM, absent from the checkpoint
                    with torch.no_grad():
                        param.zero_()
                    loaded.add(name)
            return loaded

    Eagle3.__name__ = Eagle3.__qualname__ = base.__name__
    Eagle3.__module__ = __name__
    return Eagle3

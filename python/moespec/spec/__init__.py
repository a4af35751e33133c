"""Speculative decoding: EAGLE-3 draft heads, EAGLE-2 dynamic draft trees, lossless verification,
expert-budget policies and the LLM API.

- :class:`LLM`, :class:`SpeculativeConfig`, :class:`SamplingParams`: the user API (TensorRT-LLM style).
- :mod:`moespec.spec.policies`: the policy objects of the registry :mod:`moespec.config` (``ar``, ``eagle3``,
  ``eagle3+budget``; :mod:`moespec.spec.eagle3_policy`).
- :mod:`moespec.spec.eagle3`: the EAGLE-3 head, its KV cache and checkpoint loader;
  :mod:`moespec.spec.train`: ``moespec train-draft``.
- :class:`TreeBuilder`: EAGLE-2 dynamic draft trees for a batch of requests (native
  ``DraftTreeBatch``, cpp/include/moespec/draft_tree.h), giving each request a :class:`DraftTree`
  (DESIGN.md "Contracts" -> "Draft tree").
- :mod:`moespec.spec.sampling`: logits processing and tree acceptance (greedy, speculative sampling).
"""

from moespec.spec.llm import LLM, CompletionOutput, RequestOutput, RequestStats, SpeculativeConfig
from moespec.spec.sampling import SamplingParams
from moespec.spec.tree import Candidates, DraftTree, Frontier, TreeBuilder, unpack_mask

__all__ = [
    "Candidates", "CompletionOutput", "DraftTree", "Frontier", "LLM", "RequestOutput", "RequestStats",
    "SamplingParams", "SpeculativeConfig", "TreeBuilder", "unpack_mask",
]

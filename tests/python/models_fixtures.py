"""Tiny random checkpoints written by transformers itself, and transformers-side references.

The checkpoints come from transformers' own ``save_pretrained``, so the reference is independent
of moespec's loader; the reference forward is transformers' model with
``experts_implementation="eager"`` (bit-exact MoE arithmetic, REFERENCE.md section 1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

V = 128  # vocabulary of the tiny models

CONFIGS = {
    # Qwen3-MoE with a dense layer in the middle (mlp_only_layers) and renormalised top-k.
    "qwen3_moe": (Qwen3MoeForCausalLM, lambda: Qwen3MoeConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=True, mlp_only_layers=[1], initializer_range=0.1, rope_theta=1000.0)),
    "mixtral": (MixtralForCausalLM, lambda: MixtralConfig(
        vocab_size=V, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, initializer_range=0.1,
        bos_token_id=1, eos_token_id=2)),
    # OLMoE with q/k norms over the projections and clip_qkv.
    "olmoe": (OlmoeForCausalLM, lambda: OlmoeConfig(
        vocab_size=V, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_experts=16, num_experts_per_tok=4, clip_qkv=0.5, initializer_range=0.1,
        eos_token_id=2, pad_token_id=1)),
    # Qwen2-MoE: a sigmoid-gated shared expert beside 16 routed experts of 16, top-4 (the default
    # model's family).
    "qwen2_moe": (Qwen2MoeForCausalLM, lambda: Qwen2MoeConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
        shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, qkv_bias=False, initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, bos_token_id=1, eos_token_id=2)),
    # Dense Llama with GQA (one kv head), tied embeddings and llama3 rope scaling.
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, tie_word_embeddings=True, initializer_range=0.1,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
}
FAMILIES = list(CONFIGS)
MOE_FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]


def write_checkpoint(family: str, folder: Path, seed: int = 0, **save_kwargs) -> Path:
    cls, make_config = CONFIGS[family]
    torch.manual_seed(seed)
    model = cls(make_config())
    model.save_pretrained(folder, **save_kwargs)
    return folder


FP32_TOL = 1e-4  # of the logit scale: how close fp32 logits of two implementations must be


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float = FP32_TOL) -> None:
    """max |got - want| <= tol * max |want| (the logit scale)."""
    scale = want.abs().max().item()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * scale, f"max |d| = {err:.3g}, logit scale {scale:.3g}"


def check_prefill_and_decode(model, hf, prompt: list[int], steps: int = 8, tol: float = FP32_TOL) -> None:
    """The runtime (loaded with one tap) against transformers: prefill logits and the tapped residual
    stream, then ``steps`` greedy decode steps, each against a full transformers forward."""
    cache = model.new_cache(1, len(prompt) + steps + 8)
    out = model.prefill(cache, [prompt], logits="all")
    with torch.no_grad():
        want = hf(torch.tensor([prompt]), output_hidden_states=True)
    assert_close(out.logits[0], want.logits[0], tol)
    assert_close(out.hidden[0][0], want.hidden_states[model.taps[0] + 1][0], tol)
    seq = list(prompt)
    token = int(out.logits[0, -1].argmax())
    for _ in range(steps):
        seq.append(token)
        got = model.decode(cache, [token]).logits[0]
        with torch.no_grad():
            assert_close(got, hf(torch.tensor([seq])).logits[0, -1], tol)
        token = int(got.argmax())
    assert cache.lengths == [len(seq)]


def reference(path: Path, dtype=torch.float32):
    kwargs = {"experts_implementation": "eager"} if "llama" not in str(path) else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).eval()


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """bool [T, T]: node i sees node j iff j is i or one of its ancestors."""
    T = len(parents)
    vis = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        j = i
        while j >= 0:
            vis[i, j] = True
            j = parents[j]
    return vis


def depths(parents: list[int]) -> list[int]:
    out = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


@torch.no_grad()
def hf_routing_near_tie(hf, seq: list[int], rel: float = 1e-5) -> bool:
    """Whether transformers routes the last token of ``seq`` with a near-tie at the top-k boundary in
    some layer (the k-th and (k+1)-th router scores within ``rel`` of the largest): there the chosen
    expert follows the summation order, not the model, and the logits of two correct implementations
    may differ by a whole expert."""
    k = getattr(hf.config, "num_experts_per_tok", None)
    if not k:
        return False
    for scores in hf(torch.tensor([seq]), output_router_logits=True).router_logits:
        v = scores.reshape(-1, scores.shape[-1])[-1].float().sort(descending=True).values
        if k < v.numel() and (v[k - 1] - v[k]).item() <= rel * v.abs().max().item():
            return True
    return False


@torch.no_grad()
def hf_tree_logits(hf, prompt: list[int], tree: list[int], parents: list[int], budget=None,
                   record: Optional[list] = None) -> torch.Tensor:
    """transformers' logits [T, V] for a tree after a prompt: the prompt through its cache, then the
    tree in one pass with a custom 4-D mask (ancestors only) and positions prompt length + depth.
    With ``budget``, the tree pass routes through :func:`budgeted_moe_blocks`."""
    L, T = len(prompt), len(tree)
    out = hf(torch.tensor([prompt]), use_cache=True)
    full = torch.cat([torch.ones(T, L, dtype=torch.bool), ancestor_mask(parents)], dim=1)
    mask = torch.zeros(1, 1, T, L + T, dtype=hf.dtype).masked_fill(~full, float("-inf"))
    positions = torch.tensor([[L + d for d in depths(parents)]])
    blocks = budgeted_moe_blocks(hf, budget, record) if budget is not None else []
    try:
        return hf(torch.tensor([tree]), cache=out.past_key_values, attention_mask=mask,
                  position_ids=positions).logits[0]
    finally:
        for block in blocks:
            del block.forward  # back to the class's forward


def budgeted_moe_blocks(hf, budget, record: Optional[list] = None) -> list:
    """Patches every MoE block of a transformers model to route with the plain-torch reference of the
    budget semantics (moespec.ops.reference) on the tokens of each call; transformers' eager experts
    then skip dropped slots (id N); a shared expert (Qwen2-MoE) runs as transformers runs it. The first
    ``budget.exact_layers`` MoE blocks route without the budget. Appends each call's RoutingStats to
    ``record``. Returns the patched blocks (``del block.forward`` restores one)."""
    from moespec.ops import RouterSpec
    from moespec.ops.reference import route_experts_reference

    spec = RouterSpec.from_config(hf.config)
    blocks = []
    for layer in hf.model.layers:
        block = getattr(layer, "mlp", None)
        if block is None or not hasattr(block, "experts"):
            continue

        def forward(hidden_states, block=block, exact=len(blocks) < budget.exact_layers):
            B, T, H = hidden_states.shape
            x = hidden_states.reshape(-1, H)
            logits = torch.nn.functional.linear(x, block.gate.weight)
            ids, weights, _, stats = route_experts_reference(logits, spec, None if exact else budget)
            if record is not None:
                record.append(stats)
            if hf.config.model_type != "mixtral":
                weights = weights.to(x.dtype)
            out = block.experts(x, ids.long(), weights)
            if hasattr(block, "shared_expert"):  # Qwen2-MoE: every token, never budgeted
                out = out + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
            return out.reshape(B, T, H)

        block.forward = forward
        blocks.append(block)
    return blocks


# ---- checks shared by the families tested against transformers in their own files (GPT-OSS, DeepSeek-V3)


@torch.no_grad()
def hf_last(hf, seq: list[int]) -> torch.Tensor:
    """transformers' next-token logits [V] after ``seq``."""
    return hf(torch.tensor([seq])).logits[0, -1]


def check_tree_equals_paths(model, hf, prompt: list[int]) -> None:
    """Each verified node's logits equal transformers' on the prompt plus its root-to-node path; after
    commit, decoding continues as from scratch."""
    cache = model.new_cache(1, len(prompt) + 16)
    model.prefill(cache, [prompt])
    tree, parents = [11, 12, 13, 14, 15, 16, 17], [-1, 0, 0, 1, 1, 3, 2]
    out = model.verify(cache, [tree], [parents])
    for node in range(len(tree)):
        path, j = [], node
        while j >= 0:
            path.insert(0, tree[j])
            j = parents[j]
        assert_close(out.logits[0, node], hf_last(hf, prompt + path))
    model.commit(cache, [[0, 1, 3, 5]])
    assert_close(model.decode(cache, [40]).logits[0], hf_last(hf, prompt + [11, 12, 14, 16, 40]))


def check_unequal_batch(model, prompts: list[list[int]]) -> None:
    """A batch of unequal prompts gives each request's logits alone."""
    cache = model.new_cache(len(prompts), 32)
    batch = model.prefill(cache, prompts).logits
    for b, p in enumerate(prompts):
        assert_close(batch[b], model.prefill(model.new_cache(1, 32), [p]).logits[0])


def check_greedy_speculation(target, prompts: list[list[int]], budget: int, folder: Path) -> None:
    """Greedy eagle3 and eagle3+budget (a budget that cannot bind) with a random head == greedy ar; the
    head goes through an official EAGLE-3 folder (``folder``: config.json with
    eagle_aux_hidden_state_layer_ids + model.safetensors with a draft vocabulary mapping) and loads
    back as heads for the other families do."""
    from moespec import LLM, SamplingParams, SpeculativeConfig
    from moespec.spec.eagle3 import load_eagle3
    from moespec.spec.train import _write_head, new_head

    used = torch.arange(0, target.config.vocab_size, 2)  # a draft vocabulary: every other target id
    folder.mkdir(parents=True, exist_ok=True)
    _write_head(new_head(target.config, target.weights.embed, used, seed=0), folder, {})
    head = load_eagle3(folder, target)
    assert head.config.draft_vocab_size < target.config.vocab_size and "eagle_aux_hidden_state_layer_ids" in \
        json.loads((folder / "config.json").read_text()).get("eagle_config", {})
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(target).generate(prompts, params)]
    for config in (SpeculativeConfig("eagle3", depth=3, top_k=3, total_tokens=6),
                   SpeculativeConfig("eagle3+budget", depth=3, top_k=3, total_tokens=6, budget=budget)):
        llm = LLM(target, draft=head, speculative_config=config, max_batch_size=2)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want, config.policy


def check_trace(model, prompt: list[int]) -> None:
    """A routing observer records prefill, decode and verify passes with the natural routing of every
    MoE layer (ids inside [0, E), K per token)."""
    from moespec.models.trace import RoutingObserver

    obs = RoutingObserver()
    model.observer = obs
    try:
        cache = model.new_cache(1, len(prompt) + 8)
        model.prefill(cache, [prompt])
        model.decode(cache, [7])
        model.verify(cache, [[9, 10, 11]], [[-1, 0, 0]])
    finally:
        model.observer = None
    moe = model.config.moe
    trace = obs.trace(num_experts=moe.num_experts, top_k=moe.top_k, layers=moe.layers)
    assert obs.num_passes == 3 and trace.ids.shape == (len(prompt) + 4, len(moe.layers), moe.top_k)
    assert int(trace.ids.min()) >= 0 and int(trace.ids.max()) < moe.num_experts

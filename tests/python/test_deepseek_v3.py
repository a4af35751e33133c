"""DeepSeek-V3 (moespec.models.families.deepseek_v3) against transformers' own DeepseekV3ForCausalLM: tiny
random checkpoints written by transformers (one dense layer then MoE layers with a shared expert, 16
experts in 4 groups with 2 kept, a random correction bias, MLA with and without the q rank,
interleaved rope, YaRN with mscale), eager attention and experts as the reference. fp32 logits
within 1e-4 of the logit scale; the cache holds the latent and the rope key only; both forms of MLA
(absorbed: decode and verify; expanded: prefill) each against transformers."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from models_fixtures import (
    assert_close, check_greedy_speculation, check_prefill_and_decode, check_trace, check_tree_equals_paths,
    check_unequal_batch,
)
from moespec.models import load
from moespec.ops import ExpertBudget, RouterSpec
from moespec.ops.reference import route_experts_reference
from moespec.runtime import attention

pytestmark = pytest.mark.usefixtures("one_thread")
E, K, R, ROPE = 16, 4, 32, 8
PROMPT = [3, 17, 99, 5, 42, 8, 77, 12, 9, 33]


def write(folder, q_lora_rank, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    kwargs = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=E,
                  routed_scaling_factor=2.5, kv_lora_rank=R, q_lora_rank=q_lora_rank, qk_rope_head_dim=ROPE,
                  v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=K,
                  first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=64, initializer_range=0.1,
                  rope_interleave=True, eos_token_id=2,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "original_max_position_embeddings": 16, "mscale": 1.0,
                                   "mscale_all_dim": 0.8})
    kwargs.update(overrides)
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(**kwargs))
    with torch.no_grad():  # (transformers initialises the router and its bias to zeros)
        for layer in hf.model.layers[kwargs["first_k_dense_replace"]:]:
            layer.mlp.gate.weight.normal_(0.0, 0.3)
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    hf.save_pretrained(folder)
    return folder


def reference(folder, dtype=torch.float32):
    return DeepseekV3ForCausalLM.from_pretrained(folder, dtype=dtype, experts_implementation="eager",
                                                 attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=[24, None], ids=["q_lora", "q_proj"])
def folder(request, tmp_path_factory):
    return write(tmp_path_factory.mktemp("deepseek_v3") / "m", request.param)


def test_prefill_and_decode_equal_transformers(folder):
    model, hf = load(folder, "fp32", taps=(1,)), reference(folder)
    c = model.config
    assert c.mla is not None and c.moe.layers == (1, 2) and c.moe.router.family == "deepseek_v3"
    assert c.rope.attention_scaling != 1.0  # mscale != mscale_all_dim: the cos/sin scale is exercised
    cache = model.new_cache(1, 32)
    assert cache.k.shape[2:] == (1, 32, R) and cache.v.shape[2:] == (1, 32, ROPE)  # latent + rope key only
    check_prefill_and_decode(model, hf, PROMPT)


def test_bf16_prefill_and_decode_within_bf16_rounding(folder):
    """bf16 within 3e-2 of the logit scale (transformers keeps the router and its bias in float32 where
    moespec holds them in bf16, and sums the experts' matmuls in bf16)."""
    check_prefill_and_decode(load(folder, "bf16", taps=(1,)), reference(folder, torch.bfloat16), PROMPT, tol=3e-2)


@pytest.mark.parametrize("absorbed", [True, False], ids=["absorbed", "expanded"])
def test_each_mla_form_equals_transformers(folder, monkeypatch, absorbed):
    """Prefill and decode with MLA in one form throughout: absorbed (kv_b's key part folded into the
    queries, its value part applied to the heads' outputs: one attention over the cached latent) or
    expanded (transformers' own: keys and values of every head from every slot); fp32 within 1e-4 and
    bf16 within its rounding of transformers."""
    monkeypatch.setattr(attention, "mla_absorbed", lambda c, T, S: absorbed)
    check_prefill_and_decode(load(folder, "fp32", taps=(1,)), reference(folder), PROMPT)
    check_prefill_and_decode(load(folder, "bf16", taps=(1,)), reference(folder, torch.bfloat16), PROMPT, tol=3e-2)


def test_decode_and_verify_attend_over_the_latent_without_expanding_it(folder, monkeypatch):
    """The form by multiplies: decode and tree verify (T << S) absorbed, a prefill expanded; an
    absorbed step never applies kv_b to the cache (the expanded form's S-slot projection), a prefill
    does."""
    model = load(folder, "fp32")
    c = model.config
    assert attention.mla_absorbed(c, 1, 11) and attention.mla_absorbed(c, 8, 64)
    assert not attention.mla_absorbed(c, len(PROMPT), len(PROMPT))
    kv_b = {layer.kv_b.data_ptr() for layer in model.weights.layers}
    expansions = []
    plain = attention.linear

    def recording(x, weight, *args, **kwargs):
        if weight.data_ptr() in kv_b:
            expansions.append(x.shape[-2])
        return plain(x, weight, *args, **kwargs)

    monkeypatch.setattr(attention, "linear", recording)
    cache = model.new_cache(1, 64)
    model.prefill(cache, [PROMPT])
    assert expansions == [len(PROMPT)] * c.num_layers  # each layer expands the prompt's slots once
    expansions.clear()
    model.decode(cache, [5])
    model.verify(cache, [[5, 6, 7, 8]], [[-1, 0, 0, 1]])
    assert expansions == []


def test_tree_verify_equals_path_decoding_and_commit(folder):
    check_tree_equals_paths(load(folder, "fp32"), reference(folder), PROMPT)


def test_routing_traces(folder):
    check_trace(load(folder, "fp32"), PROMPT)


def test_unequal_batch_equals_each_request_alone(folder):
    check_unequal_batch(load(folder, "fp32"), [PROMPT, PROMPT[:6]])


def test_budget_equals_the_reference_semantics(folder):
    """A budgeted verify chain against transformers whose MoE blocks route with the plain-torch budget
    reference (group-limited selection, correction bias, scaling), the shared expert unbudgeted."""
    model, hf = load(folder, "fp32"), reference(folder)
    budget = ExpertBudget(6)
    spec = RouterSpec("deepseek_v3", K, renormalize=True, n_group=4, topk_group=2, scaling=2.5)
    record = []
    for layer in hf.model.layers[1:]:
        mlp = layer.mlp

        def forward(hidden_states, mlp=mlp):
            x = hidden_states.reshape(-1, hidden_states.shape[-1])
            logits = torch.nn.functional.linear(x.float(), mlp.gate.weight.float())
            bias = mlp.gate.e_score_correction_bias
            ids, weights, _, stats = route_experts_reference(logits, spec, budget, bias=bias)
            record.append(stats)
            out = mlp.experts(x, ids.long(), weights) + mlp.shared_experts(x)
            return out.reshape(hidden_states.shape)

        mlp.forward = forward
    chain = PROMPT[:8]
    out = model.verify(model.new_cache(1, 16), [chain], [[-1] + list(range(7))], budget=budget)
    with torch.no_grad():
        want = hf(torch.tensor([chain])).logits[0]
    assert_close(out.logits[0], want)
    assert [(s.natural_unique, s.kept, s.rerouted) for s in record] == [tuple(r[:3]) for r in out.expert_stats.tolist()]
    assert all(s.kept <= 6 for s in record) and any(s.natural_unique > 6 for s in record)


def test_greedy_eagle3_equals_greedy_ar(folder, tmp_path):
    check_greedy_speculation(load(folder, "fp32"), [PROMPT, PROMPT[:7]], budget=E, folder=tmp_path / "head")


def test_engine_round_trip_and_bad_checkpoints(folder, tmp_path):
    from moespec.engine import build_engine, load_engine

    build_engine(folder, tmp_path / "engine", dtype="fp32", progress=False)
    engine, _ = load_engine(tmp_path / "engine")
    model = load(folder, "fp32")
    a, b = (m.prefill(m.new_cache(1, 16), [PROMPT]).logits for m in (engine, model))
    assert_close(a, b)  # (a memory-mapped weight may take another GEMV summation order)
    raw = json.loads((folder / "config.json").read_text())
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").symlink_to(folder / "model.safetensors")
    (broken / "config.json").write_text(json.dumps({**raw, "kv_lora_rank": R + 8}))  # the tensors disagree
    with pytest.raises(ValueError, match="kv_a_proj_with_mqa"):
        load(broken, "fp32")
    (broken / "config.json").write_text(json.dumps({**raw, "n_group": 5}))
    with pytest.raises(ValueError, match="n_group"):
        load(broken, "fp32")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    tensors.pop("model.layers.1.self_attn.kv_b_proj.weight")
    (broken / "model.safetensors").unlink()
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    (broken / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="kv_b_proj"):  # a missing MLA tensor, by name
        load(broken, "fp32")


def test_cost_catalogue_counts_the_parsed_config(folder):
    """The cost model's shape of the parsed config (MoeShape.from_config) counts exactly transformers'
    parameters (plus the correction-bias buffers the catalogue counts as router biases)."""
    from moespec.cost.shapes import MoeShape
    from moespec.models import read_config

    hf = reference(folder)
    shape = MoeShape.from_config(read_config(folder))
    assert shape.attention_type == "mla" and shape.dense_layers == 1
    biases = sum(b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    assert shape.total_params == sum(p.numel() for p in hf.parameters()) + biases


def test_mla_bench_on_a_deepseek_v3_shaped_layer(tmp_path, monkeypatch):
    """python -m moespec.bench.mla: on DeepSeek-V3's real attention shape (128 heads, kv rank 512) the
    two forms give the same layer output (fp32), the bench writes its JSON and plot, and refuses
    T > S."""
    from moespec.bench import mla

    c, layer = mla.layer_and_config(torch.float32, "cpu")
    fn = mla.step(c, layer, 4, 24, torch.float32, "cpu")
    outs = []
    for absorbed in (True, False):
        monkeypatch.setattr(attention, "mla_absorbed", lambda c_, T, S, a=absorbed: a)
        outs.append(fn())
    monkeypatch.undo()
    assert_close(outs[0], outs[1], 1e-4)
    mla.main(["--contexts", "24", "--tokens", "1", "24", "--repeats", "1", "--dtype", "fp32", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "mla.json").read_text())["rows"]
    assert [(r["T"], r["S"], r["picks"]) for r in rows] == [(1, 24, "absorbed"), (24, 24, "expanded")]
    assert all(r["expanded_ms"] > 0 and r["absorbed_ms"] > 0 for r in rows) and (tmp_path / "mla.png").stat().st_size
    with pytest.raises(SystemExit):
        mla.main(["--contexts", "8", "--tokens", "16"])

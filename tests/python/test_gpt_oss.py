"""GPT-OSS (moespec.models.families.gpt_oss) against transformers' own GptOssForCausalLM: a tiny random
checkpoint written by transformers with alternating sliding (window 4, so that it binds) and full
layers, random sinks and biases, YaRN rope; eager attention and experts as the reference.

fp32 logits within 1e-4 of the logit scale (FP32_TOL); bf16 within 3e-2 (transformers runs the
experts' matmuls and the router softmax in bf16, moespec's kernel sums in fp32). MXFP4: the
dequantization equals transformers' on random blocks, and a checkpoint holding its experts as MXFP4
blocks loads to the same weights as the same values stored dense."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig, GptOssForCausalLM

from models_fixtures import (
    FP32_TOL, assert_close, check_greedy_speculation, check_prefill_and_decode, check_trace,
    check_tree_equals_paths, check_unequal_batch,
)
from moespec.models import load
from moespec.models.weights import dequantize_mxfp4
from moespec.ops import ExpertBudget, RouterSpec
from moespec.ops.reference import route_experts_reference

pytestmark = pytest.mark.usefixtures("one_thread")
V, E, K, WINDOW = 128, 8, 2, 4
PROMPT = [3, 17, 99, 5, 42, 8, 77, 12, 9, 33]


def make_config(**overrides) -> GptOssConfig:
    kwargs = dict(vocab_size=V, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=E, num_experts_per_tok=K,
                  sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
                  initializer_range=0.1, max_position_embeddings=64, eos_token_id=2,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})
    kwargs.update(overrides)
    return GptOssConfig(**kwargs)


def write(folder, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    hf = GptOssForCausalLM(make_config(**overrides))
    with torch.no_grad():  # (transformers initialises these to zeros or leaves them empty)
        for layer in hf.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
            layer.mlp.router.bias.normal_(0.0, 0.5)
            layer.mlp.experts.gate_up_proj_bias.normal_(0.0, 0.1)
            layer.mlp.experts.down_proj_bias.normal_(0.0, 0.1)
    hf.save_pretrained(folder)
    return folder


def reference(folder, dtype=torch.float32):
    return GptOssForCausalLM.from_pretrained(folder, dtype=dtype, experts_implementation="eager",
                                             attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write(tmp_path_factory.mktemp("gpt_oss") / "gpt_oss")


@pytest.mark.parametrize("dtype,tol", [("fp32", FP32_TOL), ("bf16", 3e-2)])
def test_prefill_and_decode_equal_transformers(folder, dtype, tol):
    model = load(folder, dtype, taps=(1,))
    c = model.config
    assert c.sliding_layers == (0, 2) and c.window(0) == WINDOW and c.window(1) == 0 and c.attention_sinks
    assert c.rope.kind == "yarn" and c.moe.router.family == "gpt_oss" and model.backend_name == "reference"
    hf = reference(folder, torch.float32 if dtype == "fp32" else torch.bfloat16)
    check_prefill_and_decode(model, hf, PROMPT, tol=tol)  # 10 tokens: the window of 4 binds


def test_tree_verify_equals_path_decoding_and_commit(folder):
    """(positions by depth, the window counted in positions)"""
    check_tree_equals_paths(load(folder, "fp32"), reference(folder), PROMPT)


def test_routing_traces(folder):
    check_trace(load(folder, "fp32"), PROMPT)


def test_unequal_batch_equals_each_request_alone(folder):
    check_unequal_batch(load(folder, "fp32"), [PROMPT, PROMPT[:6]])


def test_budget_equals_the_reference_semantics(folder):
    """A budgeted verify pass against transformers whose MoE blocks route with the plain-torch budget
    reference (substitution: every token keeps K experts, each layer's union capped)."""
    model, hf = load(folder, "fp32"), reference(folder)
    budget = ExpertBudget(3)
    spec = RouterSpec("gpt_oss", K)
    record = []
    for layer in hf.model.layers:
        mlp = layer.mlp

        def forward(hidden_states, mlp=mlp):
            B, T, H = hidden_states.shape
            x = hidden_states.reshape(-1, H)
            logits = torch.nn.functional.linear(x, mlp.router.weight, mlp.router.bias)
            ids, weights, _, stats = route_experts_reference(logits, spec, budget)
            record.append(stats)
            return mlp.experts(x, ids.long(), weights.to(x.dtype)).reshape(B, T, H), None

        mlp.forward = forward
    cache = model.new_cache(1, 32)  # one chain verified on an empty cache: one transformers call
    chain = PROMPT[:8]  # 8 tokens: the window of 4 binds
    out = model.verify(cache, [chain], [[-1] + list(range(7))], budget=budget)
    with torch.no_grad():
        want = hf(torch.tensor([chain])).logits[0]
    assert_close(out.logits[0], want)
    assert [(s.natural_unique, s.kept) for s in record] == [tuple(r[:2]) for r in out.expert_stats.tolist()]
    assert all(s.kept <= 3 for s in record)


def test_greedy_eagle3_equals_greedy_ar(folder, tmp_path):
    check_greedy_speculation(load(folder, "fp32"), [PROMPT, PROMPT[:7]], budget=E, folder=tmp_path / "head")


# ---- MXFP4 ----------------------------------------------------------------------------------------


def test_mxfp4_dequantization_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 6, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 134, (3, 6, 2), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 64, 6] (transposed)
    assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(1, 2), want)
    with pytest.raises(ValueError, match="blocks must be"):
        dequantize_mxfp4(blocks[..., :15], scales)


def _quantize_mxfp4(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks and scales of values already on the e2m1 grid at scale 2^0 (nibble per value)."""
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    codes = (values[..., None] == lut).float().argmax(-1).to(torch.uint8)  # [..., n]
    codes = codes.reshape(*values.shape[:-1], values.shape[-1] // 32, 16, 2)
    return codes[..., 0] | (codes[..., 1] << 4), torch.full(codes.shape[:-2], 127, dtype=torch.uint8)


def test_mxfp4_checkpoint_loads_as_its_dense_twin(tmp_path):
    """The experts stored as MXFP4 blocks (transformers' on-disk layout) load to the weights of the same
    values stored dense; a block of the wrong size is an error naming the tensor."""
    dense = write(tmp_path / "dense", seed=1)
    tensors = load_file(str(dense / "model.safetensors"))
    g = torch.Generator().manual_seed(2)
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    packed = dict(tensors)
    for name in [n for n in tensors if n.endswith("experts.gate_up_proj") or n.endswith("experts.down_proj")]:
        t = tensors[name]  # [E, rows, cols] as the model holds it
        grid = lut[torch.randint(0, len(lut), t.shape, generator=g)]
        tensors[name] = grid * 0.25  # the dense twin: the same values
        blocks, scales = _quantize_mxfp4(grid.transpose(1, 2).contiguous())  # stored transposed
        packed.pop(name)
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales - 2  # 2^-2 = 0.25
    save_file(tensors, str(dense / "model.safetensors"), metadata={"format": "pt"})
    quant = tmp_path / "mxfp4"
    quant.mkdir()
    (quant / "config.json").write_text((dense / "config.json").read_text())
    save_file(packed, str(quant / "model.safetensors"), metadata={"format": "pt"})
    a, b = load(dense, "fp32"), load(quant, "fp32")
    for la, lb in zip(a.weights.layers, b.weights.layers):
        assert torch.equal(la.experts, lb.experts) and torch.equal(la.expert_biases, lb.expert_biases)
    bad = dict(packed)
    name = next(n for n in bad if n.endswith("down_proj_blocks"))
    bad[name] = bad[name][..., :8].contiguous()
    save_file(bad, str(quant / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj_blocks"):
        load(quant, "fp32")


def test_bad_configs_name_the_field(tmp_path):
    folder = write(tmp_path / "m")
    raw = json.loads((folder / "config.json").read_text())
    for key, value, match in (("layer_types", ["sliding_attention"] * 3, "layer_types"),
                              ("sliding_window", 0, "sliding_window"),
                              ("rope_parameters", {"rope_type": "longrope", "rope_theta": 10.0}, "longrope")):
        (folder / "config.json").write_text(json.dumps({**raw, key: value}))
        with pytest.raises(ValueError, match=match):
            load(folder, "fp32")


def test_engine_folder_round_trip(folder, tmp_path):
    """moespec build writes the GPT-OSS tensors (sinks, router bias, expert biases) and the engine
    runs as the checkpoint does; its TensorRT network, exported from the engine's memory map, is the
    checkpoint's (same initializers; the network itself is tested in test_onnx_export)."""
    from moespec.engine import build_engine, load_engine
    from moespec.engine.onnx_export import export_verify

    build_engine(folder, tmp_path / "engine", dtype="fp32", progress=False)
    engine, _ = load_engine(tmp_path / "engine")
    model = load(folder, "fp32")
    caches = [m.new_cache(1, 16) for m in (engine, model)]
    a, b = (m.prefill(c, [PROMPT], logits="all").logits for m, c in zip((engine, model), caches))
    assert torch.equal(a, b)
    got, want = (export_verify(m.config, m.weights) for m in (engine, model))
    assert {t.name: t.raw_data for t in got.graph.initializer} == {t.name: t.raw_data for t in want.graph.initializer}


def test_cost_catalogue_counts_the_parsed_config(folder):
    """MoeShape.from_config of the parsed config counts exactly transformers' parameters."""
    from moespec.cost.shapes import MoeShape
    from moespec.models import read_config

    shape = MoeShape.from_config(read_config(folder))
    assert shape.sliding_layers == 2 and shape.attention_sinks and shape.expert_bias
    assert shape.total_params == sum(p.numel() for p in reference(folder).parameters())

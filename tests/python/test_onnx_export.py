"""The TensorRT verify network (moespec.engine.onnx_export) against moespec's runtime, run by
onnxruntime with the plugin nodes as their reference bodies (moespec.engine.onnx_plugins), and those
bodies against the plain-torch references of the routing and MoE semantics."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from hypothesis import given, settings, strategies as st
from onnx import TensorProto, helper

import test_deepseek_v3 as deepseek_fixtures
import test_gpt_oss as gpt_oss_fixtures
from models_fixtures import FAMILIES, ancestor_mask, assert_close, depths, write_checkpoint
from moespec.engine.onnx_export import export_verify
from moespec.engine.onnx_plugins import (
    MOE, MOE_FIELDS, ROUTE, ROUTE_FIELDS, moe_fields, route_fields, with_reference_functions,
)
from moespec.models import load
from moespec.ops import ExpertBudget, RouterSpec
from moespec.ops.reference import moe_experts_reference, route_experts_reference
from moespec.runtime.attention import cache_shapes

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")


# GPT-OSS: sinks, sliding windows (4: they bind), YaRN, router and expert biases, clamped experts;
# DeepSeek-V3: MLA (with and without the q rank), interleaved rope, YaRN with mscale, group-limited
# sigmoid routing with a correction bias, a dense first layer, an ungated shared expert.
WRITERS = {family: (lambda out, family=family: write_checkpoint(family, out)) for family in FAMILIES}
WRITERS.update({"gpt_oss": gpt_oss_fixtures.write, "deepseek_v3": lambda out: deepseek_fixtures.write(out, 24),
                "deepseek_v3_q_proj": lambda out: deepseek_fixtures.write(out, None)})
ALL = list(WRITERS)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> fp32 TargetModel of its tiny random checkpoint (taps at layer 0)."""
    root = tmp_path_factory.mktemp("onnx")
    return {family: load(write(root / family), "fp32", taps=(0,)) for family, write in WRITERS.items()}


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(with_reference_functions(model).SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])


def run(sess: ort.InferenceSession, ids, positions, mask, past) -> dict[str, np.ndarray]:
    feeds = {"input_ids": np.asarray(ids, np.int64), "position_ids": np.asarray(positions, np.int64),
             "attention_mask": np.asarray(mask, bool), **past}
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def empty_past(c, batch: int) -> dict[str, np.ndarray]:
    shapes = dict(zip(("key", "value"), cache_shapes(c)))  # (heads, width): GQA's [Hkv, D], MLA's latent and rope key
    return {f"past_{kind}_{i}": np.zeros((batch, shapes[kind][0], 0, shapes[kind][1]), np.float32)
            for i in range(c.num_layers) for kind in ("key", "value")}


def presents(res: dict[str, np.ndarray], c) -> dict[str, np.ndarray]:
    return {f"past_{kind}_{i}": res[f"present_{kind}_{i}"] for i in range(c.num_layers) for kind in ("key", "value")}


PROMPTS = [[3, 17, 99, 5, 42, 8, 77], [9, 1, 64, 23, 5, 120, 31]]
TREE, PARENTS = [11, 12, 13, 14, 15, 16], [-1, 0, 0, 1, 1, 2]


def check_prefill_then_tree(model, budget, batch: int = 1) -> None:
    """Prefill (unbudgeted network) then one draft tree per request (budgeted network): logits, the
    KV cache, the tapped hidden state and the expert stats equal the runtime's."""
    c = model.config
    prefill = session(export_verify(c, model.weights, taps=(0,)))
    verify = session(export_verify(c, model.weights, budget=budget, taps=(0,))) if budget is not None else prefill
    prompts = PROMPTS[:batch]
    P = len(prompts[0])
    cache = model.new_cache(batch, 32)
    want = model.prefill(cache, prompts, logits="all")
    got = run(prefill, prompts, [list(range(P))] * batch, np.tril(np.ones((P, P), bool))[None].repeat(batch, 0),
              empty_past(c, batch))
    assert_close(torch.from_numpy(got["logits"]), want.logits)
    assert_close(torch.from_numpy(got["hidden_0"]), want.hidden[0])
    for i in range(c.num_layers):
        assert_close(torch.from_numpy(got[f"present_key_{i}"]), cache.k[i, :, :, :P])
        assert_close(torch.from_numpy(got[f"present_value_{i}"]), cache.v[i, :, :, :P])
    trees = [TREE] + [[t + 20 for t in TREE]] * (batch - 1)
    want = model.verify(cache, trees, [PARENTS] * batch, budget=budget)
    T = len(TREE)
    mask = np.concatenate([np.ones((T, P), bool), ancestor_mask(PARENTS).numpy()], 1)[None].repeat(batch, 0)
    positions = [[P + d for d in depths(PARENTS)]] * batch
    got = run(verify, trees, positions, mask, presents(got, c))
    assert_close(torch.from_numpy(got["logits"]), want.logits)
    if c.moe is not None:
        assert got["expert_stats"].tolist() == want.expert_stats.tolist()
        if budget is not None:
            assert (got["expert_stats"][budget.exact_layers:, 1] <= budget.max_experts).all()


@pytest.mark.parametrize("family", ALL)
def test_network_equals_the_runtime(models, family):
    check_prefill_then_tree(models[family], None)


@pytest.mark.parametrize("family,policy", [("qwen3_moe", "substitution"), ("qwen3_moe", "truncation"),
                                           ("qwen2_moe", "substitution"), ("mixtral", "truncation"),
                                           ("olmoe", "substitution"), ("gpt_oss", "substitution"),
                                           ("gpt_oss", "truncation"), ("deepseek_v3", "substitution"),
                                           ("deepseek_v3_q_proj", "truncation")])
def test_budgeted_network_equals_the_budgeted_runtime(models, family, policy):
    budget = ExpertBudget(5, policy)
    check_prefill_then_tree(models[family], budget)


def test_exact_layers_export_unbudgeted_route_fields(models):
    model = models["qwen3_moe"]
    proto = export_verify(model.config, model.weights, budget=ExpertBudget(5, exact_layers=1))
    routes = [n for n in proto.graph.node if n.op_type == ROUTE]
    budgets = [next(a.i for a in n.attribute if a.name == "max_experts") for n in routes]
    assert budgets == [0] + [5] * (len(routes) - 1)  # the first MoE layer runs without the budget
    check_prefill_then_tree(model, ExpertBudget(5, exact_layers=1))


def test_batch_of_two_trees(models):
    check_prefill_then_tree(models["qwen2_moe"], ExpertBudget(6), batch=2)


def test_bf16_network_passes_the_checker_and_names_its_plugins(tmp_path):
    model = load(write_checkpoint("qwen2_moe", tmp_path / "m"), "bf16")
    proto = export_verify(model.config, model.weights, budget=ExpertBudget(6, "truncation"))
    onnx.checker.check_model(proto, full_check=True)
    plugins = [n for n in proto.graph.node if n.domain == "moespec"]
    assert [n.op_type for n in plugins] == [ROUTE, MOE] * len(model.config.moe_layers)
    for node in plugins:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["plugin_namespace"] == b"moespec" and attrs["plugin_version"] == b"1"
        if node.op_type == ROUTE:
            assert (attrs["max_experts"], attrs["policy"], attrs["top_k"]) == (6, 1, model.config.moe.top_k)
    experts = {t.name: t for t in proto.graph.initializer}["layers.0.experts"]
    assert experts.data_type == TensorProto.BFLOAT16
    assert experts.raw_data == model.weights.layers[0].experts.view(torch.int16).numpy().tobytes()


@pytest.mark.parametrize("header,names", [("route_experts_plugin.h", ROUTE_FIELDS), ("moe_experts_plugin.h", MOE_FIELDS)])
def test_node_attributes_are_the_plugin_fields(header, names):
    """The attribute names the export writes are the C++ plugins' field tables, in order."""
    text = (ROOT / "plugins" / "tensorrt" / header).read_text()
    table = re.search(r"static void visit\(F& f, Visit&& v\) \{(.*?)\}", text, re.S).group(1)
    assert tuple(re.findall(r'v\("(\w+)"', table)) == names
    fields = route_fields(RouterSpec("softmax", 2), None) if header.startswith("route") else moe_fields(8)
    assert tuple(fields) == names


def test_export_errors(models):
    llama = models["llama"]
    with pytest.raises(ValueError, match="a budget needs an MoE model"):
        export_verify(llama.config, llama.weights, budget=ExpertBudget(4))
    with pytest.raises(ValueError, match="tap layer 9"):
        export_verify(llama.config, llama.weights, taps=(9,))
    model = models["qwen3_moe"]
    proto = export_verify(model.config, model.weights, budget=ExpertBudget(5, coverage=0.5))
    with pytest.raises(ValueError, match="covers budgets without coverage"):
        with_reference_functions(proto)


# ---- the reference bodies against the plain-torch references ------------------------------------------


def function_model(name: str, inputs: list[tuple[str, int, list]], outputs: list[tuple[str, int, list]],
                   attrs: dict) -> ort.InferenceSession:
    node = helper.make_node(name, [n for n, _, _ in inputs], [n for n, _, _ in outputs], domain="moespec",
                            plugin_namespace="moespec", plugin_version="1", **attrs)
    graph = helper.make_graph([node], "one", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                              [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("moespec", 1)])
    model.ir_version = 10
    model = with_reference_functions(model)
    onnx.checker.check_model(model)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@st.composite
def routers(draw):
    """(RouterSpec, N): a router of any family, with deepseek_v3's groups (N / n_group >= 2 each)."""
    family = draw(st.sampled_from(["softmax", "deepseek_v3", "gpt_oss"]))
    if family == "deepseek_v3":
        n_group = draw(st.sampled_from([1, 2, 4]))
        N = n_group * draw(st.integers(2, 6))
        topk_group = draw(st.integers(1, n_group))
        K = draw(st.integers(1, min(4, topk_group * (N // n_group))))
        return RouterSpec(family, K, draw(st.booleans()), n_group=n_group, topk_group=topk_group,
                          scaling=draw(st.sampled_from([1.0, 2.5]))), N
    N = draw(st.integers(4, 24))
    return RouterSpec(family, draw(st.integers(1, 4)), draw(st.booleans()) and family == "softmax"), N


@settings(max_examples=60, deadline=None)
@given(router=routers(), T=st.integers(1, 12), extra=st.integers(0, 8),
       policy=st.sampled_from(["substitution", "truncation", None]), seed=st.integers(0, 2**31 - 1))
def test_route_reference_equals_the_semantics(router, T, extra, policy, seed):
    spec, N = router
    K = spec.top_k
    budget = ExpertBudget(min(K + extra, N), policy) if policy is not None else None
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, N, generator=g) * 3
    bias = torch.randn(N, generator=g) * 0.5 if spec.family == "deepseek_v3" else None
    inputs = [("router_logits", TensorProto.FLOAT, [T, N])]
    if bias is not None:
        inputs.append(("bias", TensorProto.FLOAT, [N]))
    sess = function_model(ROUTE, inputs,
                          [("ids", TensorProto.INT32, [T, K]), ("weights", TensorProto.FLOAT, [T, K]),
                           ("active", TensorProto.INT32, [N]), ("stats", TensorProto.INT32, [4])],
                          route_fields(spec, budget, has_bias=bias is not None))
    feeds = {"router_logits": logits.numpy(), **({"bias": bias.numpy()} if bias is not None else {})}
    ids, weights, active, stats = sess.run(None, feeds)
    want_ids, want_weights, want_active, want_stats = route_experts_reference(logits, spec, budget, bias)
    # (deepseek_v3's slots come unsorted from torch: compare each token's (id, weight) pairs as sets)
    got = [sorted(zip(i, w)) for i, w in zip(ids.tolist(), weights.tolist())]
    want = [sorted(zip(i, w)) for i, w in zip(want_ids.tolist(), want_weights.tolist())]
    assert [[i for i, _ in row] for row in got] == [[i for i, _ in row] for row in want]
    np.testing.assert_allclose([[w for _, w in row] for row in got], [[w for _, w in row] for row in want],
                               rtol=1e-5, atol=1e-6)  # (onnxruntime's sigmoid and softmax differ from torch's by ulps)
    if spec.family != "deepseek_v3":  # the softmax families' slots are in descending order, as torch's
        assert ids.tolist() == want_ids.tolist()
    assert active[: want_active.numel()].tolist() == want_active.tolist() and (active[want_active.numel():] == N).all()
    assert stats.tolist() == [want_stats.natural_unique, want_stats.kept, want_stats.rerouted, want_stats.dropped]


@settings(max_examples=30, deadline=None)
@given(T=st.integers(1, 10), E=st.integers(1, 8), K=st.integers(1, 3), H=st.integers(1, 24), I=st.integers(1, 16),
       activation=st.sampled_from(["swiglu", "gpt_oss"]), seed=st.integers(0, 2**31 - 1))
def test_moe_reference_equals_the_semantics(T, E, K, H, I, activation, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.randint(0, E + 1, (T, K), generator=g, dtype=torch.int32)  # E: a dropped slot
    weights = torch.rand(T, K, generator=g) * (ids < E)
    experts = torch.randn(E, 3 * I * H, generator=g) * 0.3
    gpt_oss = activation == "gpt_oss"
    biases = torch.randn(E, 2 * I + H, generator=g) * 0.3 if gpt_oss else None
    inputs = [("x", TensorProto.FLOAT, [T, H]), ("ids", TensorProto.INT32, [T, K]),
              ("weights", TensorProto.FLOAT, [T, K]), ("experts", TensorProto.FLOAT, [E, 3 * I * H])]
    feeds = {"x": x.numpy(), "ids": ids.numpy(), "weights": weights.numpy(), "experts": experts.numpy()}
    if gpt_oss:
        inputs.append(("biases", TensorProto.FLOAT, [E, 2 * I + H]))
        feeds["biases"] = biases.numpy()
    # (limit 1.5 so that the clamps bind on these inputs)
    sess = function_model(MOE, inputs, [("out", TensorProto.FLOAT, [T, H])],
                          moe_fields(I, activation, limit=1.5, alpha=1.702, has_biases=gpt_oss))
    (out,) = sess.run(None, feeds)
    want = moe_experts_reference(x, ids, weights, experts, I, activation=activation, biases=biases, limit=1.5)
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-5, atol=1e-5)


def test_moe_reference_rounds_the_weights_to_x_dtype_with_round_weights():
    """round_weights: each routing weight rounded to x's dtype where it is read (the plugin's field, as
    moe_experts' round_weights). In float16 a weight of 1e-9 rounds to 0, which drops an expert whose
    output is ~1e8: a difference of ~0.1 in the output, where the rest is ~1."""
    H = I = 4
    x = np.ones((1, H), dtype=np.float16)
    small = np.full(3 * I * H, 0.01, dtype=np.float16)  # y ~ 1e-3 .. 1
    large = np.concatenate([np.full(I * H, 10.0), np.full(I * H, 375.0), np.full(H * I, 500.0)]).astype(np.float16)
    experts = np.stack([small, large])  # expert 1: h = silu(40) * 1500 = 60000, y = 4 * 500 * 60000 = 1.2e8
    ids = np.array([[0, 1]], dtype=np.int32)
    weights = np.array([[0.5, 1e-9]], dtype=np.float32)
    inputs = [("x", TensorProto.FLOAT16, [1, H]), ("ids", TensorProto.INT32, [1, 2]),
              ("weights", TensorProto.FLOAT, [1, 2]), ("experts", TensorProto.FLOAT16, [2, 3 * I * H])]
    feeds = {"x": x, "ids": ids, "weights": weights, "experts": experts}
    outs = {}
    for flag in (False, True):
        sess = function_model(MOE, inputs, [("out", TensorProto.FLOAT16, [1, H])], moe_fields(I, round_weights=flag))
        outs[flag] = sess.run(None, feeds)[0].astype(np.float64)
    x32, e32 = torch.from_numpy(x.astype(np.float32)), torch.from_numpy(experts.astype(np.float32))
    for flag, w in ((False, weights), (True, weights.astype(np.float16).astype(np.float32))):  # (1e-9 -> 0)
        want = moe_experts_reference(x32, torch.from_numpy(ids), torch.from_numpy(w), e32, I)
        np.testing.assert_allclose(outs[flag], want.numpy(), rtol=2e-3)
    assert (outs[False] - outs[True]).min() > 0.05, "the 1e-9 weight counts only unrounded"


# ---- moespec build --backend tensorrt ------------------------------------------------------------------


def test_build_backend_tensorrt(models, tmp_path):
    source = write_checkpoint("qwen3_moe", tmp_path / "src")
    out = tmp_path / "engine"
    run_ = subprocess.run([sys.executable, "-m", "moespec", "build", "--model", str(source), "--out", str(out),
                           "--dtype", "fp32", "--backend", "tensorrt", "--budget", "5", "--quiet"],
                          capture_output=True, text=True, timeout=300)
    assert run_.returncode == 0, run_.stderr
    assert "no TensorRT plan built" in run_.stderr and "trtexec.sh" in run_.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["backend"] == "tensorrt"
    trt = manifest["tensorrt"]
    assert set(trt["networks"]) == {"verify", "prefill"}
    assert trt["networks"]["verify"]["budget"]["max_experts"] == 5 and trt["networks"]["prefill"]["budget"] is None
    assert trt["plan_status"].startswith("not built") and trt["networks"]["verify"]["plan"] is None
    script = (out / "tensorrt" / "trtexec.sh").read_text()
    commands = [shlex.split(line) for line in script.splitlines() if line.startswith("trtexec ")]
    for name, cmd in zip(("verify", "prefill"), commands):
        assert cmd[:3] == ["trtexec", f"--onnx={name}.onnx", f"--saveEngine={name}.plan"]
        assert cmd[3].startswith("--staticPlugins=") and "libmoespec_trt_plugins.so" in cmd[3] \
            and "--stronglyTyped" in cmd  # (the built library's path, or a placeholder naming it)
        assert shlex.split(trt["networks"][name]["trtexec"]) == cmd
    assert sorted(p.name for p in (out / "tensorrt").iterdir()) == ["prefill.onnx", "trtexec.sh", "verify.onnx",
                                                                    "weights.onnx.data"]
    # the files on disk: checked, one weights file, and the budgeted network equals the runtime
    for name in ("verify", "prefill"):
        onnx.checker.check_model(str(out / "tensorrt" / f"{name}.onnx"), full_check=True)
        bare = onnx.load(str(out / "tensorrt" / f"{name}.onnx"), load_external_data=False)
        assert {e.value for t in bare.graph.initializer for e in t.external_data if e.key == "location"} == \
            {"weights.onnx.data"}
    verify = onnx.load(str(out / "tensorrt" / "verify.onnx"))
    model = models["qwen3_moe"]
    c = model.config
    prefill = session(onnx.load(str(out / "tensorrt" / "prefill.onnx")))
    P = len(PROMPTS[0])
    cache = model.new_cache(1, 32)
    model.prefill(cache, PROMPTS[:1])
    got = run(prefill, PROMPTS[:1], [list(range(P))], np.tril(np.ones((P, P), bool))[None], empty_past(c, 1))
    budget = ExpertBudget(5)
    want = model.verify(cache, [TREE], [PARENTS], budget=budget)
    mask = np.concatenate([np.ones((len(TREE), P), bool), ancestor_mask(PARENTS).numpy()], 1)[None]
    got = run(session(verify), [TREE], [[P + d for d in depths(PARENTS)]], mask, presents(got, c))
    assert_close(torch.from_numpy(got["logits"]), want.logits)
    assert got["expert_stats"].tolist() == want.expert_stats.tolist()


@pytest.mark.parametrize("family", ALL)
def test_initializers_carry_the_engine_names(models, family):
    """Every initializer is an engine tensor under its engine name and shape (and the rope table)."""
    from moespec.engine.tensors import expected_shapes

    model = models[family]
    proto = export_verify(model.config, model.weights)
    shapes = expected_shapes(model.config)
    for t in proto.graph.initializer:
        if t.name != "inv_freq":
            assert tuple(t.dims) == tuple(shapes[t.name]), t.name


def test_build_backend_tensorrt_mla_profile(tmp_path):
    """DeepSeek-V3's engine: the profile's past shapes are MLA's cache (the latent and the rope key)."""
    source = deepseek_fixtures.write(tmp_path / "src", 24)
    out = tmp_path / "engine"
    run_ = subprocess.run([sys.executable, "-m", "moespec", "build", "--model", str(source), "--out", str(out),
                           "--dtype", "fp32", "--backend", "tensorrt", "--quiet"], capture_output=True, text=True,
                          timeout=300)
    assert run_.returncode == 0, run_.stderr
    script = (out / "tensorrt" / "trtexec.sh").read_text()
    maxes = dict(item.split(":") for item in re.search(r"--maxShapes=(\S+)", script).group(1).split(","))
    R, rope = deepseek_fixtures.R, deepseek_fixtures.ROPE
    assert maxes["past_key_1"].split("x")[1::2] == ["1", str(R)]
    assert maxes["past_value_1"].split("x")[1::2] == ["1", str(rope)]
    onnx.checker.check_model(str(out / "tensorrt" / "verify.onnx"), full_check=True)


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_bf16_networks_of_the_new_families_pass_the_checker(family, tmp_path):
    """bf16 GPT-OSS and DeepSeek-V3 networks type-check in full (every Cast between the float32 parts —
    sinks, router, biases, scaled norms — and the bf16 ones in place)."""
    model = load(WRITERS[family](tmp_path / "m"), "bf16")
    proto = export_verify(model.config, model.weights, budget=ExpertBudget(3))
    onnx.checker.check_model(proto, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=True)
    types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.output}
    assert types["logits"] == TensorProto.FLOAT and types["present_key_0"] == TensorProto.BFLOAT16

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

from models_fixtures import FAMILIES, ancestor_mask, assert_close, depths, write_checkpoint
from moespec.engine.onnx_export import export_verify
from moespec.engine.onnx_plugins import (
    MOE, MOE_FIELDS, ROUTE, ROUTE_FIELDS, moe_fields, reference_functions, route_fields, with_reference_functions,
)
from moespec.models import load
from moespec.ops import ExpertBudget, RouterSpec
from moespec.ops.reference import moe_experts_reference, route_experts_reference

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> fp32 TargetModel of its tiny random checkpoint (taps at layer 0)."""
    root = tmp_path_factory.mktemp("onnx")
    out = {}
    for family in FAMILIES:
        out[family] = load(write_checkpoint(family, root / family), "fp32", taps=(0,))
    return out


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
    shape = (batch, c.num_kv_heads, 0, c.head_dim)
    return {f"past_{kind}_{i}": np.zeros(shape, np.float32) for i in range(c.num_layers) for kind in ("key", "value")}


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
            assert (got["expert_stats"][:, 1] <= budget.max_experts).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_network_equals_the_runtime(models, family):
    check_prefill_then_tree(models[family], None)


@pytest.mark.parametrize("family,policy", [("qwen3_moe", "substitution"), ("qwen3_moe", "truncation"),
                                           ("qwen2_moe", "substitution"), ("mixtral", "truncation"),
                                           ("olmoe", "substitution")])
def test_budgeted_network_equals_the_budgeted_runtime(models, family, policy):
    budget = ExpertBudget(5, policy)
    check_prefill_then_tree(models[family], budget)


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
    with pytest.raises(ValueError, match="covers the softmax family without coverage"):
        with_reference_functions(proto)


# ---- the reference bodies against the plain-torch references ------------------------------------------


def function_model(name: str, inputs: list[tuple[str, int, list]], outputs: list[tuple[str, int, list]],
                   attrs: dict) -> ort.InferenceSession:
    node = helper.make_node(name, [n for n, _, _ in inputs], [n for n, _, _ in outputs], domain="moespec",
                            plugin_namespace="moespec", plugin_version="1", **attrs)
    graph = helper.make_graph([node], "one", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                              [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("moespec", 1)],
                              functions=reference_functions())
    model.ir_version = 10
    onnx.checker.check_model(model)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 12), N=st.integers(4, 24), K=st.integers(1, 4), extra=st.integers(0, 8),
       policy=st.sampled_from(["substitution", "truncation", None]), renormalize=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_route_reference_equals_the_semantics(T, N, K, extra, policy, renormalize, seed):
    K = min(K, N)
    spec = RouterSpec("softmax", K, renormalize=renormalize)
    budget = ExpertBudget(min(K + extra, N), policy) if policy is not None else None
    logits = torch.randn(T, N, generator=torch.Generator().manual_seed(seed)) * 3
    sess = function_model(ROUTE, [("router_logits", TensorProto.FLOAT, [T, N])],
                          [("ids", TensorProto.INT32, [T, K]), ("weights", TensorProto.FLOAT, [T, K]),
                           ("active", TensorProto.INT32, [N]), ("stats", TensorProto.INT32, [4])],
                          route_fields(spec, budget))
    ids, weights, active, stats = sess.run(None, {"router_logits": logits.numpy()})
    want_ids, want_weights, want_active, want_stats = route_experts_reference(logits, spec, budget)
    assert ids.tolist() == want_ids.tolist()
    np.testing.assert_allclose(weights, want_weights.numpy(), rtol=1e-6, atol=1e-7)
    assert active[: want_active.numel()].tolist() == want_active.tolist() and (active[want_active.numel():] == N).all()
    assert stats.tolist() == [want_stats.natural_unique, want_stats.kept, want_stats.rerouted, want_stats.dropped]


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 10), E=st.integers(1, 8), K=st.integers(1, 3), H=st.integers(1, 24), I=st.integers(1, 16),
       seed=st.integers(0, 2**31 - 1))
def test_moe_reference_equals_the_semantics(T, E, K, H, I, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.randint(0, E + 1, (T, K), generator=g, dtype=torch.int32)  # E: a dropped slot
    weights = torch.rand(T, K, generator=g) * (ids < E)
    experts = torch.randn(E, 3 * I * H, generator=g) * 0.3
    sess = function_model(MOE, [("x", TensorProto.FLOAT, [T, H]), ("ids", TensorProto.INT32, [T, K]),
                                ("weights", TensorProto.FLOAT, [T, K]), ("experts", TensorProto.FLOAT, [E, 3 * I * H])],
                          [("out", TensorProto.FLOAT, [T, H])], moe_fields(I))
    (out,) = sess.run(None, {"x": x.numpy(), "ids": ids.numpy(), "weights": weights.numpy(), "experts": experts.numpy()})
    np.testing.assert_allclose(out, moe_experts_reference(x, ids, weights, experts, I).numpy(), rtol=1e-5, atol=1e-5)


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

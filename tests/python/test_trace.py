"""Routing traces (python/moespec/models/trace.py): the file contract and the runtime's observer.

The observer's routing is held against transformers' own router logits (natural top-k of a tiny
Mixtral written by transformers), on both backends, with and without a budget; the file format
against every way a trace can be broken (each error names the array).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from models_fixtures import write_checkpoint  # noqa: E402

from moespec.models import load  # noqa: E402
from moespec.models.trace import RoutingObserver, Trace, TraceError, load_trace, save_trace  # noqa: E402
from moespec.ops import ExpertBudget  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _trace(R: int = 7, L: int = 3, N: int = 11, K: int = 2, seed: int = 0) -> Trace:
    rng = np.random.default_rng(seed)
    ids = np.stack([np.stack([rng.choice(N, K, replace=False) for _ in range(L)]) for _ in range(R)])
    # pass 0: a prefill of 3 tokens; pass 1: a verify tree root -> {4, 5}, 5 -> 6
    return Trace(ids, rng.random((R, L, K)), [0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 2, 2, 2, 2], [0] * R,
                 [0, 1, 2, 3, 4, 4, 5], [-1, -1, -1, -1, 3, 3, 5], N, K, [0, 2, 3], {"model": "x"})


def test_round_trip(tmp_path):
    t = _trace()
    path = save_trace(tmp_path / "t.npz", t)
    u = load_trace(path)
    for name in ("ids", "weights", "pass_id", "kind", "request", "position", "parent", "layers"):
        np.testing.assert_array_equal(getattr(u, name), getattr(t, name))
        assert getattr(u, name).dtype == getattr(t, name).dtype
    assert (u.num_experts, u.top_k, u.meta["model"], u.meta["trace_version"]) == (11, 2, "x", 1)
    assert u.passes() == [(0, 3), (3, 7)]
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left


def _write(tmp_path, **changes) -> Path:
    t = _trace()
    arrays = {n: getattr(t, n) for n in ("ids", "weights", "pass_id", "kind", "request", "position", "parent")}
    arrays.update(num_experts=np.int32(11), top_k=np.int32(2), layers=t.layers, meta=np.array(json.dumps({})))
    for k, v in changes.items():
        if v is None:
            del arrays[k]
        else:
            arrays[k] = v
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("changes, match", [
    ({"ids": None}, "missing array.*'ids'"),
    ({"meta": None, "layers": None}, "missing array.*'layers', 'meta'"),
    ({"weights": np.zeros((7, 3, 3), np.float32)}, "'weights' has shape"),
    ({"kind": np.zeros(6, np.int8)}, "'kind' has shape"),
    ({"layers": np.zeros(2, np.int32)}, "'layers' has shape"),
    ({"ids": np.full((7, 3, 2), 11, np.int32)}, "'ids' holds ids outside"),
    ({"weights": np.full((7, 3, 2), np.nan, np.float32)}, "'weights' holds NaN"),
    ({"kind": np.full(7, 5, np.int8)}, "'kind' holds values"),
    ({"kind": np.zeros(7, np.int32)}, "'kind' is int32, expected int8"),
    ({"pass_id": np.array([1, 1, 1, 0, 0, 0, 0], np.int32)}, "'pass_id' must be non-decreasing"),
    ({"parent": np.array([-1, -1, -1, -1, 2, 3, 5], np.int32)}, "'parent': a parent row must be in the same pass"),
    ({"parent": np.array([-1, -1, -1, -1, 5, 3, 5], np.int32)}, "'parent' must be -1 or an earlier row"),
    ({"top_k": np.int32(12)}, "top_k=12"),
    ({"meta": np.array("{not json")}, "'meta' is not a JSON string"),
])
def test_bad_traces_name_the_array(tmp_path, changes, match):
    with pytest.raises(TraceError, match=match):
        load_trace(_write(tmp_path, **changes))


def test_not_a_trace(tmp_path):
    (tmp_path / "x.npz").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(TraceError, match="not a readable .npz"):
        load_trace(tmp_path / "x.npz")
    with pytest.raises(TraceError, match="does not exist"):
        load_trace(tmp_path / "missing.npz")


# ---- the observer against transformers --------------------------------------------------------


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = write_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral"))
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, experts_implementation="eager").eval()
    return path, hf


def _hf_routing(hf, tokens: list[int], k: int):
    """transformers' natural routing of a prompt: per MoE layer the top-k of softmax(router logits)."""
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_router_logits=True)
    ids, weights = [], []
    for logits in out.router_logits:  # [T, E] per layer
        probs = torch.softmax(logits.float().reshape(len(tokens), -1), dim=-1)
        w, i = probs.topk(k, dim=-1)
        ids.append(i)
        weights.append(w / w.sum(-1, keepdim=True))  # Mixtral renormalises the top-k
    return torch.stack(ids, 1).numpy(), torch.stack(weights, 1).numpy()  # [T, L, K]


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_observer_records_the_natural_routing(mixtral, backend):
    path, hf = mixtral
    model = load(path, "fp32")
    model.backend_name = backend
    K = model.config.moe.top_k
    prompt, tree = [5, 17, 33, 64, 9, 3], [11, 12, 13, 14]
    parents = [-1, 0, 0, 1]
    obs = RoutingObserver()
    model.observer = obs
    cache = model.new_cache(1, 32)
    model.prefill(cache, [prompt[:-1]])
    model.decode(cache, [prompt[-1]])
    model.verify(cache, [tree], [parents])
    model.commit(cache, [[0]])
    t = obs.trace(num_experts=model.config.moe.num_experts, top_k=K, layers=model.config.moe_layers)
    ids, weights = _hf_routing(hf, prompt, K)
    np.testing.assert_array_equal(t.ids[:6], ids)
    np.testing.assert_allclose(t.weights[:6], weights, atol=1e-5)
    # the tree's rows: each node's natural routing is what transformers gives its root-to-node path
    for node in range(4):
        path_nodes = [node]
        while parents[path_nodes[-1]] >= 0:
            path_nodes.append(parents[path_nodes[-1]])
        seq = prompt + [tree[j] for j in reversed(path_nodes)]
        np.testing.assert_array_equal(t.ids[6 + node], _hf_routing(hf, seq, K)[0][-1])
    assert t.kind.tolist() == [0] * 5 + [1] + [2] * 4
    assert t.pass_id.tolist() == [0] * 5 + [1] + [2] * 4
    assert t.position.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 7, 8]
    assert t.parent.tolist() == [-1] * 7 + [6, 6, 7]


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_a_budget_does_not_change_the_traced_routing(mixtral, backend):
    """With a budget the trace still holds each token's own top-k: at the first MoE layer exactly the
    unbudgeted pass's (later layers see the budgeted hidden states), and at every layer as many
    unique experts as the step's own natural count."""
    path, _ = mixtral
    model = load(path, "fp32")
    model.backend_name = backend
    traces = []
    for budget in (None, ExpertBudget(2)):
        obs = RoutingObserver()
        model.observer = obs
        cache = model.new_cache(1, 32)
        model.prefill(cache, [[5, 17, 33, 64, 9]])
        out = model.verify(cache, [[11, 12, 13, 14, 15, 16]], [[-1, 0, 0, 1, 1, 2]], budget=budget)
        t = obs.trace(num_experts=8, top_k=2, layers=model.config.moe_layers)
        rows = t.kind == 2
        assert out.expert_stats[:, 0].tolist() == [len(np.unique(t.ids[rows][:, layer])) for layer in range(2)]
        traces.append(t.ids[rows])
    assert out.expert_stats[:, 1].max() <= 2 < out.expert_stats[:, 0].max()  # the budget did cut
    np.testing.assert_array_equal(traces[0][:, 0], traces[1][:, 0])


def test_observer_maps_slots_to_requests_and_costs_nothing_when_off(mixtral):
    path, _ = mixtral
    model = load(path, "bf16")
    cache = model.new_cache(2, 16)
    out = model.prefill(cache, [[1, 2, 3], [4, 5]])
    assert out.routing is None  # off: nothing recorded, nothing allocated
    obs = RoutingObserver()
    obs.requests = [7, 9]
    model.observer = obs
    out = model.decode(cache, [6, 8])
    t = obs.trace(num_experts=model.config.moe.num_experts, top_k=2, layers=model.config.moe_layers)
    assert t.request.tolist() == [7, 9] and t.position.tolist() == [3, 2]
    natural = out.expert_stats[:, 0].tolist()  # the step's own count of natural unique experts
    assert natural == [len(np.unique(t.ids[:, layer])) for layer in range(t.ids.shape[1])]

"""The cost model (python/moespec/cost/step_cost.py, hardware.py, speedup.py) and ``moespec analyze``
end to end on a tiny engine.

Fixtures are computed by hand; the runtime engine's bytes are held against the roofline bench's
own count from the loaded weights (bench/roofline.py reads the tensors, the cost model only the
shape).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from moespec.cost.hardware import Hardware, hardware, load_profile, save_profile, spec_sheet  # noqa: E402
from moespec.cost.shapes import MoeShape  # noqa: E402
from moespec.cost.speedup import scaled_acceptance, transfer  # noqa: E402
from moespec.cost.step_cost import step_cost  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = MoeShape(name="tiny", hf_id="test", hidden=8, layers=2, dense_layers=0, dense_intermediate=0, num_experts=4,
                top_k=2, expert_intermediate=3, shared_intermediate=0, vocab=11, tied_embeddings=False, num_heads=2,
                num_kv_heads=1, head_dim=4)


def test_roofline_of_a_tiny_shape_by_hand():
    # attention per layer: q 8x8 + k 8x4 + v 8x4 + o 8x8 = 192; norms 2x2x8 + 8 = 40; routers 2 x 4 x 8 = 64;
    # lm_head 11 x 8 = 88  ->  dense = 2 x 192 + 40 + 64 + 88 = 576; one expert 3 x 8 x 3 = 72
    assert TINY.dense_params == 576 and TINY.expert_params == 72
    hw = Hardware("toy", bandwidth_gbs=1.0, peak_tflops=1e-3, step_overhead_us=10.0, source="test")
    c = step_cost(TINY, hw, tokens=4, requests=2, context=6, unique=[3.0, 4.0])
    assert c.bytes_dense == 576 * 2 and c.bytes_experts == 7 * 72 * 2
    # kv: 2 requests x (6 + 2) slots x 2 layers x 2 x 1 head x 4 dims x 2 bytes
    assert c.bytes_kv == 2 * 8 * 2 * 8 * 2
    # dense: max(1152 B / 1e9 B/s, 2 x 4 x 576 / 1e9) = 4.608 us; experts per layer: max(u x 144 / 1e9,
    # 2 x (8 / u) x u x 72 / 1e9) = 1.152 us each; attention: max(512 / 1e9, 4 x 4 x 2 x 4 x 6 x 2 / 1e9)
    np.testing.assert_allclose(c.dense_s, 4.608e-6)
    np.testing.assert_allclose(c.experts_s, 2 * 1.152e-6)
    np.testing.assert_allclose(c.attention_s, 1.536e-6)
    np.testing.assert_allclose(c.seconds, 10e-6 + 4.608e-6 + 2.304e-6 + 1.536e-6)
    np.testing.assert_allclose(c.flops, 2 * 4 * (576 + 2 * 72 * 2) + 4 * 4 * 2 * 4 * 6 * 2)
    with pytest.raises(ValueError, match="unique experts"):
        step_cost(TINY, hw, tokens=4, requests=2, context=6, unique=5.0)
    with pytest.raises(ValueError, match="tokens >= requests"):
        step_cost(TINY, hw, tokens=1, requests=2, context=6, unique=2.0)


def test_measured_profile_interpolates_and_round_trips(tmp_path):
    hw = Hardware("cpu", 20.0, 0.1, 300.0, "test", {1: 16.0, 4: 8.0, 16: 2.0}, expert_gbs={1: 10.0, 8: 5.0},
                  token_layer_us=2.5)
    assert hw.matrix_seconds(16e9, 1) == pytest.approx(1.0)
    assert hw.matrix_seconds(16e9, 2) == pytest.approx(16 / np.sqrt(16 * 8))  # log-log between 1 and 4
    assert hw.matrix_seconds(16e9, 32) == pytest.approx(16 / (2.0 * 16 / 32))  # compute-bound past the table
    assert hw.expert_seconds(10e9, 1) == pytest.approx(1.0)
    back = load_profile(save_profile(tmp_path / "p.json", hw))
    assert back == hw
    assert hardware(str(tmp_path / "p.json")) == hw and spec_sheet("h200").bandwidth_gbs == 4800.0
    measured = Path(__file__).parents[1] / "gpu" / "profiles" / "h200.json"  # (tests/gpu/run.sh's)
    assert hardware("H200") == (load_profile(measured) if measured.exists() else spec_sheet("h200"))
    with pytest.raises(ValueError, match="unknown hardware"):
        hardware("tpu")
    (tmp_path / "bad.json").write_text(json.dumps({"format": "moespec-hardware-profile", "name": "x"}))
    with pytest.raises(ValueError, match="missing or malformed"):
        load_profile(tmp_path / "bad.json")


def test_spec_sheet_is_a_roofline():
    h = spec_sheet("h100-sxm")
    assert h.matrix_seconds(3.35e9, 1) == pytest.approx(1e-3)  # memory-bound: bytes / 3.35 TB/s
    assert h.matrix_seconds(2e9, 4096) == pytest.approx(2 * 4096 * 1e9 / 989e12)  # compute-bound


def test_engine_shape_bytes_equal_the_loaded_weights(tmp_path):
    from models_fixtures import write_checkpoint

    from moespec.bench.roofline import step_cost as weights_cost
    from moespec.cost.step_cost import shape_from_config
    from moespec.models import load

    for family in ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe"):
        model = load(write_checkpoint(family, tmp_path / family), "bf16")
        shape = shape_from_config(model.config)
        kept = [3.0] * len(model.config.moe_layers)
        want = weights_cost(model, 4, 10, kept)
        got = step_cost(shape, spec_sheet("h200"), tokens=4, requests=1, context=10, unique=kept)
        assert got.bytes_experts == want["bytes_experts"], family
        # the roofline bench also counts the 4 tokens' embedding rows
        assert got.bytes_dense + 4 * model.config.hidden_size * 2 == want["bytes_dense"], family


def test_transfer_and_acceptance_scaling():
    t = transfer(64, 4)
    assert t.marginals.shape == (1, 64) and t.marginals.sum() == pytest.approx(4)
    assert scaled_acceptance(2.0, 2, 2) == pytest.approx(2.0)
    assert 2.0 < scaled_acceptance(2.0, 2, 4) < 3.0  # a = 0.618: 1 + a + a^2 + a^3 + a^4


# ---- moespec analyze on a tiny engine ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_bench import _head_folder

    import moespec.models as mm
    from models_fixtures import write_checkpoint
    from moespec.engine import build_engine

    root = tmp_path_factory.mktemp("analyze")
    source = write_checkpoint("qwen3_moe", root / "source")
    draft = _head_folder(root / "draft", mm.load(source, "bf16"))
    engine = build_engine(source, root / "engine", draft=draft, progress=False,
                          speculation={"depth": 2, "top_k": 3, "total_tokens": 4}).folder
    dataset = root / "d.jsonl"
    lines = [{"task_id": i, "input_ids": [(7 * i + j) % 120 + 3 for j in range(5 + i)], "output_tokens": 6}
             for i in range(5)]
    dataset.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root, engine, dataset


def _analyze(*argv) -> int:
    from moespec.cli import main

    return main(["analyze", *argv, "--no-progress"])


def test_analyze_end_to_end(tiny, capsys):
    from moespec.models.trace import load_trace

    root, engine, dataset = tiny
    for policy, extra in (("eagle3", ["--num-requests", "3"]), ("ar", ["--skip", "3"])):
        assert _analyze("trace", "--engine", str(engine), "--dataset", str(dataset), "--policy", policy,
                        "--max-batch-size", "2", *extra, "--out", str(root / f"{policy}.npz")) == 0
    t = load_trace(root / "eagle3.npz")
    assert set(t.kind.tolist()) == {0, 2} and t.meta["policy"] == "eagle3" and t.num_experts == 16
    assert sorted(set(t.request.tolist())) == [0, 1, 2]
    assert set(load_trace(root / "ar.npz").request.tolist()) == {3, 4}
    assert _analyze("fit", "--trace", str(root / "eagle3.npz"), str(root / "ar.npz"), "--out",
                    str(root / "model.json")) == 0
    assert _analyze("predict", "--model", str(root / "model.json"), "--requests", "2", "--tree", "2,3,4",
                    "--json", str(root / "p.json")) == 0
    p = json.loads((root / "p.json").read_text())
    assert p["layers"] == [0, 2] and len(p["ipf"]) == 2 and p["tokens"] == 10
    assert all(0 < u <= 16 for k in ("ipf", "independent", "uniform") for u in p[k])
    assert _analyze("validate", "--model", str(root / "model.json"), "--trace", str(root / "ar.npz"),
                    "--json", str(root / "v.json")) == 0
    assert _analyze("predict", "--model", str(root / "model.json"), "--tree", "chain:0") == 2
    assert "chain:<n> needs an integer n >= 1" in capsys.readouterr().err
    v = json.loads((root / "v.json").read_text())
    assert v["table"] and {"ipf", "independent", "uniform"} <= set(v["summary"])
    assert _analyze("speedup", "--shape", "mixtral-8x7b,qwen3-30b-a3b", "--hardware", "h200", "--model",
                    str(root / "model.json"), "--batch", "1,4", "--acceptance", str(root / "eagle3.npz"),
                    "--out-dir", str(root / "speedup")) == 0
    s = json.loads((root / "speedup" / "speedup.json").read_text())
    assert [r["batch"] for r in s["by_batch"]["qwen3-30b-a3b"]] == [1, 4]
    assert (root / "speedup" / "speedup_batch.png").stat().st_size > 0
    assert (root / "speedup" / "speedup_tree.png").stat().st_size > 0
    hw = Hardware("cpu", 10.0, 0.05, 100.0, "test", {1: 8.0, 128: 0.5})
    save_profile(root / "cpu.json", hw)
    assert _analyze("calibrate", "--engine", str(engine), "--profile", str(root / "cpu.json"), "--repeats", "1",
                    "--json", str(root / "c.json")) == 0
    c = json.loads((root / "c.json").read_text())
    assert [r["tokens"] for r in c["steps"]] == [1, 2, 4, 8, 16, 32, 64]
    assert all(r["measured_ms"] > 0 and r["predicted_ms"] > 0 for r in c["steps"])


@pytest.mark.parametrize("argv, match", [
    (["fit", "--trace", "nope.npz", "--out", "m.json"], "trace 'nope.npz' does not exist"),
    (["predict", "--model", "nope.json"], "model 'nope.json' does not exist"),
    (["speedup", "--shape", "gpt-5"], "unknown MoE shape|known"),
    (["speedup", "--batch", "1,x"], "--batch"),
    (["speedup", "--hardware", "tpu"], "unknown hardware"),
])
def test_analyze_errors_are_one_line(tiny, tmp_path, capsys, argv, match):
    assert _analyze(*argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moespec analyze")
    import re

    assert re.search(match, err), err


# ---- the trained expert predictor ------------------------------------------------------------------


def test_trained_predictor_learns_a_token_determined_routing(tmp_path, capsys):
    """A tiny Qwen3-MoE whose attention outputs are zero routes every token by the token alone, so
    the predictor (which sees the node's token embedding) can learn it, while the static top-k and
    the previous token's routing cannot (measured with these seeds: 0.88 against 0.30 and 0.26; the
    asserted margins are half of that, room for summation-order differences across machines)."""
    import torch
    from models_fixtures import CONFIGS, write_checkpoint
    from test_bench import _head_folder

    import moespec.models as mm
    from moespec.engine import build_engine
    from moespec.spec.expert_predictor import ExpertPredictor

    cls, make = CONFIGS["qwen3_moe"]
    torch.manual_seed(0)
    hf = cls(make())
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    hf.save_pretrained(tmp_path / "source")
    draft = _head_folder(tmp_path / "draft", mm.load(tmp_path / "source", "bf16"))
    engine = build_engine(tmp_path / "source", tmp_path / "engine", draft=draft, progress=False).folder
    rng = np.random.default_rng(0)
    lines = [{"task_id": i, "input_ids": rng.integers(3, 128, 24).tolist(), "output_tokens": 4} for i in range(50)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert _analyze("predictor", "--engine", str(engine), "--dataset", str(tmp_path / "d.jsonl"), "--train-requests",
                    "40", "--steps", "200", "--out", str(tmp_path / "pred"), "--json", str(tmp_path / "r.json")) == 0
    r = json.loads((tmp_path / "r.json").read_text())["recall"]
    assert r["trained"] > 0.7 and r["trained"] > r["static_top_k"] + 0.3 and r["trained"] > r["history_1"] + 0.3
    p = ExpertPredictor.load(tmp_path / "pred")
    target = mm.load(tmp_path / "source", "bf16")
    p.check_target(target.config)
    assert p.predict(torch.zeros(3, 64), torch.zeros(3, 64), 4).shape == (3, 2, 4)
    other = mm.load(write_checkpoint("mixtral", tmp_path / "mixtral"), "bf16")
    with pytest.raises(ValueError, match="another target"):
        p.check_target(other.config)
    with pytest.raises(ValueError, match="missing predictor.json"):
        ExpertPredictor.load(tmp_path / "nothing")
    assert _analyze("predictor", "--engine", str(engine)) == 2
    assert "needs --dataset" in capsys.readouterr().err


def test_predictor_needs_one_source(capsys):
    assert _analyze("predictor") == 2
    assert "give --trace" in capsys.readouterr().err


def test_engine_ships_a_predictor(tiny, tmp_path):
    """moespec build --predictor: copied, listed in the manifest, loaded and checked; an engine
    without one says how to make one; a predictor for another target is refused at build time."""
    import torch

    from moespec.engine import build_engine, load_engine
    from moespec.spec.expert_predictor import ExpertPredictor

    root, engine, _ = tiny
    source = root / "source"
    info = load_engine(engine)[1]
    with pytest.raises(ValueError, match="has no expert predictor"):
        info.expert_predictor()
    L, N, D = 2, 16, 128  # the tiny Qwen3-MoE: 2 MoE layers of 16 experts, H = 64
    ExpertPredictor(torch.randn(L, N, D), torch.zeros(L, N), torch.zeros(D), torch.ones(D)).save(tmp_path / "p")
    built = build_engine(source, tmp_path / "engine", predictor=tmp_path / "p", progress=False).folder
    info = load_engine(built)[1]
    assert info.manifest["predictor"]["experts"] == N and info.expert_predictor().num_layers == L
    ExpertPredictor(torch.randn(L, 8, D), torch.zeros(L, 8), torch.zeros(D), torch.ones(D)).save(tmp_path / "q")
    with pytest.raises(ValueError, match="another target"):
        build_engine(source, tmp_path / "engine2", predictor=tmp_path / "q", progress=False)
    assert not (tmp_path / "engine2").exists()

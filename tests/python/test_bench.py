"""moespec.bench.{metrics,report,run,plots}: ``moespec bench throughput|latency|compare``.

- metrics against hand-computed fixtures: nearest-rank percentiles (n = 1, 3, 10, 20, 100), the
  per-request and global trtllm-bench definitions, speculative decoding (acceptance length with the
  prefill counted as an iteration), expert statistics (batch steps counted once, the plain-decoding
  estimate, bytes per output token), agreement, the Pareto front;
- the quality proxy: chunked budget-free verify passes give the prefill's log-probabilities;
- end to end on a tiny engine (a random Qwen3-MoE checkpoint and a random EAGLE-3 head, 3 requests):
  throughput, latency and compare reports validate against the schemas in moespec/bench/schemas,
  the console report has trtllm-bench's sections in order, the plots are written, Ctrl-C gives a
  partial report;
- clear errors: a bad dataset line, a missing engine or dataset, an unknown policy, a policy that
  needs a missing draft head, a budget below top_k, a text prompt without a tokenizer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from moespec.bench import metrics as m
from moespec.bench.plots import pareto_front
from moespec.bench.report import format_compare, format_report, validate
from moespec.bench.run import (
    continuation_logprobs, main, open_engine, run_compare, run_latency, run_throughput, write_compare,
)

from models_fixtures import write_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")
MS = 1_000_000  # ns


# ---- percentiles ------------------------------------------------------------------------------


@pytest.mark.parametrize("values, want", [
    ([4.0], dict(p50=4, p90=4, p95=4, p99=4, minimum=4, maximum=4, average=4)),
    ([30, 10, 20], dict(p50=20, p90=30, p95=30, p99=30, minimum=10, maximum=30, average=20)),  # ranks 1, 2, 2, 2
    ([7, 1, 9, 3, 5, 2, 8, 10, 4, 6], dict(p50=6, p90=10, p95=10, p99=10, minimum=1, maximum=10, average=5.5)),
    (list(range(20, 0, -1)), dict(p50=11, p90=19, p95=20, p99=20, minimum=1, maximum=20, average=10.5)),
    (list(range(1, 101)), dict(p50=51, p90=91, p95=96, p99=100, minimum=1, maximum=100, average=50.5)),
])
def test_percentiles_are_nearest_rank_without_interpolation(values, want):
    got = m.Percentiles.of(values).to_dict()
    assert list(got) == ["p50", "p90", "p95", "p99", "minimum", "maximum", "average"]  # trtllm's JSON order
    assert got == pytest.approx(want)
    assert m.Percentiles.of(values).to_dict(1e-3)["average"] == pytest.approx(want["average"] * 1e-3)


def test_percentiles_of_nothing_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        m.Percentiles.of([])
    assert m.percentiles([]) is None


# ---- requests and global metrics --------------------------------------------------------------

# A: 5 -> 11 tokens in 3 steps after the prefill; B: 7 -> 10 tokens in 9 steps (plain decoding).
A = m.RequestRecord(0, 5, 11, start_ns=0, first_token_ns=100 * MS, end_ns=1100 * MS, decode_iterations=3)
B = m.RequestRecord(1, 7, 10, start_ns=500 * MS, first_token_ns=700 * MS, end_ns=2500 * MS, decode_iterations=9)


def test_request_metrics():
    assert (A.ttft_ns, A.e2e_ns, A.generation_ns) == (100 * MS, 1100 * MS, 1000 * MS)
    assert A.tpot_ns == pytest.approx(100 * MS)  # (1100 - 100) ms / (11 - 1)
    assert A.gen_tps == pytest.approx(10.0)  # 10 tokens in 1 s
    assert A.output_tps_per_user == pytest.approx(10.0)  # 11 tokens in 1.1 s
    assert B.tpot_ns == pytest.approx(200 * MS) and B.gen_tps == pytest.approx(5.0)
    one = m.RequestRecord(2, 3, 1, 0, 5, 5, 0)
    assert one.tpot_ns == 0.0 and one.gen_tps == 0.0
    with pytest.raises(ValueError, match="start <= first token <= end"):
        m.RequestRecord(3, 1, 2, start_ns=10, first_token_ns=5, end_ns=20, decode_iterations=1)


def test_speculative_metrics_count_the_prefill_as_an_iteration():
    s = m.spec_metrics(A, max_draft_len=6)  # it = 3 + 1
    assert (s.num_draft_tokens, s.num_accepted_draft_tokens) == (24, 7)
    assert s.draft_acceptance_rate == pytest.approx(7 / 24) and s.acceptance_length == pytest.approx(11 / 4)
    assert m.spec_metrics(B, 6).acceptance_length == pytest.approx(1.0)  # plain decoding: one token per pass
    d = m.decoding_stats([A, B], 6, "eagle3")
    assert d["acceptance_length"] == pytest.approx(21 / 14)  # sum OSL / sum it, not the mean of 2.75 and 1
    assert d["acceptance_length_percentiles"]["average"] == pytest.approx((2.75 + 1.0) / 2)
    assert (d["total_draft_tokens"], d["total_accepted_draft_tokens"]) == (24 + 60, 7 + 0)
    assert m.acceptance_length([A, B]) == pytest.approx(21 / 14)
    with pytest.raises(ValueError, match="max_draft_len"):
        m.spec_metrics(A, 0)


def test_global_metrics():
    assert m.total_latency_ns([A, B]) == 2500 * MS
    info = m.request_info([A, B])
    assert info == pytest.approx({"num_requests": 2, "avg_num_concurrent_requests": (1.1 + 2.0) / 2.5,
                                  "avg_input_length": 6.0, "avg_output_length": 10.5})
    p = m.performance([A, B])
    assert p["total_latency_ms"] == pytest.approx(2500.0)
    assert p["request_throughput_req_s"] == pytest.approx(0.8)
    assert p["system_output_throughput_tok_s"] == pytest.approx(21 / 2.5)
    assert p["system_total_throughput_tok_s"] == pytest.approx(33 / 2.5)
    assert p["output_throughput_per_user_tok_s"] == pytest.approx((10.0 + 5.0) / 2)
    assert p["output_throughput_per_gpu_tok_s"] == pytest.approx(21 / 2.5)
    assert p["avg_request_latency_ms"] == pytest.approx(1550.0)
    assert p["request_latency_percentiles_ms"] == pytest.approx(
        dict(p50=2000, p90=2000, p95=2000, p99=2000, minimum=1100, maximum=2000, average=1550))
    assert m.issue_rate([A, B]) == pytest.approx(4.0)  # 2 requests over 0.5 s of issuing, in req/s
    assert m.issue_rate([A]) is None
    s = m.streaming_metrics([A, B])
    assert s["avg_ttft_ms"] == pytest.approx(150.0) and s["avg_tpot_ms"] == pytest.approx(150.0)
    assert s["token_output_speed_tok_s"] == pytest.approx(7.5)
    assert s["ttft_percentiles"]["p50"] == pytest.approx(200.0)
    d = m.dataset_stats([5, 7, 9], [11, 10, 1], "x.jsonl")
    assert d["seq_len_stats"]["p50"] == 16 and d["osl_stats"]["minimum"] == 1 and d["num_requests"] == 3


# ---- experts ----------------------------------------------------------------------------------


def _stats(natural, kept, rerouted, dropped):
    return torch.tensor([natural, kept, rerouted, dropped], dtype=torch.int32).T.contiguous()  # [L, 4]


def test_batch_steps_are_counted_once_and_plain_decoding_is_estimated():
    s1, s2, s3 = _stats([6, 8], [4, 4], [3, 5], [0, 1]), _stats([4, 4], [4, 4], [0, 0], [0, 0]), _stats(
        [5, 5], [4, 4], [1, 1], [0, 0])
    steps = m.batch_expert_steps([[s1, s2, s3], [s1, s2]], [3, 2], top_k=4, num_experts=6, moe_layers=2)
    assert [s.natural for s in steps] == [(6, 8), (4, 4), (5, 5)] and all(s.measured for s in steps)
    est = m.batch_expert_steps([[], []], [3, 1], top_k=4, num_experts=6, moe_layers=2)
    assert [s.kept for s in est] == [(6, 6), (4, 4), (4, 4)]  # min(2 x 4, 6), then one request: 4
    assert not any(s.measured for s in est)
    with pytest.raises(ValueError):
        m.batch_expert_steps([[]], [1, 2], top_k=4, num_experts=6, moe_layers=2)


def test_expert_statistics():
    steps = m.batch_expert_steps([[_stats([6, 8], [4, 4], [3, 5], [0, 1]), _stats([4, 4], [4, 4], [0, 0], [0, 0])]],
                                 [2], top_k=2, num_experts=8, moe_layers=2)
    x = m.expert_statistics(steps, generated_tokens=10, bytes_per_expert=100, moe_layers=2, experts_per_layer=8,
                            top_k=2, budget=4)
    assert x["natural_unique_per_layer_percentiles"] == pytest.approx(
        dict(p50=7, p90=7, p95=7, p99=7, minimum=4, maximum=7, average=5.5))  # step means 7 and 4
    assert x["kept_unique_per_layer_percentiles"]["maximum"] == 4
    assert x["natural_unique_by_layer"] == [5.0, 6.0] and x["kept_unique_by_layer"] == [4.0, 4.0]
    assert x["budget_binding_rate"] == 0.5  # 6 > 4 and 8 > 4 bind, the second step does not
    assert (x["slots_rerouted"], x["slots_dropped"]) == (8, 1)
    assert x["expert_bytes_read"] == 1600 and x["expert_bytes_per_output_token"] == 160.0
    ar = m.expert_statistics(m.batch_expert_steps([[]], [5], top_k=2, num_experts=8, moe_layers=3),
                             generated_tokens=5, bytes_per_expert=100, moe_layers=3, experts_per_layer=8, top_k=2)
    assert ar["expert_bytes_per_output_token"] == 600.0  # 3 layers x top_k 2 x 100 bytes: exact at batch 1
    assert ar["verify_steps"] == 0 and ar["estimated_steps"] == 5 and ar["kept_unique_per_layer_percentiles"] is None
    assert x["predicted_unique_per_layer"] is None and x["predicted_unique_error"] is None


def test_expert_statistics_of_a_cost_aware_tree_compare_predicted_with_natural():
    """The eco selector's expected unique experts per step ride along the measured steps: their
    mean, and the mean absolute relative error against the natural count over (layer, step)."""
    natural = [_stats([6, 8], [6, 8], [0, 0], [0, 0]), _stats([4, 4], [4, 4], [0, 0], [0, 0])]
    guess = [np.array([3.0, 8.0]), np.array([5.0, 4.0])]
    steps = m.batch_expert_steps([natural, natural[:1]], [2, 1], top_k=2, num_experts=8, moe_layers=2,
                                 predicted=[guess, guess[:1]])
    assert [s.predicted for s in steps] == [(3.0, 8.0), (5.0, 4.0)]
    x = m.expert_statistics(steps, generated_tokens=4, bytes_per_expert=1, moe_layers=2, experts_per_layer=8, top_k=2)
    assert x["predicted_unique_per_layer"] == pytest.approx(5.0)
    assert x["predicted_unique_error"] == pytest.approx((3 / 6 + 0 + 1 / 4 + 0) / 4)


def test_agreement_and_pareto_front():
    a = m.agreement([[1, 2, 3], [1, 2, 4], [9]], [[1, 2, 3], [1, 2, 3], [1]])
    assert a == pytest.approx({"identical_share": 1 / 3, "token_match_rate": 5 / 7})
    assert pareto_front([(1.0, 1.0), (0.9, 1.2), (0.8, 1.1), (0.5, 1.5), (0.9, 1.2)]) == [0, 1, 3]


# ---- a tiny engine ----------------------------------------------------------------------------


def _head_folder(folder: Path, target) -> Path:
    from moespec.spec.train import new_head

    head = new_head(target.config, target.weights.embed, None, seed=0)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(head.config.to_config()))
    save_file({k: v.contiguous() for k, v in head.official_state_dict().items()}, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Engines (bf16, 16 experts top-4, 2 MoE layers) with and without a draft head; a 3-request dataset."""
    import moespec.models as mm
    from moespec.engine import build_engine

    root = tmp_path_factory.mktemp("bench")
    source = write_checkpoint("qwen3_moe", root / "source")
    draft = _head_folder(root / "draft", mm.load(source, "bf16"))
    tree = {"depth": 3, "top_k": 3, "total_tokens": 6}
    engine = build_engine(source, root / "engine", draft=draft, progress=False, speculation=tree).folder
    plain = build_engine(source, root / "plain", progress=False).folder
    dataset = root / "three.jsonl"
    lines = [{"task_id": 0, "input_ids": [5, 17, 33, 64, 9], "output_tokens": 9},
             {"task_id": 1, "input_ids": [3, 4, 120, 77, 13, 50, 8], "output_tokens": 12},
             {"task_id": 2, "input_ids": [101, 2, 77], "output_tokens": 7}]
    dataset.write_text("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines))
    return {"root": root, "engine": engine, "plain": plain, "dataset": dataset, "opened": open_engine(engine)}


SECTIONS = ["= MOESPEC ENGINE", "= MACHINE DETAILS", "= REQUEST DETAILS", "= WORLD + RUNTIME INFORMATION",
            "= PERFORMANCE OVERVIEW", "-- Request Latency Breakdown", "= DECODING STATISTICS", "= EXPERT STATISTICS",
            "= DATASET DETAILS"]


def _in_order(text: str, parts) -> bool:
    at = [text.find(p) for p in parts]
    return all(i >= 0 for i in at) and at == sorted(at)


def test_throughput_end_to_end(tiny, capsys):
    out = tiny["root"] / "throughput.json"
    rc = main(["throughput", "--engine", str(tiny["engine"]), "--dataset", str(tiny["dataset"]), "--policy",
               "eagle3+budget:5", "--max-batch-size", "2", "--warmup", "1", "--report-json", str(out)])
    assert rc == 0
    printed = capsys.readouterr()
    assert _in_order(printed.out, SECTIONS), printed.out
    assert "[Latency] P50    :" in printed.out and "[KUE] AVERAGE:" in printed.out and "[AL] P99    :" in printed.out
    assert "throughput eagle3+budget:5" in printed.err  # the progress bar
    report = json.loads(out.read_text())
    validate(report, "report")
    assert not report["partial"] and report["world_info"]["max_batch_size"] == 2
    assert [r["output_tokens"] for r in report["requests"]] == [9, 12, 7]  # exactly output_tokens, EOS ignored
    assert report["request_info"]["avg_output_length"] == pytest.approx(28 / 3)
    d = report["decoding_stats"]
    assert d["max_draft_len"] == 6 and report["engine"]["max_draft_len"] == 6
    its = sum(r["decode_iterations"] + 1 for r in report["requests"])
    assert d["acceptance_length"] == pytest.approx(28 / its)
    x = report["expert_statistics"]
    assert x["budget"] == 5 and x["bytes_per_expert"] == 3 * 32 * 64 * 2 and x["verify_steps"] > 0
    assert x["kept_unique_per_layer_percentiles"]["maximum"] <= 5
    assert x["expert_bytes_read"] == pytest.approx(x["expert_bytes_per_output_token"] * (28 - 3))
    assert "streaming_metrics" not in report


def test_latency_end_to_end(tiny, capsys):
    report = run_latency(tiny["opened"], tiny["dataset"], policy="ar", warmup=0, progress=False)
    validate(report, "report")
    s = report["streaming_metrics"]
    for r, rec in zip(report["requests"], (9, 12, 7)):
        assert r["output_tokens"] == rec and r["start_ns"] < r["first_token_ns"] < r["end_ns"]
    assert s["avg_ttft_ms"] > 0 and s["tpot_percentiles"]["minimum"] > 0
    assert "decoding_stats" not in report  # plain decoding drafts nothing
    x = report["expert_statistics"]
    assert x["verify_steps"] + x["estimated_steps"] == 8 + 11 + 6  # estimated while plain decoding records none
    assert x["expert_bytes_per_output_token"] == 2 * 4 * x["bytes_per_expert"]  # batch 1: top_k experts per layer
    text = format_report(report)
    assert _in_order(text, ["= PERFORMANCE OVERVIEW", "[TPOT] MINIMUM", "[TTFT] MINIMUM", "[GTPS] MINIMUM",
                            "[Latency] P50", "= EXPERT STATISTICS"])
    assert "= DECODING STATISTICS" not in text


def test_compare_end_to_end(tiny):
    result = run_compare(tiny["opened"], tiny["dataset"], "ar,eagle3,eagle3+budget:4", warmup=0, progress=False)
    path = write_compare(result, tiny["root"] / "compare")
    validate(json.loads(path.read_text()), "compare")
    for name in ("pareto.png", "experts.png"):
        assert (tiny["root"] / "compare" / name).stat().st_size > 1000
    rows = {r["label"]: r for r in result["policies"]}
    assert result["reference_policy"] == "eagle3" and result["num_requests"] == 3
    e3, ar, b4 = rows["eagle3"], rows["ar"], rows["eagle3+budget:4"]
    assert e3["identical_share"] == 1.0 and e3["token_match_rate"] == 1.0 and e3["logprob_delta"] == 0.0
    assert e3["speedup_vs_eagle3"] == 1.0 and ar["speedup_vs_ar"] == 1.0 and ar["decode_speedup_vs_ar"] == 1.0
    for r in rows.values():  # the decode phase: tokens after the first over the time after the first token
        recs = result["reports"][r["label"]]["requests"]
        want = sum(q["output_tokens"] - 1 for q in recs) / (sum(q["end_ns"] - q["first_token_ns"] for q in recs) / 1e9)
        assert r["decode_tokens_per_s"] == pytest.approx(want, rel=1e-9)
        assert r["decode_speedup_vs_ar"] == pytest.approx(r["decode_tokens_per_s"] / ar["decode_tokens_per_s"])
    assert ar["kept_unique_per_layer"] == 4.0 and ar["acceptance_length"] == 1.0  # batch 1: top_k per layer
    assert b4["kept_unique_per_layer"] <= 4.0 <= b4["natural_unique_per_layer"]
    assert b4["scored_tokens"] == e3["scored_tokens"] == (9 - 1) + (12 - 1) + (7 - 1)
    assert b4["mean_logprob"] < 0 and ar["mean_logprob"] == e3["mean_logprob"]
    text = format_compare(result)
    assert "eagle3+budget:4" in text and "logp/token" in text and "Plot:" in text
    # the byte profile: the gap between a full-union verify and a decode token is the N - K experts
    # it adds, each of its layers' expert block's bytes / N
    bp, target = result["engine"]["byte_profile"], tiny["opened"].target
    moe = target.config.moe
    experts = sum(target.weights.layers[i].experts.numel() * target.weights.layers[i].experts.element_size()
                  for i in target.config.moe_layers)
    assert bp["full_union_mb"] - bp["decode_mb"] == pytest.approx((moe.num_experts - moe.top_k) / moe.num_experts
                                                                  * experts / 1e6)
    assert bp["ratio"] == pytest.approx(bp["full_union_mb"] / bp["decode_mb"]) and "Byte Profile:" in text


def test_compare_in_another_dtype(tiny, capsys):
    out = tiny["root"] / "compare-fp32"
    rc = main(["compare", "--engine", str(tiny["engine"]), "--dataset", str(tiny["dataset"]), "--policies", "ar,eagle3",
               "--dtype", "fp32", "--warmup", "0", "--no-progress", "--out-dir", str(out)])
    assert rc == 0
    result = json.loads((out / "compare.json").read_text())
    assert result["engine"]["dtype"] == "fp32" and tiny["opened"].info.dtype == "bf16"  # the bf16 engine, run in fp32
    rows = {r["label"]: r for r in result["policies"]}
    assert rows["ar"]["identical_share"] == 1.0  # fp32: greedy speculation is greedy decoding, token for token
    assert "fp32" in capsys.readouterr().out


def test_quality_proxy_without_budget_is_the_prefill_log_likelihood(tiny):
    target = tiny["opened"].target
    prompt, cont = [5, 17, 33], [9, 101, 2, 77, 13, 50, 8, 64]
    cache = target.new_cache(1, 16)
    logits = target.prefill(cache, [prompt + cont[:-1]], logits="all").logits[0, len(prompt):].float()  # [7, V]
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(cont[1:])[:, None])[:, 0]
    for window in (None, 3, 1):
        got = continuation_logprobs(target, prompt, cont, window=window)
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)  # bf16 passes of different shapes
    from moespec.ops import ExpertBudget

    capped = continuation_logprobs(target, prompt, cont, budget=ExpertBudget(4), window=7)
    assert capped.shape == want.shape and not torch.allclose(capped, want, atol=1e-3)


# ---- Ctrl-C -----------------------------------------------------------------------------------


def _interrupt_on_call(monkeypatch, n: int) -> None:
    from moespec.spec.llm import LLM

    real, calls = LLM.generate, [0]

    def generate(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LLM, "generate", generate)


def test_ctrl_c_reports_the_finished_requests(tiny, monkeypatch, capsys):
    _interrupt_on_call(monkeypatch, 2)
    out = tiny["root"] / "partial.json"
    rc = main(["throughput", "--engine", str(tiny["engine"]), "--dataset", str(tiny["dataset"]), "--policy", "eagle3",
               "--max-batch-size", "1", "--warmup", "0", "--report-json", str(out), "--no-progress"])
    assert rc == 130
    assert "PARTIAL REPORT: interrupted; 1 of 3 requests finished" in capsys.readouterr().out
    report = json.loads(out.read_text())
    validate(report, "report")
    assert report["partial"] and [r["task_id"] for r in report["requests"]] == [0]


def test_ctrl_c_in_compare_keeps_complete_rounds(tiny, monkeypatch):
    _interrupt_on_call(monkeypatch, 4)  # round 1: ar, eagle3; round 2: eagle3, then ar is interrupted
    result = run_compare(tiny["opened"], tiny["dataset"], ["ar", "eagle3"], warmup=0, progress=False)
    assert result["partial"] and result["num_requests"] == 1
    assert all(len(r["requests"]) == 1 for r in result["reports"].values())
    assert all(r["mean_logprob"] is None for r in result["policies"])
    validate(json.loads(json.dumps(result)), "compare")


def test_ctrl_c_before_anything_finished(tiny, monkeypatch, capsys):
    _interrupt_on_call(monkeypatch, 1)
    rc = main(["throughput", "--engine", str(tiny["engine"]), "--dataset", str(tiny["dataset"]), "--policy", "ar",
               "--warmup", "0", "--no-progress"])
    assert rc == 130 and "nothing to report" in capsys.readouterr().err


# ---- errors -----------------------------------------------------------------------------------


def test_bad_dataset_line(tiny, capsys):
    bad = tiny["root"] / "bad.jsonl"
    bad.write_text('{"task_id":0,"input_ids":[5,6],"output_tokens":4}\n'
                   '{"task_id":1,"input_ids":[5],"output_tokens":0}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 2: output_tokens must be positive"):
        run_throughput(tiny["opened"], bad, progress=False)
    rc = main(["throughput", "--engine", str(tiny["engine"]), "--dataset", str(bad), "--no-progress"])
    assert rc == 2 and "line 2" in capsys.readouterr().err
    oov = tiny["root"] / "oov.jsonl"
    oov.write_text('{"task_id":0,"input_ids":[5,999],"output_tokens":4}\n')
    with pytest.raises(ValueError, match=r"line 1: task_id 0: token id 999 is outside the engine's vocabulary"):
        run_throughput(tiny["opened"], oov, progress=False)
    with pytest.raises(ValueError, match="does not exist"):
        run_throughput(tiny["opened"], tiny["root"] / "nowhere.jsonl", progress=False)


def test_text_prompt_needs_a_tokenizer(tiny):
    text = tiny["root"] / "text.jsonl"
    text.write_text('{"task_id":0,"prompt":"hello there","output_tokens":4}\n')
    with pytest.raises(ValueError, match="text prompt, but the engine .* has no tokenizer"):
        run_latency(tiny["opened"], text, progress=False)


def test_missing_engine(tiny, capsys):
    with pytest.raises(ValueError, match="does not exist"):
        run_throughput(tiny["root"] / "no-engine", tiny["dataset"], progress=False)
    rc = main(["compare", "--engine", str(tiny["root"] / "no-engine"), "--dataset", str(tiny["dataset"]),
               "--policies", "ar", "--no-progress"])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("policy, match", [
    ("eagle4", "unknown policy 'eagle4'"),
    ("ar:4", "unknown policy 'ar:4'"),
    ("eagle3+budget", "needs a budget"),
    ("eagle3+budget:3", "below top_k = 4"),
    ("eagle3+budget:x", "eagle3\\+budget:x"),
])
def test_unknown_or_invalid_policy(tiny, policy, match):
    with pytest.raises(ValueError, match=match):
        run_throughput(tiny["opened"], tiny["dataset"], policy=policy, progress=False)


def test_policy_errors_on_the_command_line(tiny, capsys):
    rc = main(["throughput", "--engine", str(tiny["plain"]), "--dataset", str(tiny["dataset"]), "--policy", "eagle3",
               "--no-progress"])
    assert rc == 2 and "needs an EAGLE-3 draft head" in capsys.readouterr().err
    rc = main(["compare", "--engine", str(tiny["engine"]), "--dataset", str(tiny["dataset"]), "--policies",
               "eagle3+budget:8", "--no-progress"])
    assert rc == 2 and "must include eagle3 or ar" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: mutually exclusive
        main(["throughput", "--engine", "e", "--dataset", "d", "--max-batch-size", "2", "--concurrency", "2"])


def test_schema_rejects_a_broken_report(tiny):
    report = run_throughput(tiny["opened"], tiny["dataset"], policy="ar", max_batch_size=3, warmup=0, progress=False)
    validate(report, "report")
    assert report["world_info"]["issue_rate"] is None  # one batch: every request issued at once
    broken = {k: v for k, v in report.items() if k != "performance"}
    with pytest.raises(ValueError, match="'performance' is a required property"):
        validate(broken, "report")
    report["request_info"]["num_requests"] = 0
    with pytest.raises(ValueError, match="request_info/num_requests"):
        validate(report, "report")
    assert math.isfinite(report["performance"]["system_output_throughput_tok_s"])


# ---- moespec bench roofline ---------------------------------------------------------------------------


def test_roofline_end_to_end(tiny, capsys):
    from moespec.bench.roofline import VERIFY_SIZES, format_roofline, run_roofline, step_cost

    result = run_roofline(str(tiny["engine"]), context=6, repeats=1, stream_gib=0.01, progress=False)
    m_ = result["machine"]
    assert m_["bandwidth_gbs"] > 0 and m_["peak_gflops"] > 0
    names = [r["step"] for r in result["steps"]]
    want = ["decode"] + [f"verify T={T}" for T in VERIFY_SIZES]
    assert [n for n in names if "budget" not in n and "step (" not in n] == want
    assert sum("budget 8" in n for n in names) == len(VERIFY_SIZES)  # N/2 of 16 experts
    assert any(n.startswith("draft step") for n in names) and any(n.startswith("eagle3 step") for n in names)
    for r in result["steps"]:
        assert r["ms"] > 0
        if r["mb"] is not None:
            assert 0 < r["pct_roofline"] and r["roofline_ms"] > 0 and r["bound"] in ("memory", "compute")
            assert 4 <= r["experts_per_layer"] <= 16  # top-4 of 16
    budgeted = [r for r in result["steps"] if "budget" in r["step"]]
    assert all(r["experts_per_layer"] <= 8 for r in budgeted)
    splits = result["splits"]
    assert splits["backend"] == "native" and list(splits["steps"]) == ["decode", "verify T=2", "verify T=17",
                                                                       "verify T=33"]
    for split in splits["steps"].values():
        assert 0 <= split["host_share"] < 1 and split["native_ms"] <= split["step_ms"]
        assert set(split["phases_ms"]) >= {"qkv", "attention"}
    # bytes: dense weights once, plus the experts touched, plus the cache
    target = tiny["opened"].target
    one, two = step_cost(target, 1, 6, [4, 4]), step_cost(target, 1, 6, [8, 8])
    c = target.config
    assert two["bytes"] - one["bytes"] == 2 * 4 * 3 * c.moe.intermediate_size * c.hidden_size * 2  # bf16
    assert step_cost(target, 2, 6, [4, 4])["flops"] > 2 * one["flops"] - 1
    text = format_roofline(result)
    assert "where a step goes" in text and "% roof" in text


def test_roofline_command_writes_json_and_plot(tiny, tmp_path, capsys):
    out = tmp_path / "roof"
    assert main(["roofline", "--engine", str(tiny["plain"]), "--context", "4", "--repeats", "1",
                 "--stream-gib", "0.01", "--out-dir", str(out), "--no-progress"]) == 0
    data = json.loads((out / "roofline.json").read_text())
    assert data["steps"][0]["step"] == "decode" and (out / "roofline.png").stat().st_size > 1000
    assert not any("draft" in r["step"] for r in data["steps"])  # no head, no draft step
    assert main(["roofline", "--engine", str(tiny["plain"]), "--budget", "2", "--stream-gib", "0.01"]) == 2
    assert "below top_k" in capsys.readouterr().err


def test_gpu_check_plots_from_its_json(tmp_path):
    """tests/gpu/plot_results.py draws the GPU check's JSON (the 2026-12-04 H200 run kept in
    tests/gpu/results/; and a runtime row set with the graphs' reference-forward column), and says so
    when the folder has none."""
    import importlib.util
    import shutil

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("plot_results", root / "tests" / "gpu" / "plot_results.py")
    plot_results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_results)
    results = root / "tests" / "gpu" / "results" / "h200-2026-12-04"
    assert plot_results.main([str(results), "--out", str(tmp_path / "a")]) == 0
    for name in ("gpu_steps.png", "gpu_moe_kernel.png"):
        assert (tmp_path / "a" / name).stat().st_size > 10_000
    bench = json.loads((results / "runtime_bench.json").read_text())
    for row in bench["rows"]:
        row["graphs_reference_forward_ms"] = row["graphs_ms"] * 1.5
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "runtime_bench.json").write_text(json.dumps(bench))
    assert plot_results.main([str(tmp_path / "in"), "--out", str(tmp_path / "b")]) == 0
    assert (tmp_path / "b" / "gpu_steps.png").stat().st_size > 10_000
    assert not (tmp_path / "b" / "gpu_moe_kernel.png").exists()
    linear_rows = [{"shape": shape, "T": T, "of_copy": 0.8 - 0.1 / T, "torch_of_copy": 0.7}  # (as bench_linear_cuda.py)
                   for shape in ("q/k/v", "o") for T in (1, 4, 16, 64)]
    (tmp_path / "in" / "linear_bench.json").write_text(json.dumps({"device": "test", "rows": linear_rows}))
    assert plot_results.main([str(tmp_path / "in"), "--out", str(tmp_path / "c")]) == 0
    assert (tmp_path / "c" / "gpu_linear.png").stat().st_size > 10_000
    shutil.rmtree(tmp_path / "in")
    (tmp_path / "in").mkdir()
    assert plot_results.main([str(tmp_path / "in")]) == 2

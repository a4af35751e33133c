"""Decode and verify steps of the runtime on CUDA, for tests/gpu/run.sh: a random Qwen3-30B-A3B-shaped
model (H 2048, 32 query / 4 key-value heads of 128, 128 experts of 768, top-8; vocabulary cut to
32k; 8 layers) built in memory in bf16 on the GPU, 512 cached tokens, T = 1..64 new tokens as one
chain (a verify pass), budget off and B in {16, 32, 64}: step time (median of CUDA-event-timed
calls) against the unique experts a layer actually read, and against the roofline (dense bytes +
unique-expert bytes) / the device copy bandwidth of the same run (the call as a caller sees it, and its
captured graph's replay alone: the GPU's time without the call's host work). Also the routing + budget op's
share of a layer at T = 16, and a draft round's tree work (expand_root, 5 expands, finalize at top-k
8, 32 nodes) on the GPU's tree cores (the fused one: a kernel a level; the torch ops) against the
native core fed from the GPU (each level's top-k copied to the host), and a greedy eagle3 step's parts
(draft, verify, acceptance, commit, catch-up) and kernels. Writes $OUT/runtime_bench.json when OUT is set. Target (issue "GPU
runtime"): within 15% of the roofline at T <= 16, with CUDA graphs (the "graphs" backend,
moespec.runtime.graphs); each row times the eager reference backend and the graphs backend, the
latter with its default forward (moespec.runtime.fused: the decoder ops' kernels), with the
reference forward on static buffers (MOESPEC_FUSED_STEP=0), with every kernel launched plainly instead
of as a programmatic dependent (MOESPEC_PDL=0), with each kernel releasing the next one after its wait
instead of early (MOESPEC_PDL_EARLY=0), with the MoE kernel's four launches instead of the
fused pair (MOESPEC_MOE_FUSED=0) and with torch's GEMM for the dense projections instead of
moespec's linear kernel (MOESPEC_CUDA_LINEAR=0).
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

import torch
from gpu_common import (DEVICE, SMOKE, copy_bandwidth, device_name, event_seconds, graph_seconds, profiler_activity,
                        results_saver, sync, timed_calls, timeline)

from moespec.models import TargetModel
from moespec.models.config import ModelConfig, MoeConfig, RopeConfig
from moespec.models.weights import LayerWeights, ModelWeights
from moespec.ops import ExpertBudget, RouterSpec, route_experts

CUDA = DEVICE
H, HQ, HKV, D, E, I, K, V, LAYERS = 2048, 32, 4, 128, 128, 768, 8, 32768, 8
CONTEXT = 512
ROWS, LATE_ROWS, BUDGETS = (1, 2, 4, 8, 16), (32, 64), (None, 16, 32, 64)  # T of the verify rows, budgets
if SMOKE:  # (gpu_common: the CPU, tiny shapes)
    H, HQ, HKV, D, E, I, K, V, LAYERS, CONTEXT = 64, 4, 2, 16, 64, 32, 4, 512, 2, 16
    ROWS, LATE_ROWS = (1, 16), (32,)


def model() -> TargetModel:
    moe = MoeConfig(num_experts=E, top_k=K, intermediate_size=I, router=RouterSpec("softmax", K, True),
                    layers=tuple(range(LAYERS)), weights_in_model_dtype=True)
    config = ModelConfig(architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", vocab_size=V, hidden_size=H,
                         num_layers=LAYERS, num_heads=HQ, num_kv_heads=HKV, head_dim=D, intermediate_size=0,
                         rms_norm_eps=1e-6, rope=RopeConfig(1e6), qk_norm="per_head", attention_bias=False,
                         clip_qkv=None, tie_word_embeddings=False, max_position_embeddings=4096, moe=moe)
    bf16 = dict(dtype=torch.bfloat16, device=CUDA)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=CUDA) * scale).to(torch.bfloat16)

    layers = [LayerWeights(input_norm=torch.ones(H, **bf16), qkv=rand((HQ + 2 * HKV) * D, H, scale=H**-0.5),
                           qkv_bias=None, q_norm=torch.ones(D, **bf16), k_norm=torch.ones(D, **bf16),
                           o=rand(H, HQ * D, scale=(HQ * D) ** -0.5), o_bias=None, post_norm=torch.ones(H, **bf16),
                           router=rand(E, H, scale=H**-0.5), experts=rand(E, 3 * I * H, scale=H**-0.5))
              for _ in range(LAYERS)]
    weights = ModelWeights(embed=rand(V, H), layers=layers, final_norm=torch.ones(H, **bf16),
                           lm_head=rand(V, H, scale=H**-0.5), dtype=torch.bfloat16)
    return TargetModel(config, weights)


def host_seconds(fn, calls: int = 20) -> float:
    """Host seconds per call of ``fn`` issued back to back without waiting for the GPU: the host's
    own cost of a step (a step whose event time is about this is bound by its host work)."""
    calls = timed_calls(calls)
    fn()
    sync()
    clock = time.perf_counter()
    for _ in range(calls):
        fn()
    spent = (time.perf_counter() - clock) / calls
    sync()
    return spent


def kernel_table(m: TargetModel, cache, T: int, top: int = 12) -> dict:
    """Where a graphs-backend verify step of T tokens spends GPU time (:func:`profiled`)."""
    m.backend_name = "graphs"
    tokens, parents = torch.randint(0, V, (T,)).tolist(), [-1] + list(range(T - 1))

    def step():
        m.verify(cache, [tokens], [parents])
        cache.pending = None

    return profiled(step, f"verify T={T} (graphs)", top)


def profiled(step, label: str, top: int = 12, calls: int = 3) -> dict:
    """torch's profiler over ``calls`` calls of ``step`` (after one untimed call): the GPU time and
    the kernels a call (printed), and the ``top`` kernels by time as [name, us a call, launches a call]."""
    from torch.profiler import profile

    calls = timed_calls(calls)
    step()
    sync()
    with profile(activities=[profiler_activity()[0]]) as prof:
        for _ in range(calls):
            step()
        sync()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows = sorted(((e.key, e.device_time_total / calls, e.count / calls) for e in events), key=lambda r: -r[1])
    total = sum(e.device_time_total for e in events) / calls
    launches = sum(e.count for e in events) / calls
    print(f"{label}: GPU time {total:.0f} us a call, {launches:.0f} kernels; top kernels:")
    for name, us, count in rows[:top]:
        print(f"  {us:8.1f} us {count:5.0f}x  {name[:110]}")
    line = timeline(step)
    print(f"{label}: one call on the GPU's clock: {line['span_us']:.0f} us from its first kernel's start to its last's "
          f"end, {line['busy_us']:.0f} us with a kernel running, {line['idle_us']:.0f} us idle "
          f"({100 * line['idle_us'] / max(line['span_us'], 1e-9):.0f}%)")
    return {"gpu_us": total, "kernels": launches, "top": [[n, us, c] for n, us, c in rows[:top]], **line}


def routing_in_step_us(m: TargetModel, cache, T: int = 16, budget: int = 32) -> float:
    """Routing + budget's share of a captured verify step, measured inside it: the step's time minus the
    time of the same step whose routing is its own recorded output (moespec.models.moe.route_experts
    replaced by the routings of an earlier call, layer after layer: the graph then has no routing
    kernel, and the experts read are the same), per layer, in us. (Beside route_us, the routing op timed
    alone in a graph: inside the step its launch overlaps the kernels around it.)"""
    import itertools

    from moespec.models import moe

    tokens, parents = torch.randint(0, V, (T,)).tolist(), [-1] + list(range(T - 1))
    cap = ExpertBudget(budget)

    def step():
        m.verify(cache, [tokens], [parents], budget=cap)
        cache.pending = None

    routing = moe.route_experts
    recorded = []
    moe.route_experts = lambda *a, **k: recorded.append(routing(*a, **k)) or recorded[-1]
    try:
        m.backend_name = "reference"
        step()
        sync()
        replayed = itertools.cycle(recorded)
        moe.route_experts = lambda *a, **k: next(replayed)
        m.backend_name = "graphs"  # (new buckets: captured without the routing kernels)
        without = event_seconds(step)
    finally:
        moe.route_experts = routing
    m.backend_name = "graphs"
    return (event_seconds(step) - without) / LAYERS * 1e6


def draft_round_ms(batch: int, core: str, K: int = 8, depth: int = 6, total: int = 32, repeats: int = 20) -> float:
    """Median wall-clock ms of one draft round's tree work with the level log-probs on the GPU."""
    from moespec.spec.tree import TreeBuilder

    repeats = timed_calls(repeats)
    builder = TreeBuilder(batch, depth=depth, top_k=K, total_tokens=total, device=CUDA if core != "native" else None,
                          core=core)
    gen = torch.Generator(device=CUDA).manual_seed(0)
    levels = [torch.randn(batch, *([K] if d else []), 4096, device=CUDA, generator=gen).log_softmax(-1).topk(K)
              for d in range(depth)]
    roots = torch.zeros(batch, dtype=torch.long, device=CUDA)
    times = []
    for _ in range(repeats):
        sync()
        clock = time.perf_counter()
        builder.expand_root(roots, levels[0].indices, levels[0].values)
        for top in levels[1:]:
            builder.expand(top.indices, top.values)
        builder.finalize()
        sync()
        times.append(time.perf_counter() - clock)
    return sorted(times)[len(times) // 2] * 1e3


def eagle3_step_parts(m: TargetModel, label: str, steps: int = 12, policy: str = "eagle3") -> tuple[dict, dict]:
    """A greedy eagle3 step (graphs backend, depth 4 / top-k 4 / 8 nodes, one request, an untrained head)
    on the model: its wall time as it runs, then with a synchronisation around each part (draft, verify,
    acceptance, commit, catch-up), so that the parts' shares are visible; ms per step. Also the step's
    kernels (:func:`profiled`: with draft graphs, the round's and the catch-up's inside their replays).
    ``policy`` "eco": the same step with the cost-aware selection on the GPU (a random expert predictor;
    the draft part includes the prediction and the selection)."""
    from moespec import SamplingParams, SpeculativeConfig
    from moespec.spec import eagle3_policy
    from moespec.spec.eagle3_policy import Eagle3Policy
    from moespec.spec.expert_predictor import ExpertPredictor
    from moespec.spec.llm import _Request
    from moespec.spec.train import new_head

    steps = timed_calls(steps)
    m.backend_name = "graphs"
    head = new_head(m.config, m.weights.embed, None, seed=0).to(CUDA)
    predictor = None
    if policy == "eco":
        L, N, D = len(m.config.moe.layers), m.config.moe.num_experts, 2 * m.config.hidden_size
        predictor = ExpertPredictor(torch.randn(L, N, D) * D ** -0.5, torch.zeros(L, N), torch.zeros(D), torch.ones(D))
        os.environ.setdefault("MOESPEC_HARDWARE", "h200")  # (the selection's prices: the measured H200 profile)
    policy = Eagle3Policy(m, head, SpeculativeConfig(policy, depth=4, top_k=4, total_tokens=8), predictor=predictor)
    request = _Request(0, None, torch.randint(0, V, (CONTEXT,)).tolist(),
                       SamplingParams(max_tokens=8 * (2 * steps + 10), ignore_eos=True), set())
    run = policy.start([request])
    request.output.append(run.first_tokens[0])

    def step():
        request.output.extend(policy.step(run, [request])[0])

    for _ in range(2):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    parts = {"step (as it runs)": (time.perf_counter() - start) / steps * 1e3}
    kernels = profiled(step, f"eagle3 step ({label})", top=16)
    spent: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            sync()
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
            return out
        return wrapper

    saved = (policy._draft, policy._catch_up, m.verify_trees, m.commit, eagle3_policy.accept_trees)
    policy._draft, policy._catch_up = timed("draft", policy._draft), timed("catch-up", policy._catch_up)
    m.verify_trees, m.commit = timed("verify", m.verify_trees), timed("commit", m.commit)
    eagle3_policy.accept_trees = timed("accept", eagle3_policy.accept_trees)
    try:
        for _ in range(steps):
            step()
    finally:
        policy._draft, policy._catch_up, m.verify_trees, m.commit, eagle3_policy.accept_trees = saved
    parts.update({k: v / steps * 1e3 for k, v in spent.items()})
    return parts, kernels


def main() -> int:
    torch.manual_seed(0)
    copy = copy_bandwidth()
    m = model()
    dense = sum(t.numel() * 2 for layer in m.weights.layers for t in (layer.qkv, layer.o, layer.router)) + \
        m.weights.lm_head.numel() * 2
    expert_bytes = 3 * I * H * 2
    cache = m.new_cache(1, CONTEXT + 80)
    m.prefill(cache, [torch.randint(0, V, (CONTEXT,)).tolist()])
    print(f"device {device_name()}: copy {copy:.0f} GB/s; model {LAYERS} layers, dense "
          f"{dense / 1e6:.0f} MB, {expert_bytes / 1e6:.1f} MB per expert")
    rows = []
    results = {"device": device_name(), "copy_GBps": copy, "rows": rows}
    save = results_saver(results, "runtime_bench.json")  # (after every row)
    def verify_rows(Ts):  # each T with the budget off and each budget that binds
        for T, B in ((T, B) for T in Ts for B in BUDGETS):
            if B is not None and (T * K <= B or B < K):
                continue  # the budget cannot bind
            tokens = torch.randint(0, V, (T,)).tolist()
            parents = [-1] + list(range(T - 1))
            budget = ExpertBudget(B) if B else None
            stats = {}

            def step():
                out = m.verify(cache, [tokens], [parents], budget=budget)
                cache.pending = None  # forget the tree (nothing committed)
                stats["kept"] = out.expert_stats[:, 1].float().mean()

            m.backend_name = "reference"
            t = event_seconds(step)
            kept = float(stats["kept"])
            def graphs_with(**env):  # graphs made and captured under these settings, then the caller's again
                saved = {name: os.environ.get(name) for name in env}
                os.environ.update(env)
                try:
                    m.backend_name = "graphs"
                    return event_seconds(step)
                finally:
                    for name, value in saved.items():
                        if value is None:
                            os.environ.pop(name, None)
                        else:
                            os.environ[name] = value

            t_unfused = graphs_with(MOESPEC_FUSED_STEP="0")  # graphs of the reference forward
            t_no_pdl = graphs_with(MOESPEC_PDL="0")  # every kernel launched plainly
            t_late = graphs_with(MOESPEC_PDL_EARLY="0")  # every kernel releasing the next after its wait
            t_moe_four = graphs_with(MOESPEC_MOE_FUSED="0")  # the MoE kernel's four launches
            t_torch_linear = graphs_with(MOESPEC_CUDA_LINEAR="0")  # torch's GEMM for the projections
            m.backend_name = "graphs"  # graphs of the fused forward (moespec.runtime.fused): the default
            # (the fallback run of tests/gpu/run.sh sets MOESPEC_FUSED_STEP=0: the reference forward then)
            assert m.backend.fused is not None or os.environ.get("MOESPEC_FUSED_STEP") == "0"
            t_graph = event_seconds(step)
            bucket = next(reversed(m.backend.steps.values()))  # (this call's: the most recently used)
            t_replay = event_seconds(bucket.graph.replay) if bucket.graph is not None else float("nan")
            host = host_seconds(step)
            roof = (dense + LAYERS * kept * expert_bytes) / (copy * 1e9)
            rows.append({"T": T, "budget": B, "ms": t * 1e3, "graphs_ms": t_graph * 1e3, "graphs_host_ms": host * 1e3,
                         "replay_ms": t_replay * 1e3, "replay_x_roofline": t_replay / roof,
                         "graphs_reference_forward_ms": t_unfused * 1e3, "graphs_no_pdl_ms": t_no_pdl * 1e3,
                         "graphs_late_release_ms": t_late * 1e3,
                         "graphs_moe_four_launches_ms": t_moe_four * 1e3, "graphs_torch_linear_ms": t_torch_linear * 1e3,
                         "unique": kept, "roofline_ms": roof * 1e3,
                         "x_roofline": t / roof, "graphs_x_roofline": t_graph / roof})
            print(f"T={T:3d} budget={str(B):>4s}: eager {t * 1e3:7.3f} ms, graphs {t_graph * 1e3:7.3f} ms "
                  f"(its graph's replay alone {t_replay * 1e3:7.3f} ms) "
                  f"(reference forward {t_unfused * 1e3:7.3f}, no PDL {t_no_pdl * 1e3:7.3f}, late release "
                  f"{t_late * 1e3:7.3f}, MoE in four launches "
                  f"{t_moe_four * 1e3:7.3f}, torch's projections {t_torch_linear * 1e3:7.3f} ms; "
                  f"host {host * 1e3:6.3f} ms a call), "
                  f"{kept:6.1f} experts/layer, roofline {roof * 1e3:6.3f} ms (graphs {t_graph / roof:5.2f}x)")
            save()

    verify_rows(ROWS)  # the target's (T <= 16) first: a run stopped by its limit keeps them
    x = torch.randn(16, H, device=CUDA).to(torch.bfloat16)
    router = m.weights.layers[0].router
    spec = RouterSpec("softmax", K, True)
    logits = torch.nn.functional.linear(x, router)
    # inside a CUDA graph, as in the captured verify step (no host-side dispatch in the number)
    t_route = graph_seconds(lambda: route_experts(logits, spec, ExpertBudget(32)))
    saved = os.environ.get("MOESPEC_ROUTE_FUSED")
    os.environ["MOESPEC_ROUTE_FUSED"] = "0"  # the four-launch path, for comparison (read at each call)
    t_route_4 = graph_seconds(lambda: route_experts(logits, spec, ExpertBudget(32)))
    if saved is None:
        del os.environ["MOESPEC_ROUTE_FUSED"]
    else:
        os.environ["MOESPEC_ROUTE_FUSED"] = saved
    row = next(r for r in rows if r["T"] == 16 and r["budget"] == 32)
    # a layer of the captured step (its replay alone: the GPU's time; the whole call where there is none)
    layer_ms = (row["replay_ms"] if row["replay_ms"] == row["replay_ms"] else row["graphs_ms"]) / LAYERS
    print(f"routing + budget (T=16, B=32, in a graph): {t_route * 1e6:.1f} us = {100 * t_route * 1e3 / layer_ms:.1f}% "
          f"of a verify layer ({layer_ms:.3f} ms); four launches: {t_route_4 * 1e6:.1f} us")
    results.update(route_us=t_route * 1e6, route_four_launches_us=t_route_4 * 1e6, layer_ms=layer_ms)
    save()
    in_step = results["route_in_step_us"] = routing_in_step_us(m, cache)
    print(f"routing + budget inside the captured verify step (T=16, B=32; the step without it): {in_step:.1f} us a "
          f"layer = {100 * in_step / (layer_ms * 1e3):.1f}% of a verify layer")
    save()
    step_parts = results["eagle3_step_ms"] = {}
    step_kernels = results["eagle3_step_kernels"] = {}
    for flag, label in (("1", "draft graphs"), ("0", "eager draft")):  # (MOESPEC_DRAFT_GRAPHS: read by the policy)
        os.environ["MOESPEC_DRAFT_GRAPHS"] = flag
        step_parts[label], step_kernels[label] = eagle3_step_parts(m, label)
        print(f"eagle3 step (depth 4, top-k 4, 8 nodes, graphs backend, {label}): "
              + ", ".join(f"{k} {v:.3f} ms" for k, v in step_parts[label].items()))
        save()
    os.environ.pop("MOESPEC_DRAFT_GRAPHS")
    label = "eco, selection on the GPU"  # (since 2026-12-06; before, on the host: ~10 synchronisations a step)
    step_parts[label], step_kernels[label] = eagle3_step_parts(m, label, policy="eco")
    print(f"eco step (depth 4, top-k 4, 8 nodes, graphs backend): "
          + ", ".join(f"{k} {v:.3f} ms" for k, v in step_parts[label].items()))
    save()
    results["kernels"] = {T: kernel_table(m, cache, T) for T in (1, 16)}
    save()
    rounds = results["draft_round_ms"] = {f"B={B} {core}": draft_round_ms(B, core) for B in (1, 8)
                                          for core in ("fused", "torch", "native")}
    save()
    print("draft round (top-k 8, depth 6, 32 nodes; wall clock, synchronised): "
          + ", ".join(f"{k} {v:.3f} ms" for k, v in rounds.items()))
    verify_rows(LATE_ROWS)
    if save():
        print(f"wrote {pathlib.Path(os.environ['OUT']) / 'runtime_bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

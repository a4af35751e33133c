"""The runtime on CUDA (moespec.models.load(..., device="cuda"), LLM(..., device="cuda")) against the
same model on the CPU: a tiny random Qwen3-MoE written by transformers, run by the reference backend
on both devices (on CUDA with moespec's CUDA routing and expert kernels).

- fp32: prefill, 8 decode steps and a budgeted verify tree give the CPU's logits within 1e-4 of their
  scale (sums run in other orders on the GPU), and the same expert statistics;
- bf16: within 2e-2 of the scale;
- greedy `ar` through LLM on CUDA equals greedy `ar` on the CPU in fp32 (a tiny model's logits are far
  from ties at these tolerances; the seed is fixed);
- a budget caps every verify step's experts on CUDA as on the CPU.
Skipped without a CUDA device or a CUDA build.
"""

from __future__ import annotations

import pytest
import torch
from gpu_common import require_cuda_build

require_cuda_build()

import moespec.models as mm  # noqa: E402
from models_fixtures import write_checkpoint  # noqa: E402
from moespec import LLM, SamplingParams  # noqa: E402
from moespec.ops import ExpertBudget  # noqa: E402

PROMPTS = [[5, 17, 33, 64, 9], [3, 4, 120, 77, 13, 50, 8]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("cuda") / "qwen3_moe")


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, where: str) -> None:
    got, want = got.float().cpu(), want.float().cpu()
    scale = float(want.abs().max())
    err = float((got - want).abs().max())
    assert err <= tol * scale, f"{where}: max error {err} > {tol} x {scale}"


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-4), ("bf16", 2e-2)])
def test_prefill_decode_and_verify_match_the_cpu(folder, dtype, tol):
    cpu = mm.load(folder, dtype, device="cpu")
    cpu.backend_name = "reference"
    gpu = mm.load(folder, dtype, device="cuda")
    assert gpu.backend_name == "graphs" and gpu.weights.embed.is_cuda  # the CUDA default
    gpu.backend_name = "reference"  # (graphs against eager: test_graph_replay_equals_eager)
    caches = [m.new_cache(2, 32) for m in (cpu, gpu)]
    outs = [m.prefill(c, PROMPTS, logits="all") for m, c in zip((cpu, gpu), caches)]
    _close(outs[1].logits, outs[0].logits, tol, f"{dtype} prefill")
    tokens = [int(t) for t in outs[0].logits[torch.arange(2), torch.tensor([4, 6])].argmax(-1)]
    for step in range(8):
        d = [m.decode(c, tokens) for m, c in zip((cpu, gpu), caches)]
        _close(d[1].logits, d[0].logits, tol, f"{dtype} decode {step}")
        if dtype == "fp32":  # (bf16 router logits may round a near-tie the other way)
            assert torch.equal(d[1].expert_stats.cpu(), d[0].expert_stats)
        tokens = [int(t) for t in d[0].logits.argmax(-1)]
    tree, parents = [[tokens[0], 7, 9, 11], [tokens[1], 3, 4]], [[-1, 0, 0, 1], [-1, 0, 1]]
    budget = ExpertBudget(4)
    v = [m.verify(c, tree, parents, budget=budget) for m, c in zip((cpu, gpu), caches)]
    _close(v[1].logits[0, :4], v[0].logits[0, :4], tol, f"{dtype} verify")
    if dtype == "fp32":
        assert torch.equal(v[1].expert_stats.cpu(), v[0].expert_stats)
    assert int(v[1].expert_stats[:, 1].max()) <= 4


def _family_folder(family: str, root):
    """A tiny random checkpoint of ``family``: the fixtures' (tests/python/models_fixtures.py), GPT-OSS
    (sinks, sliding windows, biases, clamped SwiGLU) and DeepSeek-V3 (MLA with a q LoRA, grouped routing
    with a bias, a shared expert, a dense first layer)."""
    try:  # (the GPU machine's transformers may predate a family: that family is skipped, saying so)
        if family == "gpt_oss":
            from test_gpt_oss import write
            return write(root / family)
        if family == "deepseek_v3":
            from test_deepseek_v3 import write
            return write(root / family, q_lora_rank=24)
    except ImportError as exc:
        pytest.skip(f"this transformers cannot write a {family} checkpoint: {exc}")
    return write_checkpoint(family, root / family)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "olmoe", "llama", "gpt_oss", "deepseek_v3"])
def test_every_family_on_cuda_matches_the_cpu(family, tmp_path):
    """Each family's CUDA paths (the graphs backend, its default on CUDA: the fused forward where the
    model fits it, else the reference forward on static buffers; routing and experts on CUDA) against
    the CPU's reference backend in fp32: prefill, decode steps replayed from their graph, budgeted
    verify trees (same logits within 1e-4 of their scale); and greedy eagle3 on CUDA equals greedy ar
    on the CPU."""
    from moespec import SpeculativeConfig
    from moespec.spec.train import new_head

    folder = _family_folder(family, tmp_path)
    cpu = mm.load(folder, "fp32", device="cpu")
    cpu.backend_name = "reference"
    gpu = mm.load(folder, "fp32", device="cuda")
    assert gpu.backend_name == "graphs"
    prompts = [p[:5] for p in PROMPTS]
    caches = [m.new_cache(2, 40) for m in (cpu, gpu)]
    first = [m.prefill(c, prompts) for m, c in zip((cpu, gpu), caches)]
    _close(first[1].logits, first[0].logits, 1e-4, f"{family} prefill")
    tokens = [7, 11]
    for step in range(3):
        d = [m.decode(c, tokens) for m, c in zip((cpu, gpu), caches)]
        _close(d[1].logits, d[0].logits, 1e-4, f"{family} decode {step}")
        tokens = [int(t) for t in d[0].logits.argmax(-1)]
    budget = ExpertBudget(4) if cpu.config.moe is not None else None
    for step in range(2):
        trees = [[tokens[0], 3 + step, 4, 5], [tokens[1], 6, 7 + step, 8]]
        v = [m.verify(c, trees, [[-1, 0, 0, 1], [-1, 0, 1, 1]], budget=budget) for m, c in zip((cpu, gpu), caches)]
        _close(v[1].logits, v[0].logits, 1e-4, f"{family} verify {step}")
        for m, c in zip((cpu, gpu), caches):
            m.commit(c, [[0, 1], [0]])
    assert all(s.graph is not None for s in gpu.backend.steps.values()) and len(gpu.backend.steps) == 2
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(cpu).generate(prompts, params)]
    head = new_head(gpu.config, gpu.weights.embed, None, seed=0).to("cuda")
    llm = LLM(gpu, draft=head, speculative_config=SpeculativeConfig("eagle3", depth=3, top_k=2, total_tokens=5),
              max_batch_size=2)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want


def test_greedy_ar_on_cuda_equals_the_cpu(folder):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(folder, dtype="fp32").generate(PROMPTS, params)]
    got = [o.outputs[0].token_ids for o in LLM(folder, dtype="fp32", device="cuda").generate(PROMPTS, params)]
    assert got == want
    sampled = LLM(folder, dtype="fp32", device="cuda").generate(
        PROMPTS, SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in sampled)


def test_greedy_speculation_on_cuda_equals_greedy_ar(folder, tmp_path):
    """eagle3, eagle3+budget (budget >= N) and eco on CUDA, greedy, fp32: token for token the output of
    ar on CUDA (the draft head on the GPU, the tree core and acceptance on the host), batches included."""
    from moespec import SpeculativeConfig
    from moespec.spec.expert_predictor import ExpertPredictor
    from moespec.spec.train import new_head

    target = mm.load(folder, "fp32", device="cuda")
    head = new_head(target.config, target.weights.embed, None, seed=0).to("cuda")
    c = target.config
    L, N, D = len(c.moe.layers), c.moe.num_experts, 2 * c.hidden_size
    predictor = ExpertPredictor(torch.randn(L, N, D), torch.zeros(L, N), torch.zeros(D), torch.ones(D))
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(target).generate(PROMPTS, params)]
    for policy, extra in (("eagle3", {}), ("eagle3+budget", {"budget": N}), ("eco", {})):
        config = SpeculativeConfig(policy, depth=3, top_k=3, total_tokens=6, **extra)
        llm = LLM(target, draft=head, speculative_config=config, predictor=predictor, max_batch_size=2)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want, policy


def _steps_agree(models, tol: float, where: str, decode_steps: int, verify_steps: int, stats: bool):
    """Two models (the reference first) on the prompts' first 5 tokens: greedy decode steps (the
    reference's argmax fed to both) and budgeted verify trees (committed), logits within ``tol`` of
    their scale and, with ``stats``, the same expert statistics. Returns the caches and the last tokens."""
    caches = [m.new_cache(2, 48) for m in models]
    for m, c in zip(models, caches):
        m.prefill(c, [p[:5] for p in PROMPTS])
    tokens = [7, 11]
    for step in range(decode_steps):
        d = [m.decode(c, tokens) for m, c in zip(models, caches)]
        _close(d[1].logits, d[0].logits, tol, f"{where}decode {step}")
        assert not stats or torch.equal(d[1].expert_stats, d[0].expert_stats)
        tokens = [int(t) for t in d[0].logits.argmax(-1)]
    for step in range(verify_steps):
        trees = [[tokens[0], 3 + step, 4, 5], [tokens[1], 6, 7 + step, 8]]
        v = [m.verify(c, trees, [[-1, 0, 0, 1], [-1, 0, 1, 1]], budget=ExpertBudget(4)) for m, c in zip(models, caches)]
        _close(v[1].logits, v[0].logits, tol, f"{where}verify {step}")
        assert not stats or torch.equal(v[1].expert_stats, v[0].expert_stats)
        for m, c in zip(models, caches):
            m.commit(c, [[0, 1], [0]])
    return caches, tokens


@pytest.mark.parametrize("fused,pdl,early", [("1", "1", "1"), ("1", "1", "0"), ("1", "0", "1"), ("0", "1", "1")],
                         ids=["fused-forward", "fused-forward-late-release", "fused-forward-no-pdl",
                              "reference-forward"])
def test_graph_replay_equals_eager(folder, fused, pdl, early, monkeypatch):
    """The "graphs" backend on CUDA: decode and budgeted tree-verify steps captured once per bucket,
    then replayed with new inputs, give the eager reference backend's logits and expert stats; greedy
    eagle3 through graphs equals greedy ar. Both forwards of the steps: moespec.runtime.fused (the
    decoder ops' kernels, launched as programmatic dependents releasing the next kernel early, or after
    their wait (MOESPEC_PDL_EARLY=0), or, MOESPEC_PDL=0, plainly) and the reference forward on static
    buffers (MOESPEC_FUSED_STEP=0)."""
    from moespec import SpeculativeConfig
    from moespec.spec.train import new_head

    monkeypatch.setenv("MOESPEC_FUSED_STEP", fused)
    monkeypatch.setenv("MOESPEC_PDL", pdl)
    monkeypatch.setenv("MOESPEC_PDL_EARLY", early)
    eager = mm.load(folder, "fp32", device="cuda")
    eager.backend_name = "reference"  # (the CUDA default is "graphs")
    graphs = mm.load(folder, "fp32", device="cuda")
    graphs.backend_name = "graphs"
    assert (graphs.backend.fused is not None) == (fused == "1")
    caches, tokens = _steps_agree((eager, graphs), 1e-4, "", decode_steps=6, verify_steps=3, stats=True)
    budget = ExpertBudget(4)
    assert all(s.graph is not None for s in graphs.backend.steps.values()) and len(graphs.backend.steps) == 2
    # unequal trees fit no bucket: eagerly, through the fused forward on packed tokens where it runs
    trees, parents = [[tokens[0], 3, 4, 5], [tokens[1], 6]], [[-1, 0, 0, 1], [-1, 0]]
    v = [m.verify(c, trees, parents, budget=budget) for m, c in zip((eager, graphs), caches)]
    _close(v[1].logits[0], v[0].logits[0], 1e-4, "unequal trees, request 0")
    _close(v[1].logits[1, :2], v[0].logits[1, :2], 1e-4, "unequal trees, request 1")
    assert torch.equal(v[1].expert_stats, v[0].expert_stats) and len(graphs.backend.steps) == 2
    for m, c in zip((eager, graphs), caches):
        m.commit(c, [[0], [0]])
    head = new_head(graphs.config, graphs.weights.embed, None, seed=0).to("cuda")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(eager).generate(PROMPTS, params)]
    llm = LLM(graphs, draft=head, speculative_config=SpeculativeConfig("eagle3", depth=3, top_k=3, total_tokens=6),
              max_batch_size=2)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want


@pytest.fixture(scope="module")
def every_expert_folder(tmp_path_factory):
    """A tiny random Qwen3-MoE whose tokens take all of its 4 experts: no discrete routing choice that
    two sums of other orders could round to the other side (bf16 logits then stay within rounding)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=4, norm_topk_prob=True, initializer_range=0.1,
                            rope_theta=1000.0)
    out = tmp_path_factory.mktemp("cuda_every_expert") / "qwen3_moe"
    Qwen3MoeForCausalLM(config).save_pretrained(out)
    return out


@pytest.mark.parametrize("early", ["1", "0"], ids=["early-release", "late-release"])
def test_bf16_graph_steps_match_the_cpu(every_expert_folder, early, monkeypatch):
    """The path a GPU serves in bf16 (the graphs backend's fused forward: moespec's linear, decoder-op,
    routing and tensor-core MoE kernels, one chain of programmatic dependent launches a step, each
    kernel releasing the next early or, MOESPEC_PDL_EARLY=0, after its wait) against the CPU's
    reference backend in bf16: decode steps replayed from their graphs and verify trees within 2e-2 of
    the logits' scale. (The fp32 tests take torch's GEMM and the MoE kernel's FMA path; on the emulated
    kernels this chain shows a kernel that reads its predecessor's output before its wait, or, after
    an early release, its predecessor's predecessor's: the MoE gate/up kernel releasing early fails
    it.)"""
    monkeypatch.setenv("MOESPEC_PDL_EARLY", early)
    cpu = mm.load(every_expert_folder, "bf16", device="cpu")
    cpu.backend_name = "reference"
    gpu = mm.load(every_expert_folder, "bf16", device="cuda")
    assert gpu.backend_name == "graphs" and gpu.backend.fused is not None
    _steps_agree((cpu, gpu), 2e-2, "bf16 ", decode_steps=6, verify_steps=2, stats=False)
    assert all(s.graph is not None for s in gpu.backend.steps.values()) and len(gpu.backend.steps) == 2


def test_graphs_over_a_short_cache_survive_a_longer_one(folder):
    """A model's graph steps over a short cache, then a longer cache (the fused forward's rope table is
    rebuilt longer), then the short cache's graphs again: they still read the table they were captured
    with (a freed table's memory, reused and overwritten meanwhile, would give other logits)."""
    eager = mm.load(folder, "fp32", device="cuda")
    eager.backend_name = "reference"  # (the CUDA default is "graphs")
    graphs = mm.load(folder, "fp32", device="cuda")
    graphs.backend_name = "graphs"
    short = [m.new_cache(1, 48) for m in (eager, graphs)]
    for m, c in zip((eager, graphs), short):
        m.prefill(c, [PROMPTS[0]])
    for token in (7, 8):  # captured over the short cache
        d = [m.decode(c, [token]) for m, c in zip((eager, graphs), short)]
        _close(d[1].logits, d[0].logits, 1e-4, f"short cache, token {token}")
    long = graphs.new_cache(1, 8192)
    graphs.prefill(long, [PROMPTS[1]])
    graphs.decode(long, [9])
    del long
    churn = [torch.full((1 << k,), float("nan"), device="cuda") for k in range(6, 21) for _ in range(8)]  # (any size)
    del churn
    for token in (10, 11, 12):
        d = [m.decode(c, [token]) for m, c in zip((eager, graphs), short)]
        _close(d[1].logits, d[0].logits, 1e-4, f"short cache again, token {token}")


@pytest.mark.parametrize("draft_graphs,sampled", [("0", False), ("1", False), ("1", True)])
def test_an_eagle3_step_on_cuda_synchronises_only_to_copy_results_back(folder, draft_graphs, sampled, monkeypatch):
    """Eagle3 on CUDA (graphs backend, the device's tree core, the head's torch path; greedy, or one request
    sampled) synchronises with the host once a step: the acceptance's copy back (the argmax choices,
    the sampled tree's token probabilities and bonus draws, the trees' tokens and parents, the draft
    round's problem flags; three copies a step until 2026-12-06: the finalize's tree shapes and the
    verify's tree tokens besides, and two more for a sampled request). Host values go to the device
    through pinned memory (moespec._tensor.to_device, copy_from_host) and the head writes its cache without nonzero:
    torch's sync debug mode counts every other synchronisation (tests/python/test_graphs.py counts
    the host reads of the same paths on the CPU)."""
    from test_graphs import started

    from moespec import SpeculativeConfig
    from moespec.spec.eagle3_policy import Eagle3Policy
    from moespec.spec.train import new_head

    monkeypatch.setenv("MOESPEC_DRAFT_GRAPHS", draft_graphs)  # (1: the draft round replayed as a graph)
    target = mm.load(folder, "fp32", device="cuda")
    target.backend_name = "graphs"
    head = new_head(target.config, target.weights.embed, None, seed=0).to("cuda")
    policy = Eagle3Policy(target, head, SpeculativeConfig("eagle3", depth=3, top_k=3, total_tokens=6))
    hot = dict(temperature=0.8, top_p=0.9, seed=3) if sampled else {}
    _, _, step = started(policy, [SamplingParams(max_tokens=64, ignore_eos=True, **(hot if i else {}))
                                  for i in range(len(PROMPTS))], PROMPTS)
    _assert_one_sync_a_step(step)


def _assert_one_sync_a_step(step, steps: int = 4) -> None:
    """After 4 warm-up steps (graph captures, the catch-up's buckets too: a capture synchronises, and
    first allocations), ``steps`` steps synchronise at most once each, as torch's sync debug mode
    counts them."""
    import warnings

    for _ in range(4):
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    where = sorted({f"{w.filename.rsplit('/', 1)[-1]}:{w.lineno}" for w in syncs})
    assert len(syncs) <= steps, f"{len(syncs) / steps:.1f} synchronisations a step, at {', '.join(where)}"


def _eco_policy(target, **tree):
    from moespec import SpeculativeConfig
    from moespec.spec.eagle3_policy import Eagle3Policy
    from moespec.spec.expert_predictor import ExpertPredictor
    from moespec.spec.train import new_head

    c = target.config
    gen = torch.Generator().manual_seed(0)
    L, N, D = len(c.moe.layers), c.moe.num_experts, 2 * c.hidden_size
    predictor = ExpertPredictor(torch.randn(L, N, D, generator=gen) * 0.3, torch.randn(L, N, generator=gen),
                                torch.zeros(D), torch.ones(D))
    head = new_head(c, target.weights.embed, None, seed=0).to(target.device)
    return Eagle3Policy(target, head, SpeculativeConfig("eco", **tree), predictor=predictor)


@pytest.mark.parametrize("draft_graphs", ["0", "1"])
def test_eco_on_cuda_is_lossless_and_synchronises_once_a_step(folder, draft_graphs, monkeypatch):
    """The eco policy on CUDA keeps its round, the experts' prediction, the cost-aware selection and
    the trees on the GPU (moespec.spec.cost_aware.CostAwareTrees.device_trees): greedy eco equals
    greedy decoding token for token with trees of every size (padded with copies of the root), and
    a step synchronises with the host once, the acceptance's copy back, which carries the
    selection's own values (about ten a step until 2026-12-06: the trees built and chosen on the
    host). With draft graphs (the default on a GPU) the round is a captured one, as eagle3's."""
    from test_graphs import started

    monkeypatch.setenv("MOESPEC_DRAFT_GRAPHS", draft_graphs)
    target = mm.load(folder, "fp32", device="cuda")
    policy = _eco_policy(target, depth=3, top_k=3, total_tokens=6)
    assert policy.device_selection and policy.selector.predictor.weight.is_cuda
    assert policy.static_round == (draft_graphs == "1")
    nodes, observe = [], policy.selector.observe_step  # each step's trees' node counts (read back with it)
    policy.selector.observe_step = lambda *a: nodes.extend(a[4][:len(PROMPTS)]) or observe(*a)
    _, requests, step = started(policy, [SamplingParams(max_tokens=64, ignore_eos=True)] * len(PROMPTS), PROMPTS)
    _assert_one_sync_a_step(step)
    assert policy.selector.predicted_unique is not None and policy.selector.calibration.x.size > 0
    assert 1 < max(nodes) and min(nodes) < 7, nodes  # (trees of several nodes, padded to 7 rows)
    n = min(len(r.output) for r in requests)
    want = LLM(folder, dtype="fp32", device="cuda").generate(PROMPTS, SamplingParams(max_tokens=n, ignore_eos=True))
    assert [r.output[:n] for r in requests] == [o.outputs[0].token_ids for o in want]


def _root_padded(tree, rows: int):
    """``tree`` (a DraftTree) padded to ``rows`` rows as the GPU selection pads its trees: copies of the
    root (its token, depth 0, its mask row: bit 0), parent -1."""
    from moespec.spec.tree import DraftTree

    n, pad = tree.num_nodes, rows - tree.num_nodes
    mask = torch.zeros(rows, (rows + 31) // 32, dtype=torch.int32)
    mask[:n, :tree.mask_words.shape[1]] = tree.mask_words
    mask[n:, 0] = 1
    return DraftTree(torch.cat([tree.tokens, tree.tokens[:1].repeat(pad)]),
                     torch.cat([tree.parents, torch.full((pad,), -1, dtype=torch.int32)]),
                     torch.cat([tree.depth, torch.zeros(pad, dtype=torch.int32)]), mask, None,
                     torch.cat([tree.scores, torch.zeros(pad)]), torch.cat([tree.candidates, torch.full((pad,), -1,
                                                                                                      dtype=torch.int32)]))


@pytest.mark.parametrize("backend", ["graphs", "reference"])
@pytest.mark.parametrize("score", ["probability", "gates"])
def test_a_root_padded_tree_verifies_as_the_tree_under_a_budget(folder, backend, score):
    """A tree padded with copies of its root (the eco policies' trees on a GPU) verifies as the tree
    itself: the same logits at its nodes and, under a budget that binds, the same kept experts: the
    padding rows weigh nothing in the budget's ranking (token weights 0) and route to the root's
    experts. (Counted once per copy, the root's experts would outrank its children's.)"""
    from moespec.spec.tree import Candidates, tree_from_selection

    target = mm.load(folder, "fp32", device="cuda")
    target.backend_name = backend
    roots, children = [11, 40], [[(5, -1), (9, -1), (17, 0), (30, 1), (2, 2)], [(7, -1), (8, 0), (21, -1)]]
    trees = []
    for root, kids in zip(roots, children):
        tokens, parents = torch.tensor([t for t, _ in kids]), torch.tensor([p for _, p in kids], dtype=torch.int32)
        cands = Candidates(tokens, parents, torch.ones(len(kids), dtype=torch.int32), torch.zeros(len(kids)))
        trees.append(tree_from_selection(root, cands, range(len(kids))))
    budget = ExpertBudget(4, score=score)
    outs = []
    for given in (trees, [_root_padded(t, 9) for t in trees]):
        cache = target.new_cache(2, 32)
        target.prefill(cache, PROMPTS)
        outs.append(target.verify_trees(cache, [_on(t, "cuda") for t in given], budget=budget))
    for b, t in enumerate(trees):
        _close(outs[1].logits[b, :t.num_nodes], outs[0].logits[b, :t.num_nodes], 1e-4, f"tree {b}")
    assert torch.equal(outs[1].expert_stats.cpu()[:, :2], outs[0].expert_stats.cpu()[:, :2])  # natural, kept experts


def _on(tree, device):
    from moespec.spec.tree import DraftTree

    return DraftTree(*(None if getattr(tree, k) is None else getattr(tree, k).to(device)
                       for k in ("tokens", "parents", "depth", "mask_words", "paths", "scores", "candidates")))


def test_an_eco_rounds_graph_replay_gives_the_eager_rounds_trees(folder, monkeypatch):
    """The eco policy's captured round (draft graphs: the levels' frontier states are the graph's own
    outputs, filled by a replay, the first step's too) hands the GPU selection the same states and
    leads it to the same trees, step after step, as the eager round, with the step's measured time
    held fixed (it prices the next tree)."""
    from test_graphs import started

    trees = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("MOESPEC_DRAFT_GRAPHS", flag)
        policy = _eco_policy(mm.load(folder, "fp32", device="cuda"), depth=3, top_k=3, total_tokens=6)
        selector, got = policy.selector, trees.setdefault(flag, [])
        observe, choose = selector.observe_step, selector.device_trees
        selector.observe_step = lambda rest_s, *a, observe=observe: observe(0.01, *a)

        def record(*a, choose=choose, got=got):
            out = choose(*a)
            got.append(([h.tolist() for h in a[2]], [(t.tokens.tolist(), t.parents.tolist()) for t in out]))
            return out

        selector.device_trees = record
        _, _, step = started(policy, [SamplingParams(max_tokens=24, ignore_eos=True)] * len(PROMPTS), PROMPTS)
        for _ in range(5):
            step()
    assert trees["1"] == trees["0"] and len(trees["1"]) == 5


def test_catch_up_graph_replay_equals_the_eager_catch_up(folder, monkeypatch):
    """The step's catch-up on CUDA graphs (moespec.spec.draft_graph.StaticCatchUp, a graph per (B, T)
    bucket) against the same calls run eagerly on a second draft cache: the same head outputs and
    cache entries, bit for bit (tests/python/test_graphs.py holds the same on the CPU with a fake
    graph)."""
    from test_graphs import assert_static_catch_up_equals_eager

    from moespec import SpeculativeConfig
    from moespec.spec.eagle3_policy import Eagle3Policy
    from moespec.spec.train import new_head

    monkeypatch.setenv("MOESPEC_DRAFT_GRAPHS", "1")
    target = mm.load(folder, "fp32", device="cuda")
    head = new_head(target.config, target.weights.embed, None, seed=0).to("cuda")
    assert_static_catch_up_equals_eager(Eagle3Policy(target, head, SpeculativeConfig("eagle3", depth=3, top_k=2,
                                                                                       total_tokens=4)))


def test_draft_graph_replay_equals_the_eager_round(folder, monkeypatch):
    """MOESPEC_DRAFT_GRAPHS=1 on CUDA (moespec.spec.draft_graph): the draft round captured once per
    (draft cache, builder) and replayed every step gives the trees of the same static round run
    eagerly on the same inputs, bit for bit, and greedy eagle3 through it equals greedy ar."""
    from moespec import SpeculativeConfig
    from moespec.spec.train import new_head

    monkeypatch.setenv("MOESPEC_DRAFT_GRAPHS", "1")
    target = mm.load(folder, "fp32", device="cuda")
    head = new_head(target.config, target.weights.embed, None, seed=0).to("cuda")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(target).generate(PROMPTS, params)]
    llm = LLM(target, draft=head, speculative_config=SpeculativeConfig("eagle3", depth=3, top_k=3, total_tokens=6),
              max_batch_size=2)
    rounds = []
    original_run = None

    def checked_run(roots, logits, hidden, deferred):
        static = llm.policy._static
        replayed = original_run(roots, logits, hidden, deferred)
        if static.graph is not None:  # the same inputs again, eagerly: the same trees
            trees = replayed[0] if deferred else replayed  # (a step's trees: views of the builder's buffers)
            got = [t.clone() for t in trees]
            static._round()
            eager = [t.clone() for t in static.builder.finalize_host()]
            for a, b in zip(got, eager):
                for name in ("tokens", "parents", "depth", "mask_words", "scores") + (() if deferred else ("paths",)):
                    assert torch.equal(getattr(a, name), getattr(b, name)), name
            rounds.append(len(trees))
        return replayed

    from moespec.spec import draft_graph

    original = draft_graph.StaticDraftRound.run

    def patched(self, roots, logits, hidden, deferred=False):
        nonlocal original_run
        original_run = lambda *a: original(self, *a)  # noqa: E731
        return checked_run(roots, logits, hidden, deferred)

    monkeypatch.setattr(draft_graph.StaticDraftRound, "run", patched)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want
    assert rounds and llm.policy._static.graph is not None
    # the value checks' flags come from the replay (the first round's from its eager run: a capture
    # computes nothing, and reading the capture's flags raised at the first round)
    static = llm.policy._static
    B, logits, hidden = static.builder.batch, static.logits.clone(), static.hidden.clone()
    with pytest.raises(ValueError, match=r"^root_tokens: expected token ids .*\(checked at finalize on cuda"):
        original(static, [-3] * B, logits, hidden)
    assert len(original(static, [7] * B, logits, hidden)) == B

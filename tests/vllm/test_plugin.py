"""moespec's vLLM plugin on vLLM's CPU build: the EAGLE-3 classes it registers, and greedy outputs
against stock vLLM and against moespec's own runtime, on a tiny random Mixtral (the default model's
family) written by transformers, in fp32, eager (no compilation)."""

from __future__ import annotations

import os

import pytest
import torch

PROMPTS = [[5, 17, 33, 64, 9, 21], [3, 4, 120, 77, 13]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Mixtral with head_dim 64 (vLLM's CPU attention takes no smaller head)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=128, hidden_size=128, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=8, num_experts_per_tok=2,
                           initializer_range=0.1, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
    out = tmp_path_factory.mktemp("vllm") / "mixtral"
    MixtralForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def head(folder, tmp_path_factory):
    """A random EAGLE-3 head for the target, in the official folder format vLLM loads."""
    from moespec.models import load
    from moespec.spec.train import _write_head, new_head

    target = load(folder, "fp32")
    out = tmp_path_factory.mktemp("head")
    _write_head(new_head(target.config, target.weights.embed, None, seed=0, aux_layers=(0, 1, 2)), out, {})
    return out


def generate(folder, speculative=None, max_tokens: int = 12, eager: bool = True,
             own_process: bool = False) -> list[list[int]]:
    """Greedy outputs of one vLLM engine; in this process (conftest) unless own_process: then in an engine
    core process of its own, vLLM's default, where the plugin is loaded through its entry point."""
    from vllm import LLM, SamplingParams, envs
    from vllm.inputs import TokensPrompt

    before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if own_process else before
    envs.disable_envs_cache()  # (an engine in this process caches vLLM's environment)
    try:
        llm = LLM(model=str(folder), tokenizer=None, skip_tokenizer_init=True, dtype="float32", enforce_eager=eager,
                  max_model_len=64, max_num_seqs=2, speculative_config=speculative, seed=0)
    finally:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = before
        envs.disable_envs_cache()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False))
    del llm
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def ar(folder):
    """Stock vLLM's greedy output on the Mixtral (eager, no draft): one engine run for every test that
    compares with it (an engine start is most of a test's time)."""
    return generate(folder)


def test_the_plugin_registers_eagle3_classes():
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    for arch in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "OlmoeForCausalLM"):
        cls = ModelRegistry._try_load_model_cls(arch)
        assert cls.__module__ == "moespec.integrations.vllm.eagle3" and cls.supports_eagle3, arch


@pytest.mark.parametrize("state", ["fake_kernel", "modes"])
def test_onednn_handler_release_outside_traces(state):
    """vLLM 0.32's CPU oneDNN handler frees its handle in ``__del__`` with ``Tensor.item()``; collected by
    the garbage collector inside torch.compile's tracing, that failed (and in vLLM's compile warm-up
    recursed until the worker died). With the plugin loaded a handler dropped inside a fake-tensor
    kernel (tensors dispatched as Meta through the Python dispatcher: the state the workers crashed
    in) or under the fake-tensor and refs modes is released at the next release outside, with no error."""
    import contextlib
    import sys

    from torch._dispatch.python import enable_python_dispatcher
    from torch._prims.context import TorchRefsMode
    from torch._subclasses.fake_tensor import FakeTensorMode, in_kernel_invocation_manager
    from vllm._custom_ops import CPUDNNLGEMMHandler
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    released, errors = [], []

    def handler(value):
        h = CPUDNNLGEMMHandler()
        h.handler_tensor, h.dtor = torch.tensor(value, dtype=torch.int64), released.append
        return h

    fake = FakeTensorMode()
    inside = contextlib.ExitStack()
    if state == "fake_kernel":
        inside.enter_context(enable_python_dispatcher())
        inside.enter_context(in_kernel_invocation_manager(fake))
    else:
        inside.enter_context(fake)
        inside.enter_context(TorchRefsMode())
    first, second = handler(7), handler(8)
    hook, sys.unraisablehook = sys.unraisablehook, errors.append
    try:
        with inside:
            del first  # (its last reference: __del__ runs here, inside the trace)
            assert released == []
        del second
    finally:
        sys.unraisablehook = hook
    assert not errors, errors[0].exc_value
    assert sorted(released) == [7, 8]


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory):
    """A tiny random Qwen2-MoE (a sigmoid-gated shared expert, no q/k/v biases: vLLM builds them anyway
    and the plugin zeroes them) with head_dim 64, and a random EAGLE-3 head for it."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from moespec.models import load
    from moespec.spec.train import _write_head, new_head

    torch.manual_seed(1)
    config = Qwen2MoeConfig(vocab_size=128, hidden_size=128, intermediate_size=96, moe_intermediate_size=32,
                            shared_expert_intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                            num_key_value_heads=1, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                            qkv_bias=False, initializer_range=0.1, max_position_embeddings=128, bos_token_id=1,
                            eos_token_id=2)
    root = tmp_path_factory.mktemp("vllm_qwen2")
    Qwen2MoeForCausalLM(config).save_pretrained(root / "qwen2_moe")
    target = load(root / "qwen2_moe", "fp32")
    (root / "head").mkdir()
    _write_head(new_head(target.config, target.weights.embed, None, seed=0, aux_layers=(0, 1, 2)), root / "head", {})
    return root / "qwen2_moe", root / "head"


def test_qwen2_moe_serves_with_eagle3_as_moespec_decodes(qwen2_folder):
    """The default model's first family: vLLM (ar, and EAGLE-3 through the plugin's class) == moespec's
    greedy output, fp32, eager."""
    from moespec import LLM, SamplingParams

    folder, head = qwen2_folder
    want = [o.outputs[0].token_ids for o in LLM(str(folder), dtype="fp32").generate(
        PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))]
    assert generate(folder) == want
    assert generate(folder, {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}) == want


def test_vllm_greedy_equals_moespec(folder, ar):
    """vLLM (with the plugin: the EAGLE-3 class, unused without a draft) == moespec's runtime, greedy fp32."""
    from moespec import LLM, SamplingParams

    want = [o.outputs[0].token_ids for o in LLM(str(folder), dtype="fp32").generate(
        PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))]
    assert ar == want


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_vllm_eagle3_through_the_plugin_equals_ar(folder, head, ar, eager):
    """vLLM's EAGLE-3 (chain drafts) on the plugin's Mixtral class: greedy output == greedy ar, eager and
    compiled (vLLM's default: torch.compile of the inner model, which must run the plugin's forward). The
    eager one runs as vLLM does by default, its engine core in a process of its own (the plugin loaded there
    through its entry point)."""
    want = ar if eager else generate(folder, eager=False)
    got = generate(folder, {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}, eager=eager,
                   own_process=eager)
    assert got == want


def _budget_run(folder, head, budget: str, mode: str):
    import json
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "MOESPEC_BUDGET": budget, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), str(Path(__file__).parents[1] / "python")])}
    run = subprocess.run([sys.executable, str(Path(__file__).parent / "budget_run.py"), str(folder), str(head), mode],
                         env=env, capture_output=True, text=True, timeout=600)
    return run, (json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 else None)


@pytest.fixture(scope="module")
def budget_runs(request, folder, head):
    """The budget_run.py runs (vLLM loads plugins once per process, so a budget needs a fresh one) that
    this session's tests mark, ``@pytest.mark.budget_runs((MOESPEC_BUDGET, "eager" | "compiled"), ...)``,
    started in the background together: one process at a time, beside the tests whose engines run in this
    process (each mostly one of the machine's cores). {run: its Future of (completed process, its JSON line
    or None)}."""
    from concurrent.futures import ThreadPoolExecutor

    wanted = dict.fromkeys(run for item in request.session.items for mark in item.iter_markers("budget_runs")
                           for run in mark.args)
    pool = ThreadPoolExecutor(max_workers=1)
    yield {run: pool.submit(_budget_run, folder, head, *run) for run in wanted}
    pool.shutdown(cancel_futures=True)


@pytest.fixture(scope="module", autouse=True)
def _start_budget_runs_early(request):
    """budget_runs from the module's first test on, where any test of the session marks one."""
    if any(item.get_closest_marker("budget_runs") for item in request.session.items):
        request.getfixturevalue("budget_runs")


def _finished(future):
    run, got = future.result()
    assert run.returncode == 0, run.stderr[-3000:]
    return got


@pytest.mark.budget_runs(("3", "eager"), ("8", "eager"))
def test_a_binding_budget_caps_every_verify_pass(ar, budget_runs):
    """MOESPEC_BUDGET=3 (of 8 experts, top-2): every budgeted routing call (verify passes only: 4
    tokens each, 2 MoE layers... as many calls as layers x verify passes) keeps at most 3 experts and
    some would have used more; a budget of 8 (all experts) changes nothing: the output is greedy ar's."""
    stats = _finished(budget_runs["3", "eager"])["stats"]
    assert stats and all(kept <= 3 for _, kept, _, _ in stats) and any(natural > 3 for natural, _, _, _ in stats)
    assert len(stats) % 4 == 0  # 4 MoE layers per verify pass: whole passes only (prefill and decode untouched)
    free = _finished(budget_runs["8", "eager"])
    assert free["outputs"] == ar and all(kept == natural for natural, kept, _, _ in free["stats"])


@pytest.mark.budget_runs(("3", "eager"))
def test_a_binding_budget_gives_moespecs_own_budgeted_output(folder, head, ar, budget_runs):
    """vLLM + MOESPEC_BUDGET=3 against moespec's runtime with eagle3+budget:3 on the same chain (3 drafts,
    top-1: vLLM's chain), both requests verified together in every pass, fp32: the same greedy tokens.
    (Equal because both route the same logits up to fp32 rounding and no budget choice here sits on a
    tie; the budget makes both differ from plain greedy decoding.)"""
    from moespec import LLM, SamplingParams, SpeculativeConfig

    got = _finished(budget_runs["3", "eager"])
    llm = LLM(str(folder), dtype="fp32", draft=str(head),
              speculative_config=SpeculativeConfig("eagle3+budget", depth=3, top_k=1, total_tokens=3, budget=3))
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))]
    assert got["outputs"] == want
    assert want != ar  # the budget binds: not plain greedy decoding


@pytest.mark.budget_runs(("3", "compiled"))
def test_the_budget_holds_in_vllms_compiled_graph(budget_runs):
    """enforce_eager=False (vLLM's torch.compile of the model on the CPU): the budget is an opaque op,
    so the compiled graph still decides per pass: verify passes capped at 3, whole passes only."""
    stats = _finished(budget_runs["3", "compiled"])["stats"]
    assert stats and all(kept <= 3 for _, kept, _, _ in stats) and any(natural > 3 for natural, _, _, _ in stats)
    assert len(stats) % 4 == 0


@pytest.mark.budget_runs(("many", "eager"))
def test_a_bad_budget_is_an_error_at_engine_start(budget_runs):
    run, _ = budget_runs["many", "eager"].result()
    assert run.returncode != 0 and "MOESPEC_BUDGET='many'" in run.stderr


def _spec_run(folder, speculative, prompts):
    """Greedy outputs and the draft tokens vLLM proposed (its spec-decode metrics), one LLM, its engine in
    this process (conftest): both requests are queued before its first step."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(folder), tokenizer=None, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              max_model_len=64, max_num_seqs=2, speculative_config=speculative, seed=0, disable_log_stats=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, detokenize=False))
    drafts = sum(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_draft_tokens")
    del llm
    return [list(o.outputs[0].token_ids) for o in outs], drafts


def test_cost_aware_drafts_per_batch_size_change_only_how_many_are_verified(folder, head, ar):
    """moespec's schedule (moespec.cost.schedule, vLLM's num_speculative_tokens_per_batch_size): the same
    greedy outputs as ar whatever it chooses; a schedule of fewer drafts proposes fewer; one of 0 drafts
    at the batch that runs proposes (next to) none."""
    from moespec.cost.hardware import hardware
    from moespec.cost.schedule import draft_schedule
    from moespec.cost.speedup import transfer
    from moespec.cost.step_cost import shape_from_config
    from moespec.models import read_config

    want = ar
    shape = shape_from_config(read_config(folder), "tiny")
    chosen = draft_schedule(shape, hardware("h200"), transfer(shape.num_experts, shape.top_k), acceptance=2.0,
                            depth=3, max_batch=2, max_drafts=3)
    runs = {}
    for name, ranges in [("moespec", chosen["num_speculative_tokens_per_batch_size"]),
                         ("3 each", [(1, 2, 3)]), ("1 each", [(1, 2, 1)]), ("none at 2", [(1, 1, 3), (2, 2, 0)])]:
        runs[name] = _spec_run(folder, {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3,
                                        "num_speculative_tokens_per_batch_size": [tuple(r) for r in ranges]}, PROMPTS)
        assert runs[name][0] == want, name
    assert 0 < runs["1 each"][1] < runs["3 each"][1]
    # Both prompts run together (same length, batch 2: K = 0) but for at most one step that may hold a
    # single request (an engine stepping between the two arrivals), where the schedule drafts 3.
    assert runs["none at 2"][1] <= 3 < runs["1 each"][1]

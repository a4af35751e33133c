"""Kernels an EAGLE-3 step's draft round, catch-up and verify forward launch on a GPU, and the step
besides its graphs, counted on the CPU:

    python -m moespec.tools.count_kernels [--depth 4] [--top-k 4] [--nodes 8] [--batch 1] [--json out.json]

A captured draft round (moespec.spec.draft_graph) replays a fixed list of kernels whose count, not
their bytes, sets its time at decode sizes (an H200 took 2.5 ms for a round of a few hundred, of a
10.4 ms eagle3 step, 2026-12-04); what the step launches outside its graphs (the round, the verify
forward, the catch-up: one replay each) the host launches one by one ("step"). This runs greedy
eagle3 steps of a tiny random Qwen3-MoE on the
CPU through the code paths a GPU takes (the head's torch ops instead of the native step, the torch
tree core with its checks deferred, draft graphs' static round and catch-up) and counts the torch
ops each static call dispatches: views, allocations and no-op conversions are not kernels;
moespec's decoder ops, projections and MoE ops count as the kernels they are on CUDA (rms_norm,
attention_inputs, linear and route_experts one each, tree_attention two: the attention and its
combine, moe_experts two: its fused pair), their CPU bodies not at all. Other ops count one each (a few, such as sort, launch more on a
GPU). No GPU needed; tests/python/test_graphs.py holds the counts under a bound.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

NOT_KERNELS = frozenset({"view", "_unsafe_view", "expand", "slice", "select", "unsqueeze", "squeeze", "t", "transpose",
                   "permute", "as_strided", "alias", "detach", "reshape", "_reshape_alias", "split", "unbind",
                   "narrow", "chunk", "split_with_sizes", "lift_fresh",
                   "to", "empty", "empty_like", "resolve_conj", "resolve_neg", "detach_"})  # (`to` copies via _to_copy)
FUSED_KERNELS = {"rms_norm": 1, "attention_inputs": 1, "tree_attention": 2}  # moespec.ops.decoder: CUDA kernels
MOE_KERNELS = {"linear": 1, "route_experts": 1, "moe_experts": 2}  # the verify's other ops (moespec.models.moe)


class _Counter(TorchDispatchMode):
    """Counts each dispatched op under the innermost label of ``labels`` (pushed by the wrapped calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.labels = ["step"]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[self.labels[-1]][func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _counted_ops(counter: _Counter) -> Iterator[None]:
    """moespec's decoder ops, projections and MoE ops counted as their CUDA kernels (their CPU bodies
    run uncounted) under ``counter``'s current label, where the draft head, the fused forward and the
    MoE layer call them."""
    from moespec.models import moe
    from moespec.ops import decoder
    from moespec.runtime import fused
    from moespec.spec import eagle3

    def one(name: str, fn, kernels: int):
        def wrapped(*args, **kwargs):
            counter.ops[counter.labels[-1]][f"[{name}]"] += kernels
            with _disable_current_modes():
                return fn(*args, **kwargs)
        return wrapped

    kernels = FUSED_KERNELS | MOE_KERNELS
    saved = [(module, name, getattr(module, name)) for module in (decoder, fused) for name in FUSED_KERNELS] + \
        [(module, "linear", module.linear) for module in (eagle3, fused, moe)] + \
        [(moe, name, getattr(moe, name)) for name in ("route_experts", "moe_experts")]
    try:
        for module, name, fn in saved:
            setattr(module, name, one(name, fn, kernels[name]))
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def _tiny_model():
    from moespec.models import TargetModel
    from moespec.models.config import ModelConfig, MoeConfig, RopeConfig
    from moespec.models.weights import LayerWeights, ModelWeights
    from moespec.ops import RouterSpec

    H, Hq, Hkv, D, E, I, K, V, L = 64, 4, 2, 16, 16, 32, 4, 256, 2
    moe = MoeConfig(num_experts=E, top_k=K, intermediate_size=I, router=RouterSpec("softmax", K, True),
                    layers=tuple(range(L)), weights_in_model_dtype=True)
    config = ModelConfig(architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", vocab_size=V, hidden_size=H,
                         num_layers=L, num_heads=Hq, num_kv_heads=Hkv, head_dim=D, intermediate_size=0,
                         rms_norm_eps=1e-6, rope=RopeConfig(1e6), qk_norm="per_head", attention_bias=False,
                         clip_qkv=None, tie_word_embeddings=False, max_position_embeddings=4096, moe=moe)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.1).to(torch.bfloat16)

    ones = dict(dtype=torch.bfloat16)
    layers = [LayerWeights(input_norm=torch.ones(H, **ones), qkv=rand((Hq + 2 * Hkv) * D, H), qkv_bias=None,
                           q_norm=torch.ones(D, **ones), k_norm=torch.ones(D, **ones), o=rand(H, Hq * D), o_bias=None,
                           post_norm=torch.ones(H, **ones), router=rand(E, H), experts=rand(E, 3 * I * H))
              for _ in range(L)]
    weights = ModelWeights(embed=rand(V, H), layers=layers, final_norm=torch.ones(H, **ones), lm_head=rand(V, H),
                           dtype=torch.bfloat16)
    return TargetModel(config, weights)


def count(depth: int = 4, top_k: int = 4, nodes: int = 8, batch: int = 1, steps: int = 2,
          tree_core: str = "fused") -> dict:
    """{"round": {"kernels": n, "ops": {op: count}}, "catch_up": {...}, "step": {..., "graphs": [names]}}:
    the last step's static draft round, static catch-up and what it launched outside its graphs
    (``graphs``: those it replayed), on a GPU's code paths (see the module docstring); the round's
    trees on ``tree_core`` ("fused": a GPU's default, :func:`moespec.spec.tree.default_device_core`;
    or "torch")."""
    from moespec import SamplingParams, SpeculativeConfig
    from moespec.runtime import graphs
    from moespec.spec import draft_graph
    from moespec.spec.eagle3_policy import Eagle3Policy
    from moespec.spec.llm import _Request
    from moespec.spec.train import new_head

    target = _tiny_model()
    target.backend_name = "graphs"
    head = new_head(target.config, target.weights.embed, None, seed=0)
    head.native_step = False  # the torch ops, as on a GPU
    saved_env = os.environ.get("MOESPEC_DRAFT_GRAPHS")
    os.environ["MOESPEC_DRAFT_GRAPHS"] = "1"
    try:
        policy = Eagle3Policy(target, head, SpeculativeConfig("eagle3", depth=depth, top_k=top_k, total_tokens=nodes))
        policy._static_core = lambda: tree_core  # (a GPU's core; the CPU's static rounds take the torch core)
    finally:
        if saved_env is None:
            os.environ.pop("MOESPEC_DRAFT_GRAPHS")
        else:
            os.environ["MOESPEC_DRAFT_GRAPHS"] = saved_env
    gen = torch.Generator().manual_seed(1)
    requests = [_Request(i, None, torch.randint(0, target.config.vocab_size, (32,), generator=gen).tolist(),
                         SamplingParams(max_tokens=8 * (steps + 2), ignore_eos=True), set()) for i in range(batch)]
    run = policy.start(requests)
    for r, first in zip(requests, run.first_tokens):
        r.output.append(first)
    counter = _Counter()

    def labelled(name: str, fn):
        def wrapped(self, *args, **kwargs):
            builder = getattr(self, "builder", None)
            if builder is not None:  # value checks deferred to the finalize, as on a GPU
                builder._core.check_now = False
            counter.labels.append(name)
            try:
                return fn(self, *args, **kwargs)
            finally:
                counter.labels.pop()
        return wrapped

    # the parts a GPU replays as CUDA graphs (one launch each), each under its own label
    calls = ((draft_graph.StaticDraftRound, "_round", "round"), (draft_graph.StaticCatchUp, "_call", "catch_up"),
             (graphs.StaticStep, "_forward", "verify"))
    saved = [(cls, attr, getattr(cls, attr)) for cls, attr, _ in calls]
    try:
        for (cls, attr, name), (_, _, fn) in zip(calls, saved):
            setattr(cls, attr, labelled(name, fn))
        for _ in range(steps):
            counter.ops.clear()  # (the last step's counts are kept)
            with _counted_ops(counter), counter:
                for r, emitted in zip(requests, policy.step(run, requests)):
                    r.output.extend(emitted)
    finally:
        for cls, attr, fn in saved:
            setattr(cls, attr, fn)
    counts = dict(counter.ops)
    kernels = {name: {op: n for op, n in ops.items() if op not in NOT_KERNELS} for name, ops in counts.items()}
    out = {name: {"kernels": sum(ops.values()), "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1]))}
           for name, ops in kernels.items()}
    out["step"]["graphs"] = sorted(name for name in ("round", "catch_up", "verify") if name in counts)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moespec.tools.count_kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tree-core", choices=["fused", "torch"], default="fused",
                        help="the draft round's tree core (fused: a GPU's default)")
    parser.add_argument("--json", help="also write the counts here (atomically)")
    args = parser.parse_args(argv)
    for name, value in (("--depth", args.depth), ("--top-k", args.top_k), ("--nodes", args.nodes),
                        ("--batch", args.batch)):
        if not 1 <= value <= 64:
            parser.error(f"{name}: expected 1 to 64, got {value}")
    result = count(args.depth, args.top_k, args.nodes, args.batch, tree_core=args.tree_core)
    for name, c in result.items():
        top = ", ".join(f"{op} {n}" for op, n in list(c["ops"].items())[:12])
        besides = f" besides one replay of each of its graphs ({', '.join(c['graphs'])})" if "graphs" in c else ""
        print(f"{name}: {c['kernels']} kernels{besides} ({top}, ...)")
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

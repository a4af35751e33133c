"""Sampling parameters, the target's logits processing, and acceptance of a verified draft tree.

Acceptance (DESIGN.md "Speculative decoding"):
- greedy (temperature 0): walk from the root, at each node follow the child whose token is the
  target's argmax there; stop where none matches. The accepted path plus the target's argmax at its
  last node (the bonus token) are emitted: exactly the tokens greedy autoregressive decoding emits.
- sampling: speculative sampling over the tree with deterministic proposals (EAGLE's multi-round
  rule, q = 1 for the drafted token): at a node, try its children in tree order; accept child x
  with probability p(x) under the target's processed distribution p; on rejection set p(x) = 0 and
  renormalise; when every child is rejected (or at a leaf) sample the bonus token from what is left.
  The emitted tokens are then distributed exactly as the target's (temperature, top-k, top-p).

Dimensions: M + 1 tree nodes (node 0 the root), V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from moespec.spec.tree import DraftTree


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens, modelled on TensorRT-LLM's / vLLM's SamplingParams.

    temperature 0 means greedy; top_k 0 and top_p 1 mean no truncation. ``stop`` strings end a
    request (the text up to the stop string is returned); ``ignore_eos`` keeps generating past EOS.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: Optional[Sequence[str]] = None
    ignore_eos: bool = False
    stop_token_ids: Sequence[int] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens: expected an int >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingParams.temperature: expected >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p: expected a number in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k: expected an int >= 0 (0 = off), got {self.top_k!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target's processed next-token distribution [..., V] (float32): temperature, then top-k,
    then top-p (the smallest set of most likely tokens whose mass reaches top_p), renormalised."""
    logits = logits.float() / max(params.temperature, 1e-6)
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the strictly more likely tokens
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def greedy_choice(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dimension (long [...]), the first maximal index (a NaN counts as the
    maximum): what every greedy choice of the target goes through. On the CPU the logits, widened
    exactly to float32, go through numpy's argmax: ~8x faster than torch's ``max(dim).indices`` on a
    verify pass's bf16 logits (9 x 49,152, one thread: 0.08 against 0.59 ms with the widening), and
    ``max(dim).indices`` is itself ~5x faster than ``argmax`` there. Elsewhere ``max(dim).indices``
    (documented, as ``argmax`` is, to give the first maximal index)."""
    if logits.device.type == "cpu":
        return torch.from_numpy(np.asarray(np.argmax(logits.detach().float().numpy(), axis=-1)))  # (0-d: an array)
    return logits.max(dim=-1).indices


def sample(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator]) -> int:
    """One token from logits [V]: argmax when greedy, else a draw from :func:`probabilities`."""
    if params.greedy:
        return int(greedy_choice(logits))
    # drawn on the host: the request's generator is a CPU one, whatever device the logits come from
    return int(torch.multinomial(probabilities(logits.cpu(), params), 1, generator=generator))


@dataclass
class Acceptance:
    path: list[int]  # accepted node indices from the root (node 0 first)
    tokens: list[int]  # emitted tokens: the accepted draft nodes' tokens, then the bonus token


def children_of(parents: Sequence[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent >= 0:
            kids[parent].append(node)
    return kids


def accept(tokens: Sequence[int], parents: Sequence[int], logits: torch.Tensor, params: SamplingParams,
           generator: Optional[torch.Generator] = None) -> Acceptance:
    """Accepts a path of one verified tree: ``tokens``/``parents`` [M + 1], target ``logits`` [M + 1, V]
    (row i: the target's next-token logits after node i). (A batch of greedy trees:
    :func:`accept_greedy_trees`, one copy back from the device.)"""
    if params.greedy:
        return _greedy_walk(tokens, parents, greedy_choice(logits).tolist())
    kids = children_of(parents)
    path, out = [0], []
    node = 0
    logits = logits.cpu()  # the draws use the request's CPU generator (a no-op for CPU logits)
    while True:
        p = probabilities(logits[node], params)  # [V]
        taken = None
        for child in kids[node]:  # tree order
            x = tokens[child]
            if float(torch.rand((), generator=generator)) < float(p[x]):
                taken = child
                break
            p[x] = 0.0  # rejected: the residual distribution drops x
            total = float(p.sum())
            if total <= 0.0:  # only reachable through rounding: fall back to the node's distribution
                p = probabilities(logits[node], params)
                break
            p = p / total
        if taken is None:
            out.append(int(torch.multinomial(p, 1, generator=generator)))
            return Acceptance(path, out)
        path.append(taken)
        out.append(tokens[taken])
        node = taken


def _greedy_walk(tokens: Sequence[int], parents: Sequence[int], choice: Sequence[int]) -> Acceptance:
    """The greedy path of one tree: from the root, the lowest-index child whose token is the target's
    choice at the path's last node, while there is one; then that node's choice (the bonus)."""
    kids = children_of(parents)
    path, out = [0], []
    node = 0
    while True:
        nxt = next((c for c in kids[node] if tokens[c] == choice[node]), None)
        if nxt is None:
            out.append(choice[node])
            return Acceptance(path, out)
        path.append(nxt)
        out.append(tokens[nxt])
        node = nxt


def accept_greedy_trees(trees: Sequence[Optional["DraftTree"]], logits: torch.Tensor, on_host: Optional[bool] = None,
                        also: Optional[Sequence[torch.Tensor]] = None):
    """Greedy acceptance of a batch of verified trees: ``trees[b]`` request b's tree (None: not
    verified), ``logits`` [B, T, V] the verify pass's (row i of request b: after node i). The same
    paths and tokens as :func:`accept` with greedy params gives for each tree: at each depth the
    lowest-index child of the path's last node whose token is the target's argmax there. Returns an
    Acceptance (or None) per tree; with ``also`` (integer or bool tensors on the logits' device, such as a
    deferred draft round's problem flags), that list and their values, read back in the same copy.

    One argmax where the logits are and one copy back (:func:`moespec.spec.tree.host_lists`: the
    choices [B, T], the tokens and parents of the trees not read back yet, and ``also``), then each
    tree is walked on the host (a few dozen Python steps). Until 2026-12-05 a GPU walked the trees
    in ~40 small tensor ops, 1.1 ms of an H200's eagle3 step (tests/gpu/bench_runtime_cuda.py
    "accept"); on a CPU the host walk was already ~3x faster than that tensor walk. ``on_host``
    (default: for CPU logits): the argmax through numpy (:func:`greedy_choice`); False: the argmax
    where the logits are, as on a GPU."""
    from moespec.spec.tree import host_lists

    B, T = len(trees), logits.shape[1]
    choice = []  # [B, T] the target's argmax after each node (none without a tree)
    if any(t is not None for t in trees):
        host_side = logits.device.type == "cpu" if on_host is None else on_host
        choice = [greedy_choice(logits) if host_side else logits.max(dim=-1).indices]
    lists, flat = host_lists(trees, choice + list(also or ()))  # the one copy back
    out = [None if t is None else _greedy_walk(*lists[b], flat[b * T: (b + 1) * T]) for b, t in enumerate(trees)]
    return out if also is None else (out, flat[B * T if choice else 0:])

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

from moespec._tensor import to_device

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


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[Optional[torch.Generator]],
                live: Optional[Sequence[bool]] = None) -> list[Optional[int]]:
    """:func:`sample` of each row of ``logits`` [B, V] (None where ``live`` is False), with one copy back
    (on a GPU one synchronisation a call, not one a request): the greedy rows' argmax and the sampled
    rows' :func:`probabilities`, computed where the logits are; each sampled row then drawn on the
    host with its request's generator, as :func:`sample` draws it."""
    B = len(params)
    live = [True] * B if live is None else live
    rows = [b for b in range(B) if live[b]]
    hot = [b for b in rows if not params[b].greedy]
    if not hot:  # (greedy only: the argmax's copy back)
        greedy = greedy_choice(logits).tolist() if rows else []
        return [greedy[b] if live[b] else None for b in range(B)]
    parts = [greedy_choice(logits).int().view(torch.float32)] if len(hot) < len(rows) else []  # (the ids' bits)
    parts.append(torch.stack([probabilities(logits[b], params[b]) for b in hot]).reshape(-1))
    flat = torch.cat(parts).cpu()  # the one copy back
    greedy = flat[:B].view(torch.int32).tolist() if len(hot) < len(rows) else []
    probs = flat[len(flat) - len(hot) * logits.shape[-1]:].view(len(hot), logits.shape[-1])
    drawn = {b: int(torch.multinomial(probs[i], 1, generator=generators[b])) for i, b in enumerate(hot)}
    return [None if not live[b] else drawn[b] if b in drawn else greedy[b] for b in range(B)]


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
    (row i: the target's next-token logits after node i). (A batch of trees: :func:`accept_trees`,
    one copy back from the device.)"""
    if params.greedy:
        return _greedy_walk(tokens, parents, greedy_choice(logits).tolist())
    n = len(tokens)
    u = torch.rand(2 * n, generator=generator)  # the children's tests, then the bonus draws
    q, bonus = _sampling_rows(torch.as_tensor(tokens), torch.as_tensor(parents), logits, params, u[n:])
    return _sampled_walk(tokens, parents, q.tolist(), bonus.tolist(), u[:n].tolist())


def _sampling_rows(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, params: SamplingParams,
                   u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The device half of speculative sampling over one tree of n nodes (tokens and parents [n] on
    any device, logits [n, V], u [n] uniforms in [0, 1) on the host): q float32 [n - 1], node c's
    token's probability under its parent's processed distribution (node c + 1's, that is), and bonus
    long [n], a token drawn at each node from its residual, the node's distribution without its
    children's tokens (where a walk that rejected every child stops; the whole distribution where
    the children hold all of it), by inverse CDF with u. No host synchronisation."""
    dev = logits.device
    probs = probabilities(logits, params)  # [n, V]
    V = probs.shape[-1]  # (ids clamped: a deferred round's are checked after this runs, never out of range here)
    child = to_device(tokens, dev, torch.long)[1:].clamp(0, V - 1), to_device(parents, dev, torch.long)[1:]
    q = probs[child[1], child[0]]  # [n - 1]
    resid = probs.index_put((child[1], child[0]), probs.new_zeros(()))  # the children's tokens dropped
    resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, probs)
    cdf = resid.cumsum(-1)  # [n, V]
    at = to_device(u, dev, torch.float32)[:, None] * cdf[:, -1:]
    bonus = torch.searchsorted(cdf, at, right=True).clamp_(max=V - 1)[:, 0]  # (right: never a 0 token)
    return q, bonus


def _sampled_walk(tokens: Sequence[int], parents: Sequence[int], q: Sequence[float], bonus: Sequence[int],
                  u: Sequence[float]) -> Acceptance:
    """Speculative sampling's walk (deterministic proposals, EAGLE's multi-round rule) from
    :func:`_sampling_rows`' values: at each node its children in tree order, child c accepted when
    u[c] < p(x) / (1 - p(rejected)), p the node's distribution, a rejected token's probability
    dropping out of it (its duplicates too); where none is accepted, the node's bonus token."""
    kids = children_of(parents)
    path, out = [0], []
    node = 0
    while True:
        taken, rejected, mass = None, set(), 0.0
        for c in kids[node]:
            x = tokens[c]
            p = 0.0 if x in rejected else q[c - 1]
            if mass >= 1.0:  # (only through rounding: the rejected tokens held all of p)
                break
            if u[c] < p / (1.0 - mass):
                taken = c
                break
            if x not in rejected:
                rejected.add(x)
                mass += p
        if taken is None:
            out.append(bonus[node])
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
    """:func:`accept_trees` with every request greedy."""
    return accept_trees(trees, logits, [_GREEDY] * len(trees), [None] * len(trees), on_host, also)


_GREEDY = SamplingParams()


def accept_trees(trees: Sequence[Optional["DraftTree"]], logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[Optional[torch.Generator]], on_host: Optional[bool] = None,
                 also: Optional[Sequence[torch.Tensor]] = None):
    """Acceptance of a batch of verified trees: ``trees[b]`` request b's tree (None: not verified),
    ``logits`` [B, T, V] the verify pass's (row i of request b: after node i), ``params[b]`` and
    ``generators[b]`` its sampling. Greedy requests: at each depth the lowest-index child of the
    path's last node whose token is the target's argmax there; sampled ones: speculative sampling
    (the module docstring's rule; each request's uniforms drawn from its generator on the host).
    Returns an Acceptance (or None) per tree; with ``also`` (integer or bool tensors on the logits'
    device, such as a deferred draft round's problem flags), that list and their values, read back in
    the same copy.

    The device work where the logits are, then one copy back (:func:`moespec.spec.tree.host_lists`:
    the argmax choices [B, T], each sampled tree's token probabilities and bonus draws
    (:func:`_sampling_rows`), the tokens and parents of the trees not read back yet, and ``also``),
    then each tree walked on the host (a few dozen Python steps). Until 2026-12-05 a GPU walked the
    greedy trees in ~40 small tensor ops, 1.1 ms of an H200's eagle3 step
    (tests/gpu/bench_runtime_cuda.py "accept"), and until 2026-12-06 each sampled request copied its
    logits [n, V] back to walk them on the host. ``on_host`` (default: for CPU logits): the argmax
    through numpy (:func:`greedy_choice`); False: the argmax where the logits are, as on a GPU."""
    from moespec.spec.tree import host_lists

    B, T = len(trees), logits.shape[1]
    live = [b for b, t in enumerate(trees) if t is not None]
    sampled = [b for b in live if not params[b].greedy]
    parts, uniforms = [], {}
    if len(sampled) < len(live):  # [B, T] the target's argmax after each node
        host_side = logits.device.type == "cpu" if on_host is None else on_host
        parts.append(greedy_choice(logits) if host_side else logits.max(dim=-1).indices)
    for b in sampled:
        t, n = trees[b], trees[b].num_nodes
        uniforms[b] = torch.rand(2 * n, generator=generators[b])  # the children's tests, then the bonus draws
        q, bonus = _sampling_rows(t.tokens, t.parents, logits[b, :n], params[b], uniforms[b][n:])
        parts += [q.view(torch.int32), bonus]  # (the floats' bits: one integer copy back)
    lists, flat = host_lists(trees, parts + list(also or ()))  # the one copy back
    at = B * T if len(sampled) < len(live) else 0
    out: list[Optional[Acceptance]] = [None] * B
    for b in live:
        if params[b].greedy:
            out[b] = _greedy_walk(*lists[b], flat[b * T: (b + 1) * T])
            continue
        n = trees[b].num_nodes
        q = np.asarray(flat[at: at + n - 1], dtype=np.int64).astype(np.int32).view(np.float32).tolist()
        out[b] = _sampled_walk(*lists[b], q, flat[at + n - 1: at + 2 * n - 1], uniforms[b][:n].tolist())
        at += 2 * n - 1
    return out if also is None else (out, flat[at:])

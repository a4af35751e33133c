"""Relations between the tokens of one forward pass, and the routing-overlap statistics of a trace.

The coactivation model (:mod:`moespec.cost.coactivation`) constrains how often two tokens of a pass
route to the same expert, by how the two are related. Every unordered pair of tokens of one pass
falls in exactly one class:

    parent    one is the other's tree parent             (verify trees)
    sibling   same tree parent
    ancestor  one is a proper ancestor at tree distance >= 2
    cousin    same tree, none of the above
    seq1 seq2 seq4 seq8
              two sequence tokens of one request (prefill chunks, ``chain:n``) at position distance
              1, 2, 3-7 and >= 8
    cross     tokens of different requests

A pass shape is a list of :class:`Group` (one request's tokens: a chain of n tokens or a tree given
by its parents). :func:`census` counts its pairs per class; :func:`pair_statistics` measures, per
layer and expert, how many pairs of each class of a trace both route to the expert.

Dimensions: R trace rows, L MoE layers, N experts, K top-k, n tokens of one request.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

RELATIONS = ("parent", "sibling", "ancestor", "cousin", "seq1", "seq2", "seq4", "seq8", "cross")
WITHIN = RELATIONS[:-1]


@dataclass(frozen=True)
class Group:
    """One request's tokens in a pass: a chain of ``n`` consecutive tokens, or a tree (``parents``:
    -1 for the root, else an earlier node)."""

    n: int
    parents: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"a request of a pass needs >= 1 token, got {self.n}")
        if self.parents is not None:
            if len(self.parents) != self.n or self.parents[0] != -1:
                raise ValueError(f"tree parents must have n={self.n} entries, the first -1, got {self.parents}")
            if any(not 0 <= p < i for i, p in enumerate(self.parents[1:], 1)):
                raise ValueError(f"tree parents must name earlier nodes, got {self.parents}")

    @staticmethod
    def chain(n: int) -> "Group":
        return Group(n)

    @staticmethod
    def tree(parents: Sequence[int]) -> "Group":
        return Group(len(parents), tuple(int(p) for p in parents))


def _chain_counts(n: int) -> dict[str, int]:
    near = {d: max(n - d, 0) for d in range(1, 8)}
    total = n * (n - 1) // 2
    out = {"seq1": near[1], "seq2": near[2], "seq4": sum(near[d] for d in range(3, 8))}
    out["seq8"] = total - out["seq1"] - out["seq2"] - out["seq4"]
    return out


def _tree_counts(parents: Sequence[int]) -> dict[str, int]:
    n = len(parents)
    depth = [0] * n
    children = [0] * n
    ancestor = 0
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
        children[parents[i]] += 1
        ancestor += depth[i] - 1  # its ancestors at distance >= 2
    out = {"parent": n - 1, "sibling": sum(c * (c - 1) // 2 for c in children), "ancestor": ancestor}
    out["cousin"] = n * (n - 1) // 2 - out["parent"] - out["sibling"] - ancestor
    return out


def group_census(g: Group) -> dict[str, int]:
    """Pairs of each within-request class among the group's tokens (absent classes are 0)."""
    counts = _tree_counts(g.parents) if g.parents is not None else _chain_counts(g.n)
    return {r: counts.get(r, 0) for r in WITHIN}


def census(groups: Sequence[Group]) -> dict[str, int]:
    """Pairs of each class of RELATIONS in a pass of these requests."""
    out = {r: 0 for r in RELATIONS}
    for g in groups:
        for r, c in group_census(g).items():
            out[r] += c
    sizes = [g.n for g in groups]
    out["cross"] = (sum(sizes) ** 2 - sum(s * s for s in sizes)) // 2
    return out


def canonical_tree(depth: int, top_k: int, total_tokens: int, decay: float = 0.5) -> tuple[int, ...]:
    """The parents of an EAGLE-2 tree of this shape (root first): every expanded node proposes its
    ``top_k`` children with draft probabilities proportional to 1, decay, decay^2, ...; each level
    expands the ``top_k`` best nodes of the previous one (as EAGLE-2 does), and the ``total_tokens``
    nodes of highest path probability within ``depth`` levels are kept (ancestor-closed, since a
    child scores below its parent)."""
    for name, v in (("depth", depth), ("top_k", top_k), ("total_tokens", total_tokens)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"tree {name} must be an int >= 1, got {v!r}")
    if total_tokens > 1024:
        raise ValueError(f"tree total_tokens must be <= 1024, got {total_tokens}")
    probs = np.array([decay**i for i in range(top_k)])
    logp = np.log(probs / probs.sum())
    nodes = [(0.0, -1, 0)]  # (path log-prob, parent, depth)
    frontier = [0]
    for level in range(1, depth + 1):
        born = []
        for parent in frontier:
            for i in range(top_k):
                nodes.append((nodes[parent][0] + logp[i], parent, level))
                born.append(len(nodes) - 1)
        frontier = heapq.nlargest(top_k, born, key=lambda j: (nodes[j][0], -j))
    best = heapq.nlargest(total_tokens, range(1, len(nodes)), key=lambda j: (nodes[j][0], -nodes[j][2], -j))
    keep = sorted(best, key=lambda j: (nodes[j][2], j))  # parents before children
    index = {0: 0, **{j: i + 1 for i, j in enumerate(keep)}}
    return (-1, *[index[nodes[j][1]] for j in keep])


def parse_tree(text: str) -> Group:
    """``chain:n`` or ``depth,top_k,total_tokens`` (a :func:`canonical_tree`) as one request's Group."""
    text = text.strip()
    if text.startswith("chain:"):
        try:
            return Group.chain(int(text[6:]))
        except ValueError:
            raise ValueError(f"--tree {text!r}: chain:<n> needs an integer n >= 1") from None
    parts = text.split(",")
    try:
        depth, top_k, total = (int(x) for x in parts)
    except ValueError:
        raise ValueError(f"--tree {text!r}: expected depth,top_k,total_tokens (e.g. 2,4,4) or chain:<n>") from None
    return Group.tree(canonical_tree(depth, top_k, total))


# ---- statistics of a trace ------------------------------------------------------------------------


@dataclass
class PairStatistics:
    """Counts over a trace: per class, the pairs, and per layer and expert the pairs both of whose
    tokens route to the expert (``co``) and the pair-weighted usage (``usage``: sum over pairs of
    the share of the two tokens using the expert, so usage / pairs is the marginal of the tokens in
    such pairs)."""

    num_layers: int
    num_experts: int
    pairs: dict[str, int] = field(default_factory=dict)
    co: dict[str, np.ndarray] = field(default_factory=dict)  # [L, N] float64
    usage: dict[str, np.ndarray] = field(default_factory=dict)  # [L, N] float64

    def __post_init__(self) -> None:
        for r in RELATIONS:
            self.pairs.setdefault(r, 0)
            self.co.setdefault(r, np.zeros((self.num_layers, self.num_experts)))
            self.usage.setdefault(r, np.zeros((self.num_layers, self.num_experts)))

    def add(self, r: str, pairs: int, co: np.ndarray, usage: np.ndarray) -> None:
        self.pairs[r] += int(pairs)
        self.co[r] += co
        self.usage[r] += usage


def indicators(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """ids [n, L, K] -> float64 [n, L, N]: 1 where the token routes to the expert."""
    n, L, _ = ids.shape
    x = np.zeros((n, L, num_experts))
    np.put_along_axis(x, ids.astype(np.int64), 1.0, axis=2)
    return x


def _add_pairs(stats: PairStatistics, r: str, x: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    if len(a):
        stats.add(r, len(a), (x[a] * x[b]).sum(0), 0.5 * (x[a].sum(0) + x[b].sum(0)))


def pass_statistics(stats: PairStatistics, x: np.ndarray, request: np.ndarray, parent: np.ndarray,
                    position: np.ndarray) -> None:
    """Adds one pass's pairs to ``stats``: x [n, L, N] indicators, request/parent (local rows, -1)/
    position [n] of its rows."""
    order = np.unique(request)
    sums, sizes = [], []
    for req in order:
        rows = np.flatnonzero(request == req)
        xs = x[rows]
        s = xs.sum(0)
        sums.append(s)
        sizes.append(len(rows))
        local = {int(r): i for i, r in enumerate(rows)}
        par = np.array([local.get(int(p), -1) for p in parent[rows]])
        if (par >= 0).any():
            _tree_statistics(stats, xs, par)
        else:
            _seq_statistics(stats, xs, position[rows])
    if len(order) > 1:
        sums_a = np.stack(sums)  # [B, L, N]
        total, n = sums_a.sum(0), sum(sizes)
        stats.add("cross", (n * n - sum(s * s for s in sizes)) // 2, (total**2 - (sums_a**2).sum(0)) / 2,
                  0.5 * sum(s * (n - m) for s, m in zip(sums, sizes)))


def _seq_statistics(stats: PairStatistics, x: np.ndarray, position: np.ndarray) -> None:
    """The pairs of one request's sequence tokens: distance classes seq1, seq2, seq4 by explicit
    pairs, seq8 as every pair less those."""
    order = np.argsort(position, kind="stable")
    x, pos = x[order], position[order]
    n = len(pos)
    near_pairs, near_co, near_usage = 0, 0.0, 0.0
    for r, lo, hi in (("seq1", 1, 1), ("seq2", 2, 2), ("seq4", 3, 7)):
        pairs = [(i, i + d) for d in range(lo, hi + 1) for i in range(max(n - d, 0)) if pos[i + d] - pos[i] == d]
        a = np.array([p[0] for p in pairs], dtype=np.int64)
        b = np.array([p[1] for p in pairs], dtype=np.int64)
        if len(a):
            co, usage = (x[a] * x[b]).sum(0), 0.5 * (x[a].sum(0) + x[b].sum(0))
            stats.add(r, len(a), co, usage)
            near_pairs, near_co, near_usage = near_pairs + len(a), near_co + co, near_usage + usage
    s = x.sum(0)
    stats.add("seq8", n * (n - 1) // 2 - near_pairs, (s * s - s) / 2 - near_co, 0.5 * s * (n - 1) - near_usage)


def _tree_statistics(stats: PairStatistics, x: np.ndarray, parent: np.ndarray) -> None:
    n = len(parent)
    child = np.flatnonzero(parent >= 0)
    _add_pairs(stats, "parent", x, parent[child], child)
    sa, sb = [], []
    for p in np.unique(parent[child]):
        kids = child[parent[child] == p]
        i, j = np.triu_indices(len(kids), 1)
        sa.append(kids[i])
        sb.append(kids[j])
    sa = np.concatenate(sa) if sa else np.zeros(0, dtype=np.int64)
    sb = np.concatenate(sb) if sb else np.zeros(0, dtype=np.int64)
    _add_pairs(stats, "sibling", x, sa, sb)
    aa, ab = [], []
    for node in range(n):
        up = parent[node]
        up = parent[up] if up >= 0 else -1
        while up >= 0:
            aa.append(up)
            ab.append(node)
            up = parent[up]
    _add_pairs(stats, "ancestor", x, np.array(aa, dtype=np.int64), np.array(ab, dtype=np.int64))
    s = x.sum(0)
    counted = len(child) + len(sa) + len(aa)
    co, usage = (s * s - s) / 2, 0.5 * s * (n - 1)  # every pair of the tree, less the classes above
    for a, b in ((parent[child], child), (sa, sb), (np.array(aa, dtype=np.int64), np.array(ab, dtype=np.int64))):
        if len(a):
            co = co - (x[a] * x[b]).sum(0)
            usage = usage - 0.5 * (x[a].sum(0) + x[b].sum(0))
    stats.add("cousin", n * (n - 1) // 2 - counted, co, usage)


def trace_pair_statistics(trace) -> PairStatistics:
    """The pair statistics of every pass of ``trace`` (a :class:`moespec.models.trace.Trace`).

    ``cross`` comes from the decode and verify passes when they have cross-request pairs (the
    passes predictions are for), else from the prefill passes: requests co-route differently over
    their prompts than over their generated tokens."""
    shape = (len(trace.layers), trace.num_experts)
    by_kind = {"prefill": PairStatistics(*shape), "generate": PairStatistics(*shape)}
    for start, end in trace.passes():
        x = indicators(trace.ids[start:end], trace.num_experts)
        parent = np.where(trace.parent[start:end] >= 0, trace.parent[start:end] - start, -1)
        stats = by_kind["prefill" if trace.kind[start] == 0 else "generate"]
        pass_statistics(stats, x, trace.request[start:end], parent, trace.position[start:end])
    out = PairStatistics(*shape)
    for r in WITHIN:
        for part in by_kind.values():
            out.add(r, part.pairs[r], part.co[r], part.usage[r])
    source = by_kind["generate"] if by_kind["generate"].pairs["cross"] else by_kind["prefill"]
    out.add("cross", source.pairs["cross"], source.co["cross"], source.usage["cross"])
    return out


def pass_groups(request: np.ndarray, parent: np.ndarray) -> list[Group]:
    """The pass shape of one pass's rows (parent as local row indices, -1)."""
    groups = []
    for req in np.unique(request):
        rows = np.flatnonzero(request == req)
        local = {int(r): i for i, r in enumerate(rows)}
        par = [local.get(int(p), -1) for p in parent[rows]]
        groups.append(Group.tree(par) if any(p >= 0 for p in par) else Group.chain(len(rows)))
    return groups


def uniform_unique(num_experts: int, top_k: int, n: int) -> float:
    """Expected unique experts of n tokens routing independently and uniformly: N (1 - (1 - k/N)^n)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** n)


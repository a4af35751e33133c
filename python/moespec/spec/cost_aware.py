"""Cost-aware draft-tree selection (EcoSpec; DESIGN.md "Cost-aware tree"): the plain-Python reference.

After EAGLE-2's expansion, the verify set is chosen node by node, ancestor-closed, by value against
marginal cost. With a candidate c's cumulative draft log-probability s_c (a(c) = exp(s_c) estimates
the probability that its whole path is accepted, EAGLE-2's assumption), its predicted experts e_clk
per MoE layer l with probabilities p_clk (1 for hard sets), the dynamic expert buffer B[l, e] (the
probability that the verify pass already reads expert e: the roots' predicted experts, then those
of every node chosen so far, over the batch) and the step so far costing S seconds for A expected
emitted tokens:

    cost(c) = token_s + sum_l expert_s[l] * sum_k p_clk * (1 - B[l, e_clk])   (expected new experts)
    gain(c) = (S / A) * a(c) - cost(c)

the frontier candidate (its parent is the root or chosen) of largest gain is added (ties: EAGLE-2's
order, score desc, depth asc, index asc): S += cost(c), A += a(c), B <- 1 - (1 - B)(1 - p) on its
experts; until the best gain is <= 0 or ``total_tokens`` nodes are chosen. S / A is the step's time
per emitted token, so a node is kept while it lowers it: its expected accepted token saves more than
it costs. ``token_s`` is the verify time one more token costs besides new experts, ``expert_s[l]``
the time to read one more expert of layer l (:class:`StepPricer` prices them and S, the draft plus
a verify of the roots alone, with the cost model). With zero costs it is exactly EAGLE-2's selection
(the best ``total_tokens`` candidates: a child never scores above its parent, so the best remaining
candidate is always on the frontier).

The C++ tree core (cpp/include/moespec/select_cost_aware.h) implements the same rule; this reference
is what it is tested against. Dimensions: C candidates, L MoE layers, K predicted experts per node,
N experts, B requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class SelectionCosts:
    token_s: float  # verify time of one more token, besides new experts
    expert_s: np.ndarray  # [L]: time of one more expert per layer

    def __post_init__(self) -> None:
        if self.token_s < 0 or (np.asarray(self.expert_s) < 0).any():
            raise ValueError("selection costs must be >= 0")


class Selection(NamedTuple):
    chosen: list[int]  # candidate indices in the order chosen
    step_s: float  # S after them
    accepted: float  # A after them


def _first_slots(ids: np.ndarray) -> list[int]:
    """Slots of one layer's prediction whose id did not occur earlier (a repeated id counts once)."""
    return [k for k in range(len(ids)) if ids[k] not in ids[:k]]


def marginal_cost(predicted: np.ndarray, predicted_p: Optional[np.ndarray], buffer: np.ndarray,
                  costs: SelectionCosts) -> float:
    """cost(c) of the module docstring: predicted [L, K] ids, predicted_p [L, K] or None (all 1),
    buffer [L, N] float32."""
    cost = float(costs.token_s)
    for layer in range(predicted.shape[0]):
        fresh = 0.0
        for k in _first_slots(predicted[layer]):
            p = 1.0 if predicted_p is None else float(predicted_p[layer, k])
            fresh += p * (1.0 - float(buffer[layer, predicted[layer, k]]))
        cost += float(np.float32(costs.expert_s[layer])) * fresh
    return cost


def add_to_buffer(buffer: np.ndarray, predicted: np.ndarray, predicted_p: Optional[np.ndarray]) -> None:
    """B <- 1 - (1 - B)(1 - p) on the predicted experts of one node ([L, K]) or of several ([R, L, K]:
    applied one node after the other), float32, in place; a repeated id in one layer's prediction
    counts once."""
    ids = np.asarray(predicted).reshape(-1, *np.shape(predicted)[-2:])  # [R, L, K]
    probs = None if predicted_p is None else np.asarray(predicted_p, dtype=np.float32).reshape(ids.shape)
    R, L, K = ids.shape
    earlier = np.triu(np.ones((K, K), dtype=bool), 1)  # [j, k]: j < k
    first = ~((ids[:, :, :, None] == ids[:, :, None, :]) & earlier).any(axis=2)  # [R, L, K]
    rows = np.broadcast_to(np.arange(L)[:, None], (L, K))
    one = np.float32(1.0)
    for r in range(R):  # within one node every (layer, expert) is updated once
        keep = first[r]
        layer, expert = rows[keep], ids[r][keep]
        p = one if probs is None else probs[r][keep]
        buffer[layer, expert] = one - (one - buffer[layer, expert]) * (one - p)


def select_cost_aware(parents: Sequence[int], depth: Sequence[int], scores: Sequence[float], predicted: np.ndarray,
                      predicted_p: Optional[np.ndarray], buffer: np.ndarray, costs: SelectionCosts,
                      total_tokens: int, *, step_s: float, accepted: float = 1.0) -> Selection:
    """One request's choice (module docstring). parents [C]: candidate index of the parent, -1 for
    the root's children; depth [C]; scores [C] cumulative log-probs; predicted [C, L, K] expert ids;
    predicted_p [C, L, K] or None; buffer [L, N] float32, updated in place with the chosen nodes."""
    C = len(parents)
    if not (len(depth) == len(scores) == C == predicted.shape[0]):
        raise ValueError("select_cost_aware: parents, depth, scores and predicted need one row per candidate")
    if total_tokens < 1:
        raise ValueError(f"select_cost_aware: total_tokens must be >= 1, got {total_tokens}")
    if step_s < 0 or not (accepted > 0 and math.isfinite(accepted)):
        raise ValueError(f"select_cost_aware: need step_s >= 0 and a finite accepted > 0, got {step_s}, {accepted}")
    any_cost = costs.token_s > 0 or bool(np.asarray(costs.expert_s).any())
    scores = [float(np.float32(s)) for s in scores]  # the contract's float32 scores
    chosen: list[int] = []
    is_chosen = np.zeros(C, dtype=bool)
    while len(chosen) < min(total_tokens, C):
        rate = step_s / accepted
        best, best_key, best_cost, best_accept = -1, None, 0.0, 0.0
        for c in range(C):
            if is_chosen[c] or (parents[c] >= 0 and not is_chosen[parents[c]]):
                continue
            cost = marginal_cost(predicted[c], None if predicted_p is None else predicted_p[c], buffer, costs)
            accept = math.exp(float(scores[c])) if math.isfinite(scores[c]) else 0.0
            key = (rate * accept - cost, float(scores[c]), -depth[c], -c)
            if best_key is None or key > best_key:
                best, best_key, best_cost, best_accept = c, key, cost, accept
        if best < 0 or (best_key[0] <= 0 and any_cost):
            break
        chosen.append(best)
        is_chosen[best] = True
        step_s += best_cost
        accepted += best_accept
        add_to_buffer(buffer, predicted[best], None if predicted_p is None else predicted_p[best])
    return Selection(chosen, step_s, accepted)


def select_cost_aware_native(parents, depth, scores, predicted, predicted_p, buffer: np.ndarray,
                             costs: SelectionCosts, total_tokens: int, *, step_s: float,
                             accepted: float = 1.0) -> Selection:
    """:func:`select_cost_aware` in the C++ tree core (``moespec._native.select_cost_aware``,
    cpp/include/moespec/select_cost_aware.h): same arguments, same result, same buffer update
    (``buffer`` must be a C-contiguous float32 array: it is updated in place)."""
    import torch

    from moespec._loader import native
    from moespec._tensor import view

    if not (isinstance(buffer, np.ndarray) and buffer.dtype == np.float32 and buffer.flags.c_contiguous):
        raise ValueError("select_cost_aware_native: buffer must be a C-contiguous float32 numpy array (updated in place)")
    parents_t = torch.as_tensor(np.asarray(parents), dtype=torch.int32).contiguous()  # [C]
    depth_t = torch.as_tensor(np.asarray(depth), dtype=torch.int32).contiguous()  # [C]
    scores_t = torch.as_tensor(np.asarray(scores), dtype=torch.float32).contiguous()  # [C]
    predicted_t = torch.as_tensor(np.asarray(predicted), dtype=torch.int32).contiguous()  # [C, L, K]
    prob_t = None if predicted_p is None else torch.as_tensor(np.asarray(predicted_p), dtype=torch.float32).contiguous()
    buffer_t = torch.from_numpy(buffer)  # [L, N], shares memory
    expert_t = torch.as_tensor(np.asarray(costs.expert_s), dtype=torch.float32).contiguous()  # [L]
    out = torch.empty(len(parents_t), dtype=torch.int32)  # [C]
    n, step, acc = native().select_cost_aware(
        view(parents_t, "parents"), view(depth_t, "depth"), view(scores_t, "scores"), view(predicted_t, "predicted"),
        None if prob_t is None else view(prob_t, "predicted_p"), view(buffer_t, "buffer"), view(expert_t, "expert_s"),
        view(out, "selected"), float(step_s), float(accepted), float(costs.token_s), int(total_tokens))
    return Selection(out[:n].tolist(), step, acc)


def select_cost_aware_cuda(parents, depth, scores, num_candidates, predicted, predicted_p, buffer, costs: SelectionCosts,
                           total_tokens: int, state):
    """A batch's selection on CUDA in one launch (``moespec._native.select_cost_aware_cuda``): the rule
    of :func:`select_cost_aware` applied request after request with one buffer and S, A carried, all
    on the GPU with no host synchronisation. parents/depth int32 [B, C], scores float32 [B, C],
    num_candidates int32 [B], predicted int32 [B, C, L, K], predicted_p float32 [B, C, L, K] or None,
    buffer float32 [L, N] and state float64 [2] (S, A) updated in place: CUDA tensors. Returns
    (selected int32 [B, C], -1 after each request's choice; count int32 [B])."""
    import torch

    from moespec._loader import native, require_cuda
    from moespec._tensor import to_device, view

    require_cuda()
    if parents.device.type != "cuda":
        raise ValueError(f"select_cost_aware_cuda: parents must be a CUDA tensor, got one on {parents.device} "
                         "(select_cost_aware_native is the CPU function)")
    B, C = parents.shape
    device = parents.device
    selected = torch.empty(B, C, dtype=torch.int32, device=device)
    count = torch.empty(B, dtype=torch.int32, device=device)
    expert_s = to_device(np.asarray(costs.expert_s, dtype=np.float32), device)
    native().select_cost_aware_cuda(
        view(parents, "parents"), view(depth, "depth"), view(scores, "scores"), view(num_candidates, "num_candidates"),
        view(predicted, "predicted"), view(predicted_p, "predicted_p"), view(buffer, "buffer"),
        view(expert_s, "expert_s"), view(state, "state"), view(selected, "selected"), view(count, "count"),
        float(costs.token_s), int(total_tokens), torch.cuda.current_stream(device).cuda_stream)
    return selected, count


def tree_from_selection_cuda(selected, count, cand_parents, cand_tokens, root_tokens, total_tokens: int):
    """The verify trees of :func:`select_cost_aware_cuda`'s output on the GPU
    (``moespec._native.tree_from_selection_cuda``): the nodes, parents, depths and packed
    ancestor-or-self masks :func:`moespec.spec.tree.tree_from_selection` gives, for the whole batch,
    with no host synchronisation. CUDA tensors: selected int32 [B, C], count int32 [B], cand_parents
    and cand_tokens int32 [B, C], root_tokens int32 [B]. Returns tokens, parents, depth int32
    [B, M + 1], mask int32 [B, M + 1, W] and num_nodes int32 [B] (M = total_tokens)."""
    import torch

    from moespec._loader import native, require_cuda
    from moespec._tensor import view

    require_cuda()
    if selected.device.type != "cuda":
        raise ValueError(f"tree_from_selection_cuda: selected must be a CUDA tensor, got one on {selected.device}")
    B, M1 = selected.shape[0], int(total_tokens) + 1
    W = (M1 + 31) // 32
    kw = dict(dtype=torch.int32, device=selected.device)
    tokens, parents, depth = (torch.empty(B, M1, **kw) for _ in range(3))
    mask, num_nodes = torch.empty(B, M1, W, **kw), torch.empty(B, **kw)
    native().tree_from_selection_cuda(
        view(selected, "selected"), view(count, "count"), view(cand_parents, "cand_parents"),
        view(cand_tokens, "cand_tokens"), view(root_tokens, "root_tokens"), view(tokens, "tokens"),
        view(parents, "parents"), view(depth, "depth"), view(mask, "mask"), view(num_nodes, "num_nodes"),
        torch.cuda.current_stream(selected.device).cuda_stream)
    return tokens, parents, depth, mask, num_nodes


class StepPricer:
    """The cost model's prices for the selection (:mod:`moespec.cost.step_cost` on a hardware
    profile): ``costs`` (token: the dense weights' extra time for one more verify token plus the
    per-token cost; expert: one expert read at one token) and ``base_s`` (S before any candidate: a
    verify of the B roots reading the buffer's experts, plus the rest of the step: the draft, the
    acceptance and the draft's catch-up, as measured on the last steps when given, else the cost
    model's draft of ``depth`` levels)."""

    def __init__(self, shape, hw, *, depth: int, top_k: int, tokens: int, context: int = 256,
                 bytes_per_weight: float = 2.0):
        self.shape, self.hw, self.depth, self.top_k = shape, hw, depth, top_k
        self.context, self.bytes_per_weight = context, bytes_per_weight
        dense = shape.dense_params * bytes_per_weight
        token = (hw.matrix_seconds(dense, tokens + 1, bytes_per_weight) - hw.matrix_seconds(dense, tokens, bytes_per_weight)
                 + hw.token_layer_us * 1e-6 * shape.layers)
        expert = hw.expert_seconds(shape.expert_params * bytes_per_weight, 1.0, bytes_per_weight)
        self.costs = SelectionCosts(max(token, 0.0), np.full(shape.moe_layers, expert))

    def base_s(self, requests: int, unique: np.ndarray, rest_s: Optional[float] = None) -> float:
        """``unique`` [L]: the roots' expected experts per layer (a buffer's row sums)."""
        from moespec.cost.step_cost import draft_seconds, step_cost

        unique = np.clip(unique, 1.0, self.shape.num_experts)
        verify = step_cost(self.shape, self.hw, tokens=requests, requests=requests, context=self.context,
                           unique=unique, bytes_per_weight=self.bytes_per_weight)
        if rest_s is None:
            rest_s = draft_seconds(self.shape, self.hw, depth=self.depth, top_k=self.top_k, requests=requests,
                                   bytes_per_weight=self.bytes_per_weight)
        return verify.seconds + rest_s


# ---- the selector of the eco policies ------------------------------------------------------------


class AcceptanceCalibration:
    """Maps a node's cumulative draft log-probability s to a calibrated log acceptance probability,
    learned from the verified trees' outcomes (was the node on the accepted path?) by Platt scaling:
    a = sigmoid(alpha + beta logit(exp(s))), fitted by Newton's method with a ridge pull toward the
    identity (alpha 0, beta 1; weight ``prior`` observations) on the last ``capacity`` outcomes,
    refitted every ``refit_every`` observed trees. beta > 0 keeps the map increasing, so a child never
    outranks its parent and EAGLE-2's order among nodes is kept. EAGLE-2's exp(s) is the identity
    map; a head's confidence is seldom calibrated (the default head's nodes at exp(s) 0.2-0.5 are
    accepted 1.5x as often as it says; README "The eco policies")."""

    def __init__(self, capacity: int = 4096, prior: float = 50.0, refit_every: int = 8):
        self.capacity, self.prior, self.refit_every = capacity, prior, refit_every
        self.x = np.zeros(0, dtype=np.float64)  # logit(exp(s)) of observed nodes
        self.y = np.zeros(0, dtype=np.float64)  # 1: accepted
        self.alpha, self.beta = 0.0, 1.0
        self._pending = 0

    @staticmethod
    def _logit(scores) -> np.ndarray:
        q = np.clip(np.exp(np.asarray(scores, dtype=np.float64)), 1e-6, 1 - 1e-6)
        return np.log(q) - np.log1p(-q)

    def observe(self, scores, accepted) -> None:
        """scores [M] of a verified tree's non-root nodes, accepted [M] bool."""
        self.x = np.concatenate([self.x, self._logit(scores)])[-self.capacity:]
        self.y = np.concatenate([self.y, np.asarray(accepted, dtype=np.float64)])[-self.capacity:]
        self._pending += 1
        if self._pending >= self.refit_every:
            self._pending = 0
            self.fit()

    def fit(self, iterations: int = 20) -> None:
        w = np.array([self.alpha, self.beta])
        anchor = np.array([0.0, 1.0])
        X = np.stack([np.ones_like(self.x), self.x], axis=1)  # [n, 2]
        for _ in range(iterations):
            p = 1.0 / (1.0 + np.exp(-(X @ w)))
            grad = X.T @ (p - self.y) + self.prior * (w - anchor)
            hess = (X * (p * (1 - p))[:, None]).T @ X + self.prior * np.eye(2)
            step = np.linalg.solve(hess, grad)
            w = w - step
            if np.abs(step).max() < 1e-8:
                break
        self.alpha, self.beta = float(w[0]), float(max(w[1], 0.05))

    def log_accept(self, scores) -> np.ndarray:
        """Calibrated log acceptance of cumulative log-probs ``scores`` (float32; -inf stays -inf)."""
        s = np.asarray(scores, dtype=np.float64)
        z = self.alpha + self.beta * self._logit(s)
        out = -np.logaddexp(0.0, -z)  # log sigmoid
        return np.where(np.isneginf(s), -np.inf, out).astype(np.float32)

    def log_accept_tensor(self, scores):
        """:meth:`log_accept` in torch ops where ``scores`` (a tensor) lie: float32, the same float64 steps."""
        import torch

        s = scores.double()
        q = s.exp().clamp(1e-6, 1 - 1e-6)
        z = self.alpha + self.beta * (q.log() - torch.log1p(-q))
        out = -torch.logaddexp(torch.zeros_like(z), -z)
        return torch.where(torch.isneginf(s), float("-inf"), out).float()


def default_hardware():
    """The profile the eco policies price nodes with: MOESPEC_HARDWARE (a name or a profile .json,
    see moespec.cost.hardware.hardware) when set, else a rough 2-core CPU estimate (measure yours
    with `moespec analyze profile --engine <engine> --out cpu.json`)."""
    import os

    from moespec.cost.hardware import Hardware, hardware

    if os.environ.get("MOESPEC_HARDWARE"):
        return hardware(os.environ["MOESPEC_HARDWARE"])
    return Hardware("cpu-estimate", 15.0, 0.1, 300.0, "a 2-core CPU estimate (set MOESPEC_HARDWARE to a measured "
                    "profile)", {1: 14.0, 8: 9.0, 64: 1.5}, expert_gbs={1: 9.0, 2: 12.0, 8: 7.0}, token_layer_us=27.0)


class CostAwareTrees:
    """Chooses each request's verify set after EAGLE-2's expansion (the ``eco`` policies): every
    candidate's ``keep`` likeliest experts per layer and their probabilities predicted from its
    parent's draft hidden state and its token, the batch's buffer started with each root's predicted
    experts, S with :meth:`StepPricer.base_s` and A = B (each root's bonus token), then
    :func:`select_cost_aware_native` request by request, carrying buffer, S and A (one verify pass
    reads the batch's union and emits the batch's tokens). ``predicted_unique`` keeps the last
    step's expected unique experts per layer (sum of the buffer), for the expert statistics.

    What is learned from the steps (:meth:`observe_step`, :meth:`observe_level`): the part of a
    step besides its verify pass (draft, acceptance, catch-up: Python and small kernels the roofline
    does not see) and the time of one draft level, exponential averages (weight ``smoothing`` for
    the newest step); S starts from the first; and the head's calibration
    (:class:`AcceptanceCalibration`), which turns scores into a(c). With them the draft stops early
    when a deeper level cannot pay (:meth:`worth_expanding`). Only which drafted nodes are verified
    depends on them, never the output."""

    def __init__(self, target, predictor, pricer: StepPricer, total_tokens: int, keep: Optional[int] = None,
                 smoothing: float = 0.2):
        predictor.check_target(target.config)
        self.target, self.predictor, self.pricer, self.total_tokens = target, predictor, pricer, total_tokens
        moe = target.config.moe
        self.keep = keep or min(moe.num_experts, 2 * moe.top_k)
        self.smoothing = smoothing
        self.rest_s: Optional[float] = None  # measured seconds of a step besides its verify pass (average)
        self.level_s: Optional[float] = None  # measured seconds of one draft level (average)
        self.rate: Optional[float] = None  # S / A when the last step's selection began
        self.calibration = AcceptanceCalibration()
        self.predicted_unique: Optional[np.ndarray] = None  # [L] of the last step
        self.root_unique: Optional[np.ndarray] = None  # [L] the last step's roots' expected experts
        self._read: Optional[tuple] = None  # a GPU selection's tensors to read back with the step's copy

    def observe_level(self, seconds: float) -> None:
        """Records one draft level's seconds (head forward, top-k and expansion)."""
        self.level_s = seconds if self.level_s is None else (1 - self.smoothing) * self.level_s + self.smoothing * seconds

    def worth_expanding(self, frontier_scores, active: Sequence[bool]) -> bool:
        """Whether one more draft level can pay, at the last step's opening S / A: its children are
        at most as likely as their parents (the frontier, [B, K] cumulative log-probs), so the level
        is skipped when no child can pay its token (rate x max a <= token_s: at that rate the
        selection would take none of them) or all of them together cannot pay the level's measured
        time and a token (rate x sum a <= level_s + token_s). Always True until both have been
        measured."""
        if self.rate is None or self.level_s is None:
            return True
        live = np.flatnonzero(np.asarray(active, dtype=bool))
        if len(live) == 0:
            return False
        a = np.exp(self.calibration.log_accept(frontier_scores[live].cpu().numpy()).astype(np.float64))
        token_s = self.pricer.costs.token_s
        return bool(self.rate * a.max() > token_s and self.rate * a.sum() > self.level_s + token_s)

    def observe_step(self, rest_s: float, trees: Sequence = (), paths: Sequence = (), live: Sequence[int] = (),
                     read: Sequence[int] = ()) -> None:
        """Records one step: its seconds besides its verify pass, and per verified tree (DraftTree)
        the accepted path (node indices from the root) for the acceptance calibration. After a GPU
        selection (:meth:`device_trees`): ``live`` the verified requests' indices and ``read`` the
        values of :attr:`to_read`, read back with the step's results (the trees' scores come from
        them; a tree's padding rows are not observed)."""
        self.rest_s = rest_s if self.rest_s is None else (1 - self.smoothing) * self.rest_s + self.smoothing * rest_s
        if self._read is None:
            scores = [t.scores for t in trees]
        else:
            B, M1, L = self._read[1]
            values = np.asarray(read, dtype=np.int64)
            nodes, bits = values[:B], values[B:].astype(np.int32).view(np.float32)
            tree_scores, self.root_unique = bits[: B * M1].reshape(B, M1), bits[B * M1: B * M1 + L].astype(np.float64)
            self.predicted_unique = bits[B * M1 + L:].astype(np.float64)
            scores = [tree_scores[b, : nodes[b]] for b in live]
            self._read = None
        for tree_scores, path in zip(scores, paths):
            M = len(tree_scores) - 1
            if M > 0:
                accepted = np.zeros(M + 1, dtype=bool)
                accepted[list(path)] = True
                self.calibration.observe(np.asarray(tree_scores[1:]), accepted[1:])

    @property
    def to_read(self) -> list:
        """What the last :meth:`device_trees` left on the GPU for :meth:`observe_step` (int32
        tensors, floats as their bits: the trees' node counts and scores, the roots' and the
        selection's expected unique experts), to copy back with the step's results ([] after a
        host selection)."""
        return [] if self._read is None else list(self._read[0])

    def trees(self, builder, roots: Sequence[int], root_hidden, level_hidden: Sequence,
              active: Optional[Sequence[bool]] = None) -> list:
        """roots [B]; root_hidden [B, H]: the draft state that proposed level 1; level_hidden[i]
        [B, K, H]: the frontier states that proposed level i + 2 (slot s -> candidates C_i + s K + j);
        active [B] (default all): an inactive request's tree is its root alone and costs nothing."""
        import torch

        from moespec.spec.tree import tree_from_selection

        embed_table = self.target.weights.embed  # (on the target's device; the selection runs on the host)

        def embed(ids):
            return embed_table[torch.as_tensor(ids).to(embed_table.device)].cpu()

        root_hidden, level_hidden = root_hidden.cpu(), [h.cpu() for h in level_hidden]
        B = len(roots)
        active = [True] * B if active is None else list(active)
        live = [b for b in range(B) if active[b]]
        L, N = self.predictor.num_layers, self.predictor.num_experts
        root_ids, root_p = self.predictor.predict_p(root_hidden, embed(torch.tensor(roots)), self.keep)  # [B, L, M]
        buffer = np.zeros((L, N), dtype=np.float32)
        add_to_buffer(buffer, root_ids[live].numpy(), root_p[live].numpy())
        self.root_unique = buffer.sum(axis=1)
        step_s, accepted = self.pricer.base_s(max(len(live), 1), self.root_unique, self.rest_s), float(max(len(live), 1))
        self.rate = step_s / accepted
        out = []
        for b in range(B):
            cands = builder.candidates(b)
            if not active[b]:
                out.append(tree_from_selection(int(roots[b]), cands, []))
                continue
            C = len(cands.tokens)
            K = int(builder.top_k)
            parent_h = [root_hidden[b].expand(min(K, C), -1)]
            start = K
            for h in level_hidden:
                if start >= C:
                    break
                parent_h.append(h[b].repeat_interleave(K, dim=0)[: C - start])  # [K K, H]
                start += K * K
            parent = torch.cat(parent_h)[:C]  # [C, H]
            log_a = self.calibration.log_accept(cands.scores.numpy())  # [C]
            # S / A only falls as nodes are chosen, so a candidate worth less than its token now never
            # pays: its experts need no prediction (it keeps cost token_s, gain <= 0: the same choice)
            hopeful = torch.from_numpy(step_s / accepted * np.exp(log_a.astype(np.float64)) > self.pricer.costs.token_s)
            ids = torch.zeros(C, L, self.keep, dtype=torch.int32)
            prob = torch.zeros(C, L, self.keep)
            if bool(hopeful.any()):
                got_ids, got_p = self.predictor.predict_p(parent[hopeful], embed(cands.tokens[hopeful]), self.keep)
                ids[hopeful], prob[hopeful] = got_ids.to(torch.int32), got_p
            chosen, step_s, accepted = select_cost_aware_native(
                cands.parents.numpy(), cands.depth.numpy(), log_a, ids.numpy(), prob.numpy(), buffer,
                self.pricer.costs, self.total_tokens, step_s=step_s, accepted=accepted)
            out.append(tree_from_selection(int(roots[b]), cands, chosen))
        self.predicted_unique = buffer.sum(axis=1)
        return out

    def candidate_cap(self, candidates: int) -> int:
        """R, the candidates a GPU round hands :meth:`device_trees` (the best R by EAGLE-2's ranking,
        an ancestor-closed set: a round of total_tokens R finalized): all of them up to 4 x
        total_tokens (the selection takes at most total_tokens; a node ranked below 4 x total_tokens
        by its draft score seldom pays, and every predicted node is a row of the predictor's GEMM)."""
        return min(candidates, 4 * self.total_tokens)

    def device_trees(self, builder, root_hidden, level_hidden: Sequence, active: Sequence[bool]) -> list:
        """:meth:`trees` on the GPU, with no host synchronisation: ``builder`` a device round of
        total_tokens R (:meth:`candidate_cap`), expanded to its full depth (a GPU draft level costs
        too little to stop early: :meth:`worth_expanding` is a host decision; a captured round, with
        draft graphs) and finalized on the device, whose trees are the candidates; every candidate's experts predicted in one batch, the roots' buffer, the
        calibrated scores, then :func:`select_cost_aware_cuda` over the batch (the same rule,
        request after request, buffer and S, A carried) and :func:`tree_from_selection_cuda`. S
        opens with :meth:`StepPricer.base_s` at the last step's roots' expected experts (read back
        with the last step's results; the first step: top-k per root), so S lags the host
        selection's by a step; only which drafted nodes are verified depends on it.

        Returns one DraftTree per request ([M + 1] rows, M = min(total_tokens, R), ``paths`` None): a tree
        of fewer nodes is padded with copies of its root (token, depth 0, the root's mask row, parent
        -1: never on a path, and the verify pass computes the root's hidden states for them, so they
        route to the root's experts and read no other). :attr:`to_read` lists what
        :meth:`observe_step` needs back."""
        import torch

        from moespec._tensor import to_device
        from moespec.spec.tree import DraftTree

        cand = builder.finalized()
        B, R1 = cand["tokens"].shape
        R, K = R1 - 1, builder.top_k
        M1 = min(self.total_tokens, R) + 1  # (the policy's largest tree: its cache's room)
        dev, H = root_hidden.device, root_hidden.shape[-1]
        L, N = self.predictor.num_layers, self.predictor.num_experts
        embed = self.target.weights.embed
        # each candidate's parent state: the root's for the first K candidates, else its frontier slot's
        states = torch.cat([root_hidden[:, None]] + list(level_hidden), dim=1)  # [B, 1 + levels K, H]
        c = cand["candidates"][:, 1:].long()  # [B, R] the builder's candidate indices
        row = torch.where(c < K, 0, 1 + (c - K) // K)  # (level i's slot s: row 1 + i K + s)
        parent_h = states.gather(1, row[:, :, None].expand(B, R, H))
        tokens, roots = cand["tokens"][:, 1:], cand["tokens"][:, 0]
        rows = embed.shape[0] - 1  # (ids clamped for the lookups: the round's recorded problems are raised later)
        ids, p = self.predictor.predict_p(parent_h.reshape(B * R, H), embed[tokens.reshape(-1).clamp(0, rows)],
                                          self.keep)
        root_ids, root_p = self.predictor.predict_p(root_hidden, embed[roots.clamp(0, rows)], self.keep)  # [B, L, k]
        live = to_device(list(active), dev, torch.bool)
        miss = (1 - root_p * live[:, None, None]).reshape(-1)  # the live roots' experts: B = 1 - prod(1 - p)
        flat = (torch.arange(L, device=dev)[None, :, None] * N + root_ids).reshape(-1)
        buffer = 1 - torch.ones(L * N, device=dev).scatter_reduce_(0, flat, miss, "prod").view(L, N)
        root_unique = buffer.sum(dim=1)
        n_live = max(sum(bool(a) for a in active), 1)
        opening = self.root_unique if self.root_unique is not None else np.full(
            L, min(N, n_live * self.target.config.moe.top_k), dtype=np.float64)
        step_s = self.pricer.base_s(n_live, opening, self.rest_s)
        self.rate = step_s / n_live
        state = to_device([step_s, float(n_live)], dev, torch.float64)
        num = to_device([R if a else 0 for a in active], dev, torch.int32)
        cand_parents = (cand["parents"][:, 1:] - 1).int()  # node index -> candidate index (the root: -1)
        selected, count = select_cost_aware_cuda(
            cand_parents, cand["depth"][:, 1:].contiguous(), self.calibration.log_accept_tensor(cand["scores"][:, 1:]),
            num, ids.view(B, R, L, self.keep).int(), p.view(B, R, L, self.keep).contiguous(), buffer,
            self.pricer.costs, self.total_tokens, state)
        t_tokens, t_parents, t_depth, t_mask, num_nodes = tree_from_selection_cuda(
            selected, count, cand_parents, tokens.int(), roots.int(), M1 - 1)
        pad = torch.arange(M1, device=dev)[None] >= num_nodes[:, None]  # [B, M + 1]
        t_tokens = torch.where(pad, roots[:, None], t_tokens.long())
        t_mask[:, :, 0] = torch.where(pad, 1, t_mask[:, :, 0])  # (a padding row: the root's own bit)
        chosen = torch.where(selected < 0, R, selected).sort(dim=1).values.long()  # candidate order, then R
        if R < M1 - 1:
            chosen = torch.cat([chosen, chosen.new_full((B, M1 - 1 - R), R)], dim=1)
        chosen = chosen[:, : M1 - 1]
        scores = torch.cat([torch.zeros(B, 1, device=dev), cand["scores"][:, 1:].gather(1, chosen.clamp(max=R - 1))],
                           dim=1)
        scores = scores.masked_fill(pad, 0.0)
        picked = torch.cat([c.new_full((B, 1), -1), c.gather(1, chosen.clamp(max=R - 1))], dim=1)
        picked = picked.masked_fill(pad, -1).int()
        self._read = ((num_nodes, scores.view(torch.int32).reshape(-1), root_unique.view(torch.int32),
                       buffer.sum(dim=1).view(torch.int32)), (B, M1, L))
        return [DraftTree(t_tokens[b], t_parents[b], t_depth[b], t_mask[b], None, scores[b], picked[b])
                for b in range(B)]

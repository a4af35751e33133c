"""The coactivation model: expected unique experts of a verify or decode pass, by IPF.

DESIGN.md "Coactivation model and cost model"; the formulation is written out in the README
("The IPF model of unique experts"). In short, per MoE layer and expert e, let z_b be the number of
tokens of request b of a pass that route to e. By linearity,

    E[unique experts] = sum_e P(no token of the pass routes to e) = sum_e P(z_b = 0 for all b).

Each request b has a propensity pi_b in [0, 1] (given it, its tokens route to e independently);
the model is the maximum-entropy density of (pi_1, ..., pi_B) with E[pi_b] = p_e (the marginal),
E[pi_b^2] = the request shape's pair-averaged overlap (its census of pair classes weights the
q_e(relation)) and E[pi_b pi_b'] = q_e(cross):

    density ~ prod_b exp(a_b pi_b + b_b pi_b^2) * exp(c sum_{b<b'} n_b n_b' pi_b pi_b'),

fitted by iterative proportional fitting (:func:`fit_maxent`: cyclic damped-Newton projections on
one constraint set at a time until every constraint holds to ``tol``); the cross coupling is
integrated with a Gaussian variable (c < 0 through the characteristic function). Predictions fit
each request shape once and add the cross term in closed form to first order in c
(:func:`expected_unique`). Baselines: ``uniform`` N (1 - (1 - k/N)^n), ``independent``
sum_e 1 - (1 - p_e)^n.

Overlaps q_e(r) are stored as lifts q / m^2 (m: the marginal of the tokens in such pairs), shrunk
toward the layer's pooled lift, and applied to the prediction marginals p_e; a class the trace lacks
falls back to its nearest measured relative (FALLBACK).

Dimensions: L MoE layers, N experts, E = L * N (solved together), G request groups, P propensity
nodes, Q Gaussian nodes, B requests of a pass.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Sequence, Union

import numpy as np

from moespec.cost.relations import (RELATIONS, Group, PairStatistics, group_census, indicators,
                                    trace_pair_statistics, uniform_unique)

MODEL_FORMAT, MODEL_VERSION = "moespec-coactivation", 1
PREDICTORS = ("ipf", "independent", "uniform")
# a class with no pairs in the trace borrows the lift of the first measured class of its list
FALLBACK = {"parent": ("seq1",), "sibling": ("seq2", "seq1"), "ancestor": ("seq2", "seq4"),
            "cousin": ("seq4", "seq2"), "seq1": ("parent",), "seq2": ("ancestor", "sibling"),
            "seq4": ("seq2", "cousin"), "seq8": ("seq4",), "cross": ()}
SHRINK = 5.0  # prior weight, in expected co-routed pairs, of the layer's pooled lift


@dataclass
class CoactivationModel:
    """Marginals and relation lifts of one model's routing (the ``model.json`` of ``moespec analyze fit``)."""

    num_experts: int
    top_k: int
    layers: list[int]
    marginals: np.ndarray  # [L, N]: share of (decode and verify) tokens routing to each expert
    lifts: dict[str, np.ndarray]  # relation -> [L, N]: P(both route to e) / m_e^2
    pairs: dict[str, int]  # relation -> pairs measured
    source: dict[str, Any]

    # ---- fit, save, load ------------------------------------------------------------------------

    @staticmethod
    def fit(trace) -> "CoactivationModel":
        """The model of a :class:`moespec.models.trace.Trace`."""
        stats = trace_pair_statistics(trace)
        gen = trace.kind > 0
        rows = gen if gen.sum() >= 16 else np.ones_like(gen)
        x = indicators(trace.ids[rows], trace.num_experts)  # [R', L, N]
        marginals = x.mean(0) if len(x) else np.full((len(trace.layers), trace.num_experts),
                                                      trace.top_k / trace.num_experts)
        kinds = {k: int((trace.kind == v).sum()) for k, v in (("prefill", 0), ("decode", 1), ("verify", 2))}
        source = {"meta": trace.meta, "rows": trace.num_rows, "passes": len(trace.passes()), "rows_by_kind": kinds,
                  "marginals_from": "decode+verify rows" if rows is gen else "all rows"}
        return CoactivationModel(trace.num_experts, trace.top_k, [int(v) for v in trace.layers], marginals,
                                 _lifts(stats), dict(stats.pairs), source)

    def to_json(self) -> dict[str, Any]:
        return {"format": MODEL_FORMAT, "version": MODEL_VERSION, "num_experts": self.num_experts,
                "top_k": self.top_k, "layers": self.layers, "marginals": self.marginals.tolist(),
                "relations": {r: {"pairs": self.pairs[r], "lift": self.lifts[r].tolist(),
                                  "pooled_lift": _pooled(self.lifts[r], self.marginals).tolist()}
                              for r in RELATIONS},
                "source": self.source}

    def save(self, path: Union[str, Path], extra: Optional[dict[str, Any]] = None) -> Path:
        from moespec.bench.report import write_json_atomic

        return write_json_atomic(Path(path), {**self.to_json(), **(extra or {})})

    @staticmethod
    def load(path: Union[str, Path]) -> "CoactivationModel":
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"model {str(path)!r} does not exist (write one with `moespec analyze fit`)")
        try:
            obj = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"model {path}: not JSON ({exc})") from None
        if not isinstance(obj, dict) or obj.get("format") != MODEL_FORMAT:
            raise ValueError(f"model {path}: not a {MODEL_FORMAT} file")
        if obj.get("version") != MODEL_VERSION:
            raise ValueError(f"model {path}: version {obj.get('version')}, this moespec reads {MODEL_VERSION}")
        try:
            N, L = int(obj["num_experts"]), len(obj["layers"])
            marginals = np.asarray(obj["marginals"], dtype=np.float64)
            lifts = {r: np.asarray(obj["relations"][r]["lift"], dtype=np.float64) for r in RELATIONS}
            pairs = {r: int(obj["relations"][r]["pairs"]) for r in RELATIONS}
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"model {path}: missing or malformed field ({exc})") from None
        for name, a in (("marginals", marginals), *((f"relations.{r}.lift", v) for r, v in lifts.items())):
            if a.shape != (L, N) or not np.isfinite(a).all():
                raise ValueError(f"model {path}: {name} must be finite [{L}, {N}], got shape {a.shape}")
        return CoactivationModel(N, int(obj["top_k"]), [int(v) for v in obj["layers"]], marginals, lifts, pairs,
                                 obj.get("source", {}))

    def summary(self) -> str:
        """Per relation: pairs measured and the layers' pooled lift (P(both) / P(one)^2)."""
        lines = [f"{len(self.layers)} MoE layers, top-{self.top_k} of {self.num_experts}; marginals from "
                 f"{self.source.get('marginals_from', '?')}; max/min expert share (mean over layers) "
                 f"{self.marginals.max(-1).mean():.3f}/{self.marginals.min(-1).mean():.4f}",
                 f"{'relation':<10}{'pairs':>10}{'lift':>8}  (pooled over experts, mean over layers)"]
        for r in RELATIONS:
            lift = _pooled(self.lifts[r], self.marginals).mean() if self.pairs[r] else float("nan")
            lines.append(f"{r:<10}{self.pairs[r]:>10}{lift:>8.3f}")
        return "\n".join(lines)

    # ---- prediction -----------------------------------------------------------------------------

    def lift(self, relation: str) -> np.ndarray:
        """[L, N] lift of a class, or of its fallback when the trace had none of its pairs (1 if none)."""
        for r in (relation, *FALLBACK[relation]):
            if self.pairs.get(r, 0) > 0:
                return self.lifts[r]
        return np.ones_like(self.marginals)

    def request_stats(self, group: Group) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One request of this shape alone, per expert (flattened [L * N]): P(none of its tokens
        routes to the expert), Var(pi) and E[pi | none] - p, from its max-ent density; fitted once
        per shape and cached (what keeps predictions fast)."""
        key = (group.n, tuple(sorted(group_census(group).items())))
        cache = self.__dict__.setdefault("_request_cache", {})
        if key not in cache:
            sizes, mult, p, q, _ = shape_targets(self, [group])
            fit = fit_maxent(sizes, mult, p, q, p * p)
            pi, log_pw = pi_grid(p, fit.q[0])
            logits = log_pw + pi * fit.a[0] + pi * pi * fit.b[0]  # [P, E]
            w = np.exp(logits - _logsumexp(logits, 0)[None])
            none = (w * (1 - pi) ** group.n).sum(0)
            var = (w * pi * pi).sum(0) - p * p
            shift = (w * pi * (1 - pi) ** group.n).sum(0) / np.maximum(none, 1e-300) - p
            cache[key] = (none, np.maximum(var, 0.0), shift)
        return cache[key]

    def overlaps(self) -> dict[str, np.ndarray]:
        """q_e(r) [L, N] for the prediction marginals: min(lift p^2, p)."""
        p = self.marginals
        return {r: np.minimum(self.lift(r) * p * p, p) for r in RELATIONS}

    def predict(self, groups: Sequence[Group], predictor: str = "ipf") -> np.ndarray:
        """Expected unique experts per MoE layer [L] of a pass of these requests."""
        if predictor not in PREDICTORS:
            raise ValueError(f"predictor: expected one of {PREDICTORS}, got {predictor!r}")
        n = sum(g.n for g in groups)
        if predictor == "uniform":
            return np.full(len(self.layers), uniform_unique(self.num_experts, self.top_k, n))
        if predictor == "independent":
            return (1 - (1 - self.marginals) ** n).sum(-1)
        return expected_unique(self, groups)


def _lifts(stats: PairStatistics) -> dict[str, np.ndarray]:
    out = {}
    for r in RELATIONS:
        pairs = stats.pairs[r]
        if pairs == 0:
            out[r] = np.ones((stats.num_layers, stats.num_experts))
            continue
        m = stats.usage[r] / pairs  # [L, N]
        expected = pairs * m * m  # co-routed pairs under independence
        pooled = stats.co[r].sum(-1, keepdims=True) / np.maximum(expected.sum(-1, keepdims=True), 1e-12)
        out[r] = (stats.co[r] + SHRINK * pooled) / (expected + SHRINK)
    return out


def _pooled(lift: np.ndarray, p: np.ndarray) -> np.ndarray:
    return (lift * p * p).sum(-1) / (p * p).sum(-1)


# ---- the maximum-entropy fit --------------------------------------------------------------------


_GL = np.polynomial.legendre.leggauss(40)


def pi_grid(p: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gauss-Legendre nodes [P, E] and log weights of each expert's propensity pi, on its window
    [max(0, p - 10 sd), min(1, p + 10 sd)], sd = sqrt(q - p^2): the model's support (a max-ent
    density with these moments has no mass to speak of beyond it, and a narrow density is resolved)."""
    sd = np.maximum(np.sqrt(np.maximum(q - p * p, 0.0)), 1e-7)
    lo, hi = np.maximum(p - 10 * sd, 0.0), np.minimum(p + 10 * sd, 1.0)
    x, w = _GL
    pi = lo[None] + (hi - lo)[None] * (x[:, None] + 1) / 2  # [P, E]
    return pi, np.log(w[:, None] * (hi - lo)[None] / 2)


def _g_grid(points: int = 20) -> tuple[np.ndarray, np.ndarray]:
    """Gauss-Hermite nodes and log weights for E over g ~ N(0, 1)."""
    x, w = np.polynomial.hermite_e.hermegauss(points)
    return x, np.log(w / math.sqrt(2 * math.pi))


def _logsumexp(a: np.ndarray, axis: int) -> np.ndarray:
    m = np.real(a).max(axis=axis, keepdims=True)
    return (m + np.log(np.exp(a - m).sum(axis=axis, keepdims=True))).squeeze(axis)


@dataclass
class MaxEntFit:
    """The fitted distribution of one pass shape, per expert (flattened E = L * N)."""

    a: np.ndarray  # [G, E]: the field on pi of a request of group g
    b: np.ndarray  # [G, E]: the coefficient of pi^2
    c: np.ndarray  # [E]: the cross coupling of sum_{b<b'} n_b n_b' pi_b pi_b' (< 0: anti-co-routing)
    p_none: np.ndarray  # [E]: P(no token of the pass routes to the expert)
    q: np.ndarray  # [G, E]: the second moments fitted (after the feasibility clamp)
    residual: float  # largest relative constraint error after fitting
    iterations: int


def _moments(sizes, mult, a, b, c, center, grid, pis):
    """Under the model: per group E[pi], E[pi^2] and their within-g (co)variances, the cross moment
    E[sum_{b<b'} n_b n_b' pi_b pi_b'], P(no token routes to the expert) and log Z (all [E]).

    The cross coupling exp(c sum_{b<b'} y_b y_b'), y_b = n_b pi_b, is written with (S - center)^2,
    S = sum_b y_b, and integrated over g ~ N(0, 1): exp(c (S - C)^2 / 2) = E_g exp(s g (S - C)) with
    s = sqrt(c) for c >= 0 and s = i sqrt(-c) (the characteristic function) for c < 0; given g the
    requests are independent. With c < 0 the per-g terms are complex and their sum is real."""
    g, log_gw = grid
    complex_ = bool((c < 0).any())
    s = np.where(c >= 0, np.sqrt(np.abs(c)), 0.0) + (1j * np.sqrt(np.abs(c)) * (c < 0) if complex_ else 0.0)
    omega = log_gw[:, None] - s[None, :] * g[:, None] * center[None, :]  # [Q, E]
    per = []
    for n, m, ag, bg, (pi, log_pw) in zip(sizes, mult, a, b, pis):
        tilt = (c * center)[None, :] + s[None, :] * g[:, None]  # [Q, E]: added to the field on y = n pi
        base = log_pw + pi * ag + pi * pi * (bg - c * n * n / 2)  # [P, E]
        logits = base[None] + (n * pi)[None] * tilt[:, None, :]  # [Q, P, E]
        A = _logsumexp(logits, 1)  # [Q, E]
        w = np.exp(logits - A[:, None, :])
        powers = np.stack([pi, pi**2, pi**3, pi**4, (1 - pi) ** n])  # [5, P, E]
        m1, m2, m3, m4, none = np.einsum("qpe,kpe->kqe", w, powers)  # none: E[(1 - pi)^n | g]
        per.append((A, m1, m2, m2 - m1 * m1, m4 - m2 * m2, m3 - m1 * m2, none, n))
        omega = omega + m * A
    log_z = _logsumexp(omega, 0)
    post = np.exp(omega - log_z[None])  # [Q, E]: the (signed, for c < 0) weight of each g
    real = np.real
    out = [tuple(real((post * v).sum(0)) for v in (m1, m2, v1, v2, v12))
           for (_A, m1, m2, v1, v2, v12, _n, _k) in per]
    Ey = sum(m * n * m1 for (_A, m1, *_r, n), m in zip(per, mult))  # [Q, E]: E[sum_b n_b pi_b | g]
    Ey2 = sum(m * (n * m1) ** 2 for (_A, m1, *_r, n), m in zip(per, mult))
    cross = real((post * (Ey * Ey - Ey2) / 2).sum(0))
    log_none = sum(m * np.log(none) for (*_r, none, _n), m in zip(per, mult))
    p_none = np.clip(real((post * np.exp(log_none)).sum(0)), 0.0, 1.0)
    return out, cross, p_none, real(log_z) - c * center * center / 2


def _feasible(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """E[pi^2] clamped inside (p^2, p): between no and total co-routing of the request's tokens."""
    return np.clip(q, p * p * (1 + 1e-6) + 1e-15, p * (1 - 1e-6))


def fit_maxent(sizes: Sequence[int], mult: Sequence[int], p: np.ndarray, q: np.ndarray, x: np.ndarray, *,
               tol: float = 1e-6, max_iterations: int = 60) -> MaxEntFit:
    """The maximum-entropy density of the requests' propensities with E[pi_b] = p [E],
    E[pi_b^2] = q[g] for the requests of group g (of ``sizes[g]`` tokens, ``mult[g]`` of them;
    [G, E]) and E[pi_b pi_b'] = x [E] across requests, by IPF.

    The parameters theta = (a_g, b_g per group, c) are those of the density's exponent. IPF cycles
    visit the constraint sets in turn (a group's (E[pi], E[pi^2]) by a Newton step on its (a_g, b_g)
    with the exact within-group Hessian; requests are independent given g, so without cross coupling
    one cycle projects every group exactly); with cross coupling, cycles alternate with joint
    Newton steps on all of theta (Hessian by differences of the exact gradient). Every step is
    backtracked until the convex dual log Z(theta) - theta . targets decreases, so the fit converges.
    A request of one token has no pairs: its b_g stays 0 (only its mean is constrained)."""
    G, E = len(sizes), p.shape[0]
    mult_a = np.asarray(mult, dtype=np.float64)[:, None]
    sizes_a = np.asarray(sizes, dtype=np.float64)[:, None]
    paired = np.asarray([n >= 2 for n in sizes])
    q = np.stack([_feasible(p, q[i]) if paired[i] else p * p for i in range(G)])
    total = float((mult_a * sizes_a).sum())
    cross_weight = (total * total - float((mult_a * sizes_a**2).sum())) / 2  # sum_{b<b'} n_b n_b'
    use_cross = cross_weight > 0 and bool((np.abs(x - p * p) > 1e-6 * p * p).any())
    X = cross_weight * (x if use_cross else p * p)
    center = total * p  # [E]
    grid = _g_grid() if use_cross else (np.zeros(1), np.zeros(1))
    # theta rows: a_0..a_{G-1}, b_0..b_{G-1}, c; free: which rows are fitted
    free = np.concatenate([np.ones(G, dtype=bool), paired, [use_cross]])
    target = np.concatenate([np.broadcast_to(p, (G, E)), q, X[None]])  # [2G + 1, E]

    # a one-token request's spread is not identified (nothing depends on it): any window will do
    q = np.stack([q[i] if paired[i] else p * p + 0.01 * p * (1 - p) for i in range(G)])
    pis = [pi_grid(p, q[i]) for i in range(G)]

    def evaluate(theta):
        out, cross, p_none, log_z = _moments(sizes, mult, theta[:G], theta[G : 2 * G], theta[-1], center, grid, pis)
        got = np.concatenate([np.stack([o[0] for o in out]), np.stack([o[1] for o in out]), cross[None]])
        weights = np.concatenate([mult_a, mult_a, np.ones((1, 1))])
        value = log_z - (weights * theta * target)[free].sum(0)
        return value, got, out, p_none

    def errors(got):
        return (np.abs(got - target) / np.maximum(np.abs(target), 1e-12))[free].max(0)  # [E]

    def backtrack(theta, value, step):
        alpha, done, best = np.ones(E), np.zeros(E, dtype=bool), theta.copy()
        for _ in range(40):
            trial = theta + alpha * step
            ok = (evaluate(trial)[0] <= value + 1e-12 * np.abs(value)) & ~done
            best = np.where(ok, trial, best)
            done |= ok
            if done.all():
                break
            alpha = np.where(done, alpha, alpha / 2)
        return best

    theta = np.zeros((2 * G + 1, E))
    value, got, out, p_none = evaluate(theta)
    residual, it = math.inf, 0
    for it in range(1, max_iterations + 1):
        for i in range(G):  # IPF: one projection per group
            m1, m2, v1, v2, v12 = out[i]
            r1, r2 = m1 - p, m2 - q[i]
            step = np.zeros_like(theta)
            if paired[i]:
                det = np.maximum(v1 * v2 - v12 * v12, 1e-300)
                step[i], step[G + i] = -(v2 * r1 - v12 * r2) / det, -(v1 * r2 - v12 * r1) / det
            else:
                step[i] = -r1 / np.maximum(v1, 1e-300)
            theta = backtrack(theta, value, step)
            value, got, out, p_none = evaluate(theta)
        if use_cross:  # a joint Newton step
            rows = np.flatnonzero(free)
            grad = (got - target)[rows]  # per unit weight; scaled below
            weights = np.concatenate([mult_a, mult_a, np.ones((1, 1))])[rows]
            H = np.empty((E, len(rows), len(rows)))
            for j, row in enumerate(rows):
                h = np.maximum(1e-4 * np.abs(theta[row]), 1e-5) * np.where(row == len(theta) - 1, 0.1, 1.0)
                probe = theta.copy()
                probe[row] += h
                H[:, :, j] = ((evaluate(probe)[1][rows] - got[rows]) * weights / h).T
            H = (H + H.transpose(0, 2, 1)) / 2 + 1e-12 * np.eye(len(rows))
            try:
                d = -np.linalg.solve(H, (grad * weights).T[..., None])[..., 0].T
            except np.linalg.LinAlgError:
                d = -grad
            step = np.zeros_like(theta)
            step[rows] = d
            theta = backtrack(theta, value, step)
            value, got, out, p_none = evaluate(theta)
        residual = float(errors(got).max())
        if residual < tol:
            break
    return MaxEntFit(theta[:G], theta[G : 2 * G], theta[-1], p_none, q, residual, it)


def shape_targets(model: CoactivationModel, groups: Sequence[Group]):
    """The requests grouped by shape: (sizes, mult, p [E], q [G, E], x [E]) of :func:`fit_maxent`;
    q_g is the mean overlap of the shape's within-request pairs (its census weights the classes)."""
    over = model.overlaps()
    keyed: dict[tuple, list] = {}  # (an expert never seen routed gets a share of 1e-9, not 0)
    for g in groups:
        key = (g.n, tuple(sorted(group_census(g).items())))
        keyed.setdefault(key, [0])[0] += 1
    sizes, mult, q = [], [], []
    p = np.clip(model.marginals.reshape(-1), 1e-9, 1 - 1e-9)
    for (n, cen), (m,) in keyed.items():
        sizes.append(n)
        mult.append(m)
        pairs = n * (n - 1) / 2
        q.append(sum(c * over[r].reshape(-1) for r, c in cen) / pairs if pairs else p * p)
    return sizes, mult, p, np.stack(q), over["cross"].reshape(-1)


def expected_unique(model: CoactivationModel, groups: Sequence[Group], *,
                    cross: Literal["linear", "exact", "none"] = "linear", return_fit: bool = False):
    """IPF prediction of the expected unique experts per MoE layer [L] of a pass of ``groups``.

    Each request shape's max-ent density is fitted once (cached on the model). ``cross``: how the
    cross-request overlap enters: ``"linear"`` (default) the weak-coupling solution of the joint
    fit, in closed form from the requests' own densities (README: first order in the coupling c,
    exact at c = 0):

        c = (x - p^2) sum_{b<b'} n_b n_b' / sum_{b<b'} n_b^2 n_b'^2 Var(pi_b) Var(pi_b'),
        P(none) = prod_b P_b(none) * exp(c sum_{b<b'} n_b n_b' d_b d_b'),  d_b = E[pi_b | none_b] - p;

    ``"exact"`` the joint IPF fit of the whole pass (:func:`fit_maxent` with the cross moment;
    seconds per shape); ``"none"`` independent requests."""
    if not groups:
        raise ValueError("a pass needs at least one request")
    if sum(g.n for g in groups) > 65536:
        raise ValueError("a pass of more than 65536 tokens is outside the model's range")
    if cross not in ("linear", "exact", "none"):
        raise ValueError(f"cross: expected 'linear', 'exact' or 'none', got {cross!r}")
    L, N = len(model.layers), model.num_experts
    if cross == "exact" or return_fit:
        sizes, mult, p, q, x = shape_targets(model, groups)
        fit = fit_maxent(sizes, mult, p, q, x if cross != "none" else p * p)
        unique = (1 - fit.p_none).reshape(L, N).sum(-1)
        return (unique, fit) if return_fit else unique
    stats = [model.request_stats(g) for g in groups]
    log_none = sum(np.log(np.maximum(none, 1e-300)) for none, _, _ in stats)
    if cross == "linear" and len(groups) > 1:
        p = model.marginals.reshape(-1)
        x = model.overlaps()["cross"].reshape(-1)
        n = np.array([g.n for g in groups], dtype=np.float64)
        pair_sum = lambda v: (v.sum(0) ** 2 - (v * v).sum(0)) / 2  # noqa: E731  sum_{b<b'} v_b v_b'
        var = np.stack([n[i] ** 2 * st[1] for i, st in enumerate(stats)])  # [B, E]
        shift = np.stack([n[i] * st[2] for i, st in enumerate(stats)])
        pairs = (n.sum() ** 2 - (n * n).sum()) / 2
        c = (x - p * p) * pairs / np.maximum(pair_sum(var), 1e-300)
        log_none = log_none + c * pair_sum(shift)
    return (1 - np.exp(np.minimum(log_none, 0.0))).reshape(L, N).sum(-1)

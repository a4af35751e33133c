"""Expert predictors for cost-aware draft trees (EcoSpec; DESIGN.md "Cost-aware tree").

A predictor scores, for a draft node not yet verified, each MoE layer's experts for the node's token
in the target. The zero-training baseline here is the **history predictor**: the routing the target
actually used for the request's last ``history`` verified tokens (the node's nearest verified
ancestors: the sequence before the tree's root), each expert scored by its routing weight summed
with recency weights ``decay^age``; ``history=1`` is "the nearest verified ancestor's experts".
Co-routing of neighbouring tokens is what makes it work; :func:`predictor_recall` measures how well
on a routing trace (``moespec analyze predictor --trace``).

The **trained predictor** (:class:`ExpertPredictor`) scores a draft node's experts with one linear
map per MoE layer from what exists when the node is created: the draft head's hidden state at its
parent (the state that proposed it) and its token's embedding, standardised. It is fitted on
teacher-forced sequences (:func:`predictor_samples`: the head's step-0 state at row t proposes
token t + 2, whose natural routing the target computes) with a multi-label logistic loss
(``moespec analyze predictor --engine``).

Dimensions: m history tokens, L MoE layers, K top-k, N experts, V verify nodes, S samples, D = 2 H.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np


def history_scores(ids: np.ndarray, weights: np.ndarray, num_experts: int, decay: float = 0.7) -> np.ndarray:
    """ids, weights [m, L, K] of the last m verified tokens (oldest first) -> scores [L, N]."""
    m, L, K = ids.shape
    age = decay ** np.arange(m - 1, -1, -1, dtype=np.float64)  # [m]: 1 for the newest
    scores = np.zeros((L, num_experts))
    for layer in range(L):
        np.add.at(scores[layer], ids[:, layer].reshape(-1), (weights[:, layer] * age[:, None]).reshape(-1))
    return scores


def top_experts(scores: np.ndarray, k: int) -> np.ndarray:
    """The k best-scored experts per layer: [L, N] -> [L, k] (ties: lower id first)."""
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


def predictor_recall(trace, histories: Sequence[int] = (1, 4, 16), decay: float = 0.7) -> dict[str, Any]:
    """Recall of the history predictor on a routing trace, for every decode token and every verify
    node whose request has verified tokens before it: per history length, the mean share of a
    token's true top-k experts among the predicted top-k (per layer), and for verify passes the
    share of the request's true union of experts covered by the predicted top-k and by the
    size-matched prediction (top-|union|); chance is k / N, ``population`` the recall of the
    trace's k most used experts per layer (a static predictor, in-sample).

    The verified tokens a trace identifies are its prefill and decode rows and the roots of its
    verify trees (a trace does not record which draft nodes were accepted), so on a verify trace the
    history is the prompt and the earlier roots; on a decode trace it is exact."""
    if not histories or min(histories) < 1:
        raise ValueError(f"history lengths must be >= 1, got {list(histories)}")
    N, K = trace.num_experts, trace.top_k
    sequence: dict[int, dict[int, int]] = {}  # request -> position -> row of a verified token
    out = {h: {"node": [], "union": [], "union_sized": []} for h in histories}
    for start, end in trace.passes():
        kind = int(trace.kind[start])
        for req in np.unique(trace.request[start:end]):
            rows = start + np.flatnonzero(trace.request[start:end] == req)
            seq = sequence.setdefault(int(req), {})
            first = rows[trace.parent[rows] < 0][0] if kind == 2 else rows[0]
            known = sorted(p for p in seq if p < int(trace.position[first]))
            if kind > 0 and known:
                true = trace.ids[rows]  # [V, L, K]
                for h in histories:
                    hist = [seq[p] for p in known[-h:]]
                    scores = history_scores(trace.ids[hist], trace.weights[hist], N, decay)
                    pred = top_experts(scores, K)  # [L, K]
                    out[h]["node"].append(recall(np.broadcast_to(pred, true.shape), true))
                    if kind == 2:
                        for layer in range(true.shape[1]):
                            union = np.unique(true[:, layer])
                            sized = top_experts(scores[layer : layer + 1], len(union))[0]
                            out[h]["union"].append(np.isin(union, pred[layer]).mean())
                            out[h]["union_sized"].append(np.isin(union, sized).mean())
            for r in (rows if kind < 2 else [first]):
                seq[int(trace.position[r])] = int(r)
    # the population's k most used experts per layer (in-sample: the trace's own decode/verify marginals)
    gen = trace.ids[trace.kind > 0]  # [R', L, K]
    counts = np.stack([np.bincount(gen[:, layer].reshape(-1), minlength=N) for layer in range(gen.shape[1])])
    popular = top_experts(counts.astype(np.float64), K)  # [L, K]
    population = recall(np.broadcast_to(popular, gen.shape), gen) if len(gen) else None
    summary = {}
    for h in histories:
        o = out[h]
        if not o["node"]:
            raise ValueError("the trace has no decode or verify token after a verified one")
        summary[str(h)] = {"node_recall": float(np.mean(o["node"])), "steps": len(o["node"]),
                           "union_recall_top_k": float(np.mean(o["union"])) if o["union"] else None,
                           "union_recall_top_union": float(np.mean(o["union_sized"])) if o["union"] else None}
    return {"histories": summary, "chance": K / N, "population": population, "decay": decay, "num_experts": N,
            "top_k": K}


def format_recall(r: dict[str, Any]) -> str:
    lines = [f"history predictor (decay {r['decay']}): recall of a token's true top-{r['top_k']} of {r['num_experts']} "
             f"experts per layer; chance {r['chance']:.3f}, population top-{r['top_k']} (in-sample) "
             f"{r['population']:.3f}" if r["population"] is not None else "",
             f"{'history':>8}{'tokens':>9}{'node recall':>13}{'union recall (top-k)':>22}{'(top-|union|)':>15}"]
    for h, s in r["histories"].items():
        u, us = s["union_recall_top_k"], s["union_recall_top_union"]
        lines.append(f"{h:>8}{s['steps']:>9}{s['node_recall']:>13.3f}{'-' if u is None else f'{u:.3f}':>22}"
                     f"{'-' if us is None else f'{us:.3f}':>15}")
    return "\n".join(lines)


# ---- the trained predictor ------------------------------------------------------------------------

PREDICTOR_FORMAT, PREDICTOR_VERSION = "moespec-expert-predictor", 1


class ExpertPredictor:
    """Per MoE layer, expert logits = W_l ((x - mean) / std) + b_l, x = [parent draft hidden, token embedding]."""

    def __init__(self, weight, bias, mean, std, meta: Optional[dict[str, Any]] = None):
        import torch

        self.weight = torch.as_tensor(weight, dtype=torch.float32)  # [L, N, D]
        self.bias = torch.as_tensor(bias, dtype=torch.float32)  # [L, N]
        self.mean = torch.as_tensor(mean, dtype=torch.float32)  # [D]
        self.std = torch.as_tensor(std, dtype=torch.float32)  # [D]
        self.meta = dict(meta or {})
        self._weight_bf16 = None  # [L N, D], made on first use
        L, N, D = self.weight.shape
        if self.bias.shape != (L, N) or self.mean.shape != (D,) or self.std.shape != (D,):
            raise ValueError(f"expert predictor: inconsistent shapes weight {tuple(self.weight.shape)}, bias "
                             f"{tuple(self.bias.shape)}, mean {tuple(self.mean.shape)}, std {tuple(self.std.shape)}")

    @property
    def num_layers(self) -> int:
        return int(self.weight.shape[0])

    @property
    def device(self):
        return self.weight.device

    def to(self, device) -> "ExpertPredictor":
        """This predictor with its tensors on ``device`` (itself where they are there already)."""
        import torch

        if self.weight.device == torch.device(device):
            return self
        from moespec._tensor import to_device

        return ExpertPredictor(*(to_device(t, device) for t in (self.weight, self.bias, self.mean, self.std)),
                               self.meta)

    @property
    def num_experts(self) -> int:
        return int(self.weight.shape[1])

    def scores(self, parent_hidden, token_embed):
        """parent_hidden, token_embed [C, H] -> expert logits float32 [C, L, N] (on a GPU, and on the
        CPU up to NATIVE_MAX_ROWS rows: with bf16 weights and inputs, fp32 accumulation; training-sized
        batches on the CPU: in fp32)."""
        import torch

        from moespec.ops.linear import NATIVE_MAX_ROWS, linear

        x = (torch.cat([parent_hidden.float(), token_embed.float()], dim=-1) - self.mean) / self.std  # [C, D]
        L, N, D = self.weight.shape
        if x.shape[0] <= NATIVE_MAX_ROWS or x.is_cuda:  # a draft tree's nodes: the native bf16 kernel reads the weights once
            if self._weight_bf16 is None:
                self._weight_bf16 = self.weight.reshape(L * N, D).to(torch.bfloat16).contiguous()  # [L N, D]
            logits = linear(x.to(torch.bfloat16), self._weight_bf16).float()
        else:  # training-sized batches: one fp32 GEMM
            logits = x @ self.weight.reshape(L * N, D).T
        return logits.reshape(-1, L, N) + self.bias

    def predict(self, parent_hidden, token_embed, k: int):
        """The k best experts per layer: int64 [C, L, k]."""
        return self.scores(parent_hidden, token_embed).topk(k, dim=-1).indices

    def predict_p(self, parent_hidden, token_embed, k: int):
        """The k likeliest experts per layer and the probability that each is among the token's
        routed experts (the sigmoid of its logit, which the multi-label loss fits): int64 and
        float32 [C, L, k]."""
        top = self.scores(parent_hidden, token_embed).topk(k, dim=-1)
        return top.indices, top.values.sigmoid()

    def check_target(self, config) -> None:
        """ValueError unless this predictor was trained for a target of ``config``'s routing."""
        moe = config.moe
        if moe is None:
            raise ValueError("expert predictor: the target is dense (no MoE layer to predict)")
        want = (len(moe.layers), moe.num_experts, 2 * config.hidden_size)
        got = tuple(self.weight.shape)
        if got != want:
            raise ValueError(f"expert predictor: trained for {got[0]} MoE layers x {got[1]} experts on {got[2]} "
                             f"inputs, the target has {want[0]} x {want[1]} on {want[2]} (another target)")

    def save(self, folder: Union[str, Path], dtype: str = "bf16") -> Path:
        """Writes predictor.safetensors (the weights in ``dtype``, bf16 or fp32; the small bias and
        standardisation in fp32: loading computes in fp32) and predictor.json, each atomically."""
        import torch
        from safetensors.torch import save_file

        from moespec.bench.report import write_json_atomic

        if dtype not in ("bf16", "fp32"):
            raise ValueError(f"expert predictor: dtype must be bf16 or fp32, got {dtype!r}")
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / ".predictor.safetensors.tmp"
        weight = self.weight.to(torch.bfloat16 if dtype == "bf16" else torch.float32).contiguous()
        save_file({"weight": weight, "bias": self.bias.contiguous(), "mean": self.mean.contiguous(),
                   "std": self.std.contiguous()}, str(tmp))
        tmp.replace(folder / "predictor.safetensors")
        write_json_atomic(folder / "predictor.json", {"format": PREDICTOR_FORMAT, "version": PREDICTOR_VERSION,
                                                     **self.meta, "dtype": dtype})
        return folder

    @staticmethod
    def load(folder: Union[str, Path]) -> "ExpertPredictor":
        from safetensors.torch import load_file

        folder = Path(folder)
        meta_path, weights_path = folder / "predictor.json", folder / "predictor.safetensors"
        if not meta_path.is_file() or not weights_path.is_file():
            raise ValueError(f"expert predictor {folder}: missing predictor.json or predictor.safetensors (train one "
                             f"with `moespec analyze predictor --engine ... --out {folder}`)")
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != PREDICTOR_FORMAT or meta.get("version") != PREDICTOR_VERSION:
            raise ValueError(f"expert predictor {folder}: not a {PREDICTOR_FORMAT} v{PREDICTOR_VERSION} folder")
        t = load_file(str(weights_path))
        missing = {"weight", "bias", "mean", "std"} - set(t)
        if missing:
            raise ValueError(f"expert predictor {folder}: missing tensors {sorted(missing)}")
        return ExpertPredictor(t["weight"], t["bias"], t["mean"], t["std"], meta)


def predictor_samples(target, head, sequences: Sequence[Sequence[int]]):
    """Teacher-forced samples of every sequence: inputs float32 [S, 2H] (the head's step-0 state at
    row t, the embedding of token t + 2), the natural routing of token t + 2 int32 [S, L, K], and the
    routing of token t (the nearest verified token: the history baseline) [S, L, K]."""
    import torch

    from moespec.models.trace import RoutingObserver

    moe = target.config.moe
    if moe is None:
        raise ValueError("expert predictor: the target is dense (no MoE layer to predict)")
    target.set_taps(head.config.aux_layers)
    X, Y, H = [], [], []
    for ids in sequences:
        ids = [int(i) for i in ids]
        if len(ids) < 3:
            continue
        obs = RoutingObserver()
        target.observer = obs
        try:
            cache = target.new_cache(1, len(ids))
            out = target.prefill(cache, [ids], logits="all")
        finally:
            target.observer = None
        routing = obs.trace(num_experts=moe.num_experts, top_k=moe.top_k, layers=moe.layers).ids  # [T, L, K]
        tokens = torch.tensor([ids])
        with torch.no_grad():
            h0 = head.ttt_forward(tokens, [h.to(head.dtype) for h in out.hidden], 1)[0].hidden[0].float()  # [T, H]
        emb = target.weights.embed[tokens[0]].float()  # [T, H]
        X.append(torch.cat([h0[:-2], emb[2:]], dim=-1))
        Y.append(routing[2:])
        H.append(routing[:-2])
    if not X:
        raise ValueError("expert predictor: no sequence of at least 3 tokens to learn from")
    return torch.cat(X), np.concatenate(Y), np.concatenate(H)


def train_predictor(X, Y: np.ndarray, num_experts: int, *, steps: int = 300, lr: float = 3e-3, l2: float = 1e-4,
                    seed: int = 0, meta: Optional[dict[str, Any]] = None, progress: bool = False) -> ExpertPredictor:
    """Fits the linear maps by full-batch Adam on the multi-label logistic loss (fp32)."""
    import torch
    from tqdm import tqdm

    if not 1 <= steps <= 100_000:
        raise ValueError(f"expert predictor: steps must be in [1, 100000], got {steps}")
    torch.manual_seed(seed)
    S, L, K = Y.shape
    labels = torch.zeros(S, L, num_experts)  # [S, L, N]
    labels.scatter_(2, torch.as_tensor(Y, dtype=torch.long), 1.0)
    mean, std = X.mean(0), X.std(0) + 1e-5
    x = (X - mean) / std
    weight = torch.zeros(L, num_experts, X.shape[1], requires_grad=True)
    bias = torch.logit(labels.mean(0).clamp(1e-3, 1 - 1e-3)).clone().requires_grad_(True)
    opt = torch.optim.Adam([weight, bias], lr=lr)
    for _ in tqdm(range(steps), desc="train-predictor", disable=not progress, dynamic_ncols=True):
        logits = (x @ weight.reshape(L * num_experts, -1).T).reshape(S, L, num_experts) + bias
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels) + l2 * (weight**2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return ExpertPredictor(weight.detach(), bias.detach(), mean, std,
                           dict(meta or {}, samples=S, steps=steps, final_loss=float(loss.detach())))


def recall(predicted: np.ndarray, true: np.ndarray) -> float:
    """Share of the true top-k ids [S, L, K] found in predicted [S, L, K'] (per sample and layer)."""
    return float((true[:, :, :, None] == predicted[:, :, None, :]).any(-1).mean())

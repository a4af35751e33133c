"""Routing traces: the natural (unbudgeted) routing of every token of every forward pass.

A :class:`RoutingObserver` set on a model (``TargetModel.observer``) receives each prefill, decode
and verify call's natural top-k ids and weights at every MoE layer (the native step writes them
beside the routing it runs; with a budget it routes a second time without it, so a layer after
the first routes the hidden states the budgeted layers before it produced). With no observer
nothing is recorded or allocated. :class:`Trace` is the file contract of ``moespec analyze trace``
(DESIGN.md "Coactivation model and cost model"; tests and users write traces in it too), a NumPy
``.npz`` with

    ids       int32   [R, L, K]  natural top-k expert ids of token row r at MoE layer l
    weights   float32 [R, L, K]  their routing weights
    pass_id   int32   [R]        forward pass of the row (one prefill, decode or verify call)
    kind      int8    [R]        0 prefill, 1 decode, 2 verify
    request   int32   [R]        request index
    position  int32   [R]        position in its sequence
    parent    int32   [R]        row of its tree parent in the same pass; -1 for a root or a sequence token
    num_experts, top_k           int32 scalars
    layers    int32   [L]        model layer index of each MoE layer
    meta                         a JSON string (model, dataset, policy, tree, moespec version)

Rows of one pass are contiguous and grouped by request; a parent row precedes its child.

Dimensions: R token rows, L MoE layers, K top-k, P tokens of one call, B requests of one call.
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

TRACE_VERSION = 1
KINDS = {"prefill": 0, "decode": 1, "verify": 2}
_ROW_ARRAYS = {"ids": np.int32, "weights": np.float32, "pass_id": np.int32, "kind": np.int8, "request": np.int32,
               "position": np.int32, "parent": np.int32}


class TraceError(ValueError):
    """A trace file or array that breaks the contract; the message names the array."""


@dataclass
class Trace:
    """One routing trace (the arrays of the module docstring)."""

    ids: np.ndarray
    weights: np.ndarray
    pass_id: np.ndarray
    kind: np.ndarray
    request: np.ndarray
    position: np.ndarray
    parent: np.ndarray
    num_experts: int
    top_k: int
    layers: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, dtype in _ROW_ARRAYS.items():
            setattr(self, name, np.ascontiguousarray(getattr(self, name), dtype=dtype))
        self.layers = np.ascontiguousarray(self.layers, dtype=np.int32)
        self.num_experts, self.top_k = int(self.num_experts), int(self.top_k)
        validate(self)

    @property
    def num_rows(self) -> int:
        return int(self.ids.shape[0])

    def passes(self) -> list[tuple[int, int]]:
        """[start, end) row ranges of the passes, in file order."""
        if self.num_rows == 0:
            return []
        cut = np.flatnonzero(np.diff(self.pass_id)) + 1
        bounds = np.concatenate(([0], cut, [self.num_rows]))
        return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def validate(t: Trace) -> None:
    """TraceError naming the array at fault for any break of the contract."""
    if t.ids.ndim != 3:
        raise TraceError(f"trace array 'ids' must be [R, L, K], got shape {t.ids.shape}")
    R, L, K = t.ids.shape
    if t.weights.shape != t.ids.shape:
        raise TraceError(f"trace array 'weights' has shape {t.weights.shape}, 'ids' has {t.ids.shape}")
    for name in ("pass_id", "kind", "request", "position", "parent"):
        a = getattr(t, name)
        if a.shape != (R,):
            raise TraceError(f"trace array {name!r} has shape {a.shape}, expected ({R},) (one per row of 'ids')")
    if t.layers.shape != (L,):
        raise TraceError(f"trace array 'layers' has shape {t.layers.shape}, expected ({L},) (one per MoE layer)")
    if not 1 <= t.top_k <= t.num_experts:
        raise TraceError(f"trace scalars: top_k={t.top_k} must be in [1, num_experts={t.num_experts}]")
    if K != t.top_k:
        raise TraceError(f"trace array 'ids' has {K} experts per row, top_k is {t.top_k}")
    if R == 0:
        return
    if t.ids.min() < 0 or t.ids.max() >= t.num_experts:
        raise TraceError(f"trace array 'ids' holds ids outside [0, num_experts={t.num_experts})")
    if not np.isfinite(t.weights).all():
        raise TraceError("trace array 'weights' holds NaN or inf")
    if not np.isin(t.kind, list(KINDS.values())).all():
        raise TraceError("trace array 'kind' holds values other than 0 (prefill), 1 (decode), 2 (verify)")
    if (np.diff(t.pass_id) < 0).any():
        raise TraceError("trace array 'pass_id' must be non-decreasing (the rows of a pass are contiguous)")
    if (t.position < 0).any() or (t.request < 0).any():
        raise TraceError("trace arrays 'position' and 'request' must be >= 0")
    rows = np.arange(R)
    has = t.parent >= 0
    if (t.parent < -1).any() or (t.parent[has] >= rows[has]).any():
        raise TraceError("trace array 'parent' must be -1 or an earlier row")
    p = t.parent[has]
    if (t.pass_id[p] != t.pass_id[has]).any() or (t.request[p] != t.request[has]).any():
        raise TraceError("trace array 'parent': a parent row must be in the same pass and request as its child")


def concat_traces(traces: Sequence[Trace]) -> Trace:
    """One trace of several (passes, rows and requests renumbered after each other)."""
    if not traces:
        raise TraceError("no trace to concatenate")
    first = traces[0]
    for t in traces[1:]:
        if (t.num_experts, t.top_k, t.layers.tolist()) != (first.num_experts, first.top_k, first.layers.tolist()):
            raise TraceError("traces of different routing (experts, top_k or MoE layers) cannot be combined")
    arrays = {n: [] for n in _ROW_ARRAYS}
    rows = passes = requests = 0
    for t in traces:
        for n in _ROW_ARRAYS:
            a = getattr(t, n)
            if n == "parent":
                a = np.where(a >= 0, a + rows, -1)
            elif n == "pass_id":
                a = a + passes
            elif n == "request":
                a = a + requests
            arrays[n].append(a)
        rows += t.num_rows
        passes += int(t.pass_id.max()) + 1 if t.num_rows else 0
        requests += int(t.request.max()) + 1 if t.num_rows else 0
    meta = dict(first.meta, combined=[t.meta for t in traces]) if len(traces) > 1 else first.meta
    return Trace(**{n: np.concatenate(v) for n, v in arrays.items()}, num_experts=first.num_experts,
                 top_k=first.top_k, layers=first.layers, meta=meta)


def save_trace(path: Union[str, Path], t: Trace) -> Path:
    """Writes ``t`` to ``path`` (.npz) atomically: a complete file or none."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(t.meta, trace_version=TRACE_VERSION)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez_compressed(f, **{n: getattr(t, n) for n in _ROW_ARRAYS}, num_experts=np.int32(t.num_experts),
                                top_k=np.int32(t.top_k), layers=t.layers, meta=np.array(json.dumps(meta)))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_trace(path: Union[str, Path]) -> Trace:
    """Reads a trace file; TraceError naming the file and the missing or broken array."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace {str(path)!r} does not exist")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {n: z[n] for n in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise TraceError(f"trace {path}: not a readable .npz file ({exc})") from None
    missing = [n for n in (*_ROW_ARRAYS, "num_experts", "top_k", "layers", "meta") if n not in arrays]
    if missing:
        raise TraceError(f"trace {path}: missing array(s) {', '.join(map(repr, missing))}")
    for name, dtype in _ROW_ARRAYS.items():
        if arrays[name].dtype != dtype:
            raise TraceError(f"trace {path}: array {name!r} is {arrays[name].dtype}, expected {np.dtype(dtype)}")
    try:
        meta = json.loads(str(arrays["meta"]))
    except json.JSONDecodeError as exc:
        raise TraceError(f"trace {path}: array 'meta' is not a JSON string ({exc})") from None
    if not isinstance(meta, dict):
        raise TraceError(f"trace {path}: array 'meta' must hold a JSON object")
    try:
        return Trace(**{n: arrays[n] for n in _ROW_ARRAYS}, num_experts=int(arrays["num_experts"]),
                     top_k=int(arrays["top_k"]), layers=arrays["layers"], meta=meta)
    except TraceError as exc:
        raise TraceError(f"trace {path}: {exc}") from None


class RoutingObserver:
    """Collects the routing of every call of the model it is set on (``model.observer = obs``).

    ``requests``: the request index of each cache slot (default: the slot itself); set it before a
    batch when slots are reused across batches.
    """

    def __init__(self) -> None:
        self._rows: list[dict[str, np.ndarray]] = []
        self._passes = 0
        self.requests: Optional[Sequence[int]] = None

    @property
    def num_passes(self) -> int:
        return self._passes

    def record(self, kind: str, starts: Sequence[int], seqs: Sequence[Sequence[int]],
               parents: Optional[Sequence[Sequence[int]]], ids, weights) -> None:
        """One call: request b's ``len(seqs[b])`` tokens after ``starts[b]`` committed ones (a tree
        when ``parents`` is given); ``ids``/``weights`` [L, P, K], packed request after request."""
        num = [len(s) for s in seqs]
        P = sum(num)
        position = np.empty(P, dtype=np.int32)
        parent = np.full(P, -1, dtype=np.int32)
        request = np.empty(P, dtype=np.int32)
        row = 0
        for b, n in enumerate(num):
            if not n:
                continue
            request[row : row + n] = self.requests[b] if self.requests is not None else b
            if parents is None:
                position[row : row + n] = starts[b] + np.arange(n)
            else:
                ps = np.asarray(parents[b], dtype=np.int64)
                depth = np.zeros(n, dtype=np.int64)
                for i in range(1, n):
                    depth[i] = depth[ps[i]] + 1
                position[row : row + n] = starts[b] + depth
                parent[row + 1 : row + n] = row + ps[1:]
            row += n
        ids = np.asarray(ids).transpose(1, 0, 2)  # [P, L, K]
        self._rows.append({"ids": ids, "weights": np.asarray(weights, dtype=np.float32).transpose(1, 0, 2),
                           "pass_id": np.full(P, self._passes, dtype=np.int32),
                           "kind": np.full(P, KINDS[kind], dtype=np.int8), "request": request,
                           "position": position, "parent": parent})
        self._passes += 1

    def trace(self, *, num_experts: int, top_k: int, layers: Sequence[int], meta: Optional[dict] = None) -> Trace:
        """The rows recorded so far as a :class:`Trace` (parents re-based to global rows)."""
        out, base = {n: [] for n in _ROW_ARRAYS}, 0
        for chunk in self._rows:
            for n in _ROW_ARRAYS:
                a = chunk[n]
                out[n].append(np.where(a >= 0, a + base, a) if n == "parent" else a)
            base += len(chunk["kind"])
        L = len(layers)
        arrays = {n: (np.concatenate(v) if v else np.zeros((0, L, top_k) if n in ("ids", "weights") else 0,
                                                            dtype=_ROW_ARRAYS[n])) for n, v in out.items()}
        return Trace(**arrays, num_experts=num_experts, top_k=top_k, layers=np.asarray(layers), meta=meta or {})

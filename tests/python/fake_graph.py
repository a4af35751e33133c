"""A CUDA graph's semantics on the CPU, for tests of code that captures one (moespec.runtime.graphs.capture).

On a GPU, capturing records kernels without running them: a tensor the captured call allocates holds
whatever its memory held (fresh memory: zeros), a buffer it writes keeps its old values, and reading
a value on the host raises; replaying runs the recorded kernels on the same memory, however the
Python objects that pointed at it were rebound since. :func:`fake_capture` does the same with a
``TorchDispatchMode``: it records the call's ops, runs only the views (no kernel: they alias memory
already there), returns new outputs filled with zeros and writes nothing; ``FakeGraph.replay`` runs
the recorded ops again, writing their results into the tensors the capture returned. So code that
reads, after a capture and before a replay, what only the capture "wrote" (or that rebinds state a
replay should write) fails on the CPU as it would on a GPU.

Not simulated: host reads are let through (the code's CPU-only checks; they see the capture's
values), and native calls that take data pointers (moespec._tensor.view) bypass the dispatcher, so
they are neither recorded nor replayed: the code under test must take its torch path, as on a GPU.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import TorchDispatchMode


class FakeGraph:
    """The ops of one captured call: (op, args, kwargs, None when the op writes its arguments, else its
    outputs as the capture returned them, None for those that alias an input)."""

    def __init__(self) -> None:
        self.ops: list[tuple] = []
        self.replays = 0

    def replay(self) -> None:
        with torch.inference_mode():  # (a capture under inference mode made inference tensors, written here)
            for func, args, kwargs, outs in self.ops:
                got = func(*args, **kwargs)
                for o, g in zip(outs or (), tree_flatten(got)[0]):
                    if o is not None:
                        o.copy_(g)
        self.replays += 1


class _Capturing(TorchDispatchMode):
    def __init__(self, graph: FakeGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.is_mutable:  # in place / out=: recorded, nothing written now
            self.graph.ops.append((func, args, kwargs, None))
            return _written_args(func, args, kwargs)
        got = func(*args, **kwargs)  # (for the shapes and the views; new values are dropped)
        flat, spec = tree_flatten(got)
        if not all(isinstance(t, torch.Tensor) for t in flat):
            return got  # a host read: the code's CPU-only checks (a GPU's capture would raise)
        inputs = {_storage(t) for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        # a view (no kernel) aliases an input; an op that may alias (to, reshape, ...) can also be a copy
        outs = [None if _storage(t) in inputs else _fresh(t) for t in flat]
        if any(o is not None for o in outs):
            self.graph.ops.append((func, args, kwargs, outs))
        return spec.unflatten([t if o is None else o for t, o in zip(flat, outs)])


def _storage(t: torch.Tensor) -> int:
    """The address of t's memory (a virtual CUDA tensor's: its host tensor's, tests/python/virtual_cuda.py)."""
    return getattr(t, "_host", t).untyped_storage().data_ptr()


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A new output's memory as a capture leaves it (fresh memory: zeros)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).zero_()


def _written_args(func, args, kwargs):
    """What a mutating op returns: the arguments it writes (matched by alias set)."""
    schema = func._schema
    values = {a.name: v for a, v in zip(schema.arguments, args)} | kwargs
    written = {frozenset(a.alias_info.before_set): values.get(a.name) for a in schema.arguments
               if a.alias_info is not None and a.alias_info.is_write}
    outs = []
    for r in schema.returns:
        if r.alias_info is None:
            raise NotImplementedError(f"{func}: a mutating op with a new output")
        outs.append(written[frozenset(r.alias_info.before_set)])
    return None if not outs else outs[0] if len(outs) == 1 else tuple(outs)


def fake_capture(fn, pool=None) -> tuple:
    """moespec.runtime.graphs.capture on the CPU: a warm-up call that runs, then ``fn()`` captured into
    a :class:`FakeGraph`; returns (graph, what the captured call returned)."""
    fn()
    graph = FakeGraph()
    with _Capturing(graph):
        out = fn()
    return graph, out

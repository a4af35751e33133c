"""A CUDA device played on the CPU, for the Python code that only a GPU runs (moespec's "cuda" branches,
graph captures, pinned copies), so that its device mistakes show here rather than in a GPU session's
few minutes:

    PYTHONPATH=python:tests/python python -m pytest -p virtual_cuda tests/gpu/test_runtime_cuda.py

Under :func:`virtual_cuda` (or the pytest plugin: the whole session), torch reports one CUDA device;
a tensor made on "cuda" (a factory's device, ``.to("cuda")``, ``.cuda()``, ``torch.tensor(...,
device="cuda")``) is a :class:`VirtualCudaTensor`: its ``device`` is cuda:0 and its values live in a
host tensor (``_host``) that every op runs on. What a GPU would refuse is refused, what it would
synchronise on is counted:
- an op mixing a virtual CUDA tensor with a host tensor of one or more dimensions raises torch's
  device-mismatch error (a GPU's torch lets index tensors on the host through with a copy: here they
  are refused too), ``.numpy()`` on one raises as on a GPU;
- a read of a device value on the host (``tolist``, ``item``, ``int``/``float``/``bool``, ``.cpu()``,
  a copy to the host, ops whose output size depends on the values such as ``nonzero``) and a
  blocking copy from the host are synchronisations: ``VirtualCuda.syncs`` lists them, each a warning
  under ``torch.cuda.set_sync_debug_mode("warn")``, and inside a graph capture an error, as a real
  capture refuses them;
- ``torch.cuda.graph`` captures with tests/python/fake_graph.py's semantics (ops recorded, not run;
  a replay runs them on the same memory), moespec's native kernel launches recorded with them;
- moespec's native entry points given virtual CUDA tensors check that every tensor they are given is
  one (a host tensor passed to a CUDA kernel raises), then run the CPU entry of the same name on the
  host memory, or, for the decoder ops that only CUDA has, their torch versions.

With ``kernels="emulated"`` (or MOESPEC_VIRTUAL_KERNELS=emulated for the plugin), the native entry
points given virtual CUDA tensors run the CUDA kernels' own source instead: moespec._native_emulated,
the same bindings over cpp/kernels/*.cu compiled for the block emulator (tests/cpp/emulated), given
the host memory as CUDA tensors. Then tests/gpu's kernel tests, which hold the kernels to the CPU ops,
test the kernels' code (thread indexing, barriers, shuffles, mma fragments, launch geometry) on the
CPU; not their speed, nor the bits of a GPU's tensor-core sums and approximate functions. The block
emulator defers each launch to the next one, so that a programmatic dependent's first block runs up to
its wait before its primary (tests/cpp/emulated/cuda_emulator.h); here the deferred launches run before
anything else touches the device's memory (a torch op on a device tensor other than a view or an
allocation, a host read or copy, a CPU entry), with the tensors of their arguments held until then (a
GPU's stream-ordered allocator keeps freed memory from later work the same way). So one step's chain of
moespec kernels (norm -> projections -> attention -> routing -> experts) runs as on a GPU, a kernel
that reads its predecessor's output before its wait getting a wrong result.

Not played: streams and events (one stream, nothing asynchronous; events read the host's clock), CUDA
generators (a generator made for "cuda" draws on the host), memory limits. The runtime's tests
(tests/gpu/test_runtime_cuda.py) and the kernel tests run here on the emulated kernels at every
./build.sh test (tests/python/test_virtual_cuda.py).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
import types
import warnings
from typing import Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils._python_dispatch import TorchDispatchMode

from moespec._tensor import view as _host_view  # (bound now: virtual_cuda() patches moespec's `view` names)

CUDA = torch.device("cuda", 0)
# ops on device tensors that neither read nor write their values (views, allocations): the emulated
# launches before them may still be deferred. (Not every op with an aliasing schema: `to` copies.)
NO_DATA = frozenset({"view", "_unsafe_view", "_reshape_alias", "as_strided", "slice", "select", "narrow", "split",
                     "split_with_sizes", "chunk", "unbind", "transpose", "t", "permute", "expand", "squeeze",
                     "unsqueeze", "unflatten", "diagonal", "detach", "alias", "empty_like", "new_empty",
                     "new_empty_strided"})
# ops whose output size depends on the values: on a GPU the host waits for them
DATA_DEPENDENT = frozenset({"nonzero", "unique", "_unique", "_unique2", "unique_consecutive", "masked_select",
                            "_local_scalar_dense"})


class VirtualCudaTensor(torch.Tensor):
    """A tensor on cuda:0 whose values are the host tensor ``_host``."""

    @staticmethod
    def __new__(cls, host: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, host.shape, strides=host.stride(),
                                                storage_offset=host.storage_offset(), dtype=host.dtype, device=CUDA)
        t._host = host
        return t

    def __repr__(self) -> str:
        return f"VirtualCudaTensor({self._host!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func}: a virtual CUDA tensor used outside virtual_cuda()")


class Syncs(list):
    """The synchronisations seen, as "what at file:line"; ``debug``: torch's sync debug mode."""

    debug = "default"

    def add(self, what: str) -> None:
        frame = _caller()
        what = f"{what} at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}" if frame else what
        if CAPTURING:
            raise RuntimeError(f"{what}: a synchronisation while a CUDA graph is captured (operation not "
                               "permitted when stream is capturing)")
        self.append(what)
        if self.debug in ("warn", 1):  # (attributed to the caller's line, as torch's warning is)
            warnings.warn_explicit(f"called a synchronizing CUDA operation: {what}", UserWarning,
                                   frame.filename if frame else __file__, frame.lineno if frame else 0)
        elif self.debug in ("error", 2):
            raise RuntimeError(f"called a synchronizing CUDA operation: {what}")


def _caller():
    """The innermost frame of moespec or of a test (None: none)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if ("/moespec/" in frame.filename or "/tests/" in frame.filename) and \
                frame.filename.rsplit("/", 1)[-1] != "virtual_cuda.py":
            return frame
    return None


CAPTURING: list = []  # the FakeGraph being captured: native launches are recorded into it


class VirtualCuda(TorchDispatchMode):
    """Runs every op on the host tensors of its virtual CUDA arguments (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs = Syncs()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = func.overloadpacket.__name__
        on, host = False, []

        def unwrap(t):
            nonlocal on
            if isinstance(t, VirtualCudaTensor):
                on = True
                return t._host
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                host.append(t)
            return t

        a, k = tree_map(unwrap, (args, kwargs))
        device = k.get("device")
        to = None if device is None else torch.device(device).type
        if to == "cuda":
            k["device"] = torch.device("cpu")
        if on and host and name not in ("_to_copy", "copy_", "lift_fresh"):
            raise RuntimeError(f"{name}: Expected all tensors to be on the same device, but found at least two "
                               "devices, cuda:0 and cpu!")
        if on and name not in NO_DATA and not (name == "reshape" and a[0].is_contiguous()):  # (after the launches)
            _run_deferred()
        if on and name in DATA_DEPENDENT:
            self.syncs.add(name)
        if on and name in ("_to_copy", "copy_") and (to == "cpu" or (name == "copy_" and
                                                                     not isinstance(args[0], VirtualCudaTensor))):
            self.syncs.add(f"{name} to the host")
        out = func(*a, **k)
        if name == "copy_":
            return args[0]
        if not ((on and to != "cpu") or to == "cuda"):
            return out
        # (under inference mode a view of a normal tensor is a normal tensor: its wrapper too)
        normal = any(isinstance(t, VirtualCudaTensor) and not t.is_inference() for t in tree_flatten((args, kwargs))[0])
        with torch.inference_mode(False) if normal else contextlib.nullcontext():
            return tree_map(lambda t: VirtualCudaTensor(t) if isinstance(t, torch.Tensor) and
                            not isinstance(t, VirtualCudaTensor) else t, out)


class _Stream:
    cuda_stream = 0

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Event:
    """A CUDA event on the host's clock (everything ran when it is recorded)."""

    def __init__(self, *args, **kwargs) -> None:
        self.at = 0.0

    def record(self, stream=None) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_Event") -> float:
        return (end.at - self.at) * 1e3  # ms


class _HostGenerator(torch.Generator):
    """torch.Generator whatever the device asked for: a CUDA one draws on the host (the virtual device's
    values live there)."""

    def __new__(cls, device="cpu"):
        return super().__new__(cls, "cpu")

    def __init__(self, device="cpu") -> None:
        pass


class _Graph:
    """torch.cuda.CUDAGraph: a fake_graph.FakeGraph once captured."""

    def __init__(self, *args, **kwargs) -> None:
        self.fake = None

    def replay(self) -> None:
        self.fake.replay()


@contextlib.contextmanager
def _graph(graph: _Graph, pool=None, stream=None, **kwargs) -> Iterator[None]:
    from fake_graph import FakeGraph, _Capturing

    graph.fake = FakeGraph()
    CAPTURING.append(graph.fake)
    try:
        with _Capturing(graph.fake):
            yield
    finally:
        CAPTURING.pop()


class _Desc(tuple):
    """A native tensor descriptor (moespec._tensor.view) that keeps its tensor (a virtual CUDA
    tensor's host tensor) and whether it is on the device."""

    def __new__(cls, values, tensor: torch.Tensor, on_device: bool):
        d = super().__new__(cls, tuple(values[:4]) + (0, 0))  # (the host memory's: what a CPU entry reads)
        d.tensor, d.on_device = tensor, on_device
        return d

    def as_device(self) -> tuple:
        """The descriptor of the same memory as a tensor on cuda:0 (what the emulated kernels take)."""
        return tuple(self[:4]) + (1, 0)


_DEFERRED: list = []  # the emulated module's synchronize while the block emulator holds launches not run
_HELD: list = []      # their tensors (a stream-ordered allocator keeps freed memory until its launches end)


def _run_deferred() -> None:
    """Runs the emulated launches not run yet (the block emulator defers each one until the next launch,
    to play a programmatic dependent's start before its primary ends): before anything else reads or
    writes the device's memory (a torch op, a host read or copy, a CPU entry)."""
    if _DEFERRED:
        try:
            _DEFERRED.pop()()
        finally:
            _HELD.clear()


class _Launch:
    """One native kernel launch on virtual CUDA tensors, as a captured graph holds it; ``deferred``: the
    emulated module's synchronize (its kernels run at the next emulated launch or ``_run_deferred``,
    ``tensors`` held until then), else the launch runs before it returns."""

    def __init__(self, name: str, fn, deferred=None, tensors=()) -> None:
        self.__name__, self.fn, self.deferred, self.tensors = name, fn, deferred, tuple(tensors)

    def __call__(self, *args, **kwargs):
        if self.deferred is None:
            _run_deferred()
        out = self.fn(*args, **kwargs)
        if self.deferred is not None:
            _DEFERRED[:] = [self.deferred]
            _HELD.extend(self.tensors)
        return out


class _Native:
    """The native module with its CUDA entry points played on the host (see the module docstring)."""

    def __init__(self, real, emulated=None) -> None:
        self.real, self.emulated = real, emulated

    def cuda_available(self) -> bool:
        return True

    def __getattr__(self, name: str):
        value = getattr(self.real, name)
        if not callable(value):
            return value

        def call(*args, **kwargs):
            descs = [d for d in tree_flatten((list(args), kwargs))[0] if isinstance(d, _Desc)]
            on = [d.on_device for d in descs]
            if not any(on):
                return value(*args, **kwargs)
            if not all(on):
                host = [i for i, d in enumerate(args) if isinstance(d, _Desc) and not d.on_device]
                raise ValueError(f"native {name}: host tensors (arguments {host}) in a call on CUDA tensors")
            if self.emulated is not None and hasattr(self.emulated, name):
                launch = _Launch(name, getattr(self.emulated, name), self.emulated.emulated_synchronize,
                                 [d.tensor for d in descs])
                args = tuple(d.as_device() if isinstance(d, _Desc) else d for d in args)
                kwargs = {k: d.as_device() if isinstance(d, _Desc) else d for k, d in kwargs.items()}
            elif name in ADAPTERS:
                launch = _Launch(name, ADAPTERS[name])
                args = tuple(d.tensor if isinstance(d, _Desc) else d for d in args)
            else:
                launch = _Launch(name, value)
            if CAPTURING:  # a launch inside a capture: recorded, run by the replays
                CAPTURING[-1].ops.append((launch, args, kwargs, None))
                return None
            return launch(*args, **kwargs)

        return call


def _rms_norm(x, residual, weight, out, total, eps, scale_fp32, stream):
    from moespec.ops import decoder

    s, normed = decoder.rms_norm(x, weight, eps, residual=residual, scale_fp32=scale_fp32)
    out.copy_(normed)
    if total is not None:
        total.copy_(s)


def _attention_inputs(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, rows, slots, q, num_heads, num_kv_heads,
                      code, eps, clip, stream):
    from moespec.ops import decoder

    names = {v: k for k, v in decoder.QK_NORM_CODES.items()}
    q.copy_(decoder.attention_inputs(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, rows, slots,
                                     num_heads=num_heads, num_kv_heads=num_kv_heads, qk_norm=names[code], eps=eps,
                                     clip=clip or None))


def _tree_attention(q, k_cache, v_cache, start, offsets, groups, spans, words, positions, sinks, out, scale, window,
                    workspace, stream):
    from moespec.ops import decoder

    out.copy_(decoder.tree_attention(q, k_cache, v_cache, start, offsets, groups, words, scale, spans=spans,
                                     positions=positions, window=window, sinks=sinks))


def _route_experts(*args):
    """The CPU entry (which checks the values for NaN itself), then the workspace's non-finite count
    zeroed, as the CUDA kernel leaves it where every value is finite."""
    from moespec import _native

    *rest, workspace, stream = args
    _native.route_experts(*[_host_view(a, "arg") if isinstance(a, torch.Tensor) else a for a in rest], None, 0)
    at = _native.route_experts_nonfinite_offset()
    workspace[at:at + 4].zero_()


def _select_cost_aware(parents, depth, scores, num_candidates, predicted, predicted_p, buffer, expert_s, state,
                       selected, count, token_s, total_tokens, stream):
    """select_cost_aware_cuda's contract on the host: the CPU selection (the C++ tree core) request
    after request, the buffer and S, A carried."""
    from moespec.spec.cost_aware import SelectionCosts, select_cost_aware_native

    costs, buf = SelectionCosts(token_s, expert_s.numpy().copy()), buffer.numpy()  # (buf: the buffer's memory)
    step_s, accepted = state.tolist()
    selected.fill_(-1)
    for b, n in enumerate(num_candidates.tolist()):
        count[b] = 0
        if n == 0:  # (the CPU function takes one candidate at least)
            continue
        chosen, step_s, accepted = select_cost_aware_native(
            parents[b, :n].numpy(), depth[b, :n].numpy(), scores[b, :n].numpy(), predicted[b, :n].numpy(),
            None if predicted_p is None else predicted_p[b, :n].numpy(), buf, costs, total_tokens,
            step_s=step_s, accepted=accepted)
        selected[b, :len(chosen)] = torch.tensor(list(chosen), dtype=torch.int32)
        count[b] = len(chosen)
    state.copy_(torch.tensor([step_s, accepted], dtype=state.dtype))


def _tree_from_selection(selected, count, cand_parents, cand_tokens, root_tokens, tokens, parents, depth, mask,
                         num_nodes, stream):
    """tree_from_selection_cuda's contract on the host: moespec.spec.tree.tree_from_selection per
    request, rows past its nodes parent -1 and zero elsewhere."""
    from moespec.spec.tree import Candidates, tree_from_selection

    for t, fill in ((tokens, 0), (parents, -1), (depth, 0), (mask, 0)):
        t.fill_(fill)
    for b, n in enumerate(count.tolist()):
        C = cand_tokens.shape[1]
        cands = Candidates(cand_tokens[b].long(), cand_parents[b], torch.zeros(C, dtype=torch.int32), torch.zeros(C))
        tree = tree_from_selection(int(root_tokens[b]), cands, selected[b, :n].tolist())
        tokens[b, :n + 1], parents[b, :n + 1], depth[b, :n + 1] = tree.tokens.int(), tree.parents, tree.depth
        mask[b, :n + 1, :tree.mask_words.shape[1]] = tree.mask_words
        num_nodes[b] = n + 1


ADAPTERS = {"rms_norm": _rms_norm, "attention_inputs": _attention_inputs, "tree_attention": _tree_attention,
            "route_experts": _route_experts, "select_cost_aware_cuda": _select_cost_aware,
            "tree_from_selection_cuda": _tree_from_selection}


def _emulated_module(kernels: str | None):
    """moespec._native_emulated when the kernels are "emulated", None when "cpu" (the CPU entries)."""
    kernels = kernels or os.environ.get("MOESPEC_VIRTUAL_KERNELS", "cpu")
    if kernels == "cpu":
        return None
    if kernels != "emulated":
        raise ValueError(f"MOESPEC_VIRTUAL_KERNELS: expected 'cpu' or 'emulated', got {kernels!r}")
    try:
        from moespec import _native_emulated
    except ImportError as exc:
        raise ImportError(f"moespec._native_emulated is not built ({exc}): ./build.sh test builds it") from exc
    return _native_emulated


@contextlib.contextmanager
def virtual_cuda(kernels: str | None = None) -> Iterator[VirtualCuda]:
    """The virtual CUDA device, for the block (yields the mode: its ``syncs``). kernels: "cpu" (the CPU
    entries and torch versions play the kernels) or "emulated" (the kernels' CUDA source on the block
    emulator); default MOESPEC_VIRTUAL_KERNELS, else "cpu"."""
    import importlib
    import pkgutil

    import moespec._loader as loader

    for package in ("ops", "models", "runtime", "spec", "bench"):  # (every module whose `native` and `view`
        root = importlib.import_module(f"moespec.{package}")      # names are patched: imported first)
        for info in pkgutil.iter_modules(root.__path__, f"{root.__name__}."):
            with contextlib.suppress(ImportError):
                importlib.import_module(info.name)

    mode = VirtualCuda()
    saved: list[tuple] = []

    def patch(obj, name: str, value) -> None:
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    real_view, real_native = _host_view, loader.native
    real = {name: getattr(torch.Tensor, name) for name in (
        "to", "copy_", "tolist", "numpy", "__getitem__", "__setitem__", "__int__", "__float__", "__bool__",
        "__index__", "item", "contiguous")}
    real_tensor = torch.tensor

    def tensor(data, *args, device=None, **kwargs):
        t = real_tensor(data, *args, **kwargs)
        return t if device is None else to(t, device)

    def view(t, name):
        if isinstance(t, VirtualCudaTensor):
            return _Desc(real_view(t._host, name), t._host, True)
        d = real_view(t, name)
        return None if d is None else _Desc(d, t, False)

    def to(self, *args, **kwargs):
        device, dtype = kwargs.get("device"), kwargs.get("dtype")
        flags = [a for a in args if isinstance(a, bool)]  # (non_blocking, copy), positionally
        non_blocking = kwargs.get("non_blocking", flags[0] if flags else False)
        copy = kwargs.get("copy", flags[1] if len(flags) > 1 else False)
        for a in args:
            if isinstance(a, torch.dtype):
                dtype = a
            elif isinstance(a, torch.Tensor):
                device, dtype = a.device, a.dtype
            elif isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
                device = a
        on = isinstance(self, VirtualCudaTensor)
        device = None if device is None else torch.device(device)
        same = device is None or (device.type == "cuda") == on
        if same and (dtype is None or dtype == self.dtype) and not copy:
            return self  # (no data touched: deferred launches stay deferred)
        _run_deferred()
        if same:
            if dtype is not None and dtype != self.dtype:
                return real["to"](self, dtype=dtype)
            return real["to"](self, dtype=self.dtype, copy=True)
        if device.type == "cuda":  # to the device: blocking from pageable memory
            if not non_blocking:
                mode.syncs.add("a blocking copy to the device")
            return VirtualCudaTensor((real["to"](self, dtype=dtype) if dtype is not None else self).clone())
        if device.type == "cpu" and on:
            mode.syncs.add("a copy to the host")
            host = self._host.clone()
            return real["to"](host, dtype=dtype) if dtype is not None else host
        return real["to"](self, *args, **kwargs)

    def copy_(self, src, non_blocking=False):
        _run_deferred()
        if not (isinstance(self, VirtualCudaTensor) or isinstance(src, VirtualCudaTensor)):
            return real["copy_"](self, src, non_blocking)
        if not isinstance(self, VirtualCudaTensor):
            mode.syncs.add("a copy to the host")
        elif not isinstance(src, VirtualCudaTensor) and not non_blocking:
            mode.syncs.add("a blocking copy to the device")
        real["copy_"](getattr(self, "_host", self), getattr(src, "_host", src))
        return self

    def host_read(name):
        def read(self, *args):
            _run_deferred()
            if isinstance(self, VirtualCudaTensor):
                mode.syncs.add(name)
                return real[name](self._host, *args)
            return real[name](self, *args)
        return read

    def numpy(self, *args, **kwargs):
        if isinstance(self, VirtualCudaTensor):
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                            "to host memory first.")
        return real["numpy"](self, *args, **kwargs)

    def index(idx):
        def one(i):
            return i._host if isinstance(i, VirtualCudaTensor) else i
        return tuple(one(i) for i in idx) if isinstance(idx, tuple) else one(idx)

    def indices_on_device(idx) -> bool:
        return any(isinstance(i, VirtualCudaTensor) for i in (idx if isinstance(idx, tuple) else (idx,)))

    def index_syncs(idx) -> None:
        """What indexing a device tensor with ``idx`` waits for on a GPU: index tensors on the host
        (copied to the device, blocking) and boolean masks (their nonzero)."""
        for i in idx if isinstance(idx, tuple) else (idx,):
            if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8):
                mode.syncs.add("indexing with a boolean mask")
            elif isinstance(i, torch.Tensor) and not isinstance(i, VirtualCudaTensor) and i.dim() > 0:
                mode.syncs.add("a blocking copy to the device (host indices)")

    def getitem(self, idx):  # (torch's indexing takes a device guard, which a CPU build cannot give)
        if isinstance(self, VirtualCudaTensor):
            index_syncs(idx)
            if any(isinstance(i, (torch.Tensor, list)) for i in (idx if isinstance(idx, tuple) else (idx,))):
                _run_deferred()  # (a gather on the host memory: a view otherwise)
            return VirtualCudaTensor(real["__getitem__"](self._host, index(idx)))
        if indices_on_device(idx):
            raise RuntimeError("indices on cuda:0 for a tensor on the cpu")
        return real["__getitem__"](self, idx)

    def setitem(self, idx, value):
        _run_deferred()
        if not isinstance(self, VirtualCudaTensor):
            if isinstance(value, VirtualCudaTensor) or indices_on_device(idx):
                raise RuntimeError("a value or indices on cuda:0 written into a tensor on the cpu")
            return real["__setitem__"](self, idx, value)
        index_syncs(idx)
        if isinstance(value, torch.Tensor) and not isinstance(value, VirtualCudaTensor) and value.dim() > 0:
            mode.syncs.add("a blocking copy to the device")
        return real["__setitem__"](self._host, index(idx), getattr(value, "_host", value))

    def contiguous(self, memory_format=torch.contiguous_format):  # (the bindings of this and ~ take a
        if not isinstance(self, VirtualCudaTensor):                # device guard, which a CPU build lacks)
            return real["contiguous"](self, memory_format=memory_format)
        return self if self.is_contiguous(memory_format=memory_format) else self.clone(memory_format=memory_format)

    cuda = torch.cuda
    for name, value in (("_lazy_init", lambda: None), ("is_available", lambda: True), ("device_count", lambda: 1),
                        ("current_device", lambda: 0), ("get_device_name", lambda *a: "virtual CUDA (moespec tests)"),
                        ("get_device_properties", lambda *a: types.SimpleNamespace(
                            name="virtual CUDA", total_memory=80 << 30, multi_processor_count=132, major=9, minor=0)),
                        ("synchronize", lambda *a: None), ("current_stream", lambda *a: _Stream()),
                        ("Stream", _Stream), ("Event", _Event), ("stream", lambda s: contextlib.nullcontext()),
                        ("CUDAGraph", _Graph), ("graph", _graph), ("graph_pool_handle", lambda: None),
                        ("is_current_stream_capturing", lambda: bool(CAPTURING)),
                        ("set_sync_debug_mode", lambda m: setattr(mode.syncs, "debug", m))):
        patch(cuda, name, value)
    patch(torch, "tensor", tensor)
    patch(torch, "Generator", _HostGenerator)
    for name, value in (("to", to), ("cuda", lambda self, *a, **k: to(self, "cuda", **k)), ("copy_", copy_),
                        ("numpy", numpy), ("__getitem__", getitem), ("__setitem__", setitem),
                        ("pin_memory", lambda self, *a: self), ("is_pinned", lambda self, *a: False),
                        ("__invert__", lambda self: torch.bitwise_not(self)), ("contiguous", contiguous)):
        patch(torch.Tensor, name, value)
    for name in ("tolist", "__int__", "__float__", "__bool__", "__index__", "item"):
        patch(torch.Tensor, name, host_read(name))
    proxy = _Native(real_native(), _emulated_module(kernels))
    for module in list(sys.modules.values()):  # every moespec module's `view` and `native` names
        if getattr(module, "__name__", "").startswith("moespec"):
            if getattr(module, "view", None) is real_view:
                patch(module, "view", view)
            if getattr(module, "native", None) is real_native:
                patch(module, "native", lambda: proxy)
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)  # (Module.to: new parameters, not .data =)
    try:
        with mode:
            yield mode
            _run_deferred()
    finally:
        _DEFERRED.clear()
        _HELD.clear()
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


# ---- the pytest plugin (pytest -p virtual_cuda): the whole session on the virtual device ----------------

_session = None


def pytest_configure(config) -> None:
    global _session
    _session = virtual_cuda()
    _session.__enter__()


def pytest_unconfigure(config) -> None:
    if _session is not None:
        _session.__exit__(None, None, None)

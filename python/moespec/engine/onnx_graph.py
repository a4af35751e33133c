"""A small ONNX graph builder: nodes by op name, constants, weights by reference, fresh value names.

:mod:`moespec.engine.onnx_export` writes the target's verify network with it and
:mod:`moespec.engine.onnx_plugins` the reference bodies of moespec's plugin ops; both build
``onnx.NodeProto`` lists through :meth:`Graph.op` so that no file spells protobuf by hand.

Example::

    g = Graph("demo")
    x = g.input("x", onnx.TensorProto.FLOAT, ["tokens", 64])
    y = g.op("Relu", x)
    g.output(y, onnx.TensorProto.FLOAT, ["tokens", 64], name="y")
    model = g.model(opset=OPSET)
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

OPSET = 20  # the default domain's opset (TensorRT 10+ and onnxruntime 1.17+ import it)
PLUGIN_DOMAIN = "moespec"  # the domain of moespec's plugin nodes (TensorRT's parser ignores it)
PLUGIN_DOMAIN_VERSION = 1

ONNX_DTYPES: dict[torch.dtype, int] = {torch.float32: TensorProto.FLOAT, torch.bfloat16: TensorProto.BFLOAT16,
                                       torch.float16: TensorProto.FLOAT16, torch.int64: TensorProto.INT64,
                                       torch.int32: TensorProto.INT32, torch.bool: TensorProto.BOOL}


def tensor_proto(name: str, t: torch.Tensor) -> onnx.TensorProto:
    """``t`` as an ONNX tensor, bytes as they are (bf16 included: its raw 16-bit words)."""
    t = t.detach().contiguous().cpu()
    if t.dtype not in ONNX_DTYPES:
        raise ValueError(f"onnx export: tensor {name!r} has dtype {t.dtype}, which the export does not write")
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    out = onnx.TensorProto(name=name, data_type=ONNX_DTYPES[t.dtype], dims=list(t.shape))
    out.raw_data = raw.numpy().tobytes()
    return out


class Graph:
    """Nodes, initializers, inputs and outputs of one graph (or one function body)."""

    def __init__(self, name: str):
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._count = 0
        self._consts: dict[tuple, str] = {}

    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def op(self, op_type: str, *inputs: Optional[str], outputs: Union[int, Sequence[str]] = 1,
           domain: str = "", **attrs: Any) -> Any:
        """Appends one node; returns its output name, or the list of them when it has several (``outputs``:
        a count, or the names). ``None`` inputs are ONNX's empty optional inputs."""
        names = [self.fresh(op_type.lower()) for _ in range(outputs)] if isinstance(outputs, int) else list(outputs)
        node = helper.make_node(op_type, ["" if i is None else i for i in inputs], names,
                                name=self.fresh("n_" + op_type), domain=domain or None,
                                **{k: v for k, v in attrs.items() if not isinstance(v, onnx.AttributeProto)})
        node.attribute.extend(v for v in attrs.values() if isinstance(v, onnx.AttributeProto))
        self.nodes.append(node)
        return names[0] if len(names) == 1 else names

    def const(self, value: Any, dtype: int = TensorProto.INT64) -> str:
        """A Constant node holding ``value`` (a number or a nested list; ``dtype`` an ONNX type); equal
        constants are made once."""
        key = (repr(value), dtype)
        if key not in self._consts:
            np_dtype = np.float32 if dtype in (TensorProto.BFLOAT16, TensorProto.FLOAT16) else \
                helper.tensor_dtype_to_np_dtype(dtype)
            arr = np.asarray(value, dtype=np_dtype)
            self._consts[key] = self.op("Constant", value=helper.make_tensor(self.fresh("c"), dtype, arr.shape,
                                                                             arr.reshape(-1).tolist()))
        return self._consts[key]

    def attr_const(self, attribute: str, kind: str = "int") -> str:
        """A Constant node holding the calling node's attribute ``attribute`` (function bodies only)."""
        ref = onnx.AttributeProto(name=f"value_{kind}", ref_attr_name=attribute,
                                  type=onnx.AttributeProto.INT if kind == "int" else onnx.AttributeProto.FLOAT)
        return self.op("Constant", value_ref=ref)

    def weight(self, name: str, t: torch.Tensor) -> str:
        """An initializer named ``name`` holding ``t``."""
        self.initializers.append(tensor_proto(name, t))
        return name

    def input(self, name: str, dtype: int, shape: Sequence[Union[int, str]]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, dtype, list(shape)))
        return name

    def output(self, value: str, dtype: int, shape: Sequence[Union[int, str]], name: Optional[str] = None) -> str:
        """Marks ``value`` as a graph output, renamed ``name`` through an Identity when given."""
        if name is not None and name != value:
            value = self.op("Identity", value, outputs=[name])
        self.outputs.append(helper.make_tensor_value_info(value, dtype, list(shape)))
        return value

    def model(self, functions: Sequence[onnx.FunctionProto] = (), opset: int = OPSET) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        opsets = [helper.make_opsetid("", opset), helper.make_opsetid(PLUGIN_DOMAIN, PLUGIN_DOMAIN_VERSION)]
        model = helper.make_model(graph, opset_imports=opsets, functions=list(functions), producer_name="moespec")
        model.ir_version = 10
        return model

    def function(self, name: str, inputs: Sequence[str], outputs: Sequence[str], attributes: Sequence[str],
                 doc: str = "", opset: int = OPSET) -> onnx.FunctionProto:
        """These nodes as the body of function ``name`` in the plugin domain."""
        return helper.make_function(PLUGIN_DOMAIN, name, list(inputs), list(outputs), self.nodes,
                                    [helper.make_opsetid("", opset)], attributes=list(attributes), doc_string=doc)

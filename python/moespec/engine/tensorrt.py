"""``moespec build --backend tensorrt``: the engine folder plus its TensorRT networks, as ONNX with
moespec's plugin nodes, and their plans where TensorRT is installed.

Writes into ``<engine>/tensorrt/``::

    verify.onnx          the verify network (:mod:`moespec.engine.onnx_export`), the engine's budget
                         on its MoE nodes; with no budget it serves prefill and decode too
    prefill.onnx         only with a budget: the same network unbudgeted (prefill is never budgeted),
                         sharing verify's weights file
    weights.onnx.data    the initializers of both (ONNX external data)
    trtexec.sh           the exact trtexec command lines that build the plans
    verify.plan, ...     the serialized plans, when the ``tensorrt`` Python package is importable

Both networks pass ``onnx.checker`` (full check, shape inference) before anything else is written.
The plans need the plugin library ``libmoespec_trt_plugins.so`` (``./build.sh`` with
``TensorRT_ROOT`` set builds it into build/dev/plugins/tensorrt; ``MOESPEC_TRT_PLUGINS`` names
another); a process that runs a plan loads the same library first (TensorRT finds the creators
through its ``getCreators`` entry point). Where ``tensorrt`` is missing (every machine without an
NVIDIA stack), the build says so, writes the commands, and records ``plan: null`` with the reason in
the manifest; it never fails silently.

Optimization profiles (per network, every input): batch 1..``max_batch``, new tokens
1..``max_tokens`` (opt: the engine's tree size + 1), past slots 0..``max_seq_len`` - ``max_tokens``.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import onnx

from moespec.engine.onnx_export import export_verify
from moespec.engine.onnx_plugins import MOE, PLUGIN_VERSION, ROUTE
from moespec.engine.tensors import file_sha256
from moespec.ops import ExpertBudget
from moespec.runtime.attention import cache_shapes

FOLDER = "tensorrt"
DATA = "weights.onnx.data"
PLUGIN_LIBRARY = "libmoespec_trt_plugins.so"
_REPO = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Profile:
    """The shape ranges TensorRT optimizes for."""

    max_batch: int = 8
    max_tokens: int = 128
    max_seq_len: int = 4096
    opt_tokens: int = 9
    opt_past: int = 256

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_tokens", "max_seq_len", "opt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"tensorrt profile: {name} must be >= 1, got {getattr(self, name)}")
        if self.max_tokens >= self.max_seq_len:
            raise ValueError(f"tensorrt profile: max_tokens={self.max_tokens} must be below max_seq_len="
                             f"{self.max_seq_len} (the past holds the rest)")

    def shapes(self, config) -> dict[str, tuple[list[int], list[int], list[int]]]:
        """Input name -> (min, opt, max) shape."""
        opt_t = min(self.opt_tokens, self.max_tokens)
        max_p = self.max_seq_len - self.max_tokens
        opt_p = min(self.opt_past, max_p)
        out = {"input_ids": ([1, 1], [1, opt_t], [self.max_batch, self.max_tokens])}
        out["position_ids"] = out["input_ids"]
        out["attention_mask"] = ([1, 1, 1], [1, opt_t, opt_p + opt_t], [self.max_batch, self.max_tokens,
                                                                         self.max_seq_len])
        kv = dict(zip(("key", "value"), cache_shapes(config)))  # (heads, width): GQA [Hkv, D]; MLA latent, rope key
        for i in range(config.num_layers):
            for kind, (heads, width) in kv.items():
                out[f"past_{kind}_{i}"] = ([1, heads, 0, width], [1, heads, opt_p, width],
                                           [self.max_batch, heads, max_p, width])
        return out


def plugin_library() -> Optional[Path]:
    """The plugin library: ``MOESPEC_TRT_PLUGINS``, else the development build's, else None."""
    given = os.environ.get("MOESPEC_TRT_PLUGINS")
    if given:
        return Path(given).absolute()
    built = _REPO / "build" / "dev" / "plugins" / "tensorrt" / PLUGIN_LIBRARY
    return built if built.is_file() else None


def trtexec_command(network: str, library: Optional[Path], profile: Profile, config) -> list[str]:
    """The trtexec command line that builds ``<network>.plan`` from ``<network>.onnx``, run in the
    engine's tensorrt folder."""
    shapes = profile.shapes(config)

    def spec(i: int) -> str:
        return ",".join(f"{name}:{'x'.join(str(d) for d in dims[i])}" for name, dims in shapes.items())

    lib = str(library) if library is not None else f"<path to {PLUGIN_LIBRARY}>"
    return ["trtexec", f"--onnx={network}.onnx", f"--saveEngine={network}.plan", f"--staticPlugins={lib}",
            "--stronglyTyped",
            f"--minShapes={spec(0)}", f"--optShapes={spec(1)}", f"--maxShapes={spec(2)}"]


def _save(model: onnx.ModelProto, path: Path, shared: Optional[onnx.ModelProto]) -> None:
    """Writes ``model`` to ``path``: its initializers into DATA, or, given ``shared`` (a model saved
    before with the same initializers), pointing at ``shared``'s copies in DATA."""
    if shared is None:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=DATA,
                        size_threshold=0)
        return
    saved = {t.name: t for t in shared.graph.initializer}
    for t in model.graph.initializer:
        if t.name not in saved or list(saved[t.name].dims) != list(t.dims) or saved[t.name].data_type != t.data_type:
            raise ValueError(f"tensorrt export: initializer {t.name!r} differs between the networks")
        t.CopyFrom(saved[t.name])
    onnx.save_model(model, str(path))


def _build_plan(onnx_path: Path, plan: Path, library: Optional[Path], profile: Profile, config) -> dict[str, Any]:
    """Builds and serializes the plan with the tensorrt Python package (strongly typed network)."""
    import tensorrt as trt  # noqa: F401  (the caller checked it imports)

    if library is None:
        raise ValueError(f"tensorrt build: {PLUGIN_LIBRARY} not found (./build.sh with TensorRT_ROOT set builds it; "
                         f"or set MOESPEC_TRT_PLUGINS)")
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    builder.get_plugin_registry().load_library(str(library))
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ValueError(f"tensorrt build: the parser refused {onnx_path.name}: {errors}")
    builder_config = builder.create_builder_config()
    opt = builder.create_optimization_profile()
    for name, (lo, mid, hi) in profile.shapes(config).items():
        opt.set_shape(name, lo, mid, hi)
    builder_config.add_optimization_profile(opt)
    serialized = builder.build_serialized_network(network, builder_config)
    if serialized is None:
        raise ValueError(f"tensorrt build: building {plan.name} failed (TensorRT's log above says why)")
    part = plan.with_name(plan.name + ".part")
    part.write_bytes(bytes(serialized))
    os.replace(part, plan)
    return {"file": f"{FOLDER}/{plan.name}", "bytes": plan.stat().st_size, "sha256": file_sha256(plan),
            "tensorrt_version": trt.__version__}


def write_tensorrt(engine_tmp: Path, target, speculation: dict[str, Any], *, taps: Sequence[int] = (),
                   profile: Profile = Profile(), log=print) -> dict[str, Any]:
    """Exports, checks and (where TensorRT exists) builds the networks of ``target`` into
    ``engine_tmp/tensorrt``, with ``taps`` (the draft head's feature layers) as outputs; returns the
    manifest's ``tensorrt`` section."""
    config = target.config
    folder = engine_tmp / FOLDER
    folder.mkdir()
    budget = ExpertBudget(**speculation["budget"]) if speculation.get("budget") else None
    taps = tuple(int(t) for t in taps)
    networks: dict[str, dict[str, Any]] = {}
    verify = export_verify(config, target.weights, budget=budget, taps=taps)
    _save(verify, folder / "verify.onnx", None)
    networks["verify"] = {"budget": speculation.get("budget")}
    if budget is not None:
        _save(export_verify(config, target.weights, taps=taps), folder / "prefill.onnx", verify)
        networks["prefill"] = {"budget": None}
    for name, entry in networks.items():
        path = folder / f"{name}.onnx"
        onnx.checker.check_model(str(path), full_check=True)
        entry.update(file=f"{FOLDER}/{path.name}", bytes=path.stat().st_size, sha256=file_sha256(path),
                     checker="passed (onnx.checker full_check)")
    library = plugin_library()
    commands = {name: trtexec_command(name, library, profile, config) for name in networks}
    script = folder / "trtexec.sh"
    script.write_text("#!/bin/sh\n# Builds the TensorRT plans of this engine (moespec build --backend tensorrt).\n"
                      "set -e\ncd \"$(dirname \"$0\")\"\n"
                      + "".join(shlex.join(cmd) + "\n" for cmd in commands.values()))
    umask = os.umask(0)
    os.umask(umask)
    script.chmod(0o777 & ~umask)
    (folder / DATA).chmod(0o666 & ~umask)  # onnx writes it private
    try:
        import tensorrt  # noqa: F401

        have_trt, reason = True, None
    except ImportError as exc:
        have_trt, reason = False, f"the tensorrt Python package is not importable here ({exc})"
    for name, entry in networks.items():
        entry["trtexec"] = shlex.join(commands[name])  # run in the tensorrt folder
        if have_trt:
            entry["plan"] = _build_plan(folder / f"{name}.onnx", folder / f"{name}.plan", library, profile, config)
        else:
            entry["plan"] = None
    if not have_trt:
        log(f"moespec build: no TensorRT plan built: {reason}. The ONNX networks and the exact trtexec command lines "
            f"are in {FOLDER}/trtexec.sh (run it where TensorRT {'and ' + PLUGIN_LIBRARY if library is None else ''}"
            f"exist{'s' if library is not None else ''}).")
    return {"folder": FOLDER, "networks": networks, "weights_file": f"{FOLDER}/{DATA}",
            "weights_bytes": (folder / DATA).stat().st_size,
            "plugins": {"library": str(library) if library is not None else None, "namespace": "moespec",
                        "names": [ROUTE, MOE], "version": PLUGIN_VERSION},
            "profile": {name: {"min": lo, "opt": mid, "max": hi}
                        for name, (lo, mid, hi) in list(profile.shapes(config).items())[:3]},
            "plan_status": "built" if have_trt else f"not built: {reason}", "taps": list(taps)}

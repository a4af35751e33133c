"""Engine folders: the manifest, and loading a folder memory-mapped with clear errors for foreign,
partial or corrupt folders.

Implements DESIGN.md "Contracts" -> "Engine folder". Built by :mod:`moespec.engine.build`; the weights
file is :mod:`moespec.engine.tensors`. Layout::

    <engine>/manifest.json        written last: a folder without it is not (yet) an engine
    <engine>/weights.safetensors  the runtime layout (ModelWeights), experts [E, 3 I H] per MoE layer
    <engine>/draft/               optional EAGLE-3 head: config.json + model.safetensors, official names
    <engine>/predictor/           optional expert predictor (cost-aware trees): predictor.json + .safetensors
    <engine>/tokenizer/           optional: the source's tokenizer files
    <engine>/tensorrt/            optional (--backend tensorrt): verify.onnx [+ prefill.onnx], weights.onnx.data,
                                  trtexec.sh, the plans where TensorRT exists (moespec.engine.tensorrt)

Manifest (``format_version`` 1)::

    format, format_version   "moespec-engine", 1
    architecture, dtype      e.g. "Qwen3MoeForCausalLM", "bf16" | "fp32"
    config                   the full ModelConfig (config_to_dict; config_from_dict reads it back exactly)
    layers                   "moe" | "dense" per decoder layer
    weights                  {file, bytes, sha256, data_offset, tensors: {name: {shape, dtype}}}
    summary                  parameters, active_parameters, moe_layers, experts_per_layer, top_k,
                             expert_intermediate_size, bytes_per_expert, expert_bytes, weights_bytes
    draft                    null | {folder, config (Eagle3Config.to_config), aux_layers, parameters,
                             dtype, files: {name: {bytes, sha256}}}
    predictor                (optional) null | {folder, layers, experts, files: {name: {bytes, sha256}}}
    tokenizer                null | {folder, files: {name: {bytes, sha256}}}
    speculation              {policy, depth, top_k, total_tokens, budget: null | {max_experts, policy, coverage, score, exact_layers}}
    backend                  (optional) "runtime" | "tensorrt"
    tensorrt                 (optional) null | {folder, networks: {verify, prefill?: {file, bytes, sha256, budget,
                             checker, trtexec, plan}}, weights_file, plugins, profile, plan_status, taps}
    provenance               {source: {kind, path, files, ...}, draft_source, predictor_source, moespec_version, git_commit,
                             git_dirty, created, command, versions, seeds, build_seconds}
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Sequence, Union

import torch

from moespec.models.config import ModelConfig
from moespec.models.runtime import TargetModel
from moespec.engine.tensors import DTYPE_NAMES, expected_shapes, file_sha256, map_tensors, read_header, unflatten

FORMAT = "moespec-engine"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
DRAFT = "draft"
PREDICTOR = "predictor"
TOKENIZER = "tokenizer"
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}
REBUILD = "rebuild it with `moespec build --model <source> --out <engine folder>`"


# ---- ModelConfig <-> JSON -----------------------------------------------------------------------


def config_to_dict(config: ModelConfig) -> dict[str, Any]:
    """ModelConfig (with its RopeConfig, MoeConfig and RouterSpec) as plain JSON values; tuples become
    lists. :func:`config_from_dict` inverts it exactly (JSON floats round-trip exactly)."""
    return _plain(dataclasses.asdict(config))


def config_from_dict(data: Any, where: str = "config") -> ModelConfig:
    """The ModelConfig of :func:`config_to_dict`'s output; ValueError naming a missing, unknown or
    mistyped field (``where`` prefixes the field path)."""
    return _build(ModelConfig, data, where)


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"{where}.{name}: missing")
            continue
        kwargs[name] = _value(hints[name], data[name], f"{where}.{name}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def _value(hint: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        return _value(hint, value, where)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if origin is tuple:
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        item = args[0] if args else Any
        return tuple(_value(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{where}: expected one of {list(args)}, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected a string, got {value!r}")
        return value
    return value


# ---- recognising and reading folders ------------------------------------------------------------


def is_engine_folder(path: Union[str, Path]) -> bool:
    """True when ``path`` is a folder that is, or looks like the remains of, an engine folder: it has a
    manifest.json, or a weights.safetensors without a config.json. :func:`load_engine` then loads it
    or says what is wrong with it. Reads no file."""
    p = Path(path)
    if not p.is_dir():
        return False
    return (p / MANIFEST).is_file() or ((p / WEIGHTS).is_file() and not (p / "config.json").is_file())


def _not_an_engine(folder: Path) -> ValueError:
    if (folder / WEIGHTS).is_file():
        return ValueError(f"{folder}: partial engine folder: {WEIGHTS} without {MANIFEST} (an interrupted build or "
                          f"copy?); {REBUILD}")
    if (folder / "config.json").is_file():
        return ValueError(f"{folder}: not a moespec engine folder (no {MANIFEST}); it looks like a Hugging Face "
                          f"checkpoint folder: build an engine from it with `moespec build --model {folder} --out "
                          f"<engine folder>`, or load it directly with moespec.models.load")
    return ValueError(f"{folder}: not a moespec engine folder (no {MANIFEST})")


def read_manifest(folder: Union[str, Path]) -> dict[str, Any]:
    """The checked manifest of an engine folder (format, version, required sections).

    ValueError for a missing folder or manifest (saying what the folder looks like instead), invalid
    JSON, another format or a newer format version.
    """
    folder = Path(folder)
    if not folder.exists():
        raise ValueError(f"engine folder {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder (an engine is a folder with {MANIFEST}; build one with "
                         f"`moespec build`)")
    path = folder / MANIFEST
    if not path.is_file():
        raise _not_an_engine(folder)
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: corrupt manifest, not valid JSON ({exc}); {REBUILD}") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path}: corrupt manifest, expected a JSON object")
    fmt = manifest.get("format")
    if fmt != FORMAT:
        raise ValueError(f"{path}: not a moespec engine manifest: format is {fmt!r}, expected {FORMAT!r}")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f"{path}: format_version must be an integer >= 1, got {version!r}")
    if version > FORMAT_VERSION:
        raise ValueError(f"{path}: engine format version {version} was written by a newer moespec; this one reads "
                         f"versions up to {FORMAT_VERSION}: upgrade moespec, or {REBUILD}")
    for key in ("architecture", "dtype", "config", "weights", "summary", "speculation", "provenance"):
        if key not in manifest:
            raise ValueError(f"{path}: corrupt manifest, section {key!r} is missing; {REBUILD}")
    if manifest["dtype"] not in DTYPES:
        raise ValueError(f"{path}: dtype must be one of {sorted(DTYPES)}, got {manifest['dtype']!r}")
    return manifest


@dataclass
class EngineInfo:
    """What :func:`load_engine` read besides the weights."""

    folder: Path
    manifest: dict[str, Any]
    config: ModelConfig
    dtype: str  # the engine's dtype, "bf16" | "fp32"
    draft_folder: Optional[Path]  # an official EAGLE-3 folder (moespec.spec.eagle3.load_eagle3 reads it)
    predictor_folder: Optional[Path]  # an expert predictor (moespec.spec.expert_predictor.ExpertPredictor.load)
    tokenizer_folder: Optional[Path]
    speculation: dict[str, Any]  # SpeculativeConfig keyword arguments (see engine_defaults)
    mapped: bool  # the weights are views of the memory-mapped file (False when converted to another dtype)

    @property
    def summary(self) -> dict[str, Any]:
        return self.manifest["summary"]

    @property
    def provenance(self) -> dict[str, Any]:
        return self.manifest["provenance"]

    def expert_predictor(self):
        """The engine's expert predictor, checked against its target; ValueError when it has none."""
        from moespec.spec.expert_predictor import ExpertPredictor

        if self.predictor_folder is None:
            raise ValueError(f"engine {self.folder} has no expert predictor (a cost-aware tree needs one): train one "
                             f"with `moespec analyze predictor --engine {self.folder} --dataset <jsonl> --out <dir>` "
                             f"and rebuild with `moespec build ... --predictor <dir>`")
        predictor = ExpertPredictor.load(self.predictor_folder)
        predictor.check_target(self.config)
        return predictor


def _side_folder(folder: Path, manifest: dict[str, Any], key: str, verify: bool = False) -> Optional[Path]:
    """The draft, predictor or tokenizer folder the manifest names, checked file by file: present, of the
    manifest's size and (``verify``) of its sha256."""
    entry = manifest.get(key)
    if entry is None:
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("folder"), str):
        raise ValueError(f"{folder / MANIFEST}: corrupt manifest, section {key!r} must be null or an object with "
                         f"a 'folder'")
    side = folder / entry["folder"]
    if not side.is_dir():
        raise ValueError(f"{folder}: the manifest names a {key} folder {entry['folder']!r}, which is missing (a "
                         f"partial copy of the engine folder?); {REBUILD}")
    for name, info in (entry.get("files") or {}).items():
        path = side / name
        if not path.is_file():
            raise ValueError(f"{folder}: {key} file {entry['folder']}/{name} is missing; {REBUILD}")
        if isinstance(info, dict) and info.get("bytes") is not None and path.stat().st_size != info["bytes"]:
            raise ValueError(f"{folder}: {key} file {entry['folder']}/{name} has {path.stat().st_size} bytes, the "
                             f"manifest says {info['bytes']} (truncated or replaced?); {REBUILD}")
        if verify and isinstance(info, dict) and info.get("sha256") and file_sha256(path) != info["sha256"]:
            raise ValueError(f"{folder}: {key} file {entry['folder']}/{name}: sha256 differs from the manifest's "
                             f"(corrupt or replaced); {REBUILD}")
    return side


def speculation_kwargs(spec: Any, where: str = "speculation") -> dict[str, Any]:
    """The manifest's speculation section as SpeculativeConfig keyword arguments (budget an ExpertBudget)."""
    from moespec.ops import ExpertBudget

    if not isinstance(spec, dict):
        raise ValueError(f"{where}: expected a JSON object, got {spec!r}")
    out = {k: spec[k] for k in ("policy", "depth", "top_k", "total_tokens") if k in spec}
    budget = spec.get("budget")
    if isinstance(budget, dict):
        try:
            budget = ExpertBudget(**budget)
        except TypeError as exc:
            raise ValueError(f"{where}.budget: {exc}") from None
    out["budget"] = budget
    return out


def engine_defaults(folder: Union[str, Path]) -> tuple[Optional[Path], Optional[Path], dict[str, Any]]:
    """(draft folder or None, tokenizer folder or None, speculation) of an engine folder, where
    ``speculation`` holds SpeculativeConfig keyword arguments (``SpeculativeConfig(**speculation)``:
    policy, depth, top_k, total_tokens, budget as an ExpertBudget or None). Reads the manifest only."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    spec = speculation_kwargs(manifest["speculation"], f"{folder / MANIFEST}: speculation")
    return _side_folder(folder, manifest, "draft"), _side_folder(folder, manifest, "tokenizer"), spec


def engine_predictor(folder: Union[str, Path], config: ModelConfig):
    """The expert predictor shipped in an engine folder (checked against ``config``), or None."""
    from moespec.spec.expert_predictor import ExpertPredictor

    folder = Path(folder)
    path = _side_folder(folder, read_manifest(folder), PREDICTOR)
    if path is None:
        return None
    predictor = ExpertPredictor.load(path)
    predictor.check_target(config)
    return predictor


def load_engine(folder: Union[str, Path], *, dtype: Optional[Literal["bf16", "fp32"]] = None, taps: Sequence[int] = (),
                moe_impl: Optional[str] = None, verify: bool = False,
                device: Union[str, "torch.device"] = "cpu") -> tuple[TargetModel, EngineInfo]:
    """Loads an engine folder: the target model over a memory map of its weights file, and its info.

    Every tensor is a view into one private (copy-on-write) mapping of ``weights.safetensors``: loading
    reads only the headers, pages come in on first use, and the MoE experts of a layer are the file's
    own [E, 3 I H] tensor. Checks, each a ValueError naming the problem: a folder with a manifest of
    this format and a version this moespec reads; the weights file present, not truncated, and holding
    exactly the tensors the manifest and the config call for with their shapes and dtype; the draft
    and tokenizer files the manifest names present.

    Parameters
    ----------
    dtype : {"bf16", "fp32"}, optional
        Default: the engine's own (memory-mapped). Another dtype converts every tensor in memory,
        exactly as loading the source checkpoint in that dtype would.
    taps, moe_impl, device
        As :func:`moespec.models.load`.
    verify : bool
        Also check the sha256 of the weights file and of every draft, predictor and tokenizer file against
        the manifest (reads them whole); without it sizes are checked.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    where = folder / MANIFEST
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"load_engine: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    config = config_from_dict(manifest["config"], f"{where}: config")
    if config.architecture != manifest["architecture"]:
        raise ValueError(f"{where}: architecture {manifest['architecture']!r} disagrees with config.architecture "
                         f"{config.architecture!r}")
    engine_dtype = DTYPES[manifest["dtype"]]
    wmeta = manifest["weights"]
    if not isinstance(wmeta, dict) or not isinstance(wmeta.get("tensors"), dict):
        raise ValueError(f"{where}: corrupt manifest, 'weights' must be an object with 'tensors'; {REBUILD}")
    path = folder / wmeta.get("file", "")
    if not path.is_file():
        raise ValueError(f"{folder}: weights file {wmeta.get('file')!r} is missing (a partial engine folder?); "
                         f"{REBUILD}")
    header = read_header(path)
    if wmeta.get("bytes") is not None and header.file_size != wmeta["bytes"]:
        raise ValueError(f"{path}: {header.file_size} bytes, the manifest says {wmeta['bytes']} (truncated or "
                         f"replaced?); {REBUILD}")
    _check_tensors(path, header.tensors, wmeta["tensors"], expected_shapes(config), DTYPE_NAMES[engine_dtype])
    if verify:
        digest = file_sha256(path)
        if digest != wmeta.get("sha256"):
            raise ValueError(f"{path}: sha256 {digest} differs from the manifest's {wmeta.get('sha256')} (corrupt or "
                             f"replaced); {REBUILD}")
    draft = _side_folder(folder, manifest, "draft", verify)
    predictor = _side_folder(folder, manifest, "predictor", verify)
    tokenizer = _side_folder(folder, manifest, "tokenizer", verify)
    spec = speculation_kwargs(manifest["speculation"], f"{where}: speculation")
    tensors = map_tensors(path, header)
    torch_dtype = engine_dtype if dtype is None else DTYPES[dtype]
    mapped = torch_dtype == engine_dtype
    if not mapped:
        tensors = {k: v.to(torch_dtype) for k, v in tensors.items()}
    from moespec.models import check_device

    weights = unflatten(config, tensors, torch_dtype).to(check_device(device))
    model = TargetModel(config, weights, taps=taps, moe_impl=moe_impl)
    info = EngineInfo(folder=folder, manifest=manifest, config=config, dtype=manifest["dtype"] if mapped else dtype,
                      draft_folder=draft, predictor_folder=predictor, tokenizer_folder=tokenizer, speculation=spec,
                      mapped=mapped)
    return model, info


def _check_tensors(path: Path, in_file: dict[str, dict], in_manifest: dict[str, Any],
                   expected: dict[str, tuple[int, ...]], dtype_name: str) -> None:
    """The file, the manifest and the config must agree on every tensor's name, shape and dtype."""
    for name, shape in expected.items():
        if name not in in_manifest:
            raise ValueError(f"{path.parent / MANIFEST}: tensor {name!r}, which the config calls for, is not in the "
                             f"manifest; {REBUILD}")
        if name not in in_file:
            raise ValueError(f"{path}: tensor {name!r} is missing from the weights file (a partial or damaged engine "
                             f"folder); {REBUILD}")
        listed = in_manifest[name]
        if not isinstance(listed, dict) or [int(d) for d in listed.get("shape", [])] != list(shape):
            got = listed.get("shape") if isinstance(listed, dict) else listed
            raise ValueError(f"{path.parent / MANIFEST}: tensor {name!r} has shape {got} in the manifest, the config "
                             f"calls for {list(shape)}")
        if list(in_file[name]["shape"]) != list(shape):
            raise ValueError(f"{path}: tensor {name!r} has shape {in_file[name]['shape']} in the weights file, the "
                             f"manifest says {list(shape)}; {REBUILD}")
        for what, got in (("weights file", in_file[name]["dtype"]), ("manifest", listed.get("dtype"))):
            if got != dtype_name:
                raise ValueError(f"{path}: tensor {name!r} has dtype {got} in the {what}, the engine's dtype is "
                                 f"{dtype_name}")
    for what, names in (("weights file", in_file), ("manifest", in_manifest)):
        extra = sorted(set(names) - set(expected))
        if extra:
            raise ValueError(f"{path}: the {what} lists tensors the config does not call for: {', '.join(extra[:4])}; "
                             f"{REBUILD}")

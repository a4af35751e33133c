"""Engine folders (DESIGN.md "Contracts" -> "Engine folder"): ``moespec build`` writes one, the runtime
loads it memory-mapped.

Example::

    from moespec.engine import build_engine, load_engine
    build_engine("path/to/Qwen3MoeForCausalLM-folder", "engines/qwen3", draft="path/to/eagle3", dtype="bf16")
    model, info = load_engine("engines/qwen3")      # TargetModel over a memory map of weights.safetensors
    info.summary["bytes_per_expert"], info.draft_folder, info.speculation

Modules: :mod:`~moespec.engine.folder` (layout, manifest, loading and its checks),
:mod:`~moespec.engine.tensors` (the weights file), :mod:`~moespec.engine.build` (the build and the
``moespec build`` command line), :mod:`~moespec.engine.gguf` (GGUF sources).
"""

from moespec.engine.build import BuildResult, build_engine, format_summary, main, set_default_model, summarize
from moespec.engine.folder import (
    FORMAT, FORMAT_VERSION, EngineInfo, config_from_dict, config_to_dict, engine_defaults, is_engine_folder,
    load_engine, read_manifest,
)

__all__ = [
    "FORMAT", "FORMAT_VERSION", "BuildResult", "EngineInfo", "build_engine", "config_from_dict", "config_to_dict",
    "engine_defaults", "format_summary", "is_engine_folder", "load_engine", "main", "read_manifest",
    "set_default_model", "summarize",
]

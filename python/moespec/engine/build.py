"""``moespec build``: a Hugging Face folder or a GGUF file (plus an optional EAGLE-3 head) -> an engine
folder (DESIGN.md "Contracts" -> "Engine folder"; layout and manifest in :mod:`moespec.engine.folder`).

    moespec build --model <HF folder | GGUF file | default> [--draft <EAGLE-3 folder>] --out <engine>
                  [--dtype bf16|fp32] [--policy ar|eagle3|eagle3+budget] [--depth D] [--top-k K]
                  [--total-tokens M] [--budget B] [--backend runtime|tensorrt] [--force] [--quiet]

The weights go through the runtime's own loader (:func:`moespec.models.load` in the requested dtype),
so an engine holds exactly the tensors a run from the source would use. Everything is written into a
hidden temporary folder next to ``--out``, ``manifest.json`` last, then renamed into place: a crashed
build never leaves a folder that looks complete. The build draws no random numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Sequence, Union

import torch

from moespec.engine.folder import (
    DRAFT, DTYPES, FORMAT, FORMAT_VERSION, MANIFEST, PREDICTOR, TOKENIZER, WEIGHTS, config_from_dict, config_to_dict,
    is_engine_folder,
)
from moespec.engine.gguf import gguf_metadata, gguf_to_hf, is_gguf_file
from moespec.engine.tensors import ALIGN, DTYPE_NAMES, expected_shapes, file_sha256, flatten, read_header, \
    write_safetensors

# Files of a Hugging Face folder that make up its tokenizer (what AutoTokenizer.from_pretrained reads).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
                   "chat_template.json")
TOKENIZER_DIRS = ("additional_chat_templates",)
BACKENDS = ("runtime", "tensorrt")  # what --backend builds: the runtime's folder, plus TensorRT networks

# ``--model default``: a callable (scratch folder) -> a Hugging Face folder or GGUF file, or a pair
# (model, EAGLE-3 folder or None). Set with :func:`set_default_model`.
DefaultModel = Callable[[Path], Union[Path, tuple[Path, Optional[Path]]]]
_default_model: Optional[DefaultModel] = None


def set_default_model(provider: Optional[DefaultModel]) -> None:
    """Registers what ``--model default`` builds: ``provider(scratch)`` returns a Hugging Face folder or
    GGUF file (or ``(model, draft_folder_or_None)``); ``scratch`` is a folder it may write into, deleted
    after the build."""
    global _default_model
    _default_model = provider


@dataclass
class BuildResult:
    folder: Path
    manifest: dict[str, Any]
    seconds: float


# ---- the build ----------------------------------------------------------------------------------


def build_engine(model: Union[str, Path], out: Union[str, Path], *, draft: Union[str, Path, None] = None,
                 dtype: Literal["bf16", "fp32"] = "bf16", speculation: Optional[dict[str, Any]] = None,
                 force: bool = False, progress: bool = True, command: Optional[Sequence[str]] = None,
                 predictor: Union[str, Path, None] = None, backend: Literal["runtime", "tensorrt"] = "runtime",
                 tensorrt_profile: Optional[Any] = None) -> BuildResult:
    """Builds the engine folder ``out`` from ``model`` (a Hugging Face folder, a GGUF file or
    ``"default"``), an optional EAGLE-3 head folder ``draft`` and an optional expert predictor
    folder ``predictor`` (``moespec analyze predictor --out``; checked against the target).
    ``backend="tensorrt"`` adds the TensorRT networks (ONNX with moespec's plugin nodes, and their
    plans where TensorRT is installed; :mod:`moespec.engine.tensorrt`), shaped by
    ``tensorrt_profile`` (a :class:`moespec.engine.tensorrt.Profile`).

    ``speculation`` holds SpeculativeConfig keyword arguments (policy, depth, top_k, total_tokens,
    budget: an int or ExpertBudget) for the engine's default policy; the policy defaults to
    "eagle3+budget" with a budget, "eagle3" with a draft, else "ar". ``force`` replaces an existing
    engine folder (never a folder that is not one). Raises ValueError naming the problem.
    """
    start = time.perf_counter()
    if dtype not in DTYPES:
        raise ValueError(f"build: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if backend not in BACKENDS:
        raise ValueError(f"build: backend must be one of {list(BACKENDS)}, got {backend!r}")
    out = Path(out).absolute()
    for p in (model, draft):
        if p is not None and str(p) != "default" and (Path(p).resolve() == out.resolve()
                                                      or out.resolve() in Path(p).resolve().parents):
            raise ValueError(f"--out {out} would replace the source {p}: choose another output folder")
    _check_out(out, force)
    spec_args = dict(speculation or {})
    if str(model) != "default":  # (the default model may bring its own draft head)
        _check_speculation_args(spec_args, draft is not None)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would make the engine private to its builder
    try:
        source, draft_path, predictor, source_info = _resolve_source(model, draft, predictor, tmp, dtype, progress)
        _check_speculation_args(spec_args, draft_path is not None)
        from moespec.models import load

        target = load(source, dtype, progress=progress)
        config = target.config
        if config_from_dict(json.loads(json.dumps(config_to_dict(config)))) != config:  # a field JSON cannot hold
            raise ValueError("build: the model config does not survive the JSON round trip (update "
                             "moespec.engine.folder.config_to_dict)")
        spec = _speculation(spec_args, draft_path is not None, config)
        from moespec.config import policy_spec

        if policy_spec(spec["policy"]).selector == "cost_aware" and predictor is None:
            raise ValueError(f"--policy {spec['policy']} needs an expert predictor: pass --predictor <folder> "
                             "(moespec analyze predictor --engine ... --out <folder>)")
        draft_entry = _write_draft(draft_path, target, tmp / DRAFT, dtype) if draft_path is not None else None
        predictor_entry = _copy_predictor(predictor, target, tmp / PREDICTOR) if predictor is not None else None
        tensors = flatten(config, target.weights)
        sha = write_safetensors(tmp / WEIGHTS, tensors, metadata={"format": "pt", "moespec": FORMAT},
                                progress=progress)
        header = read_header(tmp / WEIGHTS)
        tokenizer_entry = _copy_tokenizer(source, tmp / TOKENIZER, source_info)
        tensorrt_entry = None
        if backend == "tensorrt":
            from moespec.engine.tensorrt import Profile, write_tensorrt

            taps = draft_entry["aux_layers"] if draft_entry is not None else ()
            tensorrt_entry = write_tensorrt(tmp, target, spec, taps=taps, profile=tensorrt_profile or Profile(),
                                            log=lambda msg: print(msg, file=sys.stderr))
        for scratch in (".source", ".default"):  # a GGUF's dequantized copy, the default model's scratch
            shutil.rmtree(tmp / scratch, ignore_errors=True)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "architecture": config.architecture,
            "dtype": dtype,
            "config": config_to_dict(config),
            "layers": ["moe" if config.is_moe_layer(i) else "dense" for i in range(config.num_layers)],
            "weights": {
                "file": WEIGHTS, "bytes": header.file_size, "sha256": sha, "data_offset": header.data_start,
                "alignment": ALIGN, "order": "layers.*.experts first, then each layer's other tensors, embed, "
                                             "final_norm, lm_head",
                "tensors": {name: {"shape": list(t.shape), "dtype": DTYPE_NAMES[t.dtype]}
                            for name, t in tensors.items()},
            },
            "summary": summarize(config, dtype, header.file_size),
            "draft": draft_entry,
            "predictor": predictor_entry,
            "tokenizer": tokenizer_entry,
            "speculation": spec,
            "backend": backend,
            "tensorrt": tensorrt_entry,
            "provenance": _provenance(source_info, draft_path, command, start, predictor),
        }
        del tensors, target
        _write_json(tmp / MANIFEST, manifest)  # last: its presence marks a complete folder
        _fsync_dir(tmp)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return BuildResult(out, manifest, time.perf_counter() - start)


def _check_out(out: Path, force: bool) -> None:
    if not out.exists():
        return
    if not force:
        raise ValueError(f"--out {out} already exists: pass --force to replace it, or choose another folder")
    if not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder; refusing to replace it")
    if any(out.iterdir()) and not is_engine_folder(out):
        raise ValueError(f"--out {out} exists and is not a moespec engine folder; refusing to replace it even with "
                         f"--force (delete it yourself if you mean to)")


def _move_into_place(tmp: Path, out: Path) -> None:
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(out.parent)


def _write_json(path: Path, obj: Any) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "w") as f:
        f.write(json.dumps(obj, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- sources ------------------------------------------------------------------------------------


def _resolve_source(model: Union[str, Path], draft: Union[str, Path, None], predictor: Union[str, Path, None],
                    tmp: Path, dtype: str,
                    progress: bool) -> tuple[Path, Optional[Path], Union[str, Path, None], dict[str, Any]]:
    """(Hugging Face folder to load, draft folder or None, expert predictor folder or None, provenance
    of the source). The default model may bring its own draft head and predictor."""
    kind = "huggingface"
    if str(model) == "default":
        provider = _default_model
        if provider is None:  # the embedded default (moespec.default_model): derived and cached on first use
            from moespec.default_model.pipeline import provide

            provider = lambda scratch: provide(scratch, progress=progress)  # noqa: E731
        given = provider(tmp / ".default")
        model, default_draft, default_predictor = (tuple(given) + (None,) * 2)[:3] if isinstance(given, tuple) \
            else (given, None, None)
        draft = draft if draft is not None else default_draft
        predictor = predictor if predictor is not None else default_predictor
        kind = "default"
    path = Path(model).absolute()
    draft_path = Path(draft).absolute() if draft is not None else None
    if draft_path is not None and not draft_path.is_dir():
        raise ValueError(f"--draft {draft}: not a folder (an EAGLE-3 head folder holds config.json and its weights)")
    if not path.exists():
        raise ValueError(f"--model {model}: no such file or folder")
    if path.is_file():
        if not is_gguf_file(path):
            raise ValueError(f"--model {model}: a file that is not GGUF (no GGUF magic); pass a GGUF file or a "
                             f"Hugging Face checkpoint folder")
        info = {"kind": "gguf" if kind != "default" else "default-gguf", "path": str(path),
                "files": {path.name: _file_info(path, progress)}, "gguf": gguf_metadata(path)}
        info["gguf"]["conversion"] = gguf_to_hf(path, tmp / ".source", DTYPES[dtype], progress=progress)
        info["config"] = json.loads((tmp / ".source" / "config.json").read_text())  # (export-hf writes it back)
        return tmp / ".source", draft_path, predictor, info
    if is_engine_folder(path):
        raise ValueError(f"--model {model}: this is a moespec engine folder already; build from its source (a Hugging "
                         f"Face folder or GGUF file), or load it directly")
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {model}: not a Hugging Face checkpoint folder (no config.json)")
    files = ["config.json"] + _weight_files(path)
    info = {"kind": kind, "path": str(path), "files": {f: _file_info(path / f, progress) for f in files},
            "config": json.loads((path / "config.json").read_text())}
    return path, draft_path, predictor, info


def _weight_files(folder: Path) -> list[str]:
    """The safetensors files moespec.models.load reads (index + shards, or model.safetensors)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as exc:
            raise ValueError(f"{index}: not a safetensors index ({exc!r})") from None
        return [index.name] + [s for s in shards if (folder / s).is_file()]
    return ["model.safetensors"] if (folder / "model.safetensors").is_file() else []


def _file_info(path: Path, progress: bool) -> dict[str, Any]:
    st = path.stat()
    return {"bytes": st.st_size, "mtime": datetime.datetime.fromtimestamp(st.st_mtime, datetime.timezone.utc)
            .isoformat(timespec="seconds"), "sha256": file_sha256(path, progress=progress)}


# ---- speculation, draft, tokenizer --------------------------------------------------------------


def _check_speculation_args(args: dict[str, Any], has_draft: bool) -> None:
    unknown = sorted(set(args) - {"policy", "depth", "top_k", "total_tokens", "budget"})
    if unknown:
        raise ValueError(f"build: unknown speculation settings {unknown}")
    from moespec.config import policy_spec

    policy = args.get("policy")
    if policy is not None and policy_spec(policy).speculative and not has_draft:
        raise ValueError(f"--policy {policy} needs an EAGLE-3 draft head: pass --draft <folder>")


def _speculation(args: dict[str, Any], has_draft: bool, config) -> dict[str, Any]:
    """The manifest's default policy, checked by SpeculativeConfig itself and against the model."""
    from moespec.spec.llm import SpeculativeConfig

    defaults = SpeculativeConfig("ar")
    budget = args.get("budget")
    from moespec.config import default_policy

    policy = args.get("policy") or default_policy(has_draft=has_draft, budget=budget)
    spec = SpeculativeConfig(policy, depth=args.get("depth") or defaults.depth,
                             top_k=args.get("top_k") or defaults.top_k,
                             total_tokens=args.get("total_tokens") or defaults.total_tokens, budget=budget)
    if spec.budget is not None:
        if config.moe is None:
            raise ValueError(f"--budget: the model ({config.architecture}) is dense, an expert budget has nothing to "
                             f"cap (use --policy eagle3)")
        if spec.budget.max_experts < config.moe.top_k:
            raise ValueError(f"--budget {spec.budget.max_experts}: below the model's top-k ({config.moe.top_k}); one "
                             f"token alone needs {config.moe.top_k} experts")
    return {"policy": spec.policy, "depth": spec.depth, "top_k": spec.top_k, "total_tokens": spec.total_tokens,
            "budget": dataclasses.asdict(spec.budget) if spec.budget is not None else None}


def _write_draft(source: Path, target, folder: Path, dtype: str) -> dict[str, Any]:
    """Loads the head for ``target`` (checks it fits) and writes it in official EAGLE-3 form, in the
    engine's dtype: config.json (Eagle3Config.to_config) + model.safetensors."""
    from safetensors.torch import save_file

    from moespec.spec.eagle3 import load_eagle3

    head = load_eagle3(source, target)
    tensors = dict(head.official_state_dict())
    if head.config.draft_vocab_size == head.config.vocab_size and bool(head.d2t.any()):
        tensors["d2t"], tensors["t2d"] = head.d2t, head.t2d  # a permuted full vocabulary: keep the mapping
    embed = target.weights.embed
    own_embed = head.embed.shape != embed.shape or not torch.equal(head.embed, embed)
    if own_embed:
        tensors["embed_tokens.weight"] = head.embed
    folder.mkdir()
    config = head.config.to_config()
    config["torch_dtype"] = {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    files = {name: {"bytes": (folder / name).stat().st_size, "sha256": file_sha256(folder / name)}
             for name in ("config.json", "model.safetensors")}
    return {"folder": DRAFT, "config": head.config.to_config(), "aux_layers": list(head.config.aux_layers),
            "draft_vocab_size": head.config.draft_vocab_size, "own_embedding": own_embed,
            "parameters": sum(p.numel() for p in head.parameters()) + (embed.numel() if own_embed else 0),
            "dtype": dtype, "files": files}


def _copy_predictor(source: Union[str, Path], target, folder: Path) -> dict[str, Any]:
    """Checks the expert predictor fits the target and copies its two files."""
    from moespec.spec.expert_predictor import ExpertPredictor

    predictor = ExpertPredictor.load(source)
    predictor.check_target(target.config)
    folder.mkdir()
    files = {}
    for name in ("predictor.json", "predictor.safetensors"):
        shutil.copy2(Path(source) / name, folder / name)
        files[name] = {"bytes": (folder / name).stat().st_size, "sha256": file_sha256(folder / name)}
    return {"folder": PREDICTOR, "layers": predictor.num_layers, "experts": predictor.num_experts, "files": files}


def _copy_tokenizer(source: Path, folder: Path, info: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Copies the source's tokenizer files (if it has a tokenizer) and checks that they load alone."""
    names = [n for n in TOKENIZER_FILES if (source / n).is_file()]
    if not any(n in names for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    folder.mkdir()
    for name in names:
        shutil.copy2(source / name, folder / name)
    for name in TOKENIZER_DIRS:
        if (source / name).is_dir():
            shutil.copytree(source / name, folder / name)
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # the engine still works with token-id prompts
        shutil.rmtree(folder)
        info["tokenizer_error"] = f"{type(exc).__name__}: {exc}"
        print(f"moespec build: warning: the tokenizer does not load on its own ({exc}); the engine has none",
              file=sys.stderr)
        return None
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        files[str(path.relative_to(folder))] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    return {"folder": TOKENIZER, "files": files}


# ---- summary and provenance ---------------------------------------------------------------------


def summarize(config, dtype: str, weights_bytes: int) -> dict[str, Any]:
    """Parameter counts and expert sizes. ``active_parameters`` counts what one token uses: everything
    but the (E - K) experts it is not routed to in each MoE layer (embedding and lm_head included)."""
    shapes = expected_shapes(config)
    total = 0
    for shape in shapes.values():
        n = 1
        for d in shape:
            n *= d
        total += n
    item = DTYPES[dtype].itemsize
    out: dict[str, Any] = {"parameters": total, "active_parameters": total, "layers": config.num_layers,
                           "moe_layers": len(config.moe_layers),
                           "dense_layers": config.num_layers - len(config.moe_layers),
                           "experts_per_layer": 0, "top_k": 0, "experts_total": 0, "expert_intermediate_size": 0,
                           "parameters_per_expert": 0, "bytes_per_expert": 0, "expert_bytes": 0,
                           "weights_bytes": weights_bytes}
    if config.moe is not None:
        E, K, I, H = config.moe.num_experts, config.moe.top_k, config.moe.intermediate_size, config.hidden_size
        per_expert = 3 * I * H
        out.update(active_parameters=total - len(config.moe_layers) * (E - K) * per_expert, experts_per_layer=E,
                   top_k=K, experts_total=E * len(config.moe_layers), expert_intermediate_size=I,
                   parameters_per_expert=per_expert, bytes_per_expert=per_expert * item,
                   expert_bytes=per_expert * item * E * len(config.moe_layers))
    return out


def _git(*args: str) -> Optional[str]:
    try:
        run = subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return run.stdout.strip() if run.returncode == 0 else None


def _provenance(source: dict[str, Any], draft: Optional[Path], command: Optional[Sequence[str]],
                start: float, predictor: Union[str, Path, None] = None) -> dict[str, Any]:
    import safetensors
    import transformers

    import moespec

    from importlib.metadata import PackageNotFoundError, version

    try:
        gguf_version = version("gguf")
    except PackageNotFoundError:
        gguf_version = None
    commit = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    draft_info = None
    if draft is not None:
        files = [f for f in ("config.json", "model.safetensors", "pytorch_model.bin") if (draft / f).is_file()]
        draft_info = {"path": str(draft), "files": {f: _file_info(draft / f, False) for f in files}}
    return {
        "source": source,
        "draft_source": draft_info,
        "predictor_source": {"path": str(Path(predictor).absolute())} if predictor is not None else None,
        "moespec_version": moespec.__version__,
        "git_commit": commit,
        "git_dirty": bool(dirty) if dirty is not None else None,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": list(command) if command is not None else list(sys.argv),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "safetensors": safetensors.__version__,
                     "gguf": gguf_version},
        "seeds": {},  # the build draws no random numbers
        "build_seconds": round(time.perf_counter() - start, 3),
    }


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def _count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(int(n))


def format_summary(result: BuildResult) -> str:
    """The human summary ``moespec build`` prints."""
    m, s = result.manifest, result.manifest["summary"]
    c, src = m["config"], m["provenance"]["source"]
    src_bytes = sum(f["bytes"] for f in src["files"].values())
    out_bytes = sum(p.stat().st_size for p in result.folder.rglob("*") if p.is_file())
    files = sum(1 for p in result.folder.rglob("*") if p.is_file())
    lines = [
        f"engine        {result.folder} ({m['dtype']}, format {m['format']} v{m['format_version']})",
        f"source        {src['kind']} {src['path']} ({_size(src_bytes)})",
        f"architecture  {m['architecture']}: {s['layers']} layers ({s['moe_layers']} MoE, {s['dense_layers']} dense), "
        f"hidden {c['hidden_size']}, vocabulary {c['vocab_size']}",
        f"parameters    {_count(s['parameters'])} total, {_count(s['active_parameters'])} active per token",
    ]
    if s["moe_layers"]:
        lines.append(f"experts       {s['experts_per_layer']} per MoE layer x {s['moe_layers']} layers, "
                     f"top-{s['top_k']}, {_size(s['bytes_per_expert'])} per expert "
                     f"({s['parameters_per_expert']} parameters), {_size(s['expert_bytes'])} of experts")
    else:
        lines.append("experts       none (dense model)")
    d = m["draft"]
    lines.append(f"draft head    EAGLE-3, {_count(d['parameters'])} parameters, taps {tuple(d['aux_layers'])}, draft "
                 f"vocabulary {d['draft_vocab_size']}" if d else "draft head    none")
    sp = m["speculation"]
    budget = f", budget {sp['budget']['max_experts']}" if sp["budget"] else ""
    lines.append(f"policy        {sp['policy']} (depth {sp['depth']}, top-k {sp['top_k']}, {sp['total_tokens']} tree "
                 f"tokens{budget})")
    tok = m["tokenizer"]
    lines.append(f"tokenizer     {', '.join(tok['files'])}" if tok else "tokenizer     none (token-id prompts only)")
    trt = m.get("tensorrt")
    if trt:
        nets = ", ".join(f"{entry['file']} (budget {entry['budget']['max_experts'] if entry['budget'] else 'off'})"
                         for entry in trt["networks"].values())
        lines.append(f"tensorrt      {nets}; plan {trt['plan_status']}; commands in {trt['folder']}/trtexec.sh")
    prov = m["provenance"]
    commit = (prov["git_commit"] or "unknown")[:12] + (" (dirty)" if prov["git_dirty"] else "")
    lines.append(f"built         moespec {prov['moespec_version']} at {commit}, {prov['created']}")
    lines.append(f"output        {_size(out_bytes)} in {files} files, built in {result.seconds:.1f} s")
    return "\n".join(lines)


# ---- command line -------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``moespec build`` (argv without the "build" word)."""
    from moespec.spec.llm import SpeculativeConfig

    argv = list(sys.argv[1:] if argv is None else argv)
    defaults = SpeculativeConfig("ar")
    p = argparse.ArgumentParser(prog="moespec build", description="Build an engine folder from a Hugging Face "
                                "checkpoint folder or a GGUF file, with an optional EAGLE-3 draft head.")
    p.add_argument("--model", required=True, help="Hugging Face checkpoint folder, GGUF file, or 'default' (the "
                                                  "project's default model; ./default for a folder of that name)")
    p.add_argument("--draft", help="EAGLE-3 draft head folder (official, SpecForge or vLLM names)")
    p.add_argument("--predictor", help="expert predictor folder (moespec analyze predictor --out) to ship with the "
                                       "engine")
    p.add_argument("--out", required=True, help="the engine folder to write")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    from moespec.config import POLICY_NAMES

    p.add_argument("--policy", choices=POLICY_NAMES,
                   help="default speculation policy (default: eagle3+budget with --budget, eagle3 with --draft, "
                        "else ar)")
    p.add_argument("--depth", type=int, default=defaults.depth, help="draft tree depth")
    p.add_argument("--top-k", type=int, default=defaults.top_k, help="draft tree branching")
    p.add_argument("--total-tokens", type=int, default=defaults.total_tokens, help="draft tree nodes besides the root")
    p.add_argument("--budget", type=int, help="max unique experts per MoE layer on verify passes (eagle3+budget)")
    p.add_argument("--backend", choices=BACKENDS, default="runtime",
                   help="runtime: the engine folder moespec's runtime loads; tensorrt: that folder plus the verify "
                        "network as ONNX with moespec's plugin nodes, its trtexec command lines, and its plan where "
                        "the tensorrt package is importable")
    p.add_argument("--trt-max-batch", type=int, default=8, help="tensorrt: largest batch of the profiles")
    p.add_argument("--trt-max-tokens", type=int, default=128, help="tensorrt: most new tokens per request and call")
    p.add_argument("--trt-max-seq-len", type=int, default=4096, help="tensorrt: most slots (past + new) per request")
    p.add_argument("--force", action="store_true", help="replace --out if it is an engine folder")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    speculation = {"policy": args.policy, "depth": args.depth, "top_k": args.top_k, "total_tokens": args.total_tokens,
                   "budget": args.budget}
    try:
        profile = None
        if args.backend == "tensorrt":
            from moespec.engine.tensorrt import Profile

            profile = Profile(max_batch=args.trt_max_batch, max_tokens=args.trt_max_tokens,
                              max_seq_len=args.trt_max_seq_len, opt_tokens=args.total_tokens + 1)
        result = build_engine(args.model, args.out, draft=args.draft, predictor=args.predictor, dtype=args.dtype,
                              speculation=speculation, backend=args.backend, tensorrt_profile=profile,
                              force=args.force, progress=not args.quiet, command=["moespec", "build", *argv])
    except ValueError as exc:
        print(f"moespec build: error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(result))
    return 0


"""``moespec export-hf``: an engine folder as a Hugging Face checkpoint folder, for transformers and
serving engines (vLLM loads it as it is; the plugin supplies EAGLE-3 where vLLM lacks it):

    moespec export-hf --engine <engine> --out <folder> [--force]

Writes ``config.json`` (the source checkpoint's, recorded in the engine's manifest, with the engine's
dtype), ``model.safetensors`` (every tensor under the family's Hugging Face names,
:func:`moespec.models.weights.hf_tensors`: experts in the per-expert layout, streamed from the
engine's memory map, no second copy of the model in memory), the tokenizer files, and the draft head
(``draft/``, official EAGLE-3 names, as the engine holds it). The folder is written beside ``--out``
under a hidden name and renamed at the end: an interrupted export leaves nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

from moespec.engine.folder import is_engine_folder, load_engine, read_manifest
from moespec.models import DTYPES
from moespec.engine.tensors import write_safetensors

def export_hf(engine: str | Path, out: str | Path, *, force: bool = False, progress: bool = True) -> Path:
    """Writes the engine as a Hugging Face folder ``out`` (see the module docstring); returns it."""
    from moespec.models.families import family_for
    from moespec.models.weights import hf_tensors

    engine, out = Path(engine), Path(out)
    manifest = read_manifest(engine)
    source = (manifest.get("provenance") or {}).get("source") or {}
    config = source.get("config")
    if not isinstance(config, dict):
        raise ValueError(f"{engine}: the manifest records no source config.json (an engine built by an older moespec): "
                         f"rebuild it with `moespec build`, or use its source folder {source.get('path')!r}")
    if out.resolve() == engine.resolve() or engine.resolve() in out.resolve().parents:
        raise ValueError(f"--out {out}: would write into the engine folder itself")
    if out.exists() and not force:
        raise ValueError(f"--out {out} exists: pass --force to replace it")
    if out.exists() and not (out.is_dir() and ((out / "config.json").is_file() or not any(out.iterdir()))):
        raise ValueError(f"--out {out}: not an exported checkpoint folder (no config.json): refusing to replace it")
    model, info = load_engine(engine)
    tensors = hf_tensors(model.config, model.weights, family_for(manifest["architecture"]).names)
    tmp = out.parent / f".{out.name}.export-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        dtype = str(DTYPES[manifest["dtype"]]).removeprefix("torch.")  # "bfloat16" | "float32"
        config = {k: v for k, v in config.items() if k != "torch_dtype"} | {"dtype": dtype}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_safetensors(tmp / "model.safetensors", tensors, metadata={"format": "pt"}, progress=progress,
                          desc="export-hf")
        if info.tokenizer_folder is not None:
            for f in info.tokenizer_folder.iterdir():
                if f.is_file():
                    shutil.copy2(f, tmp / f.name)
        if info.draft_folder is not None:
            shutil.copytree(info.draft_folder, tmp / "draft")
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``moespec export-hf`` (argv without the "export-hf" word)."""
    from moespec.cli import run_command

    p = argparse.ArgumentParser(prog="moespec export-hf", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help="an engine folder (moespec build --out)")
    p.add_argument("--out", required=True, help="the Hugging Face folder to write")
    p.add_argument("--force", action="store_true", help="replace --out if it is an exported folder")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    args = p.parse_args(argv)

    def body() -> int:
        if not is_engine_folder(Path(args.engine)):
            raise ValueError(f"--engine {args.engine}: not an engine folder (no manifest.json)")
        out = export_hf(args.engine, args.out, force=args.force, progress=not args.quiet)
        print(f"wrote {out}: config.json, model.safetensors"
              + (", the tokenizer" if (out / "tokenizer_config.json").is_file() else "")
              + (", draft/ (EAGLE-3)" if (out / "draft").is_dir() else ""))
        return 0

    return run_command("moespec export-hf", body, args.debug)


if __name__ == "__main__":
    sys.exit(main())

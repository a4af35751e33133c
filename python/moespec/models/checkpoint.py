"""Reading a local Hugging Face checkpoint folder: ``config.json`` + safetensors (one file or sharded).

No network: only the folder's own files are read. A missing folder, config, weight file or tensor,
or a file safetensors cannot parse, is a ``ValueError`` that names it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open


class Checkpoint:
    """Lazy access to the tensors of a checkpoint folder."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise ValueError(f"checkpoint folder {str(self.folder)!r} does not exist or is not a folder")
        config_path = self.folder / "config.json"
        if not config_path.is_file():
            raise ValueError(f"{self.folder}: no config.json (not a Hugging Face checkpoint folder)")
        try:
            self.config: dict[str, Any] = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{config_path}: not valid JSON ({exc})") from None
        self._handles: dict[Path, Any] = {}
        self._where = self._index()

    def _index(self) -> dict[str, Path]:
        index = self.folder / "model.safetensors.index.json"
        single = self.folder / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise ValueError(f"{index}: not a safetensors index ({exc!r})") from None
            where = {name: self.folder / file for name, file in weight_map.items()}
            for path in set(where.values()):
                if not path.is_file():
                    raise ValueError(f"{index} names shard {path.name}, which is missing")
            return where
        if single.is_file():
            return {name: single for name in self._open(single).keys()}
        others = sorted(p.name for p in self.folder.glob("*.safetensors"))
        raise ValueError(
            f"{self.folder}: no model.safetensors or model.safetensors.index.json"
            + (f" (found {', '.join(others)})" if others else "")
        )

    def _open(self, path: Path):
        handle = self._handles.get(path)
        if handle is None:
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError, ValueError) as exc:
                raise ValueError(f"{path}: cannot read safetensors file ({exc})") from None
            self._handles[path] = handle
        return handle

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def keys(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name``; ValueError naming it (and the folder) if it is absent or unreadable."""
        path = self._where.get(name)
        if path is None:
            raise ValueError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
        try:
            return self._open(path).get_tensor(name)
        except (SafetensorError, OSError, ValueError) as exc:
            raise ValueError(f"{path}: cannot read tensor {name!r} ({exc})") from None

"""The preallocated KV cache of a batch of requests (gpt-fast style: written at explicit slots).

``k`` and ``v`` are [L, B, Hkv, S_max, D]; request b's committed tokens occupy slots
``[0, lengths[b])``. A verify pass writes its tree tokens at ``[lengths[b], lengths[b] + M_b + 1)``
without committing them; :meth:`TargetModel.commit` then moves the accepted path's entries into
place and forgets the rest (they are simply overwritten later).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch


@dataclass
class PendingTree:
    """What a verify pass left for commit: per request, the tree size and parent of each node (a
    :class:`moespec.spec.tree.HostLists` after a verify of device trees: read back when commit
    looks, unless the acceptance has read them back already)."""

    parents: Sequence[Sequence[int]]


@dataclass
class KVCache:
    k: torch.Tensor  # [L, B, Hkv, S_max, D]
    v: torch.Tensor  # [L, B, Hkv, S_max, D]
    lengths: list[int]  # [B] committed tokens per request
    pending: Optional[PendingTree] = field(default=None)

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def reset(self, rows: Optional[list[int]] = None) -> None:
        """Forgets the tokens of the given requests (all by default); the memory is reused."""
        for b in range(self.batch) if rows is None else rows:
            self.lengths[b] = 0
        self.pending = None

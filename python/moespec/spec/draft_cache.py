"""The EAGLE-3 head's KV cache and a forward's inputs and outputs (:mod:`moespec.spec.eagle3` re-exports
them): the cache allocated once and written at explicit slots, the accepted prefix first, scratch
slots for the tree's levels after it, and one discard slot for padding entries.

Dimensions: B requests, T new entries, S attended slots, H draft hidden, Vd draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from moespec._tensor import to_device


@dataclass
class StepInputs:
    """Where the new tokens of one forward go and what they see (see :meth:`DraftCache.append_inputs`)."""

    positions: torch.Tensor  # long [B, T]: rope positions
    slots: torch.Tensor  # long [B, T]: cache slot written; -1 for padding (not written)
    visible: torch.Tensor  # bool [B, T, S]: query (b, t) attends slot s


@dataclass
class DraftCache:
    """The draft head's KV cache, allocated once and written at explicit slots (gpt-fast style).

    ``lengths[b]`` entries of request b are the accepted prefix (EAGLE's ``stable_kv``): slots
    ``[0, lengths[b])``. Slots from ``lengths[b]`` on are scratch for tree expansion; the next
    catch-up overwrites them. One more slot, ``max_len``, takes the writes of padding entries (so
    that a forward writes every entry, with no host synchronisation to find the real ones); it is
    never attended.
    """

    k: torch.Tensor  # [B, Hkv, S_max + 1, D] (slot S_max: the discard slot)
    v: torch.Tensor  # [B, Hkv, S_max + 1, D]
    lengths: list[int]  # [B]

    @property
    def batch(self) -> int:
        return self.k.shape[0]

    @property
    def max_len(self) -> int:
        return self.k.shape[2] - 1

    def reset(self, rows: Optional[Sequence[int]] = None) -> None:
        """Forgets the entries of the given requests (all by default); the memory is reused."""
        for b in range(self.batch) if rows is None else rows:
            self.lengths[b] = 0

    def advance(self, num: Sequence[int]) -> None:
        """Marks ``num[b]`` more entries of request b as accepted (after a catch-up forward)."""
        if len(num) != self.batch:
            raise ValueError(f"advance: num has {len(num)} entries, the cache holds {self.batch} requests")
        for b, n in enumerate(num):
            if not 0 <= self.lengths[b] + int(n) <= self.max_len:
                raise ValueError(f"advance: request {b} would hold {self.lengths[b] + int(n)} entries, "
                                 f"max_len is {self.max_len}")
            self.lengths[b] += int(n)

    def append_inputs(self, num: Sequence[int]) -> StepInputs:
        """Inputs for appending ``num[b]`` entries to request b (catch-up): slots and positions
        ``lengths[b] + j``, each entry seeing the accepted prefix and the earlier new entries.
        Padded tokens (j >= num[b]) get slot -1 and see slot 0 only. Does not advance the lengths."""
        if len(num) != self.batch:
            raise ValueError(f"append_inputs: num has {len(num)} entries, the cache holds {self.batch} requests")
        count, start = np.array([int(n) for n in num], dtype=np.int64), np.array(self.lengths, dtype=np.int64)
        if (count < 0).any() or int(count.max()) < 1:
            raise ValueError(f"append_inputs: num must be >= 0 with at least one token, got {list(num)}")
        end = start + count
        if int(end.max()) > self.max_len:
            b = int(end.argmax())
            raise ValueError(f"draft cache overflow: request {b} holds {self.lengths[b]} entries, {int(count[b])} "
                             f"more exceed max_len={self.max_len}")
        T, S = int(count.max()), int(end.max())
        j = np.arange(T)
        valid = j[None, :] < count[:, None]  # [B, T]
        positions = start[:, None] + j[None, :]  # [B, T]
        slots = np.where(valid, positions, -1)  # [B, T]
        visible = np.arange(S)[None, None, :] <= positions[:, :, None]  # [B, T, S]
        visible &= valid[:, :, None]
        visible[:, :, 0] |= ~valid
        positions, slots, visible = (torch.from_numpy(a) for a in (positions, slots, visible))
        device = self.k.device
        return StepInputs(positions=to_device(positions, device), slots=to_device(slots, device),
                          visible=to_device(visible, device))


@dataclass
class DraftOutput:
    logits: torch.Tensor  # float32 [B, T, Vd]: draft logits over the draft vocabulary
    hidden: torch.Tensor  # [B, T, H]: the layer's output before the final norm (fed back when expanding)

"""Step state of the native backend: rope tables sized once, and the packed geometry of one step.

A step's tokens are packed request by request (no padding; DESIGN.md "The next phase": step state
allocated once, written by index). :func:`step_geometry` turns the request lists of a prefill,
decode or verify call (or :func:`tree_geometry`: the draft trees' own tensors) into what the native
decoder step reads (cpp/include/moespec/decoder_step.h):
row offsets per request, each token's rope position, and its attention mask over the request's new
tokens as bit-packed int32 words, the draft tree contract's ``mask_words`` (causal rows for
sequences, ancestor-or-self rows for trees).

Dimensions: P packed tokens, B requests, D head dim, W mask words per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.nn.functional as F

from moespec._tensor import to_device

if TYPE_CHECKING:
    from moespec.spec.tree import DraftTree


@dataclass
class StepGeometry:
    tokens: torch.Tensor  # long [P] packed token ids
    offsets: list[int]  # [B + 1] rows of request b: [offsets[b], offsets[b + 1])
    positions: torch.Tensor  # long [P] rope positions: start + index (sequences) or start + depth (trees)
    mask: torch.Tensor  # int32 [P, W] mask words over the request's new tokens
    # float32 [P] the tokens' weights in a budget's ranking (0: a padding row, a copy of its tree's root
    # that no walk reaches), or None: all 1
    weights: Optional[torch.Tensor] = None

    @property
    def num(self) -> list[int]:
        """[B] new tokens of each request."""
        return [b - a for a, b in zip(self.offsets, self.offsets[1:])]


def _words(bits: int, W: int) -> list[int]:
    """A row's bits as W int32 words (bit j % 32 of word j // 32), two's complement."""
    out = []
    for _ in range(W):
        w = bits & 0xFFFFFFFF
        out.append(w - (1 << 32) if w >= 1 << 31 else w)
        bits >>= 32
    return out


def step_geometry(seqs: Sequence[Sequence[int]], starts: Sequence[int],
                  parents: Optional[Sequence[Sequence[int]]]) -> StepGeometry:
    """The packed geometry of one call: ``seqs[b]`` new tokens of request b after ``starts[b]``
    committed ones; ``parents`` (trees) as :meth:`TargetModel.verify` takes them, or None (sequences)."""
    W = max(1, (max(len(s) for s in seqs) + 31) // 32)
    tokens, offsets, positions, mask = [], [0], [], []
    for b, seq in enumerate(seqs):
        tokens.extend(seq)
        offsets.append(offsets[-1] + len(seq))
        start = starts[b]
        if parents is None:
            for j in range(len(seq)):
                positions.append(start + j)
                mask.append(_words((1 << (j + 1)) - 1, W))
        else:
            rows, depth = [], []
            for i, p in enumerate(parents[b]):
                rows.append((rows[p] if i else 0) | (1 << i))
                depth.append(depth[p] + 1 if i else 0)
            positions.extend(start + d for d in depth)
            mask.extend(_words(r, W) for r in rows)
    return StepGeometry(torch.tensor(tokens), offsets, torch.tensor(positions),
                        torch.tensor(mask, dtype=torch.int32).view(len(tokens), W))


def new_tokens(seqs: Sequence[Sequence[int]], geo: Optional[StepGeometry]) -> list[int]:
    """[B] new tokens of each request of a call: from its geometry where it has one (a verify of
    device trees: ``seqs`` are then read back only where a backend needs their values)."""
    return geo.num if geo is not None else [len(s) for s in seqs]


def tree_geometry(trees: Sequence[Optional["DraftTree"]], starts: Sequence[int],
                  vocab: Optional[int] = None, weights: bool = False) -> StepGeometry:
    """The packed geometry of a verify call straight from the draft trees' own tensors (DESIGN.md
    "Contracts" -> "Draft tree": tokens, depth and the packed ancestor mask; None: no tokens for that
    request), with no per-node Python work; ``vocab``: token ids clamped into [0, vocab) (trees whose
    ids were not checked on the host: no id reaches an embedding lookup out of range). ``weights``
    (a budgeted verify): the tokens' budget weights made, 0 for a padding row (a GPU selection's copy of its root,
    moespec.spec.cost_aware.CostAwareTrees.device_trees), so that a budget ranks the experts of the
    unpadded tree."""
    present = [(b, t) for b, t in enumerate(trees) if t is not None and t.num_nodes]
    W = max(t.mask_words.shape[1] for _, t in present)
    offsets = [0]
    for t in trees:
        offsets.append(offsets[-1] + (t.num_nodes if t is not None else 0))
    tokens = torch.cat([t.tokens for _, t in present])
    if vocab is not None:
        tokens = tokens.clamp_(0, vocab - 1)
    rows = [[starts[b] for b, t in present for _ in range(t.num_nodes)]]  # each token's start (and root flag)
    if weights:
        rows.append([i == 0 for _, t in present for i in range(t.num_nodes)])
    packed = to_device(rows, tokens.device, torch.long)  # [1 or 2, P]: one copy
    start = packed[0]
    positions = torch.cat([t.depth for _, t in present]) + start  # (a few launches for any B)
    mask = torch.cat([t.mask_words if t.mask_words.shape[1] == W else F.pad(t.mask_words, (0, W - t.mask_words.shape[1]))
                      for _, t in present])
    weight = None
    if weights:  # (padding rows: parent -1 past the root)
        weight = ((torch.cat([t.parents for _, t in present]) >= 0) | (packed[1] > 0)).float()
    return StepGeometry(tokens, offsets, positions, mask.contiguous(), weight)


class RopeTable:
    """cos and sin of every rope position up to a length, in the model dtype, computed once (and
    again, twice as long, when a longer position comes) with the reference's own ops, so a row is
    bit-identical to what the reference forward computes for that position."""

    def __init__(self, inv_freq: torch.Tensor, dtype: torch.dtype, length: int = 4096):
        self.inv_freq, self.dtype = inv_freq, dtype
        self.cos = self.sin = torch.empty(0)
        self._build(length)

    def _build(self, length: int) -> None:
        freqs = torch.arange(length)[:, None].float() * self.inv_freq  # [S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [S, D]
        self.cos, self.sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [P, D] of long positions [P]."""
        top = int(positions.max()) + 1
        if top > self.cos.shape[0]:
            self._build(max(top, 2 * self.cos.shape[0]))
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)

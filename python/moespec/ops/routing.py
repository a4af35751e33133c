"""Routing and the MoE-Spec expert budget: ``route_experts`` and its configuration types.

Implements DESIGN.md "Routing families" and "Expert budget" on top of the native op
``moespec::route_experts`` (C++: cpp/src/route_experts.cc, CUDA: cpp/kernels/route_experts.cu);
the exact semantics are documented in cpp/include/moespec/route_experts.h. The plain-torch
reference the tests hold it against is :mod:`moespec.ops.reference`.

Dimensions: T tokens, N experts, K top-k, B budget.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional

import torch

from moespec._loader import native, require_cuda
from moespec._tensor import view

Family = Literal["softmax", "deepseek_v3", "gpt_oss"]
Policy = Literal["substitution", "truncation"]
Score = Literal["probability", "gates"]

_FAMILY_CODES: dict[str, int] = {"softmax": 0, "deepseek_v3": 1, "gpt_oss": 2}
_POLICY_CODES: dict[str, int] = {"substitution": 0, "truncation": 1}
_SCORE_CODES: dict[str, int] = {"probability": 0, "gates": 1}


@dataclass(frozen=True)
class RouterSpec:
    """How a model routes tokens to experts.

    Parameters
    ----------
    family : {"softmax", "deepseek_v3", "gpt_oss"}
        ``"softmax"``: softmax over all experts then top-k (Qwen3-MoE, OLMoE, Mixtral).
        ``"deepseek_v3"``: sigmoid scores, correction bias, group-limited top-k.
        ``"gpt_oss"``: top-k on the logits (router bias included), softmax over the k.
    top_k : int
        Experts per token (K).
    renormalize : bool
        softmax family: divide the k weights by their sum (Qwen3-MoE/OLMoE ``norm_topk_prob``;
        Mixtral always). deepseek_v3: ``norm_topk_prob``. Ignored by gpt_oss.
    n_group, topk_group : int
        deepseek_v3's group limit (groups of N / n_group experts, keep topk_group groups).
    scaling : float
        deepseek_v3's ``routed_scaling_factor``.

    Examples
    --------
    >>> RouterSpec("softmax", 8, renormalize=True)
    RouterSpec(family='softmax', top_k=8, renormalize=True, n_group=1, topk_group=1, scaling=1.0)
    """

    family: Family
    top_k: int
    renormalize: bool = False
    _: dataclasses.KW_ONLY
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0

    def __post_init__(self) -> None:
        if self.family not in _FAMILY_CODES:
            raise ValueError(f"RouterSpec.family: expected one of {sorted(_FAMILY_CODES)}, got {self.family!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 1:
            raise ValueError(f"RouterSpec.top_k: expected an int >= 1, got {self.top_k!r}")
        if not isinstance(self.n_group, int) or self.n_group < 1:
            raise ValueError(f"RouterSpec.n_group: expected an int >= 1, got {self.n_group!r}")
        if not isinstance(self.topk_group, int) or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"RouterSpec.topk_group: expected an int in [1, n_group={self.n_group}], got {self.topk_group!r}")
        if not math.isfinite(self.scaling):
            raise ValueError(f"RouterSpec.scaling: expected a finite number, got {self.scaling!r}")

    @classmethod
    def from_config(cls, config: Any) -> "RouterSpec":
        """The router of a transformers config (object or dict) of a supported MoE architecture.

        Supported ``model_type``: qwen3_moe, qwen2_moe, olmoe, mixtral, deepseek_v3, gpt_oss.
        """
        get = (lambda k, d=None: config.get(k, d)) if isinstance(config, Mapping) else (lambda k, d=None: getattr(config, k, d))
        model_type = get("model_type")
        top_k = get("num_experts_per_tok")
        if model_type in ("qwen3_moe", "qwen2_moe", "olmoe"):
            return cls("softmax", int(top_k), bool(get("norm_topk_prob", False)))
        if model_type == "mixtral":
            return cls("softmax", int(top_k), True)
        if model_type == "deepseek_v3":
            return cls(
                "deepseek_v3",
                int(top_k),
                bool(get("norm_topk_prob", True)),
                n_group=int(get("n_group") or 1),
                topk_group=int(get("topk_group") or 1),
                scaling=float(get("routed_scaling_factor", 1.0)),
            )
        if model_type == "gpt_oss":
            return cls("gpt_oss", int(top_k))
        raise ValueError(
            f"RouterSpec.from_config: unknown MoE architecture model_type={model_type!r} "
            "(supported: qwen3_moe, qwen2_moe, olmoe, mixtral, deepseek_v3, gpt_oss)"
        )


@dataclass(frozen=True)
class ExpertBudget:
    """MoE-Spec's cap on the unique experts of one verify pass, per layer.

    Parameters
    ----------
    max_experts : int
        B. Experts are ranked by routing probability summed over the pass's tokens and the best B
        kept; B >= N means no cap; B < top_k is an error (one token alone needs k experts).
    policy : {"substitution", "truncation"}
        substitution (default): a token whose experts fall outside the set takes its best k
        inside it, so it keeps k experts (a token whose experts all lie inside keeps them).
        truncation: the slots outside the set are dropped.
    coverage : float, optional
        In (0, 1]: keep only the smallest set of experts holding this share of the score mass
        (at least top_k, at most ``max_experts``).
    score : {"probability", "gates"}
        How the experts are ranked. probability (default, MoE-Spec's): each expert's full routing
        probability summed over the tokens. gates (moespec's): each expert's weight in the tokens'
        own top-k routing summed, and every token's first choice ranked before all other experts;
        an expert no token chose scores 0.
    exact_layers : int
        For runtimes that apply the budget layer by layer (moespec's runtime, the ONNX export): the
        first ``exact_layers`` MoE layers of each pass run without it (:meth:`for_layer`). A single
        ``route_experts`` call applies the budget as given.

    Examples
    --------
    >>> ExpertBudget(16)
    ExpertBudget(max_experts=16, policy='substitution', coverage=None, score='probability', exact_layers=0)
    """

    max_experts: int
    policy: Policy = "substitution"
    coverage: Optional[float] = None
    score: Score = "probability"
    exact_layers: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_experts, int) or isinstance(self.max_experts, bool) or self.max_experts < 1:
            raise ValueError(f"ExpertBudget.max_experts: expected an int >= 1, got {self.max_experts!r}")
        if self.policy not in _POLICY_CODES:
            raise ValueError(f"ExpertBudget.policy: expected 'substitution' or 'truncation', got {self.policy!r}")
        if self.coverage is not None and not (isinstance(self.coverage, (int, float)) and 0.0 < self.coverage <= 1.0):
            raise ValueError(f"ExpertBudget.coverage: expected a number in (0, 1] or None, got {self.coverage!r}")
        if self.score not in _SCORE_CODES:
            raise ValueError(f"ExpertBudget.score: expected 'probability' or 'gates', got {self.score!r}")
        if not isinstance(self.exact_layers, int) or isinstance(self.exact_layers, bool) or self.exact_layers < 0:
            raise ValueError(f"ExpertBudget.exact_layers: expected an int >= 0, got {self.exact_layers!r}")

    def for_layer(self, moe_index: int) -> Optional["ExpertBudget"]:
        """The budget of the MoE layer ``moe_index`` (0: the first MoE layer): None for the first
        ``exact_layers``, else this one."""
        return None if moe_index < self.exact_layers else self


@dataclass(frozen=True)
class RoutingStats:
    """What the experts did in one routing call (one layer, one pass)."""

    natural_unique: int  # unique experts the unbudgeted routing would use
    kept: int  # unique experts actually used
    rerouted: int  # token slots now holding an expert the token did not choose (substitution)
    dropped: int  # token slots dropped (truncation)


@dataclass(frozen=True)
class Routing:
    """The routing contract (DESIGN.md "Contracts").

    ``ids`` int32 [T, K] (sentinel N = dropped slot), ``weights`` float32 [T, K],
    ``active_padded`` int32 [N] (sorted active ids, then N), ``stats_tensor`` int32 [4].
    ``active`` and ``stats`` read the counts back to the host (a device sync on CUDA).
    """

    ids: torch.Tensor
    weights: torch.Tensor
    active_padded: torch.Tensor
    stats_tensor: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.active_padded.shape[0]

    @property
    def active(self) -> torch.Tensor:
        """Sorted ids of the experts used by at least one slot, int32 [kept]."""
        return self.active_padded[: int(self.stats_tensor[1])]

    @property
    def stats(self) -> RoutingStats:
        return RoutingStats(*(int(x) for x in self.stats_tensor.tolist()))


# Lane count of PyTorch's CPU reductions on this machine (16 with its AVX-512 kernels, else 8),
# read once at import (torch.compile cannot trace the query).
_SOFTMAX_VECTOR_WIDTH = 16 if torch.backends.cpu.get_cpu_capability().upper().startswith("AVX512") else 8


def budget_codes(budget: Optional[ExpertBudget]) -> tuple[int, int, float, int]:
    """An ExpertBudget as the native ops take it: (max_experts, policy code, coverage, score code);
    0s for none."""
    if budget is None:
        return 0, 0, 0.0, 0
    return (budget.max_experts, _POLICY_CODES[budget.policy], float(budget.coverage or 0.0),
            _SCORE_CODES[budget.score])


def softmax_vector_width() -> int:
    """Lane count of PyTorch's CPU softmax reduction on this machine (16 with AVX-512, else 8).

    moespec's CPU routing sums in the same order, so that its weights equal transformers' bit for bit.
    """
    return _SOFTMAX_VECTOR_WIDTH


def _route_experts_impl(
    router_logits: torch.Tensor,
    bias: Optional[torch.Tensor],
    token_weights: Optional[torch.Tensor],
    family: int,
    top_k: int,
    renormalize: bool,
    n_group: int,
    topk_group: int,
    scaling: float,
    max_experts: int,
    policy: int,
    coverage: float,
    score: int,
    softmax_vector_width: int,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits: expected a 2-d tensor [T, N], got shape {tuple(router_logits.shape)}")
    T, N = router_logits.shape
    if T == 0 or router_logits.stride(1) != 1:  # the native op reads rows of contiguous experts
        router_logits = router_logits.contiguous() if T else router_logits.new_empty((0, N))
    device = router_logits.device
    ids = torch.empty((T, top_k), dtype=torch.int32, device=device)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=device)
    active = torch.empty((N,), dtype=torch.int32, device=device)
    stats = torch.empty((4,), dtype=torch.int32, device=device)
    workspace, stream = None, 0
    if device.type == "cuda":
        require_cuda()
        nbytes = native().route_experts_workspace_size(T, N, top_k)
        workspace = torch.empty((max(nbytes, 1),), dtype=torch.uint8, device=device)
        stream = torch.cuda.current_stream(device).cuda_stream
    native().route_experts(
        view(router_logits, "router_logits"),
        view(bias, "bias"),
        view(token_weights, "token_weights"),
        view(ids, "ids"),
        view(weights, "weights"),
        view(active, "active"),
        view(stats, "stats"),
        family,
        top_k,
        renormalize,
        n_group,
        topk_group,
        scaling,
        max_experts,
        policy,
        coverage,
        score,
        softmax_vector_width,
        view(workspace, "workspace"),
        stream,
    )
    if check_finite and workspace is not None and not torch.cuda.is_current_stream_capturing():
        at = native().route_experts_nonfinite_offset()
        bad = int(workspace[at:at + 4].view(torch.int32).item())  # (a host sync: pass check_finite=False to skip)
        if bad:
            raise ValueError(f"router_logits: non-finite values (NaN or inf in the logits, bias or token_weights) "
                             f"at {bad} of {T} tokens")
    return ids, weights, active, stats


@torch.library.custom_op("moespec::route_experts", mutates_args=())
def route_experts_op(
    router_logits: torch.Tensor,
    bias: Optional[torch.Tensor],
    token_weights: Optional[torch.Tensor],
    family: int,
    top_k: int,
    renormalize: bool,
    n_group: int,
    topk_group: int,
    scaling: float,
    max_experts: int,
    policy: int,
    coverage: float,
    score: int,
    softmax_vector_width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch custom op ``moespec::route_experts`` (flat arguments; see :func:`route_experts`)."""
    return _route_experts_impl(
        router_logits, bias, token_weights, family, top_k, renormalize, n_group, topk_group, scaling,
        max_experts, policy, coverage, score, softmax_vector_width,
    )


@route_experts_op.register_fake
def _route_experts_fake(router_logits, bias, token_weights, family, top_k, renormalize, n_group, topk_group,
                        scaling, max_experts, policy, coverage, score, softmax_vector_width):
    T, N = router_logits.shape
    new = router_logits.new_empty
    return (new((T, top_k), dtype=torch.int32), new((T, top_k), dtype=torch.float32),
            new((N,), dtype=torch.int32), new((4,), dtype=torch.int32))


def route_experts(
    router_logits: torch.Tensor,
    spec: RouterSpec,
    budget: Optional[ExpertBudget] = None,
    bias: Optional[torch.Tensor] = None,
    *,
    token_weights: Optional[torch.Tensor] = None,
    check_finite: bool = True,
) -> Routing:
    """Routes T tokens to experts, optionally under an expert budget.

    Parameters
    ----------
    router_logits : Tensor [T, N], float32 | bfloat16 | float16, CPU or CUDA
        The router's output (for gpt_oss including its bias). Rows must be contiguous.
    spec : RouterSpec
    budget : ExpertBudget, optional
        MoE-Spec's cap, applied to all T tokens together (use it on verify passes only).
    bias : Tensor [N] float32, optional
        deepseek_v3's ``e_score_correction_bias``.
    token_weights : Tensor [T] float32, optional
        Weights of the tokens in the budget's expert scores (default: all 1).
    check_finite : bool
        On CUDA, raise ValueError when an input value is NaN or inf, as the CPU always does: the kernel
        counts such tokens on the GPU and this reads the count back (one host synchronisation; skipped
        inside CUDA graph capture and torch.compile). False: no synchronisation, and such tokens get
        unspecified (in-range) ids and weights. The CPU checks in any case.

    Returns
    -------
    Routing
        ``ids`` int32 [T, K] (N marks a dropped slot), ``weights`` float32 [T, K], ``active``,
        ``stats``. On the CPU, fp32 weights equal transformers' router bit for bit.

    Examples
    --------
    >>> import torch, moespec
    >>> logits = torch.randn(16, 64)
    >>> r = moespec.ops.route_experts(logits, moespec.ops.RouterSpec("softmax", 8, True),
    ...                               moespec.ops.ExpertBudget(16))
    >>> r.ids.shape, r.stats.kept <= 16
    (torch.Size([16, 8]), True)
    """
    if not isinstance(spec, RouterSpec):
        raise TypeError(f"spec: expected a moespec.ops.RouterSpec, got {type(spec).__name__}")
    if budget is not None and not isinstance(budget, ExpertBudget):
        raise TypeError(f"budget: expected a moespec.ops.ExpertBudget or None, got {type(budget).__name__}")
    if not isinstance(router_logits, torch.Tensor):
        raise TypeError(f"router_logits: expected a torch.Tensor, got {type(router_logits).__name__}")
    args = (
        router_logits,
        bias,
        token_weights,
        _FAMILY_CODES[spec.family],
        spec.top_k,
        spec.renormalize,
        spec.n_group,
        spec.topk_group,
        float(spec.scaling),
        *budget_codes(budget),
        _SOFTMAX_VECTOR_WIDTH,
    )
    # Eager calls go straight to the implementation (the dispatcher round trip of the custom op
    # adds ~15 us per call, as much as the routing itself at decode sizes: see
    # `python -m moespec.bench.ops`); traced code (torch.compile) goes through the op.
    if torch.compiler.is_compiling():
        return Routing(*route_experts_op(*args))
    return Routing(*_route_experts_impl(*args, check_finite=check_finite))

"""The metrics of ``moespec bench``: trtllm-bench's definitions, plus expert statistics.

Pure computations over per-request records (no model, no clock), so that every number of a report
can be checked against a hand-computed fixture (tests/python/test_bench.py). The definitions follow
trtllm-bench (REFERENCE.md section 5, ``tensorrt_llm/bench/dataclasses/{statistics,reporting}.py``);
times are integer nanoseconds of ``time.perf_counter_ns`` internally, reported in ms or s:

per request (OSL = output tokens, including the first)
    TTFT = first_token - start;  E2E = end - start;  generation time = E2E - TTFT;
    TPOT = (end - first_token) / (OSL - 1)  (0 when OSL = 1);
    GTPS = (OSL - 1) / generation time;  per-user output throughput = OSL / E2E.
global
    total latency = max(end) - min(start);  request throughput = N / total latency;
    total output throughput = sum OSL / total latency;  total token throughput = (sum ISL + sum OSL) /
    total latency;  per-GPU = output throughput / world size;  average concurrency = sum E2E / total
    latency;  issue rate = N / (last start - first start) in requests per second (trtllm-bench
    computes (last - first) / N in ns and multiplies by 1e9, a wrong unit; we do not).
percentiles
    nearest rank without interpolation: ``sorted(values)[int(n * q)]`` for q in 0.5, 0.9, 0.95, 0.99,
    plus minimum, maximum and average.
speculative decoding, per request, with it = decode iterations + 1 (the prefill is an iteration)
    draft tokens = max_draft_len * it;  accepted draft tokens = OSL - it;
    draft acceptance rate = accepted / drafted;  acceptance length = OSL / it;
    global acceptance length = sum OSL / sum it (EAGLE's tau: it counts the bonus token).
    ``max_draft_len`` is our draft tree's node count per verify step (root excluded), and, as in
    trtllm-bench, it is charged for every iteration including the prefill.
experts (our addition), per target step after the prefill, per MoE layer: natural unique experts
    (the unbudgeted routing's), kept unique experts, slots re-routed, slots dropped; see
    :func:`expert_statistics`.

Dimensions: N requests, L MoE layers, S target steps after the prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

PERCENTILE_KEYS = ("p50", "p90", "p95", "p99", "minimum", "maximum", "average")  # JSON (trtllm) order
PRINT_KEYS = ("minimum", "maximum", "average", "p50", "p90", "p95", "p99")  # trtllm's printed order
QUANTILES = {"p50": 0.50, "p90": 0.90, "p95": 0.95, "p99": 0.99}
NS_PER_MS, NS_PER_S = 1.0e6, 1.0e9


# ---- percentiles ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Percentiles:
    """trtllm-bench's PercentileStats: nearest-rank percentiles, minimum, maximum, average."""

    p50: float
    p90: float
    p95: float
    p99: float
    minimum: float
    maximum: float
    average: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Percentiles":
        """Percentiles of a non-empty sequence: ``sorted(values)[int(n * q)]`` (no interpolation)."""
        n = len(values)
        if n == 0:
            raise ValueError("percentiles of an empty sequence")
        ordered = sorted(float(v) for v in values)
        ranks = {key: ordered[int(n * q)] for key, q in QUANTILES.items()}
        return cls(**ranks, minimum=ordered[0], maximum=ordered[-1], average=sum(ordered) / n)

    def to_dict(self, scale: float = 1.0) -> dict[str, float]:
        """{p50, p90, p95, p99, minimum, maximum, average}, each multiplied by ``scale``."""
        return {key: getattr(self, key) * scale for key in PERCENTILE_KEYS}


def percentiles(values: Sequence[float], scale: float = 1.0) -> Optional[dict[str, float]]:
    """:meth:`Percentiles.to_dict` of ``values``, or None when there are none."""
    return Percentiles.of(values).to_dict(scale) if len(values) else None


# ---- requests ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestRecord:
    """One finished request: lengths, perf_counter_ns timestamps and target steps after the prefill."""

    task_id: int
    input_tokens: int  # ISL
    output_tokens: int  # OSL, the first token included
    start_ns: int
    first_token_ns: int
    end_ns: int
    decode_iterations: int  # target passes after the prefill (RequestStats.decode_steps)

    def __post_init__(self) -> None:
        if self.output_tokens < 1:
            raise ValueError(f"request {self.task_id}: output_tokens must be >= 1, got {self.output_tokens}")
        if not self.start_ns <= self.first_token_ns <= self.end_ns:
            raise ValueError(f"request {self.task_id}: timestamps must satisfy start <= first token <= end, got "
                             f"{self.start_ns}, {self.first_token_ns}, {self.end_ns}")

    @property
    def ttft_ns(self) -> int:
        return self.first_token_ns - self.start_ns

    @property
    def e2e_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def generation_ns(self) -> int:
        return self.e2e_ns - self.ttft_ns

    @property
    def tpot_ns(self) -> float:
        """Time per output token after the first; 0 for a one-token request."""
        return (self.end_ns - self.first_token_ns) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0

    @property
    def gen_tps(self) -> float:
        """Generation throughput (OSL - 1) / generation time, tokens per second (0 if not measurable)."""
        return (self.output_tokens - 1) * NS_PER_S / self.generation_ns if self.generation_ns > 0 else 0.0

    @property
    def output_tps_per_user(self) -> float:
        """OSL / E2E in tokens per second: the first token included ("[w/ ctx]")."""
        return self.output_tokens * NS_PER_S / self.e2e_ns if self.e2e_ns > 0 else 0.0

    @property
    def iterations(self) -> int:
        """trtllm-bench's ``it = decode_iteration + 1``: the prefill plus the steps after it."""
        return self.decode_iterations + 1


@dataclass(frozen=True)
class SpecMetrics:
    """trtllm-bench's speculative-decoding numbers of one request."""

    num_draft_tokens: int
    num_accepted_draft_tokens: int
    draft_acceptance_rate: float
    acceptance_length: float


def spec_metrics(record: RequestRecord, max_draft_len: int) -> SpecMetrics:
    """Draft tokens ``max_draft_len * it``, accepted ``OSL - it``, their ratio, and ``OSL / it``."""
    if max_draft_len < 1:
        raise ValueError(f"max_draft_len must be >= 1 for speculative metrics, got {max_draft_len}")
    it = record.iterations
    drafted, accepted = max_draft_len * it, record.output_tokens - it
    return SpecMetrics(drafted, accepted, accepted / drafted, record.output_tokens / it)


# ---- global sections (the keys of trtllm-bench's --report_json) -------------------------------


def _check(records: Sequence[RequestRecord]) -> None:
    if not records:
        raise ValueError("no finished requests to report")


def total_latency_ns(records: Sequence[RequestRecord]) -> int:
    """max(end) - min(start)."""
    _check(records)
    return max(r.end_ns for r in records) - min(r.start_ns for r in records)


def issue_rate(records: Sequence[RequestRecord]) -> Optional[float]:
    """N / (last start - first start) in requests per second; None when every request started at once."""
    _check(records)
    span = max(r.start_ns for r in records) - min(r.start_ns for r in records)
    return len(records) * NS_PER_S / span if span > 0 else None


def request_info(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """num_requests, avg_num_concurrent_requests (sum E2E / total latency), average lengths."""
    _check(records)
    n, total = len(records), total_latency_ns(records)
    return {
        "num_requests": n,
        "avg_num_concurrent_requests": sum(r.e2e_ns for r in records) / total if total > 0 else float(n),
        "avg_input_length": sum(r.input_tokens for r in records) / n,
        "avg_output_length": sum(r.output_tokens for r in records) / n,
    }


def performance(records: Sequence[RequestRecord], world_size: int = 1) -> dict[str, Any]:
    """The PERFORMANCE OVERVIEW numbers (rates per second, latencies in ms)."""
    _check(records)
    total = total_latency_ns(records)
    seconds = total / NS_PER_S
    osl = sum(r.output_tokens for r in records)
    isl = sum(r.input_tokens for r in records)
    rate = (lambda x: x / seconds) if seconds > 0 else (lambda x: 0.0)
    latency = Percentiles.of([r.e2e_ns for r in records])
    return {
        "total_latency_ms": total / NS_PER_MS,
        "avg_request_latency_ms": latency.average / NS_PER_MS,
        "request_throughput_req_s": rate(len(records)),
        "system_output_throughput_tok_s": rate(osl),
        "system_total_throughput_tok_s": rate(isl + osl),
        "output_throughput_per_user_tok_s": sum(r.output_tps_per_user for r in records) / len(records),
        "output_throughput_per_gpu_tok_s": rate(osl) / world_size,
        "request_latency_percentiles_ms": latency.to_dict(1.0 / NS_PER_MS),
    }


def streaming_metrics(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """TTFT, TPOT and generation throughput (per-request averages and percentiles)."""
    _check(records)
    n = len(records)
    return {
        "token_output_speed_tok_s": sum(r.gen_tps for r in records) / n,
        "avg_ttft_ms": sum(r.ttft_ns for r in records) / n / NS_PER_MS,
        "avg_tpot_ms": sum(r.tpot_ns for r in records) / n / NS_PER_MS,
        "tpot_percentiles": Percentiles.of([r.tpot_ns for r in records]).to_dict(1.0 / NS_PER_MS),
        "ttft_percentiles": Percentiles.of([r.ttft_ns for r in records]).to_dict(1.0 / NS_PER_MS),
        "gen_tps_percentiles": Percentiles.of([r.gen_tps for r in records]).to_dict(),
    }


def decoding_stats(records: Sequence[RequestRecord], max_draft_len: int, mode: str) -> dict[str, Any]:
    """trtllm-bench's decoding_stats section plus the totals and the global acceptance length."""
    _check(records)
    spec = [spec_metrics(r, max_draft_len) for r in records]
    osl, it = sum(r.output_tokens for r in records), sum(r.iterations for r in records)
    drafted, accepted = sum(s.num_draft_tokens for s in spec), sum(s.num_accepted_draft_tokens for s in spec)
    return {
        "mode": mode,
        "max_draft_len": max_draft_len,
        "num_draft_tokens_percentiles": Percentiles.of([s.num_draft_tokens for s in spec]).to_dict(),
        "num_accepted_draft_tokens_percentiles": Percentiles.of([s.num_accepted_draft_tokens for s in spec]).to_dict(),
        "draft_acceptance_rate_percentiles": Percentiles.of([s.draft_acceptance_rate for s in spec]).to_dict(),
        "acceptance_length_percentiles": Percentiles.of([s.acceptance_length for s in spec]).to_dict(),
        "total_draft_tokens": drafted,
        "total_accepted_draft_tokens": accepted,
        "draft_acceptance_rate": accepted / drafted,
        "acceptance_length": osl / it,
    }


def acceptance_length(records: Sequence[RequestRecord]) -> float:
    """The global acceptance length sum OSL / sum it (1 for plain decoding)."""
    _check(records)
    return sum(r.output_tokens for r in records) / sum(r.iterations for r in records)


def dataset_stats(input_lengths: Sequence[int], output_lengths: Sequence[int],
                  dataset_path: Optional[str] = None) -> dict[str, Any]:
    """trtllm-bench's DatasetMetadata: percentiles of input, output and total sequence lengths."""
    if len(input_lengths) != len(output_lengths) or not input_lengths:
        raise ValueError("dataset_stats: need as many output lengths as input lengths, at least one")
    seq = [i + o for i, o in zip(input_lengths, output_lengths)]
    return {
        "dataset_path": dataset_path,
        "num_requests": len(seq),
        "isl_stats": Percentiles.of(input_lengths).to_dict(),
        "osl_stats": Percentiles.of(output_lengths).to_dict(),
        "seq_len_stats": Percentiles.of(seq).to_dict(),
    }


# ---- experts ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertStep:
    """The experts of one target step after the prefill, over the whole batch, per MoE layer.

    ``measured`` False: the runtime did not record the step (plain decoding does not), and
    ``natural`` = ``kept`` hold the estimate min(active requests * top_k, experts), which is exact at
    batch size 1 (one token uses top_k distinct experts) and an upper bound above it.
    """

    natural: tuple[int, ...]  # [L] unique experts the unbudgeted routing uses
    kept: tuple[int, ...]  # [L] unique experts actually read
    rerouted: tuple[int, ...]  # [L] token slots moved to another expert (substitution)
    dropped: tuple[int, ...]  # [L] token slots dropped (truncation)
    measured: bool = True
    predicted: Optional[tuple[float, ...]] = None  # [L] the cost-aware selector's expected unique experts (eco)


def batch_expert_steps(per_request: Sequence[Sequence[Any]], decode_steps: Sequence[int], *, top_k: int,
                       num_experts: int, moe_layers: int,
                       predicted: Optional[Sequence[Sequence[Any]]] = None) -> list[ExpertStep]:
    """The target steps of one static batch, each counted once.

    ``per_request[r]`` is request r's RequestStats.expert_stats: one int [L, 4] array (natural, kept,
    re-routed, dropped) per verify step, batch-wide, so every request of the batch holds the same
    rows while it is active. No request joins a running static batch, so each request's list is a
    prefix of the longest one, which therefore holds every step exactly once. When nothing was
    recorded (plain decoding), step j is estimated from the a_j requests still active at it
    (``decode_steps[r] > j``): min(a_j * top_k, num_experts) unique experts per layer.
    ``predicted[r]`` (optional) is request r's RequestStats.predicted_unique, batch-wide the same way.
    """
    if len(per_request) != len(decode_steps):
        raise ValueError("batch_expert_steps: one expert_stats list per decode_steps entry")
    longest = max(per_request, key=len, default=[])
    guesses = max(predicted or [], key=len, default=[])
    if len(longest):
        steps = []
        for j, stats in enumerate(longest):
            a = np.asarray(stats, dtype=np.int64).reshape(-1, 4)  # [L, 4]
            guess = tuple(float(x) for x in np.asarray(guesses[j]).reshape(-1)) if j < len(guesses) else None
            steps.append(ExpertStep(*(tuple(int(x) for x in a[:, c]) for c in range(4)), predicted=guess))
        return steps
    out = []
    for j in range(max(decode_steps, default=0)):
        active = sum(1 for s in decode_steps if s > j)
        used = (min(active * top_k, num_experts),) * moe_layers
        out.append(ExpertStep(used, used, (0,) * moe_layers, (0,) * moe_layers, measured=False))
    return out


def expert_statistics(steps: Sequence[ExpertStep], *, generated_tokens: int, bytes_per_expert: int,
                      moe_layers: int, experts_per_layer: int, top_k: int,
                      budget: Optional[int] = None) -> dict[str, Any]:
    """The EXPERT STATISTICS section.

    - natural / kept unique experts per layer per step: percentiles over the measured steps of the
      step's mean over MoE layers; also each layer's mean over the steps;
    - budget binding rate: the share of measured (layer, step) pairs whose natural unique count
      exceeded the kept one;
    - expert bytes read: kept experts x bytes per expert, summed over layers and steps (estimated
      steps included, see :class:`ExpertStep`), per generated token, where ``generated_tokens``
      counts the tokens those steps emitted, i.e. sum (OSL - 1): the prefill, which produces the
      first token, is in neither the numerator nor the denominator;
    - slots re-routed and dropped, summed over layers and measured steps;
    - with a cost-aware tree (steps carrying ``predicted``): the selector's expected unique experts
      per layer per step (mean) and its mean absolute relative error against the natural count, over
      (layer, step) pairs.
    """
    measured = [s for s in steps if s.measured]
    natural = np.array([s.natural for s in measured], dtype=np.float64).reshape(len(measured), moe_layers)  # [S, L]
    kept = np.array([s.kept for s in measured], dtype=np.float64).reshape(len(measured), moe_layers)  # [S, L]
    have = len(measured) > 0 and moe_layers > 0
    bytes_read = sum(sum(s.kept) for s in steps) * bytes_per_expert
    guessed = [s for s in measured if s.predicted is not None and len(s.predicted) == moe_layers]
    guess = np.array([s.predicted for s in guessed], dtype=np.float64).reshape(len(guessed), moe_layers)  # [S', L]
    truth = np.array([s.natural for s in guessed], dtype=np.float64).reshape(len(guessed), moe_layers)  # [S', L]
    have_guess = len(guessed) > 0 and moe_layers > 0
    return {
        "moe_layers": moe_layers,
        "experts_per_layer": experts_per_layer,
        "top_k": top_k,
        "bytes_per_expert": bytes_per_expert,
        "budget": budget,
        "verify_steps": len(measured),
        "estimated_steps": len(steps) - len(measured),
        "natural_unique_per_layer_percentiles": percentiles(natural.mean(axis=1).tolist()) if have else None,
        "kept_unique_per_layer_percentiles": percentiles(kept.mean(axis=1).tolist()) if have else None,
        "natural_unique_by_layer": natural.mean(axis=0).tolist() if have else [],
        "kept_unique_by_layer": kept.mean(axis=0).tolist() if have else [],
        "budget_binding_rate": float((natural > kept).mean()) if have else None,
        "slots_rerouted": sum(sum(s.rerouted) for s in measured),
        "slots_dropped": sum(sum(s.dropped) for s in measured),
        "expert_bytes_read": int(bytes_read),
        "generated_tokens": generated_tokens,
        "expert_bytes_per_output_token": bytes_read / generated_tokens if generated_tokens > 0 else None,
        "predicted_unique_per_layer": float(guess.mean()) if have_guess else None,
        "predicted_unique_error": float((np.abs(guess - truth) / np.maximum(truth, 1)).mean()) if have_guess else None,
    }


# ---- agreement and quality (bench compare) ----------------------------------------------------


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens up to the first divergence."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> dict[str, float]:
    """identical_share: the share of requests whose output equals the reference token for token;
    token_match_rate: sum over requests of the common prefix / sum of reference lengths."""
    if len(outputs) != len(reference) or not reference:
        raise ValueError("agreement: need one output per reference output, at least one")
    same = sum(1 for o, r in zip(outputs, reference) if list(o) == list(r))
    prefix = sum(common_prefix(o, r) for o, r in zip(outputs, reference))
    return {"identical_share": same / len(reference), "token_match_rate": prefix / sum(len(r) for r in reference)}

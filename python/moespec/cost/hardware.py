"""Hardware profiles of the cost model: bandwidth, matrix throughput and per-step overhead.

A profile prices one weight matrix of ``bytes`` read by ``M`` tokens (``matrix_seconds``). Two kinds:

- spec-sheet profiles (``h100-sxm``, ``h200``, ``b200``): the roofline max(bytes / bandwidth,
  2 M params / peak bf16 FLOP/s) with the data-sheet figures (sources in SPEC_SHEETS) and an
  assumed per-step overhead; a profile file measured on the GPU by ``tests/gpu/run.sh``
  (``tests/gpu/profiles/<name>.json``) replaces the built-in one where it exists;
- measured profiles (``moespec analyze profile --out cpu.json``): this machine's read bandwidth, the
  runtime's bf16 matrix kernel timed at M = 1..128 tokens on a matrix larger than the caches (its
  effective GB/s of weights at each M, interpolated in log M), and the runtime's fixed cost per
  step (a decode step of a tiny model).

Dimensions: M tokens a matrix is applied to.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

PROFILE_FORMAT = "moespec-hardware-profile"
PROFILE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)

# name: (read bandwidth GB/s, dense bf16 TFLOP/s, source)
SPEC_SHEETS = {
    "h100-sxm": (3350.0, 989.0, "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 3.35 TB/s HBM3, "
                                "989 TFLOPS dense BF16; the sheet's 1,979 is with sparsity)"),
    "h200": (4800.0, 989.0, "NVIDIA H200 Tensor Core GPU datasheet (SXM: 4.8 TB/s HBM3e, "
                            "989 TFLOPS dense BF16; the sheet's 1,979 is with sparsity)"),
    "b200": (8000.0, 2250.0, "NVIDIA DGX B200 / HGX B200 datasheet (8 TB/s HBM3e per GPU, "
                             "2.25 PFLOPS dense BF16 per GPU; the sheet's 4.5 is with sparsity)"),
}
GPU_STEP_OVERHEAD_US = 20.0  # assumed: one CUDA-graph replay of a decode/verify step plus sampling


@dataclass(frozen=True)
class Hardware:
    name: str
    bandwidth_gbs: float  # read bandwidth, 1e9 bytes/s
    peak_tflops: float  # dense bf16 matrix throughput
    step_overhead_us: float  # fixed time per step (launch, host, sampling)
    source: str
    # measured: GB/s of weight bytes the runtime's matrix kernel reaches at M tokens (M -> GB/s)
    matrix_gbs: dict[int, float] = field(default_factory=dict)
    attention_gbs: Optional[float] = None  # measured KV-read rate of attention (None: bandwidth_gbs)
    # measured: GB/s of expert weights the runtime's MoE kernel reaches at m tokens per expert
    expert_gbs: dict[int, float] = field(default_factory=dict)
    # measured: per token and layer, what the runtime spends besides reading weights (norms,
    # residuals, rope and cache writes, attention at the profile's context, routing)
    token_layer_us: float = 0.0

    def __post_init__(self) -> None:
        if not (self.bandwidth_gbs > 0 and self.peak_tflops > 0 and self.step_overhead_us >= 0):
            raise ValueError(f"hardware {self.name!r}: bandwidth and peak must be > 0, overhead >= 0")

    @property
    def measured(self) -> bool:
        return bool(self.matrix_gbs)

    def matrix_seconds(self, nbytes: float, tokens: float, bytes_per_weight: float = 2.0) -> float:
        """Time of reading a weight matrix of ``nbytes`` and applying it to ``tokens`` tokens."""
        if nbytes <= 0 or tokens <= 0:
            return 0.0
        if self.matrix_gbs:
            return nbytes / (_interp(self.matrix_gbs, tokens) * 1e9)
        flops = 2.0 * tokens * nbytes / bytes_per_weight
        return max(nbytes / (self.bandwidth_gbs * 1e9), flops / (self.peak_tflops * 1e12))

    def expert_seconds(self, nbytes: float, tokens_per_expert: float, bytes_per_weight: float = 2.0) -> float:
        """Time of the routed experts of one layer: ``nbytes`` of active experts, each applied to
        ``tokens_per_expert`` tokens (the measured MoE kernel where the profile has it)."""
        if nbytes <= 0 or tokens_per_expert <= 0:
            return 0.0
        if self.expert_gbs:
            return nbytes / (_interp(self.expert_gbs, tokens_per_expert) * 1e9)
        return self.matrix_seconds(nbytes, tokens_per_expert, bytes_per_weight)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["matrix_gbs"] = {str(k): v for k, v in self.matrix_gbs.items()}
        d["expert_gbs"] = {str(k): v for k, v in self.expert_gbs.items()}
        return {"format": PROFILE_FORMAT, **d}


def _interp(table: dict[int, float], tokens: float) -> float:
    """GB/s at ``tokens`` from a measured table, log-log interpolated; beyond its end compute-bound
    (GB/s falls as 1 / M)."""
    ms = sorted(table)
    if tokens <= ms[0]:
        return table[ms[0]]
    if tokens >= ms[-1]:
        return table[ms[-1]] * ms[-1] / tokens
    for lo, hi in zip(ms, ms[1:]):
        if lo <= tokens <= hi:
            t = (math.log(tokens) - math.log(lo)) / (math.log(hi) - math.log(lo))
            return math.exp((1 - t) * math.log(table[lo]) + t * math.log(table[hi]))
    raise AssertionError("unreachable")


def spec_sheet(name: str) -> Hardware:
    bw, tflops, source = SPEC_SHEETS[name]
    return Hardware(name, bw, tflops, GPU_STEP_OVERHEAD_US, source + f"; step overhead {GPU_STEP_OVERHEAD_US} us "
                    "assumed")


def load_profile(path: Union[str, Path]) -> Hardware:
    path = Path(path)
    try:
        obj = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"hardware profile {path}: cannot read it ({exc})") from None
    if not isinstance(obj, dict) or obj.get("format") != PROFILE_FORMAT:
        raise ValueError(f"hardware profile {path}: not a {PROFILE_FORMAT} file (write one with "
                         f"`moespec analyze profile`)")
    try:
        return Hardware(str(obj["name"]), float(obj["bandwidth_gbs"]), float(obj["peak_tflops"]),
                        float(obj["step_overhead_us"]), str(obj.get("source", path)),
                        {int(k): float(v) for k, v in obj.get("matrix_gbs", {}).items()},
                        None if obj.get("attention_gbs") is None else float(obj["attention_gbs"]),
                        {int(k): float(v) for k, v in obj.get("expert_gbs", {}).items()},
                        float(obj.get("token_layer_us", 0.0)))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"hardware profile {path}: missing or malformed field ({exc})") from None


def hardware(name_or_path: str) -> Hardware:
    """A built-in profile by name (a measured ``tests/gpu/profiles/<name>.json`` first), or a file."""
    key = name_or_path.lower()
    if key in SPEC_SHEETS:
        measured = Path(__file__).resolve().parents[3] / "tests" / "gpu" / "profiles" / f"{key}.json"
        return load_profile(measured) if measured.is_file() else spec_sheet(key)
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise ValueError(f"hardware profile {path} does not exist")
        return load_profile(path)
    raise ValueError(f"unknown hardware {name_or_path!r}: expected one of {', '.join(SPEC_SHEETS)} or a profile "
                     f".json (moespec analyze profile)")


# ---- measuring this machine -------------------------------------------------------------------


def measure_cpu(*, repeats: int = 5, matrix_mib: int = 128, hidden: int = 2048,
                experts: Optional[tuple[int, int, int]] = None, engine=None, progress: bool = True) -> Hardware:
    """This machine: read bandwidth, the runtime's bf16 matrix kernel at PROFILE_SIZES tokens on a
    ``matrix_mib`` MiB matrix of ``hidden`` columns (beyond the caches), the MoE kernel at 1..16
    tokens per expert when ``experts`` = (E, I, H) names a layer shape (every expert active), and a
    tiny model's decode step (the fixed cost per step); with ``engine`` (a loaded TargetModel) also
    the runtime's per-token, per-layer cost besides weights, from the native step's phase clock on
    a verify of 16 tokens after 128 (TOKEN_PHASES)."""
    import torch
    from tqdm import tqdm

    from moespec._loader import native
    from moespec.bench.roofline import _median_s, matmul_peak, stream_bandwidth
    from moespec.ops import linear, moe_experts

    if not 16 <= matrix_mib <= 4096:
        raise ValueError(f"--matrix-mib must be in [16, 4096], got {matrix_mib}")
    if not 16 <= hidden <= 65536:
        raise ValueError(f"hidden must be in [16, 65536], got {hidden}")
    stream = stream_bandwidth(1.0, repeats)
    peak = matmul_peak(repeats)["peak"]
    rows = matrix_mib * 2**20 // (2 * hidden)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(rows, hidden, generator=gen).bfloat16()
    table = {}
    for M in tqdm(PROFILE_SIZES, desc="profile: bf16 matrix kernel", disable=not progress, leave=False):
        x = torch.randn(M, hidden, generator=gen).bfloat16()
        table[M] = w.numel() * 2 / _median_s(lambda: linear(x, w), repeats) / 1e9
    expert_table = {}
    if experts is not None:
        E, I, H = experts
        layers = max(1, (matrix_mib * 2**20) // (E * 3 * I * H * 2))  # several layers: beyond the caches
        weights = [torch.randn(E, 3 * I * H, generator=gen).bfloat16() * 0.02 for _ in range(layers)]
        K = 2
        for m in (1, 2, 4, 8, 16):
            T = max(1, E * m // K)
            ids = ((torch.arange(T)[:, None] * K + torch.arange(K)[None]) % E).int()  # every expert m tokens
            x, wts = torch.randn(T, H, generator=gen).bfloat16(), torch.full((T, K), 0.5)
            seconds = _median_s(lambda: [moe_experts(x, ids, wts, lw, I) for lw in weights], repeats) / layers
            expert_table[m] = E * 3 * I * H * 2 / seconds / 1e9
    overhead = _tiny_step_seconds(repeats)
    token_us = _token_layer_seconds(engine, repeats) * 1e6 if engine is not None else 0.0
    shapes = f"matrix {rows}x{hidden}" + (f", experts E={experts[0]} I={experts[1]} H={experts[2]}" if experts else "")
    return Hardware("cpu", stream["read"], peak / 1e3, overhead * 1e6,
                    f"measured by moespec analyze profile ({native().num_threads()} threads, ISA {native().cpu_isa()}, "
                    f"{shapes})", table, expert_gbs=expert_table, token_layer_us=token_us)


TOKEN_PHASES = ("norms+residual", "rope+cache write", "attention", "router+routing")


def _token_layer_seconds(model, repeats: int, context: int = 128, tokens: int = 16) -> float:
    """Seconds per token and layer of the native step's TOKEN_PHASES (0 on another backend)."""
    if model.backend_name != "native":
        return 0.0
    decoder = model.backend.decoder
    cache = model.new_cache(1, context + tokens)
    model.prefill(cache, [[(5 * i + 1) % model.config.vocab_size for i in range(context)]])
    seq = [(7 * i + 3) % model.config.vocab_size for i in range(tokens)]
    parents = [-1] + list(range(tokens - 1))
    decoder.set_profiling(True)
    decoder.reset_profile()
    try:
        for _ in range(repeats):
            model.verify(cache, [seq], [parents])
            cache.pending = None
        phases = decoder.profile()
    finally:
        decoder.set_profiling(False)
    return sum(phases[p] for p in TOKEN_PHASES) / repeats / (tokens * model.config.num_layers)


def _tiny_step_seconds(repeats: int) -> float:
    """A decode step of a 2-layer model with H = 64: the runtime's fixed cost per step."""
    import torch

    from moespec.bench.roofline import _median_s

    from moespec.models.config import ModelConfig, MoeConfig, RopeConfig
    from moespec.models.runtime import TargetModel
    from moespec.models.weights import LayerWeights, ModelWeights
    from moespec.ops import RouterSpec

    H, E, I, V, D = 64, 8, 32, 256, 16
    moe = MoeConfig(num_experts=E, top_k=2, intermediate_size=I, router=RouterSpec("softmax", 2, True),
                    layers=(0, 1), weights_in_model_dtype=False)
    config = ModelConfig(architecture="MixtralForCausalLM", model_type="mixtral", vocab_size=V, hidden_size=H,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=D, intermediate_size=0,
                         rms_norm_eps=1e-5, rope=RopeConfig(10000.0), qk_norm="none", attention_bias=False,
                         clip_qkv=None, tie_word_embeddings=False, max_position_embeddings=512, moe=moe)
    gen = torch.Generator().manual_seed(0)
    r = lambda *shape: (0.1 * torch.randn(*shape, generator=gen)).bfloat16()  # noqa: E731
    layers = [LayerWeights(input_norm=torch.ones(H).bfloat16(), qkv=r(8 * D, H), qkv_bias=None, q_norm=None,
                           k_norm=None, o=r(H, 4 * D), o_bias=None, post_norm=torch.ones(H).bfloat16(),
                           router=r(E, H), experts=r(E, 3 * I * H)) for _ in range(2)]
    weights = ModelWeights(embed=r(V, H), layers=layers, final_norm=torch.ones(H).bfloat16(), lm_head=r(V, H),
                           dtype=torch.bfloat16)
    model = TargetModel(config, weights)
    cache = model.new_cache(1, 64)
    model.prefill(cache, [[1, 2, 3]])

    def step():
        model.decode(cache, [4])
        cache.lengths[0] = 3

    return _median_s(step, max(repeats, 20))


def save_profile(path: Union[str, Path], hw: Hardware) -> Path:
    from moespec.bench.report import write_json_atomic

    return write_json_atomic(Path(path), hw.to_json())

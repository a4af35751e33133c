"""DeepSeek-V3 (also DeepSeek-V3.1/R1 and Kimi-K2 configs): multi-head latent attention (a low-rank q
path with its norm, one compressed kv latent with its norm, the head split into no-rope and rope
parts, rope pairs interleaved), YaRN rope with its attention scale (mscale), the first
``first_k_dense_replace`` layers dense, every later layer MoE with shared experts beside the routed
ones (never budgeted): sigmoid scores, the correction bias on the selection, group-limited top-k,
``routed_scaling_factor``, router logits in float32."""

from __future__ import annotations

from moespec.models.config import MlaConfig, ModelConfig, MoeConfig, RawConfig, parse_common
from moespec.models.families.base import Family, TensorNames
from moespec.ops import RouterSpec


def parse_config(cfg: RawConfig, architecture: str) -> ModelConfig:
    common = parse_common(cfg, architecture)
    q_rank = cfg.get("q_lora_rank")
    mla = MlaConfig(q_lora_rank=int(q_rank) if q_rank is not None else None, kv_lora_rank=cfg.require("kv_lora_rank"),
                    qk_nope_head_dim=cfg.require("qk_nope_head_dim"), qk_rope_head_dim=cfg.require("qk_rope_head_dim"),
                    v_head_dim=cfg.require("v_head_dim"), rope_interleave=bool(cfg.get("rope_interleave", True)))
    common["head_dim"] = mla.qk_rope_head_dim  # D: the rope part (what the rope table covers)
    common["num_kv_heads"] = common["num_heads"]
    experts, top_k = cfg.require_any("n_routed_experts", "num_local_experts"), cfg.require("num_experts_per_tok")
    n_group, topk_group = int(cfg.get("n_group", 1)), int(cfg.get("topk_group", 1))
    if experts % n_group:
        raise cfg.fail("n_group", f"{experts} experts do not split into {n_group} groups")
    first_dense = int(cfg.get("first_k_dense_replace", 0))
    moe = MoeConfig(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=cfg.require("moe_intermediate_size"),
        router=RouterSpec("deepseek_v3", top_k, renormalize=bool(cfg.get("norm_topk_prob", True)), n_group=n_group,
                          topk_group=topk_group, scaling=float(cfg.get("routed_scaling_factor", 1.0))),
        layers=tuple(range(first_dense, common["num_layers"])),
        weights_in_model_dtype=False,  # float32 weights scale the experts' outputs
        shared_intermediate_size=cfg.require("moe_intermediate_size") * int(cfg.get("n_shared_experts", 0)),
        shared_gated=False,
        router_fp32=True,
        score_bias=True,
    )
    return ModelConfig(**common, qk_norm="none", moe=moe, mla=mla)


FAMILY = Family(
    architectures=("DeepseekV3ForCausalLM",),
    parse_config=parse_config,
    names=TensorNames(shared_expert="shared_experts."),
)

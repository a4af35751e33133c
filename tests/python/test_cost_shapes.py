"""The MoE shape catalogue (moespec.cost.shapes): parameter counts against the model cards, a
hand-computed tiny shape, MLA / sliding-window / linear-attention cache sizes, and lookup."""

from __future__ import annotations

import dataclasses

import pytest

from moespec.cost.shapes import CATALOGUE, MoeShape, shape

REQUIRED = ("mixtral-8x7b", "mixtral-8x22b", "olmoe-1b-7b", "qwen3-30b-a3b", "qwen3-235b-a22b",
            "qwen3-next-80b-a3b", "deepseek-v3", "kimi-k2", "gpt-oss-20b", "gpt-oss-120b", "glm-4.5")

TOLERANCE = 0.06
# Entries whose card figure no counting convention reaches within TOLERANCE, with the reason.
ACTIVE_TOLERANCE = {
    # The card's "3B activated" is the A3B name, rounded down: the checkpoint's own tensors give
    # 3.87B with the embedding table (Qwen's convention, as for qwen3-30b-a3b's 3.3B) and 3.56B
    # without; the total (79,674,391,296) matches the checkpoint exactly (test below).
    "qwen3-next-80b-a3b": 0.30,
}


def _table() -> str:
    rows = [f"{'entry':20s} {'total B':>9s} {'card':>7s} {'err':>7s} {'active B':>9s} "
            f"{'card-conv':>9s} {'card':>6s} {'err':>7s}"]
    for name, s in CATALOGUE.items():
        total, active, card = s.total_params / 1e9, s.active_params / 1e9, s.card_active_params / 1e9
        rows.append(f"{name:20s} {total:9.2f} {s.published_total_b:7.1f} "
                    f"{total / s.published_total_b - 1:+7.1%} {active:9.2f} {card:9.2f} "
                    f"{s.published_active_b:6.1f} {card / s.published_active_b - 1:+7.1%}")
    return "\n".join(rows)


def test_catalogue_has_the_required_entries():
    assert set(REQUIRED) <= set(CATALOGUE), sorted(set(REQUIRED) - set(CATALOGUE))
    for name, s in CATALOGUE.items():
        assert s.name == name and name == name.lower()
        assert "/" in s.hf_id, f"{name}: hf_id {s.hf_id!r} is not a Hugging Face repository id"
        assert s.published_total_b > 0 and s.published_active_b > 0, name


def test_counts_match_the_model_cards():
    bad = []
    for name, s in CATALOGUE.items():
        total_err = abs(s.total_params / 1e9 / s.published_total_b - 1)
        active_err = abs(s.card_active_params / 1e9 / s.published_active_b - 1)
        if total_err > TOLERANCE or active_err > ACTIVE_TOLERANCE.get(name, TOLERANCE):
            bad.append(name)
    assert not bad, f"off the published counts: {bad}\n{_table()}"


def test_active_params_is_what_a_token_reads():
    # active_params never counts the embedding table; the card convention adds it where the card does.
    for name, s in CATALOGUE.items():
        routed = s.top_k * s.expert_params * s.moe_layers
        assert s.active_params == s.dense_params + routed, name
        assert s.card_active_params - s.active_params in (0, s.vocab * s.hidden), name
        assert s.active_params < s.total_params, name


def test_exact_checkpoint_counts():
    # Tensor totals of the published checkpoints (safetensors metadata, MTP excluded), as recorded
    # by an independent counter (modelsheet-cli's catalogue tests): every weight is accounted for.
    assert shape("olmoe-1b-7b").total_params == 6_919_161_856
    assert shape("olmoe-1b-7b").card_active_params == 1_282_017_280
    assert shape("qwen3-next-80b-a3b").total_params == 79_674_391_296
    assert shape("qwen3-next-80b-a3b").card_active_params == 3_874_929_408
    # The gpt-oss model card's table (billions, 2 decimals): total 20.91 / 116.83, active 3.61 / 5.13.
    assert round(shape("gpt-oss-20b").total_params / 1e9, 2) == 20.91
    assert round(shape("gpt-oss-20b").active_params / 1e9, 2) == 3.61
    assert round(shape("gpt-oss-120b").total_params / 1e9, 2) == 116.83
    assert round(shape("gpt-oss-120b").active_params / 1e9, 2) == 5.13


# ---- a tiny shape, counted by hand -------------------------------------------------------------

TINY = MoeShape(name="tiny", hf_id="test/tiny", hidden=8, layers=2, dense_layers=1,
                dense_intermediate=6, num_experts=4, top_k=2, expert_intermediate=3,
                shared_intermediate=5, vocab=11, tied_embeddings=False, num_heads=2,
                num_kv_heads=1, head_dim=4)


def test_tiny_shape_by_hand():
    assert TINY.moe_layers == 1
    assert TINY.attention_type == "gqa"
    # one expert: gate 3x8 + up 3x8 + down 8x3
    assert TINY.expert_params == 24 + 24 + 24                      # 72
    # attention per layer: q 8x8 = 64, k 8x4 = 32, v 8x4 = 32, o 8x8 = 64 -> 192; two layers
    assert TINY.attention_params() == 2 * (64 + 32 + 32 + 64)       # 384
    # dense: attention 384 + norms (2 per layer + final) 5 x 8 = 40 + router 4x8 = 32
    #        + shared expert 3 x 8 x 5 = 120 + dense MLP 3 x 8 x 6 = 144 + lm_head 11 x 8 = 88
    assert TINY.dense_params == 384 + 40 + 32 + 120 + 144 + 88      # 808
    # total: embedding 88 + dense 808 + 4 experts x 72 x 1 MoE layer
    assert TINY.total_params == 88 + 808 + 288                      # 1184
    # active: dense 808 + 2 experts x 72 x 1 MoE layer
    assert TINY.active_params == 808 + 144                          # 952
    # kv: 2 layers x (k + v) 2 x 1 kv head x 4 x 10 tokens
    assert TINY.kv_elements(10) == 2 * 2 * 1 * 4 * 10               # 160
    # flops: 2 layers x 4 x 2 heads x 4 x 10 tokens
    assert TINY.attention_flops(10) == 2 * 4 * 2 * 4 * 10           # 640.0
    assert TINY.kv_elements(0) == 0


def test_tiny_shape_tied_and_with_biases():
    tied = dataclasses.replace(TINY, tied_embeddings=True)
    assert tied.dense_params == 808                # the lm_head is still read in full
    assert tied.total_params == 808 + 288          # the table is counted once
    biased = dataclasses.replace(TINY, expert_bias=True, qkv_bias=True, o_bias=True,
                                 qk_norm="head", attention_sinks=True, router_bias=True)
    # expert: + gate/up biases 2 x 3 + down bias 8
    assert biased.expert_params == 72 + 6 + 8
    # attention per layer: + q/k/v biases 8 + 4 + 4, o bias 8, q/k norms 4 + 4, 2 sinks
    assert biased.attention_params() == 2 * (192 + 16 + 8 + 8 + 2)
    # router: + 4 biases
    assert biased.router_params == 32 + 4


def test_gated_q_and_full_qk_norm_by_hand():
    gated = dataclasses.replace(TINY, gated_q=True, qk_norm="full", shared_expert_gate=True)
    # q 8 x 16 = 128, k 32, v 32, o 64, q_norm 8, k_norm 4
    assert gated.attention_params() == 2 * (128 + 32 + 32 + 64 + 8 + 4)
    assert gated.shared_expert_params == 120 + 8


# ---- cache sizes ------------------------------------------------------------------------------

TINY_MLA = MoeShape(name="tiny-mla", hf_id="test/tiny-mla", hidden=16, layers=2, dense_layers=0,
                    dense_intermediate=0, num_experts=4, top_k=1, expert_intermediate=3,
                    shared_intermediate=0, vocab=11, tied_embeddings=False, num_heads=2,
                    num_kv_heads=2, head_dim=5, kv_lora_rank=6, qk_rope_head_dim=2,
                    qk_nope_head_dim=3, v_head_dim=4)


def test_mla_reads_the_compressed_cache():
    assert TINY_MLA.attention_type == "mla"
    # per layer per token: kv_lora 6 + rope 2, not 2 x heads x head_dim
    assert TINY_MLA.kv_elements(10) == 2 * (6 + 2) * 10             # 160
    # absorbed: 2 x 2 heads x (6 + 2) + 2 x 2 heads x 6 = 56 per token per layer
    assert TINY_MLA.attention_flops(10) == 2 * 56 * 10              # 1120.0
    # q_proj 16 x 2 x (3 + 2) = 160, kv_a 16 x (6 + 2) = 128 + norm 6, kv_b 6 x 2 x (3 + 4) = 84,
    # o 2 x 4 x 16 = 128
    assert TINY_MLA.attention_params() == 2 * (160 + 128 + 6 + 84 + 128)
    with_q_lora = dataclasses.replace(TINY_MLA, q_lora_rank=3)
    # q_a 16 x 3 = 48 + norm 3, q_b 3 x 2 x 5 = 30 instead of q_proj 160
    assert with_q_lora.attention_params() == 2 * (48 + 3 + 30 + 128 + 6 + 84 + 128)
    v3 = shape("deepseek-v3")
    assert v3.kv_elements(1000) == 61 * (512 + 64) * 1000
    assert shape("kimi-k2").kv_elements(7) == 61 * 576 * 7


def test_sliding_layers_cap_at_the_window():
    sliding = dataclasses.replace(TINY, sliding_window=4, sliding_layers=1)
    per_token = 2 * 1 * 4
    assert sliding.kv_elements(3) == 2 * per_token * 3              # both under the window
    assert sliding.kv_elements(10) == per_token * 10 + per_token * 4
    assert sliding.kv_elements(1000) == per_token * 1000 + per_token * 4
    assert sliding.attention_flops(10) == 4 * 2 * 4 * (10 + 4)
    oss = shape("gpt-oss-20b")
    per_layer = 2 * 8 * 64
    assert oss.kv_elements(100) == 24 * per_layer * 100
    assert oss.kv_elements(4096) == 12 * per_layer * 4096 + 12 * per_layer * 128


def test_linear_attention_state_is_constant():
    nxt = shape("qwen3-next-80b-a3b")
    assert nxt.linear_attention_layers == 36 and nxt.full_layers == 12
    # recurrent state 32 value heads x 128 x 128 + conv state (2 x 16 x 128 + 32 x 128) x 3
    assert nxt.linear_attention_state == 32 * 128 * 128 + 8192 * 3
    # in_proj_qkvz 2048 x 12288 + in_proj_ba 2048 x 64 + conv 8192 x 4 + dt_bias/A_log 2 x 32
    # + norm 128 + out_proj 4096 x 2048
    assert nxt.linear_attention_params == (2048 * 12288 + 2048 * 64 + 8192 * 4 + 64 + 128
                                           + 4096 * 2048)
    const = 36 * nxt.linear_attention_state
    assert nxt.kv_elements(0) == const
    assert nxt.kv_elements(1000) - const == 12 * 2 * 2 * 256 * 1000
    assert nxt.attention_flops(2000) - nxt.attention_flops(1000) == 12 * 4 * 16 * 256 * 1000


# ---- lookup and validation ---------------------------------------------------------------------

def test_lookup():
    assert shape("Mixtral-8x7B") is CATALOGUE["mixtral-8x7b"]
    assert shape(" GLM-4.5 ") is CATALOGUE["glm-4.5"]
    with pytest.raises(ValueError, match="nope") as info:
        shape("nope")
    for key in REQUIRED:
        assert key in str(info.value)


@pytest.mark.parametrize("change, message", [
    (dict(top_k=5), "top_k"),
    (dict(dense_layers=2), "dense_layers"),
    (dict(dense_intermediate=0), "dense_intermediate"),
    (dict(hidden=0), "hidden"),
    (dict(num_kv_heads=3, num_heads=2), "num_kv_heads"),
    (dict(sliding_layers=1), "sliding_window"),
    (dict(linear_attention_layers=1), "linear_attention"),
    (dict(qk_norm="per-head"), "qk_norm"),
    (dict(name="Tiny"), "lower-case"),
    (dict(qk_rope_head_dim=2), "kv_lora_rank"),
])
def test_bad_shapes_raise(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **change)


def test_bad_context_raises():
    with pytest.raises(ValueError, match="context"):
        TINY.kv_elements(-1)
    with pytest.raises(ValueError, match="context"):
        TINY.attention_flops(2.5)

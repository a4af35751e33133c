"""The catalogue of real Mixture-of-Experts model shapes, for ``moespec analyze speedup`` and the
roofline cost model (bytes read and FLOPs of a decode or verify step).

Each entry is transcribed from the model's published Hugging Face ``config.json``; its ``hf_id``
names that source, and ``notes`` says what is approximated or left out (multi-token-prediction
modules are never counted). ``published_total_b`` / ``published_active_b`` are the model card's
figures, which the tests hold the counts below to.

Dimensions: L layers, H hidden, E experts, K top-k, I expert intermediate, V vocabulary.

Counting conventions (bf16-agnostic: everything here is in parameters / elements, never bytes):

* routed expert: SwiGLU gate and up ``[I, H]`` and down ``[H, I]``, so ``3 H I`` (+ biases);
* ``dense_params`` is what every token reads whatever it routes to: attention, layer norms, routers,
  shared experts, dense-layer MLPs and the full lm_head (``V H``, read each step even when tied);
  the embedding table is not in it (a token reads one row of it);
* ``active_params`` is ``dense_params`` plus K routed experts per MoE layer, i.e. the embedding
  table is NOT counted. Model cards disagree here (Mixtral, OLMoE and Qwen count it in their
  active figure; GPT-OSS counts only the unembedding), so each entry records its card's convention
  in ``card_counts_embeddings`` and :attr:`MoeShape.card_active_params` reproduces the card's figure.
"""

from __future__ import annotations

from dataclasses import dataclass

_QK_NORMS = ("", "head", "full")

# FLOPs per recurrent-state element for one decode token of a Gated DeltaNet layer: the decay
# (1), the delta rule's retrieval k^T S (2) and rank-1 update (2), and the read-out q^T S (2).
_LINEAR_FLOPS_PER_STATE_ELEMENT = 7


def gated_deltanet_params(hidden: int, key_heads: int, value_heads: int, key_head_dim: int,
                          value_head_dim: int, conv_kernel: int) -> int:
    """Parameters of one Qwen3-Next Gated DeltaNet block (HF ``Qwen3NextGatedDeltaNet``).

    in_proj_qkvz ``[2 Dk + 2 Dv, H]``, in_proj_ba ``[2 Hv, H]``, a depthwise conv1d without bias over
    the q, k, v channels ``[2 Dk + Dv, kernel]``, dt_bias and A_log ``[Hv]``, the gated norm
    ``[dv]`` and out_proj ``[H, Dv]`` (Dk = key heads x key dim, Dv = value heads x value dim).
    """
    key_dim, value_dim = key_heads * key_head_dim, value_heads * value_head_dim
    conv_dim = 2 * key_dim + value_dim
    return (hidden * (2 * key_dim + 2 * value_dim) + hidden * 2 * value_heads
            + conv_dim * conv_kernel + 2 * value_heads + value_head_dim + value_dim * hidden)


def gated_deltanet_state(key_heads: int, value_heads: int, key_head_dim: int, value_head_dim: int,
                         conv_kernel: int) -> int:
    """Elements of one Gated DeltaNet layer's state per sequence: the recurrent state
    ``[Hv, dk, dv]`` plus the convolution's last ``kernel - 1`` inputs of its ``2 Dk + Dv`` channels."""
    conv_dim = 2 * key_heads * key_head_dim + value_heads * value_head_dim
    return value_heads * key_head_dim * value_head_dim + conv_dim * (conv_kernel - 1)


@dataclass(frozen=True)
class MoeShape:
    """One MoE decoder's shape: enough to count its weights, KV cache and attention FLOPs."""

    name: str                 # catalogue key, lower-case
    hf_id: str                # the Hugging Face repository whose config.json this transcribes
    hidden: int               # H
    layers: int               # L, all decoder layers (MTP modules excluded)
    dense_layers: int         # layers whose feed-forward is a dense MLP (first_k_dense_replace)
    dense_intermediate: int   # intermediate size of those dense MLPs (0 if none)
    num_experts: int          # E routed experts per MoE layer
    top_k: int                # K
    expert_intermediate: int  # I of one routed expert
    shared_intermediate: int  # total intermediate size of the shared expert(s) per MoE layer
    vocab: int                # V
    tied_embeddings: bool
    num_heads: int
    num_kv_heads: int         # MLA: the config's num_key_value_heads (= num_heads), unused
    head_dim: int             # MLA: qk_nope + qk_rope (the q/k head size), unused
    expert_bias: bool = False          # GPT-OSS: biases on gate_up and down
    q_lora_rank: int = 0               # MLA (DeepSeek-V3, Kimi-K2); all 0 for GQA models
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    sliding_window: int = 0            # window of the sliding layers (0 = none)
    sliding_layers: int = 0            # how many layers use the window
    linear_attention_layers: int = 0   # Qwen3-Next: Gated DeltaNet layers (constant-size state)
    linear_attention_params: int = 0   # params of ONE such layer's attention block
    linear_attention_state: int = 0    # elements of ONE such layer's state per sequence
    published_total_b: float = 0.0     # model card: total parameters, billions
    published_active_b: float = 0.0    # model card: active parameters per token, billions
    notes: str = ""
    # Details of the attention and router blocks that change the counts (all off by default).
    qkv_bias: bool = False             # biases on q, k, v (GLM-4.5, GPT-OSS)
    o_bias: bool = False               # bias on o_proj (GPT-OSS)
    qk_norm: str = ""                  # "head": RMSNorm(head_dim) on q and k (Qwen3, GLM-4.5);
                                       # "full": over all q / all k channels (OLMoE)
    attention_sinks: bool = False      # one learned sink logit per head per layer (GPT-OSS)
    gated_q: bool = False              # q_proj also emits a per-channel output gate (Qwen3-Next)
    router_bias: bool = False          # E router biases per MoE layer (GPT-OSS bias, DeepSeek-style
                                       # e_score_correction_bias)
    shared_expert_gate: bool = False   # Linear(H, 1) gating the shared expert (Qwen3-Next)
    card_counts_embeddings: bool = False  # the card's active figure includes the embedding table

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.lower():
            raise ValueError(f"MoeShape name must be a non-empty lower-case key, got {self.name!r}")
        where = f"MoeShape {self.name!r}"
        for field in ("hidden", "layers", "num_experts", "top_k", "expert_intermediate", "vocab",
                      "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{where}: {field} must be a positive int, got {value!r}")
        for field in ("dense_layers", "dense_intermediate", "shared_intermediate", "q_lora_rank",
                      "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                      "sliding_window", "sliding_layers", "linear_attention_layers",
                      "linear_attention_params", "linear_attention_state"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where}: {field} must be a non-negative int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"{where}: top_k {self.top_k} exceeds num_experts {self.num_experts}")
        if self.dense_layers >= self.layers:
            raise ValueError(f"{where}: dense_layers {self.dense_layers} leaves no MoE layer "
                             f"of {self.layers}")
        if (self.dense_layers > 0) != (self.dense_intermediate > 0):
            raise ValueError(f"{where}: dense_layers and dense_intermediate must both be 0 or "
                             f"both positive, got {self.dense_layers} and {self.dense_intermediate}")
        if (self.sliding_layers > 0) != (self.sliding_window > 0):
            raise ValueError(f"{where}: sliding_layers and sliding_window must both be 0 or both "
                             f"positive, got {self.sliding_layers} and {self.sliding_window}")
        linear = (self.linear_attention_layers, self.linear_attention_params,
                  self.linear_attention_state)
        if any(linear) and not all(linear):
            raise ValueError(f"{where}: linear_attention_layers, _params and _state must all be 0 "
                             f"or all positive, got {linear}")
        if self.sliding_layers + self.linear_attention_layers > self.layers:
            raise ValueError(f"{where}: {self.sliding_layers} sliding + "
                             f"{self.linear_attention_layers} linear-attention layers exceed "
                             f"{self.layers} layers")
        if self.qk_norm not in _QK_NORMS:
            raise ValueError(f"{where}: qk_norm must be one of {_QK_NORMS}, got {self.qk_norm!r}")
        if self.kv_lora_rank:
            if not (self.qk_rope_head_dim and self.qk_nope_head_dim and self.v_head_dim):
                raise ValueError(f"{where}: MLA (kv_lora_rank > 0) needs qk_rope_head_dim, "
                                 "qk_nope_head_dim and v_head_dim")
            if self.sliding_layers or self.linear_attention_layers or self.gated_q or self.qk_norm:
                raise ValueError(f"{where}: MLA with sliding, linear-attention, gated-q or q/k-norm "
                                 "layers is not modelled")
        else:
            if self.q_lora_rank or self.qk_rope_head_dim or self.qk_nope_head_dim or self.v_head_dim:
                raise ValueError(f"{where}: MLA fields set without kv_lora_rank")
            if self.num_heads % self.num_kv_heads:
                raise ValueError(f"{where}: num_heads {self.num_heads} is not a multiple of "
                                 f"num_kv_heads {self.num_kv_heads}")

    # ---- structure ---------------------------------------------------------------------------

    @classmethod
    def from_config(cls, config, name: str = "", hf_id: str = "") -> "MoeShape":
        """The shape of a parsed :class:`moespec.models.config.ModelConfig` (the runtime's one config
        parser: every family it loads, an engine's manifest included). MoE layers must be the last
        ones (as in every family here: DeepSeek's dense layers come first)."""
        c, moe, mla = config, config.moe, config.mla
        if moe is None:
            raise ValueError(f"{c.architecture}: a dense model has no MoE shape")
        dense = c.num_layers - len(moe.layers)
        if tuple(moe.layers) != tuple(range(dense, c.num_layers)):
            raise ValueError(f"{c.architecture}: MoE layers {list(moe.layers)} are not the last ones")
        return cls(
            name=name or c.model_type, hf_id=hf_id, hidden=c.hidden_size, layers=c.num_layers, dense_layers=dense,
            dense_intermediate=c.intermediate_size if dense else 0, num_experts=moe.num_experts, top_k=moe.top_k,
            expert_intermediate=moe.intermediate_size, shared_intermediate=moe.shared_intermediate_size,
            vocab=c.vocab_size, tied_embeddings=c.tie_word_embeddings, num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads, head_dim=mla.qk_head_dim if mla else c.head_dim,
            expert_bias=moe.expert_biases, q_lora_rank=(mla.q_lora_rank or 0) if mla else 0,
            kv_lora_rank=mla.kv_lora_rank if mla else 0, qk_rope_head_dim=mla.qk_rope_head_dim if mla else 0,
            qk_nope_head_dim=mla.qk_nope_head_dim if mla else 0, v_head_dim=mla.v_head_dim if mla else 0,
            sliding_window=c.sliding_window, sliding_layers=len(c.sliding_layers),
            qkv_bias=c.attention_bias, o_bias=c.attention_bias,
            qk_norm={"none": "", "per_head": "head", "full": "full"}[c.qk_norm], attention_sinks=c.attention_sinks,
            router_bias=moe.router_bias or moe.score_bias, shared_expert_gate=moe.shared_gated and bool(
                moe.shared_intermediate_size))

    @property
    def moe_layers(self) -> int:
        """Layers whose feed-forward is the routed MoE block."""
        return self.layers - self.dense_layers

    @property
    def attention_type(self) -> str:
        """``"mla"`` (compressed latent KV cache) or ``"gqa"`` (grouped-query, MHA included)."""
        return "mla" if self.kv_lora_rank else "gqa"

    @property
    def softmax_layers(self) -> int:
        """Layers with softmax attention over a KV cache (full or sliding), i.e. not linear."""
        return self.layers - self.linear_attention_layers

    @property
    def full_layers(self) -> int:
        """Softmax-attention layers that attend to the whole context."""
        return self.softmax_layers - self.sliding_layers

    # ---- parameters --------------------------------------------------------------------------

    @property
    def expert_params(self) -> int:
        """One routed expert: ``3 H I`` (+ ``2 I + H`` biases with ``expert_bias``)."""
        bias = 2 * self.expert_intermediate + self.hidden if self.expert_bias else 0
        return 3 * self.hidden * self.expert_intermediate + bias

    def _softmax_layer_attention_params(self) -> int:
        h, heads = self.hidden, self.num_heads
        if self.kv_lora_rank:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank:  # q_a_proj, q_a_layernorm, q_b_proj
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * qk
            else:                 # q_proj
                q = h * heads * qk
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank  # + norm
            kv_b = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv_a + kv_b + heads * self.v_head_dim * h
        q_out = heads * self.head_dim * (2 if self.gated_q else 1)
        kv_out = self.num_kv_heads * self.head_dim
        params = h * q_out + 2 * h * kv_out + heads * self.head_dim * h
        if self.qkv_bias:
            params += q_out + 2 * kv_out
        if self.o_bias:
            params += h
        if self.qk_norm == "head":
            params += 2 * self.head_dim
        elif self.qk_norm == "full":
            params += heads * self.head_dim + kv_out
        if self.attention_sinks:
            params += heads
        return params

    def attention_params(self) -> int:
        """All layers' attention blocks: projections, their biases and norms (q/k norms, MLA's
        q_a / kv_a norms), sinks; linear-attention layers count ``linear_attention_params``."""
        return (self.softmax_layers * self._softmax_layer_attention_params()
                + self.linear_attention_layers * self.linear_attention_params)

    @property
    def norm_params(self) -> int:
        """Layer norms: input and post-attention RMSNorm per layer, and the final norm."""
        return (2 * self.layers + 1) * self.hidden

    @property
    def router_params(self) -> int:
        """Routers of all MoE layers: ``E H`` (+ ``E`` biases) each."""
        bias = self.num_experts if self.router_bias else 0
        return self.moe_layers * (self.num_experts * self.hidden + bias)

    @property
    def shared_expert_params(self) -> int:
        """Shared experts of all MoE layers: ``3 H I_shared`` (+ the shared gate) each."""
        if not self.shared_intermediate:
            return 0
        gate = self.hidden if self.shared_expert_gate else 0
        return self.moe_layers * (3 * self.hidden * self.shared_intermediate + gate)

    @property
    def dense_mlp_params(self) -> int:
        """The dense MLPs of the first ``dense_layers`` layers."""
        return self.dense_layers * 3 * self.hidden * self.dense_intermediate

    @property
    def embedding_params(self) -> int:
        """The embedding table, ``V H`` (the lm_head too when tied)."""
        return self.vocab * self.hidden

    @property
    def dense_params(self) -> int:
        """What every token reads whatever it routes to: attention, norms, routers, shared experts,
        dense-layer MLPs and the whole lm_head (``V H``, even when tied). Excludes the embedding
        table (only the tokens' rows are read) and the routed experts."""
        return (self.attention_params() + self.norm_params + self.router_params
                + self.shared_expert_params + self.dense_mlp_params + self.vocab * self.hidden)

    @property
    def routed_expert_params(self) -> int:
        """All routed experts of all MoE layers."""
        return self.num_experts * self.expert_params * self.moe_layers

    @property
    def total_params(self) -> int:
        """Every weight: embeddings (once if tied), dense params and all routed experts."""
        embedding = 0 if self.tied_embeddings else self.embedding_params
        return embedding + self.dense_params + self.routed_expert_params

    @property
    def active_params(self) -> int:
        """Weights one token reads: ``dense_params`` + K routed experts per MoE layer. The lm_head
        is counted, the embedding table is not (one row per token is negligible); see
        :attr:`card_active_params` for the model card's own convention."""
        return self.dense_params + self.top_k * self.expert_params * self.moe_layers

    @property
    def card_active_params(self) -> int:
        """``active_params`` counted as the model card counts it: plus the embedding table when
        ``card_counts_embeddings`` (and the table is not already counted as the tied lm_head)."""
        extra = self.embedding_params if self.card_counts_embeddings and not self.tied_embeddings else 0
        return self.active_params + extra

    # ---- per-token attention traffic and compute ---------------------------------------------

    @staticmethod
    def _check_context(context: int) -> None:
        if isinstance(context, bool) or not isinstance(context, int) or context < 0:
            raise ValueError(f"context must be a non-negative int (cached tokens), got {context!r}")

    def _attended(self, context: int) -> int:
        """Cached tokens attended to, summed over the softmax-attention layers."""
        window = min(context, self.sliding_window)
        return self.full_layers * context + self.sliding_layers * window

    def kv_elements(self, context: int) -> int:
        """Elements one token's attention reads from the cache over ``context`` cached tokens,
        summed over layers. GQA: ``2 kv_heads head_dim`` per attended token (sliding layers attend
        to ``min(context, window)``); MLA: the compressed ``kv_lora_rank + qk_rope_head_dim``;
        linear-attention layers: their constant ``linear_attention_state``."""
        self._check_context(context)
        if self.kv_lora_rank:
            per_token = self.kv_lora_rank + self.qk_rope_head_dim
        else:
            per_token = 2 * self.num_kv_heads * self.head_dim
        return (per_token * self._attended(context)
                + self.linear_attention_layers * self.linear_attention_state)

    def attention_flops(self, context: int) -> float:
        """FLOPs of one token's attention scores and weighted sum over ``context`` cached tokens,
        summed over layers (projections excluded: they are 2 FLOPs per weight).

        GQA: ``4 num_heads head_dim`` per attended token. MLA, in the absorbed form that reads the
        compressed cache: ``2 num_heads (kv_lora_rank + rope)`` for the scores plus
        ``2 num_heads kv_lora_rank`` for the weighted sum. Linear attention (Gated DeltaNet): about
        7 FLOPs per state element per token (decay, delta-rule retrieval and update, read-out;
        the small conv state is counted at the same rate), independent of ``context``.
        """
        self._check_context(context)
        if self.kv_lora_rank:
            per_token = (2 * self.num_heads * (self.kv_lora_rank + self.qk_rope_head_dim)
                         + 2 * self.num_heads * self.kv_lora_rank)
        else:
            per_token = 4 * self.num_heads * self.head_dim
        linear = (self.linear_attention_layers * self.linear_attention_state
                  * _LINEAR_FLOPS_PER_STATE_ELEMENT)
        return float(per_token * self._attended(context) + linear)


# ---- the catalogue ---------------------------------------------------------------------------

_QWEN3_NEXT_LINEAR = dict(key_heads=16, value_heads=32, key_head_dim=128, value_head_dim=128,
                          conv_kernel=4)

_ENTRIES: tuple[MoeShape, ...] = (
    MoeShape(
        name="mixtral-8x7b", hf_id="mistralai/Mixtral-8x7B-v0.1",
        hidden=4096, layers=32, dense_layers=0, dense_intermediate=0,
        num_experts=8, top_k=2, expert_intermediate=14336, shared_intermediate=0,
        vocab=32000, tied_embeddings=False, num_heads=32, num_kv_heads=8, head_dim=128,
        published_total_b=46.7, published_active_b=12.9, card_counts_embeddings=True,
        notes="config sliding_window is null (no sliding layers)."),
    MoeShape(
        name="mixtral-8x22b", hf_id="mistralai/Mixtral-8x22B-Instruct-v0.1",
        hidden=6144, layers=56, dense_layers=0, dense_intermediate=0,
        num_experts=8, top_k=2, expert_intermediate=16384, shared_intermediate=0,
        vocab=32768, tied_embeddings=False, num_heads=48, num_kv_heads=8, head_dim=128,
        published_total_b=141.0, published_active_b=39.0, card_counts_embeddings=True,
        notes="vocab 32768 is the Instruct (v3 tokenizer) config; the base "
              "mistralai/Mixtral-8x22B-v0.1 config has 32000 (9.4M fewer parameters)."),
    MoeShape(
        name="olmoe-1b-7b", hf_id="allenai/OLMoE-1B-7B-0924",
        hidden=2048, layers=16, dense_layers=0, dense_intermediate=0,
        num_experts=64, top_k=8, expert_intermediate=1024, shared_intermediate=0,
        vocab=50304, tied_embeddings=False, num_heads=16, num_kv_heads=16, head_dim=128,
        qk_norm="full", published_total_b=6.9, published_active_b=1.3, card_counts_embeddings=True,
        notes="q_norm over all 2048 q channels and k_norm over all 2048 k channels (not per head)."),
    MoeShape(
        name="qwen3-30b-a3b", hf_id="Qwen/Qwen3-30B-A3B",
        hidden=2048, layers=48, dense_layers=0, dense_intermediate=0,
        num_experts=128, top_k=8, expert_intermediate=768, shared_intermediate=0,
        vocab=151936, tied_embeddings=False, num_heads=32, num_kv_heads=4, head_dim=128,
        qk_norm="head", published_total_b=30.5, published_active_b=3.3, card_counts_embeddings=True,
        notes="decoder_sparse_step 1, mlp_only_layers [] (every layer MoE)."),
    MoeShape(
        name="qwen3-235b-a22b", hf_id="Qwen/Qwen3-235B-A22B",
        hidden=4096, layers=94, dense_layers=0, dense_intermediate=0,
        num_experts=128, top_k=8, expert_intermediate=1536, shared_intermediate=0,
        vocab=151936, tied_embeddings=False, num_heads=64, num_kv_heads=4, head_dim=128,
        qk_norm="head", published_total_b=235.0, published_active_b=22.0,
        card_counts_embeddings=True,
        notes="decoder_sparse_step 1, mlp_only_layers [] (every layer MoE)."),
    MoeShape(
        name="qwen3-next-80b-a3b", hf_id="Qwen/Qwen3-Next-80B-A3B-Instruct",
        hidden=2048, layers=48, dense_layers=0, dense_intermediate=0,
        num_experts=512, top_k=10, expert_intermediate=512, shared_intermediate=512,
        vocab=151936, tied_embeddings=False, num_heads=16, num_kv_heads=2, head_dim=256,
        qk_norm="head", gated_q=True, shared_expert_gate=True,
        linear_attention_layers=36,
        linear_attention_params=gated_deltanet_params(hidden=2048, **_QWEN3_NEXT_LINEAR),
        linear_attention_state=gated_deltanet_state(**_QWEN3_NEXT_LINEAR),
        published_total_b=80.0, published_active_b=3.0, card_counts_embeddings=True,
        notes="full_attention_interval 4: 12 gated full-attention layers (q_proj emits q and its "
              "gate), 36 Gated DeltaNet layers (16 key / 32 value heads of 128, conv kernel 4); "
              "the DeltaNet state is usually kept in fp32 (twice the KV dtype's bytes); MTP "
              "module excluded. The card's 3B active is the A3B name's rounding: the count here "
              "is 3.87B with the embedding table, 3.56B without."),
    MoeShape(
        name="deepseek-v3", hf_id="deepseek-ai/DeepSeek-V3",
        hidden=7168, layers=61, dense_layers=3, dense_intermediate=18432,
        num_experts=256, top_k=8, expert_intermediate=2048, shared_intermediate=2048,
        vocab=129280, tied_embeddings=False, num_heads=128, num_kv_heads=128, head_dim=192,
        q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, router_bias=True, published_total_b=671.0, published_active_b=37.0,
        notes="MTP module (num_nextn_predict_layers 1, ~14B) excluded, as in the published 671B; "
              "router bias = e_score_correction_bias."),
    MoeShape(
        name="kimi-k2", hf_id="moonshotai/Kimi-K2-Instruct",
        hidden=7168, layers=61, dense_layers=1, dense_intermediate=18432,
        num_experts=384, top_k=8, expert_intermediate=2048, shared_intermediate=2048,
        vocab=163840, tied_embeddings=False, num_heads=64, num_kv_heads=64, head_dim=192,
        q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, router_bias=True, published_total_b=1040.0, published_active_b=32.0,
        notes="DeepSeek-V3 architecture (num_nextn_predict_layers 0); total 1.04T from the "
              "technical report (the card rounds to 1T)."),
    MoeShape(
        name="gpt-oss-20b", hf_id="openai/gpt-oss-20b",
        hidden=2880, layers=24, dense_layers=0, dense_intermediate=0,
        num_experts=32, top_k=4, expert_intermediate=2880, shared_intermediate=0,
        vocab=201088, tied_embeddings=False, num_heads=64, num_kv_heads=8, head_dim=64,
        expert_bias=True, qkv_bias=True, o_bias=True, attention_sinks=True, router_bias=True,
        sliding_window=128, sliding_layers=12,
        published_total_b=21.0, published_active_b=3.6, card_counts_embeddings=False,
        notes="layer_types alternate sliding (window 128) and full attention; experts are MXFP4 "
              "in the checkpoint (counted here as parameters); the card's active count includes "
              "the unembedding but not the embedding."),
    MoeShape(
        name="gpt-oss-120b", hf_id="openai/gpt-oss-120b",
        hidden=2880, layers=36, dense_layers=0, dense_intermediate=0,
        num_experts=128, top_k=4, expert_intermediate=2880, shared_intermediate=0,
        vocab=201088, tied_embeddings=False, num_heads=64, num_kv_heads=8, head_dim=64,
        expert_bias=True, qkv_bias=True, o_bias=True, attention_sinks=True, router_bias=True,
        sliding_window=128, sliding_layers=18,
        published_total_b=117.0, published_active_b=5.1, card_counts_embeddings=False,
        notes="as gpt-oss-20b: alternating sliding (128) / full layers, MXFP4 experts, card's "
              "active count includes the unembedding but not the embedding."),
    MoeShape(
        name="glm-4.5", hf_id="zai-org/GLM-4.5",
        hidden=5120, layers=92, dense_layers=3, dense_intermediate=12288,
        num_experts=160, top_k=8, expert_intermediate=1536, shared_intermediate=1536,
        vocab=151552, tied_embeddings=False, num_heads=96, num_kv_heads=8, head_dim=128,
        qkv_bias=True, qk_norm="head", router_bias=True,
        published_total_b=355.0, published_active_b=32.0, card_counts_embeddings=False,
        notes="attention_bias (q, k, v), use_qk_norm true, partial_rotary_factor 0.5; MTP layer "
              "(num_nextn_predict_layers 1) excluded; router bias = e_score_correction_bias."),
)

CATALOGUE: dict[str, MoeShape] = {}
for _entry in _ENTRIES:
    if _entry.name in CATALOGUE:
        raise ValueError(f"duplicate catalogue key {_entry.name!r}")
    CATALOGUE[_entry.name] = _entry
del _entry


def shape(name: str) -> MoeShape:
    """The catalogue entry ``name`` (case-insensitive); ValueError naming the known keys if none."""
    if not isinstance(name, str):
        raise ValueError(f"MoE shape name must be a str, got {name!r}")
    entry = CATALOGUE.get(name.strip().lower())
    if entry is None:
        raise ValueError(f"unknown MoE shape {name!r}; known: {', '.join(sorted(CATALOGUE))}")
    return entry


__all__ = ["CATALOGUE", "MoeShape", "gated_deltanet_params", "gated_deltanet_state", "shape"]

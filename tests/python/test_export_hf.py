"""moespec export-hf: an engine folder back as a Hugging Face checkpoint. transformers loads the
export into exactly the source checkpoint's model (every parameter equal, the logits equal) for every
family, GPT-OSS's interleaved experts and DeepSeek-V3's MLA included; the draft head and tokenizer go
with it; bad folders and an existing --out are clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import test_deepseek_v3 as deepseek_fixtures
import test_gpt_oss as gpt_oss_fixtures
from models_fixtures import FAMILIES, write_checkpoint
from moespec.engine import build_engine
from moespec.engine.export_hf import export_hf

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = torch.tensor([[3, 17, 99, 5, 42, 8, 77, 12]])
WRITERS = {f: (lambda out, f=f: write_checkpoint(f, out)) for f in FAMILIES} | {
    "gpt_oss": gpt_oss_fixtures.write, "deepseek_v3": lambda out: deepseek_fixtures.write(out, 24)}


def _hf(folder):
    kwargs = {} if "llama" in str(folder) else {"experts_implementation": "eager"}
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()


@pytest.mark.parametrize("family", list(WRITERS))
def test_transformers_loads_the_export_as_the_source(family, tmp_path):
    source = WRITERS[family](tmp_path / family)
    engine = build_engine(source, tmp_path / "engine", dtype="fp32", progress=False).folder
    out = export_hf(engine, tmp_path / "hf", progress=False)
    want, got = _hf(source), _hf(out)
    a, b = want.state_dict(), got.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    with torch.no_grad():
        assert torch.equal(want(PROMPT).logits, got(PROMPT).logits)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def test_the_draft_head_goes_with_it_and_errors_are_clear(tmp_path):
    from test_bad_input import _head_of_another_target

    source = write_checkpoint("qwen3_moe", tmp_path / "src")
    head = _head_of_another_target(source, tmp_path / "head", hidden=64)
    engine = build_engine(source, tmp_path / "engine", draft=head, dtype="bf16", progress=False).folder
    out = export_hf(engine, tmp_path / "hf", progress=False)
    assert (out / "draft" / "config.json").is_file() and json.loads((out / "config.json").read_text())["dtype"] == \
        "bfloat16"
    with pytest.raises(ValueError, match="exists: pass --force"):
        export_hf(engine, out, progress=False)
    export_hf(engine, out, force=True, progress=False)  # replaced in place
    with pytest.raises(ValueError, match="into the engine folder"):
        export_hf(engine, engine / "hf", progress=False)
    manifest = json.loads((engine / "manifest.json").read_text())
    del manifest["provenance"]["source"]["config"]
    (engine / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="records no source config.json"):
        export_hf(engine, tmp_path / "hf2", progress=False)
    run = subprocess.run([sys.executable, "-m", "moespec", "export-hf", "--engine", str(tmp_path / "src"), "--out",
                          str(tmp_path / "x")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "not an engine folder" in run.stderr and "Traceback" not in run.stderr

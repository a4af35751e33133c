"""``moespec bench throughput|latency|compare``: trtllm-bench-style runs over an engine folder
(``moespec bench roofline``, step times against the machine's roofline, is :mod:`moespec.bench.roofline`).

    moespec bench throughput --engine <folder> --dataset <jsonl> [--num-requests N]
        [--max-batch-size B | --concurrency C] [--warmup W] [--policy ar|eagle3|eagle3+budget] [--budget B]
        [--depth D] [--top-k K] [--total-tokens M] [--temperature T] [--top-p P] [--seed S]
        [--report-json <file>]
    moespec bench latency --engine <folder> --dataset <jsonl> [same, without batch options]
    moespec bench compare --engine <folder> --dataset <jsonl> --policies ar,eagle3,eagle3+budget:16,...
        [--num-requests N] [--max-batch-size B] [--warmup W] [--out-dir <folder>] [--dtype bf16|fp32]

Every request generates exactly its ``output_tokens`` (SamplingParams(max_tokens=output_tokens,
ignore_eos=True)), greedy unless --temperature says otherwise, in dataset order. Metrics and the
report layout: :mod:`moespec.bench.metrics`, :mod:`moespec.bench.report`.

How runs are timed (``time.perf_counter_ns``):
- throughput: static batches of B consecutive requests, one ``LLM(max_batch_size=B).generate``
  call each. A request's start is the instant before its batch's call (its submission); its first
  token and end are that start plus RequestStats.time_to_first_token and wall_time, which the LLM
  measures from its own start of the batch, a little later (after encoding the prompts: microseconds
  for token ids), so TTFT and E2E are short by that much. Where RequestStats carries absolute
  ``first_token_ns`` / ``end_ns`` (perf_counter_ns), those are used instead. ``--concurrency C``
  means at most C requests in flight; with static batches that is batches of C (a batch is issued
  when the previous one has finished, so fewer than C are in flight at the tail of each batch).
- latency: batch 1, one request at a time through ``LLM.generate_stream``: start before the first
  step, first token when the first output arrives (after the prefill), end when the last arrives.
- compare: the policies run the same batches in one process, interleaved batch by batch with the
  order rotated each round, so that machine drift hits all alike. A policy's tokens/s is its output
  tokens over the summed wall time of its own generate calls; its embedded report uses the same
  per-request timestamps, shifted so that its batches follow each other without the others' gaps.
The quality proxy of compare is :func:`continuation_logprobs`.

Ctrl-C stops a run between batches or mid-batch (that batch is lost) and reports the finished
requests, marked partial (exit status 130). Dimensions: N requests, B batch size, V vocabulary.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
from tqdm import tqdm

from moespec.bench import metrics as m
from moespec.bench.report import format_compare, format_report, make_report, write_json

from moespec.config import DEFAULT_TREE, POLICY_FORMS, default_policy, parse_policy_text  # noqa: E402


class NothingToReport(RuntimeError):
    """Interrupted before any request finished."""


# ---- the engine, the requests, the policies -----------------------------------------------------


@dataclass
class Engine:
    """An engine folder opened once: target (memory-mapped), draft head, tokenizer, manifest."""

    folder: Path
    target: Any  # TargetModel
    info: Any  # EngineInfo
    head: Any = None  # Eagle3Head or None
    tokenizer: Any = None

    @property
    def moe_layers(self) -> int:
        return len(self.target.config.moe_layers) if self.target.config.moe is not None else 0


def open_engine(folder: Union[str, Path], dtype: Optional[str] = None, device: str = "cpu") -> Engine:
    """Loads an engine folder, in ``dtype`` ("bf16" | "fp32") instead of its own when given (converted
    in memory), onto ``device`` ("cpu" | "cuda[:i]"); ValueError naming the problem for a missing or
    broken one."""
    from moespec.data.datasets import load_tokenizer
    from moespec.engine import load_engine
    from moespec.spec.eagle3 import load_eagle3

    target, info = load_engine(folder, dtype=dtype, device=device)
    head = load_eagle3(info.draft_folder, target) if info.draft_folder is not None else None
    tokenizer = load_tokenizer(info.tokenizer_folder) if info.tokenizer_folder is not None else None
    return Engine(Path(folder), target, info, head, tokenizer)


@dataclass(frozen=True)
class Request:
    task_id: int
    input_ids: list[int]  # [L]
    output_tokens: int


def load_requests(dataset: Union[str, Path], engine: Engine, num_requests: Optional[int] = None) -> list[Request]:
    """The first ``num_requests`` requests of a trtllm-bench dataset (all when None or 0), as token
    ids: ``prompt`` texts go through the engine's tokenizer (a ValueError when it has none)."""
    from moespec.data.datasets import read_dataset

    path = Path(dataset)
    if not path.is_file():
        raise ValueError(f"dataset {str(path)!r} does not exist" if not path.exists() else
                         f"dataset {path} is not a file (expected trtllm-bench JSON Lines)")
    if num_requests is not None and num_requests < 0:
        raise ValueError(f"--num-requests must be >= 0 (0 = all), got {num_requests}")
    entries = read_dataset(path)
    if not entries:
        raise ValueError(f"{path}: the dataset has no requests")
    entries = entries[: num_requests or None]
    V = engine.target.config.vocab_size
    out = []
    for line, e in enumerate(entries, 1):  # read_dataset allows no blank lines: entry i is line i
        if e.input_ids is not None:
            ids = list(e.input_ids)
        elif engine.tokenizer is None:
            raise ValueError(f"{path} line {line}: task_id {e.task_id} has a text prompt, but the engine "
                             f"{engine.folder} has no tokenizer to encode it: give input_ids (moespec "
                             f"prepare-dataset --tokenizer <folder>) or build the engine from a checkpoint with "
                             f"tokenizer files")
        else:
            ids = list(engine.tokenizer.encode(e.prompt))
        bad = [t for t in ids if t >= V]
        if bad:
            raise ValueError(f"{path} line {line}: task_id {e.task_id}: token id {bad[0]} is outside the engine's "
                             f"vocabulary [0, {V})")
        out.append(Request(e.task_id, ids, e.output_tokens))
    return out


@dataclass(frozen=True)
class Sampling:
    """The sampling flags; a request's seed is ``seed + task_id``."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def params(self, r: Request):
        from moespec.spec.sampling import SamplingParams

        return SamplingParams(max_tokens=r.output_tokens, temperature=self.temperature, top_p=self.top_p,
                              seed=self.seed + r.task_id, ignore_eos=True)


@dataclass(frozen=True)
class PolicyChoice:
    label: str  # "ar", "eagle3", "eagle3+budget:16", "eagle3+budget:16:truncation", "eagle3+budget:12:gates"
    config: Any  # SpeculativeConfig

    @property
    def budget(self) -> Optional[int]:
        return self.config.budget.max_experts if self.config.budget is not None else None


def tree_settings(engine: Engine, depth: Optional[int] = None, top_k: Optional[int] = None,
                  total_tokens: Optional[int] = None) -> dict[str, int]:
    """The draft tree: the engine's default speculation, overridden by the flags given."""
    spec = engine.info.speculation
    given = {"depth": depth, "top_k": top_k, "total_tokens": total_tokens}
    return {k: (v if v is not None else spec.get(k, DEFAULT_TREE[k]))
            for k, v in given.items()}


def parse_policy(text: Optional[str], engine: Engine, tree: dict[str, int],
                 budget: Optional[int] = None) -> PolicyChoice:
    """A policy name (see POLICY_FORMS) as a SpeculativeConfig; None: the budgeted policy when
    ``budget`` is given, else the engine's default policy. ValueError for an unknown policy, a
    speculative policy on an engine without a draft head, or a budget below top_k."""
    from moespec.ops import ExpertBudget
    from moespec.spec.llm import SpeculativeConfig

    from_engine = text is None and budget is None
    if text is None:
        text = default_policy(has_draft=True, budget=budget) if budget is not None else \
            engine.info.speculation.get("policy", "ar")
    spec, cap = parse_policy_text(text)
    if from_engine and spec.budgeted and cap is None:  # the engine's default policy with its budget
        budget = engine.info.speculation.get("budget")
    if spec.speculative and engine.head is None:
        raise ValueError(f"policy {spec.name!r} needs an EAGLE-3 draft head, and the engine {engine.folder} has none "
                         f"(build it with `moespec build --draft <EAGLE-3 folder>`)")
    if spec.budgeted:
        if cap is None:
            if budget is None:
                raise ValueError(f"policy {text!r} needs a budget: write {spec.name}:<max experts> or give --budget")
            cap = budget if isinstance(budget, ExpertBudget) else ExpertBudget(int(budget))
        moe = engine.target.config.moe
        if moe is not None and cap.max_experts < moe.top_k:
            raise ValueError(f"policy {text!r}: a budget of {cap.max_experts} experts is below top_k = {moe.top_k} "
                             f"(one token alone needs top_k experts)")
    elif budget is not None:
        raise ValueError(f"--budget needs a budgeted policy (e.g. {default_policy(has_draft=True, budget=budget)}), "
                         f"got {text!r}")
    label = spec.name if cap is None else f"{spec.name}:{cap.max_experts}" + (
        f":{cap.policy}" if cap.policy != "substitution" else "") + (
        f":{cap.score}" if cap.score != "probability" else "") + (
        f":coverage={cap.coverage}" if cap.coverage is not None else "") + (
        f":exact={cap.exact_layers}" if cap.exact_layers else "")
    return PolicyChoice(label, SpeculativeConfig(spec.name, budget=cap, **tree))


def _needs_budget(text: str) -> bool:
    """A budgeted policy named without its size (it takes --budget)."""
    spec, cap = parse_policy_text(text)
    return spec.budgeted and cap is None


def make_llm(engine: Engine, choice: PolicyChoice, max_batch_size: int):
    from moespec.spec.llm import LLM

    if max_batch_size < 1:
        raise ValueError(f"the batch size must be >= 1, got {max_batch_size}")
    draft = engine.head if choice.config.spec.speculative else None
    predictor = None
    if choice.config.spec.selector == "cost_aware":
        predictor = engine.info.expert_predictor()
    return LLM(engine.target, draft=draft, speculative_config=choice.config, max_batch_size=max_batch_size,
               tokenizer=engine.tokenizer, predictor=predictor)


def max_draft_len(llm) -> int:
    """Draft tree nodes verified per step, root excluded (0 for plain decoding)."""
    return getattr(llm.policy, "max_tree_nodes", 1) - 1


# ---- running batches ----------------------------------------------------------------------------


@dataclass
class BatchResult:
    records: list[m.RequestRecord]
    steps: list[m.ExpertStep]
    outputs: dict[int, list[int]]  # task_id -> output token ids
    start_ns: int
    elapsed_ns: int


def _expert_steps(engine: Engine, outs) -> list[m.ExpertStep]:
    moe = engine.target.config.moe
    return m.batch_expert_steps([o.stats.expert_stats for o in outs], [o.stats.decode_steps for o in outs],
                                top_k=moe.top_k if moe else 0, num_experts=moe.num_experts if moe else 0,
                                moe_layers=engine.moe_layers,
                                predicted=[getattr(o.stats, "predicted_unique", []) for o in outs])


def run_batch(llm, batch: Sequence[Request], sampling: Sampling, engine: Engine) -> BatchResult:
    """One static batch through ``LLM.generate`` (timestamps: see the module docstring)."""
    params = [sampling.params(r) for r in batch]
    start = time.perf_counter_ns()
    outs = llm.generate([r.input_ids for r in batch], params)
    elapsed = time.perf_counter_ns() - start
    records = []
    for r, o in zip(batch, outs):
        first = start + round(o.stats.time_to_first_token * m.NS_PER_S)
        end = max(first, start + round(o.stats.wall_time * m.NS_PER_S))
        if getattr(o.stats, "first_token_ns", 0) > 0:  # absolute timestamps, where the LLM records them
            first, end = o.stats.first_token_ns, o.stats.end_ns
        records.append(m.RequestRecord(r.task_id, len(r.input_ids), len(o.outputs[0].token_ids), start, first, end,
                                       o.stats.decode_steps))
    return BatchResult(records, _expert_steps(engine, outs), {r.task_id: o.outputs[0].token_ids
                                                              for r, o in zip(batch, outs)}, start, elapsed)


def run_streamed(llm, request: Request, sampling: Sampling, engine: Engine) -> BatchResult:
    """One request through ``LLM.generate_stream`` (batch 1)."""
    start = time.perf_counter_ns()
    first = now = out = None
    for out in llm.generate_stream(request.input_ids, sampling.params(request)):
        now = time.perf_counter_ns()
        first = now if first is None else first
    record = m.RequestRecord(request.task_id, len(request.input_ids), len(out.outputs[0].token_ids), start, first,
                             now, out.stats.decode_steps)
    return BatchResult([record], _expert_steps(engine, [out]), {request.task_id: out.outputs[0].token_ids}, start,
                       now - start)


@dataclass
class Collected:
    """The finished batches of one policy. ``rebase``: shift each batch's timestamps so that the
    policy's batches follow each other (for interleaved runs)."""

    records: list[m.RequestRecord] = field(default_factory=list)
    steps: list[m.ExpertStep] = field(default_factory=list)
    outputs: dict[int, list[int]] = field(default_factory=dict)
    elapsed_ns: int = 0
    clock_ns: Optional[int] = None

    def add(self, b: BatchResult, rebase: bool = False) -> None:
        shift = 0
        if rebase:
            self.clock_ns = b.start_ns if self.clock_ns is None else self.clock_ns
            shift = self.clock_ns - b.start_ns
            self.clock_ns += b.elapsed_ns
        self.records += [dataclasses.replace(r, start_ns=r.start_ns + shift, first_token_ns=r.first_token_ns + shift,
                                             end_ns=r.end_ns + shift) for r in b.records]
        self.steps += b.steps
        self.outputs.update(b.outputs)
        self.elapsed_ns += b.elapsed_ns


def _warm_up(llm, requests: Sequence[Request], sampling: Sampling, engine: Engine, batch: int, stream: bool) -> None:
    """Runs the first requests untimed (first-call costs: allocation, page faults of the weights)."""
    if stream:
        for r in requests:
            run_streamed(llm, r, sampling, engine)
        return
    for i in range(0, len(requests), batch):
        run_batch(llm, requests[i : i + batch], sampling, engine)


# ---- reports ------------------------------------------------------------------------------------


def _machine(device: torch.device) -> dict[str, Any]:
    """Where the model ran: the CPU's name and threads, or the GPU's name and its device."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine() or "unknown"
    return {"name": name, "device": str(device), "threads": torch.get_num_threads()}


def _engine_section(engine: Engine, choice: PolicyChoice, llm) -> dict[str, Any]:
    import moespec

    c = choice.config
    return {
        "model": engine.info.config.architecture,
        "model_path": engine.info.provenance.get("source", {}).get("path"),
        "engine_dir": str(engine.folder),
        "version": moespec.__version__,
        "backend": f"moespec (torch, {llm.target.device.type})",
        "dtype": engine.info.dtype,
        "kv_cache_dtype": engine.info.dtype,
        "quantization": None,
        "policy": choice.label,
        "speculative_config": {"policy": c.policy, "depth": c.depth, "top_k": c.top_k, "total_tokens": c.total_tokens,
                               "budget": dataclasses.asdict(c.budget) if c.budget is not None else None},
        "max_draft_len": max_draft_len(llm),
    }


def _experts_context(engine: Engine, choice: PolicyChoice) -> dict[str, Any]:
    s = engine.info.summary
    return {"bytes_per_expert": int(s.get("bytes_per_expert", 0)), "moe_layers": engine.moe_layers,
            "experts_per_layer": int(s.get("experts_per_layer", 0)), "top_k": int(s.get("top_k", 0)),
            "budget": choice.budget}


def build_report(mode: str, engine: Engine, choice: PolicyChoice, llm, col: Collected, requests: Sequence[Request],
                 dataset: Union[str, Path], *, batch: int, concurrency: Optional[int], partial: bool) -> dict[str, Any]:
    draft = max_draft_len(llm)
    notes = []
    if mode == "throughput":
        notes.append("first-token and end timestamps are the batch's submission time plus the LLM's own "
                      "RequestStats.time_to_first_token / wall_time (see moespec.bench.run)")
    estimated = sum(1 for s in col.steps if not s.measured)
    if estimated and engine.moe_layers:
        notes.append(f"plain decoding records no expert statistics: its {estimated} decode steps are counted as "
                     f"min(active requests x top_k, experts) unique experts per layer (exact at batch size 1, an "
                     f"upper bound above)")
    notes.append(f"Max Runtime Tokens: tokens of one decode/verify pass at full batch, {batch} x "
                 f"({draft} draft nodes + 1); prefill passes run the batch's whole prompts. KV cache: allocated per "
                 f"batch for prompts, outputs and one tree (no memory fraction)")
    world = {"tp_size": 1, "pp_size": 1, "ep_size": None, "world_size": 1, "max_batch_size": batch,
             "max_num_tokens": batch * (draft + 1), "scheduling_policy": "static_batch", "kv_cache_percentage": None,
             "concurrency": concurrency}
    return make_report(mode=mode, engine=_engine_section(engine, choice, llm), machine=_machine(llm.target.device),
                       world_info=world,
                       records=col.records, expert_steps=col.steps, experts=_experts_context(engine, choice),
                       dataset=m.dataset_stats([len(r.input_ids) for r in requests],
                                               [r.output_tokens for r in requests], str(dataset)),
                       max_draft_len=draft, partial=partial, streaming=mode == "latency", notes=notes)


# ---- throughput and latency ---------------------------------------------------------------------


def _open(engine: Union[str, Path, Engine]) -> Engine:
    return engine if isinstance(engine, Engine) else open_engine(engine)


def run_throughput(engine: Union[str, Path, Engine], dataset: Union[str, Path], *, num_requests: Optional[int] = None,
                   max_batch_size: Optional[int] = None, concurrency: Optional[int] = None, warmup: int = 2,
                   policy: Optional[str] = None, budget: Optional[int] = None, depth: Optional[int] = None,
                   top_k: Optional[int] = None, total_tokens: Optional[int] = None, sampling: Sampling = Sampling(),
                   progress: bool = True) -> dict[str, Any]:
    """``moespec bench throughput``: static batches of ``max_batch_size`` (default 8) or ``concurrency``
    requests; returns the JSON report (``partial`` after Ctrl-C)."""
    if max_batch_size is not None and concurrency is not None:
        raise ValueError("give --max-batch-size or --concurrency, not both (with static batches they are the same)")
    batch = concurrency or max_batch_size or 8
    return _run("throughput", engine, dataset, batch=batch, concurrency=concurrency, num_requests=num_requests,
                warmup=warmup, policy=policy, budget=budget, tree=(depth, top_k, total_tokens), sampling=sampling,
                progress=progress)


def run_latency(engine: Union[str, Path, Engine], dataset: Union[str, Path], *, num_requests: Optional[int] = None,
                warmup: int = 2, policy: Optional[str] = None, budget: Optional[int] = None,
                depth: Optional[int] = None, top_k: Optional[int] = None, total_tokens: Optional[int] = None,
                sampling: Sampling = Sampling(), progress: bool = True) -> dict[str, Any]:
    """``moespec bench latency``: one request at a time, streamed (TTFT, TPOT, GTPS)."""
    return _run("latency", engine, dataset, batch=1, concurrency=1, num_requests=num_requests, warmup=warmup,
                policy=policy, budget=budget, tree=(depth, top_k, total_tokens), sampling=sampling, progress=progress)


def _run(mode: str, engine, dataset, *, batch: int, concurrency: Optional[int], num_requests, warmup: int, policy,
         budget, tree, sampling: Sampling, progress: bool) -> dict[str, Any]:
    if warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {warmup}")
    eng = _open(engine)
    requests = load_requests(dataset, eng, num_requests)
    choice = parse_policy(policy, eng, tree_settings(eng, *tree), budget)
    llm = make_llm(eng, choice, batch)
    stream = mode == "latency"
    col, partial = Collected(), False
    bar = tqdm(total=len(requests), desc=f"{mode} {choice.label}", unit="req", disable=not progress, file=sys.stderr)
    try:
        _warm_up(llm, requests[:warmup], sampling, eng, batch, stream)
        for i in range(0, len(requests), batch):
            chunk = requests[i : i + batch]
            col.add(run_streamed(llm, chunk[0], sampling, eng) if stream else run_batch(llm, chunk, sampling, eng))
            bar.update(len(chunk))
    except KeyboardInterrupt:
        partial = True
    finally:
        bar.close()
    if not col.records:
        raise NothingToReport(f"interrupted before any of the {len(requests)} requests finished: nothing to report")
    return build_report(mode, eng, choice, llm, col, requests, dataset, batch=batch, concurrency=concurrency,
                        partial=partial)


# ---- compare ------------------------------------------------------------------------------------


@torch.inference_mode()
def continuation_logprobs(target, prompt: Sequence[int], continuation: Sequence[int], *, budget=None,
                          window: Optional[int] = None) -> torch.Tensor:
    """float32 [n - 1] on the host: log p(continuation[i] | prompt, continuation[:i]) for i = 1 .. n - 1
    under the target model as a policy runs it.

    The prompt is prefilled (never budgeted, as in every policy), then ``continuation[:-1]`` goes
    through verify passes of ``window`` tokens each (a chain: each token sees the prompt and the
    tokens before it), every pass with ``budget`` (an ExpertBudget or None), committed after each
    pass. Row j of a pass's logits is the distribution of the token after its j-th token. The first
    token, which comes from the unbudgeted prefill, is not scored. ``window`` None: one pass.
    """
    n = len(continuation)
    if n < 2:
        return torch.zeros(0)
    cache = target.new_cache(1, len(prompt) + n)
    target.prefill(cache, [list(prompt)])
    feed = [int(t) for t in continuation[:-1]]  # [n - 1]
    width = window or len(feed)
    parts = []
    for s in range(0, len(feed), width):
        chunk = feed[s : s + width]
        out = target.verify(cache, [chunk], [[-1] + list(range(len(chunk) - 1))], budget=budget)
        logp = torch.log_softmax(out.logits[0, : len(chunk)].float(), dim=-1)  # [w, V]
        nxt = torch.tensor([int(t) for t in continuation[s + 1 : s + 1 + len(chunk)]], device=logp.device)  # [w]
        parts.append(logp.gather(1, nxt[:, None])[:, 0])
        target.commit(cache, [list(range(len(chunk)))])
    return torch.cat(parts).cpu()  # (on the host: one copy for the sequence)


def _score(engine: Engine, choices: Sequence[PolicyChoice], llms: dict, requests: Sequence[Request],
           reference: dict[int, list[int]], progress: bool) -> tuple[dict[str, tuple[float, int]], bool]:
    """Sum of log-probabilities and token count of the reference continuations, per policy. Policies
    without a budget share one unbudgeted pass; a budgeted one scores in windows of its verify width
    (draft nodes + 1, batch 1). Ctrl-C keeps the requests scored under every policy."""
    keys = {c.label: (None, None) if c.config.budget is None else (c.config.budget, max_draft_len(llms[c.label]) + 1)
            for c in choices}
    distinct = list(dict.fromkeys(keys.values()))
    totals = {k: [0.0, 0] for k in distinct}
    bar = tqdm(total=len(requests) * len(distinct), desc="score", unit="pass", disable=not progress, file=sys.stderr)
    interrupted = False
    try:
        for r in requests:
            done = {}
            for key in distinct:
                lp = continuation_logprobs(engine.target, r.input_ids, reference[r.task_id], budget=key[0],
                                           window=key[1])
                done[key] = (float(lp.sum()), lp.numel())
                bar.update(1)
            for key, (s, n) in done.items():
                totals[key][0] += s
                totals[key][1] += n
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
    return {label: tuple(totals[key]) for label, key in keys.items()}, interrupted


def run_compare(engine: Union[str, Path, Engine], dataset: Union[str, Path], policies: Union[str, Sequence[str]], *,
                num_requests: Optional[int] = None, max_batch_size: int = 1, warmup: int = 1,
                budget: Optional[int] = None, depth: Optional[int] = None, top_k: Optional[int] = None,
                total_tokens: Optional[int] = None, progress: bool = True) -> dict[str, Any]:
    """``moespec bench compare``: every policy on the same requests, greedy, interleaved; returns the
    compare JSON (without plots: :func:`write_compare` adds them)."""
    if isinstance(policies, str):
        policies = [p for p in policies.split(",") if p.strip()]
    if not policies:
        raise ValueError(f"--policies: give at least one policy ({POLICY_FORMS})")
    if warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {warmup}")
    eng = _open(engine)
    requests = load_requests(dataset, eng, num_requests)
    tree = tree_settings(eng, depth, top_k, total_tokens)
    choices = [parse_policy(p, eng, tree, budget if _needs_budget(p) else None) for p in policies]
    labels = [c.label for c in choices]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--policies: a policy repeats ({', '.join(labels)})")
    reference = "eagle3" if "eagle3" in labels else "ar" if "ar" in labels else None
    if reference is None:
        raise ValueError("--policies must include eagle3 or ar: the unbudgeted greedy reference for agreement, the "
                         "quality proxy and the speed-ups")
    llms = {c.label: make_llm(eng, c, max_batch_size) for c in choices}
    sampling = Sampling()  # greedy: agreement and the quality proxy are defined against greedy outputs
    cols = {label: Collected() for label in labels}
    partial = False
    bar = tqdm(total=len(requests) * len(choices), desc="compare", unit="req", disable=not progress, file=sys.stderr)
    try:
        for c in choices:
            _warm_up(llms[c.label], requests[:warmup], sampling, eng, max_batch_size, stream=False)
        for k, i in enumerate(range(0, len(requests), max_batch_size)):
            batch = requests[i : i + max_batch_size]
            round_ = {}
            for j in range(len(choices)):  # the order rotates every round
                c = choices[(k + j) % len(choices)]
                round_[c.label] = run_batch(llms[c.label], batch, sampling, eng)
                bar.update(len(batch))
            for label, result in round_.items():  # only complete rounds count, so all policies share requests
                cols[label].add(result, rebase=True)
    except KeyboardInterrupt:
        partial = True
    finally:
        bar.close()
    done = [r for r in requests if r.task_id in cols[reference].outputs]
    if not done:
        raise NothingToReport(f"interrupted before any of the {len(requests)} requests finished under every policy")
    scores, interrupted = ({label: (0.0, 0) for label in labels}, True) if partial else \
        _score(eng, choices, llms, done, cols[reference].outputs, progress)
    partial = partial or interrupted
    reports = {c.label: build_report("throughput", eng, c, llms[c.label], cols[c.label], requests, dataset,
                                     batch=max_batch_size, concurrency=None, partial=partial) for c in choices}
    rows = _compare_rows(choices, cols, reports, scores, reference, done)
    notes = [
        "tok/s: output tokens / summed wall time of the policy's own generate calls (policies interleaved batch "
        "by batch, order rotated each round); x ar, x eagle3: ratios of tok/s; dec x ar: the ratio over the decode "
        "phase alone (tokens after the first / time after the first token, i.e. 1 / TPOT), where speculation "
        "acts (tok/s also holds the prefill and the first token)",
        "AL: acceptance length, sum OSL / sum (target steps after the prefill + 1); experts/layer: mean over verify "
        "steps of the mean over MoE layers of kept unique experts (natural: before the budget)",
        f"identical: share of requests whose output equals {reference}'s token for token; match: tokens up to the "
        f"first divergence / output tokens, summed over requests",
        f"logp/token: mean log-probability of {reference}'s greedy continuation (tokens 2..OSL) under the target "
        "run with the policy's budget: prompt prefilled unbudgeted, continuation fed as a chain through verify "
        "passes of the policy's verify width (draft nodes + 1, batch 1), each with the budget; unbudgeted policies "
        "score in one pass. d logp: minus the reference's",
    ]
    if any(r["experts_estimated"] for r in rows):
        notes.append("* estimated: plain decoding records no expert statistics; min(batch x top_k, experts) per layer")
    if partial and not any(r["scored_tokens"] for r in rows):
        notes.append("interrupted: the quality proxy was not computed")
    s = reports[labels[0]]["engine"]
    from moespec.bench.roofline import byte_profile

    return {
        "mode": "compare", "partial": partial,
        "engine": {**{k: s[k] for k in ("model", "model_path", "engine_dir", "version", "dtype")},
                   "byte_profile": byte_profile(eng.target)},
        "machine": _machine(eng.target.device),
        "settings": {"max_batch_size": max_batch_size, "warmup": warmup, **tree,
                     "order": "interleaved batch by batch, rotated each round"},
        "dataset": m.dataset_stats([len(r.input_ids) for r in requests], [r.output_tokens for r in requests],
                                   str(dataset)),
        "num_requests": len(done), "reference_policy": reference, "policies": rows, "reports": reports,
        "notes": notes, "plots": [],
    }


def _mean_unique(steps: Sequence[m.ExpertStep], which: str) -> Optional[float]:
    """Mean over steps of the mean over MoE layers of ``which`` ("kept" or "natural"); None without."""
    per_step = [sum(getattr(s, which)) / len(getattr(s, which)) for s in steps if getattr(s, which)]
    return sum(per_step) / len(per_step) if per_step else None


def _compare_rows(choices, cols, reports, scores, reference, done) -> list[dict[str, Any]]:
    ref_outputs = [cols[reference].outputs[r.task_id] for r in done]
    rows = []
    for c in choices:
        col = cols[c.label]
        steps = [s for s in col.steps if s.measured] or list(col.steps)  # estimated ones when none is measured
        osl = sum(r.output_tokens for r in col.records)
        seconds = col.elapsed_ns / m.NS_PER_S
        # the decode phase (what speculation changes): tokens after the first, over the time after it
        decode_tokens = sum(max(r.output_tokens - 1, 0) for r in col.records)
        decode_s = sum(r.end_ns - r.first_token_ns for r in col.records) / m.NS_PER_S
        total, count = scores[c.label]
        agree = m.agreement([col.outputs[r.task_id] for r in done], ref_outputs)
        rows.append({
            "label": c.label, "policy": c.config.policy, "budget": c.budget, "output_tokens": osl,
            "total_time_s": seconds, "tokens_per_s": osl / seconds if seconds > 0 else 0.0,
            "speedup_vs_ar": None, "speedup_vs_eagle3": None,
            "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 else 0.0, "decode_speedup_vs_ar": None,
            "acceptance_length": m.acceptance_length(col.records),
            "kept_unique_per_layer": _mean_unique(steps, "kept"),
            "natural_unique_per_layer": _mean_unique(steps, "natural"),
            "predicted_unique_per_layer": reports[c.label]["expert_statistics"]["predicted_unique_per_layer"],
            "experts_estimated": bool(col.steps) and not any(s.measured for s in col.steps),
            "expert_bytes_per_output_token": reports[c.label]["expert_statistics"]["expert_bytes_per_output_token"],
            **agree, "mean_logprob": total / count if count else None, "logprob_delta": None, "scored_tokens": count,
        })
    by_label = {r["label"]: r for r in rows}
    for row in rows:
        for base in ("ar", "eagle3"):
            if base in by_label and by_label[base]["tokens_per_s"] > 0:
                row[f"speedup_vs_{base}"] = row["tokens_per_s"] / by_label[base]["tokens_per_s"]
        if "ar" in by_label and by_label["ar"]["decode_tokens_per_s"] > 0:
            row["decode_speedup_vs_ar"] = row["decode_tokens_per_s"] / by_label["ar"]["decode_tokens_per_s"]
        ref = by_label[reference]["mean_logprob"]
        if row["mean_logprob"] is not None and ref is not None:
            row["logprob_delta"] = row["mean_logprob"] - ref
    return rows


def write_compare(result: dict[str, Any], out_dir: Union[str, Path]) -> Path:
    """Writes ``compare.json`` (validated), ``pareto.png`` and ``experts.png`` under ``out_dir``."""
    from moespec.bench.plots import experts_plot, pareto_plot

    out = Path(out_dir)
    rows = result["policies"]
    baseline = "ar" if any(r["label"] == "ar" for r in rows) else "eagle3"
    layers = {label: rep["expert_statistics"]["kept_unique_by_layer"] for label, rep in result["reports"].items()}
    result["plots"] = [str(pareto_plot(rows, out / "pareto.png", baseline=baseline)),
                       str(experts_plot(rows, layers, out / "experts.png"))]
    return write_json(out / "compare.json", result, "compare")


def default_policies(engine: Engine) -> list[str]:
    """ar, and with a draft head eagle3 plus budgets of N/8, N/4 and N/2 experts (at least top_k)."""
    policies = ["ar"]
    moe = engine.target.config.moe
    if engine.head is not None:
        policies.append("eagle3")
        if moe is not None:
            sizes = sorted({max(moe.top_k, moe.num_experts // d) for d in (8, 4, 2)} - {moe.num_experts})
            policies += [f"{default_policy(has_draft=True, budget=b)}:{b}" for b in sizes]
    return policies


def bench_engine(engine: Union[str, Path], dataset: Union[str, Path], out_dir: Union[str, Path], *,
                 policies: Optional[Sequence[str]] = None, num_requests: Optional[int] = None,
                 progress: bool = True) -> dict[str, Any]:
    """What ``./build.sh bench`` runs: :func:`run_compare` of :func:`default_policies` (or ``policies``)
    over ``dataset``, printed, with compare.json and the plots written under ``out_dir``."""
    eng = open_engine(engine)
    result = run_compare(eng, dataset, policies or default_policies(eng), num_requests=num_requests, progress=progress)
    write_compare(result, out_dir)
    print(format_compare(result))
    return result


# ---- command line -------------------------------------------------------------------------------


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", required=True, help="engine folder (moespec build)")
    p.add_argument("--dataset", required=True, help="trtllm-bench JSON Lines (moespec prepare-dataset)")
    p.add_argument("--num-requests", type=int, default=0, help="the first N requests (0: all)")
    p.add_argument("--budget", type=int, help="max unique experts per MoE layer per verify pass (eagle3+budget)")
    p.add_argument("--depth", type=int, help="draft tree depth (default: the engine's)")
    p.add_argument("--top-k", type=int, help="draft tree branching (default: the engine's)")
    p.add_argument("--total-tokens", type=int, help="draft tree nodes besides the root (default: the engine's)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), help="run in this dtype instead of the engine's (fp32: "
                   "greedy outputs of different policies differ only by the budget, not by rounding)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:i]: where the target and the draft head run")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moespec bench", description="trtllm-bench-style benchmarks of an engine")
    sub = parser.add_subparsers(dest="mode", required=True)
    for mode, doc in (("throughput", "static batches: throughput and latency percentiles"),
                      ("latency", "batch 1, streaming: TTFT, TPOT, GTPS")):
        p = sub.add_parser(mode, help=doc)
        _common(p)
        if mode == "throughput":
            group = p.add_mutually_exclusive_group()
            group.add_argument("--max-batch-size", type=int, help="requests per static batch (default 8)")
            group.add_argument("--concurrency", type=int, help="at most C requests in flight (batches of C)")
        p.add_argument("--warmup", type=int, default=2, help="untimed requests first (default 2)")
        p.add_argument("--policy", help=f"{POLICY_FORMS} (default: the engine's)")
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--seed", type=int, default=0, help="request seeds are seed + task_id")
        p.add_argument("--report-json", help="write the report as JSON (trtllm-bench --report_json sections)")
    sub.add_parser("roofline", help="step times against the machine's roofline (see moespec bench roofline --help)")
    p = sub.add_parser("compare", help="several policies on the same requests, interleaved, in one table")
    _common(p)
    p.add_argument("--policies", required=True, help=f"comma-separated: {POLICY_FORMS}")
    p.add_argument("--max-batch-size", type=int, default=1, help="requests per static batch (default 1)")
    p.add_argument("--warmup", type=int, default=1, help="untimed requests per policy first (default 1)")
    p.add_argument("--out-dir", default="build/bench/compare", help="compare.json, pareto.png, experts.png")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``moespec bench throughput|latency|compare ...``; returns the exit status (2: bad input, 130:
    interrupted)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "roofline":
        from moespec.bench.roofline import main as roofline_main

        return roofline_main(argv[1:])
    args = _parser().parse_args(argv)
    tree = dict(depth=args.depth, top_k=args.top_k, total_tokens=args.total_tokens)
    try:
        engine = open_engine(args.engine, args.dtype, args.device)
        if args.mode == "compare":
            result = run_compare(engine, args.dataset, args.policies, num_requests=args.num_requests,
                                 max_batch_size=args.max_batch_size, warmup=args.warmup, budget=args.budget,
                                 progress=not args.no_progress, **tree)
            write_compare(result, args.out_dir)
            print(format_compare(result))
            return 130 if result["partial"] else 0
        sampling = Sampling(args.temperature, args.top_p, args.seed)
        common = dict(num_requests=args.num_requests, warmup=args.warmup, policy=args.policy, budget=args.budget,
                      sampling=sampling, progress=not args.no_progress, **tree)
        if args.mode == "throughput":
            report = run_throughput(engine, args.dataset, max_batch_size=args.max_batch_size,
                                    concurrency=args.concurrency, **common)
        else:
            report = run_latency(engine, args.dataset, **common)
        print(format_report(report))
        if args.report_json:
            write_json(args.report_json, report)
        return 130 if report["partial"] else 0
    except ValueError as exc:
        print(f"moespec bench {args.mode}: error: {exc}", file=sys.stderr)
        return 2
    except NothingToReport as exc:
        print(f"moespec bench {args.mode}: {exc}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

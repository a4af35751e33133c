"""The LLM API (modelled on TensorRT-LLM's): ``LLM(model, draft, speculative_config).generate(...)``.

A batch of requests runs together: one target prefill, then steps of the configured policy until
every request is finished. Each step reads on one screen in the policies (:mod:`moespec.spec.policies`):
draft -> select tree -> verify -> accept -> commit -> emit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Optional, Sequence, Union

import torch

from moespec.config import DEFAULT_TREE, POLICY_NAMES, PolicySpec, default_policy, policy_spec
from moespec.models import TargetModel, load
from moespec.ops import ExpertBudget
from moespec.spec.sampling import SamplingParams

Prompt = Union[str, Sequence[int]]
PolicyName = str  # a name of moespec.config.POLICIES: "ar", "eagle3", "eagle3+budget"


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which decoding policy runs and with which draft tree.

    policy : a name of :data:`moespec.config.POLICIES`: "ar" (plain decoding), "eagle3" (EAGLE-3 tree,
        no budget), "eagle3+budget" (MoE-Spec: ``budget`` applied to every MoE layer on every verify
        pass, per batch), "eco" / "eco+budget" (the verify set chosen cost-aware, EcoSpec; needs an
        expert predictor).
    depth, top_k, total_tokens : the EAGLE-2 dynamic tree (expansion steps, branching, draft
        nodes kept after reranking).
    budget : ExpertBudget or int (max experts), required by "eagle3+budget".
    """

    policy: PolicyName = "eagle3"
    depth: int = DEFAULT_TREE["depth"]
    top_k: int = DEFAULT_TREE["top_k"]
    total_tokens: int = DEFAULT_TREE["total_tokens"]
    budget: Optional[Union[ExpertBudget, int]] = None

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"SpeculativeConfig.policy: expected one of {', '.join(map(repr, POLICY_NAMES))}, "
                             f"got {self.policy!r}")
        for name in ("depth", "top_k", "total_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SpeculativeConfig.{name}: expected an int >= 1, got {value!r}")
        if isinstance(self.budget, int) and not isinstance(self.budget, bool):
            object.__setattr__(self, "budget", ExpertBudget(self.budget))
        if self.spec.budgeted and self.budget is None:
            raise ValueError(f"SpeculativeConfig: policy {self.policy!r} needs a budget (e.g. budget=16)")
        if not self.spec.budgeted and self.budget is not None:
            raise ValueError(f"SpeculativeConfig: a budget needs a budgeted policy (e.g. 'eagle3+budget'), got "
                             f"{self.policy!r}")

    @property
    def spec(self) -> PolicySpec:
        """The policy's composition (drafter, tree selector, verify routing)."""
        return policy_spec(self.policy)


@dataclass
class RequestStats:
    """What happened while generating one request."""

    decode_steps: int = 0  # target forward passes after the prefill (decode or verify steps)
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens emitted per step
    # per verify step: int32 [MoE layers, 4] (natural unique, kept, re-routed, dropped), batch-wide; on
    # the host once the request's batch has finished (on the target's device while it runs)
    expert_stats: list[torch.Tensor] = field(default_factory=list)
    # per verify step of a cost-aware tree (eco policies): the selector's expected unique experts [MoE layers]
    predicted_unique: list[Any] = field(default_factory=list)
    wall_time: float = 0.0  # seconds from the start of the request's batch to its last token
    time_to_first_token: float = 0.0
    prompt_tokens: int = 0
    first_token_ns: int = 0  # time.perf_counter_ns() when the first token was emitted
    end_ns: int = 0  # time.perf_counter_ns() when the last token was emitted

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]  # "length", "stop" (EOS or a stop string), or None while running


@dataclass
class RequestOutput:
    request_id: int
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    stats: RequestStats


class _Request:
    """A request being generated (internal)."""

    def __init__(self, rid: int, prompt: Optional[str], ids: list[int], params: SamplingParams, eos: set[int]):
        self.rid, self.prompt, self.prompt_ids, self.params = rid, prompt, ids, params
        self.eos = set() if params.ignore_eos else set(eos)
        self.eos |= set(params.stop_token_ids)
        self.generator = torch.Generator()
        self.generator.manual_seed(params.seed if params.seed is not None else int(torch.randint(2**62, ())))
        self.output: list[int] = []
        self.text = ""
        self.finish_reason: Optional[str] = None
        self.stats = RequestStats(prompt_tokens=len(ids))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def last(self) -> int:
        return self.output[-1]


TREE_MARGIN = 256  # cache slots a verify tree may add beyond prompt + max_tokens (the largest tree here)


def max_memory_bytes() -> int:
    """MOESPEC_MAX_MEMORY (bytes, or with a K/M/G suffix), else half the machine's physical memory: the
    most one request batch's KV cache may take."""
    import os

    given = os.environ.get("MOESPEC_MAX_MEMORY", "").strip()
    if given:
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(given[-1].upper(), 1)
        try:
            return int(float(given[:-1] if scale > 1 else given) * scale)
        except ValueError:
            raise ValueError(f"MOESPEC_MAX_MEMORY={given!r}: expected bytes, or a number with K, M or G") from None
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def check_bounds(target, prompt_len: int, max_tokens: int, batch: int) -> None:
    """ValueError before anything is allocated when a request cannot fit: prompt + max_tokens beyond the
    model's maximum positions, or a batch's KV cache (batch x (prompt + max_tokens + a tree)) beyond
    :func:`max_memory_bytes`."""
    c = target.config
    if prompt_len + max_tokens > c.max_position_embeddings:
        raise ValueError(f"max_tokens={max_tokens}: with a prompt of {prompt_len} tokens it exceeds the model's "
                         f"{c.max_position_embeddings} positions (max_position_embeddings)")
    from moespec.runtime.attention import cache_shapes

    (hk, dk), (hv, dv) = cache_shapes(c)
    slots = prompt_len + max_tokens + TREE_MARGIN
    need = c.num_layers * batch * slots * (hk * dk + hv * dv) * target.dtype.itemsize
    limit = max_memory_bytes()
    if need > limit:
        raise ValueError(f"max_tokens={max_tokens}: the KV cache of {batch} such requests needs {need / 2**30:.1f} GiB, "
                         f"more than the {limit / 2**30:.1f} GiB allowed (MOESPEC_MAX_MEMORY)")


class LLM:
    """Generation with a target model, optionally an EAGLE-3 draft head and a speculation policy.

    Parameters
    ----------
    model : str | Path | TargetModel
        A checkpoint folder (see :func:`moespec.models.load`) or a loaded model.
    draft : str | Path | Eagle3Head, optional
        An EAGLE-3 head folder (official or SpecForge names) or a loaded head. Needed by the
        "eagle3" policies; without it the default policy is "ar".
    speculative_config : SpeculativeConfig, optional
    dtype : "bf16" | "fp32"
    max_batch_size : int
        Requests decoded together (static batches).
    device : "cpu" | "cuda[:i]"
        Where the target and the draft head run (:func:`moespec.models.load`); the draft tree core and
        the acceptance stay host code (on CUDA: a copy of each level's top-k, of the tree and of the
        verified logits' argmax per step).

    Examples
    --------
    >>> llm = LLM("path/to/checkpoint", draft="path/to/eagle3", speculative_config=SpeculativeConfig(
    ...     "eagle3+budget", budget=16))                                       # doctest: +SKIP
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=32))          # doctest: +SKIP
    >>> out[0].outputs[0].text, out[0].stats.mean_acceptance_length           # doctest: +SKIP
    """

    def __init__(self, model: Union[str, Path, TargetModel], draft=None,
                 speculative_config: Optional[SpeculativeConfig] = None, dtype: Literal["bf16", "fp32"] = "bf16",
                 *, max_batch_size: int = 8, tokenizer=None, predictor=None, device="cpu"):
        from moespec.engine import engine_defaults, is_engine_folder
        from moespec.spec.policies import make_policy

        tokenizer_path = None if isinstance(model, TargetModel) else Path(model)
        if tokenizer_path is not None and is_engine_folder(model):  # the engine's head, tokenizer and policy
            engine_draft, tokenizer_path, engine_spec = engine_defaults(model)
            if draft is None and engine_draft is not None:
                draft = engine_draft
                if speculative_config is None:
                    speculative_config = SpeculativeConfig(**engine_spec)
        self.target = model if isinstance(model, TargetModel) else load(model, dtype, device=device)
        self.model_path = None if isinstance(model, TargetModel) else Path(model)
        self.tokenizer = tokenizer if tokenizer is not None else _local_tokenizer(tokenizer_path)
        if speculative_config is None:
            speculative_config = SpeculativeConfig(default_policy(has_draft=draft is not None))
        self.speculative_config = speculative_config
        self.max_batch_size = max_batch_size
        self.policy = make_policy(self.target, draft, speculative_config, self.model_path, predictor)

    # ---- prompts and text ---------------------------------------------------------------------------

    def _encode(self, prompt: Prompt) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer: give prompts as lists of token ids")
            return prompt, list(self.tokenizer.encode(prompt))
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("a prompt needs at least one token")
        return None, ids

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    # ---- generation -----------------------------------------------------------------------------------

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None, *,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generates a completion for every prompt (a string, or a list of token ids)."""
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        requests = [self._request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="generate", disable=not use_tqdm)
        for start in range(0, len(requests), self.max_batch_size):
            batch = requests[start : start + self.max_batch_size]
            for _ in self._run(batch):
                pass
            bar.update(len(batch))
        bar.close()
        return [self._output(r) for r in requests]

    def generate_stream(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None) -> Iterator[RequestOutput]:
        """Generates one request, yielding its output so far after every step (the last one finished)."""
        request = self._request(0, prompt, sampling_params or SamplingParams())
        for _ in self._run([request]):
            yield self._output(request)

    def _request(self, rid: int, prompt: Prompt, params: SamplingParams) -> _Request:
        text, ids = self._encode(prompt)
        check_bounds(self.target, len(ids), params.max_tokens, self.max_batch_size)
        V = self.target.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < V), None)
        if bad is not None:
            raise ValueError(f"prompt {rid}: token id {bad} is outside the vocabulary [0, {V})")
        return _Request(rid, text, ids, params, set(self.target.config.eos_token_ids))

    def _output(self, r: _Request) -> RequestOutput:
        completion = CompletionOutput(0, r.text, list(r.output), r.finish_reason)
        return RequestOutput(r.rid, r.prompt, r.prompt_ids, [completion], r.finished, r.stats)

    def _run(self, batch: list[_Request]) -> Iterator[None]:
        """Runs a batch to completion, yielding after the prefill and after every step."""
        start = time.perf_counter()
        run = self.policy.start(batch)
        for r, token in zip(batch, run.first_tokens):
            r.stats.time_to_first_token = time.perf_counter() - start
            r.stats.first_token_ns = time.perf_counter_ns()
            self._emit(r, [token], start)
        yield
        while not all(r.finished for r in batch):
            emitted = self.policy.step(run, batch)
            for r, tokens in zip(batch, emitted):
                if r.finished or tokens is None:
                    continue
                r.stats.decode_steps += 1
                r.stats.acceptance_lengths.append(len(tokens))
                if run.last_expert_stats is not None:
                    r.stats.expert_stats.append(run.last_expert_stats)
                if run.last_predicted_unique is not None:
                    r.stats.predicted_unique.append(run.last_predicted_unique)
                self._emit(r, tokens, start)
            if all(r.finished for r in batch):
                _expert_stats_to_host(batch)
            yield

    def _emit(self, r: _Request, tokens: list[int], start: float) -> None:
        """Appends tokens to a request and applies its stop conditions (EOS, stop strings, length)."""
        for token in tokens:
            if r.finished:
                break
            r.output.append(token)
            if token in r.eos:
                r.finish_reason = "stop"
            elif len(r.output) >= r.params.max_tokens:
                r.finish_reason = "length"
        r.text = self._decode(r.output)
        if r.params.stop and self.tokenizer is not None:
            for s in r.params.stop:
                cut = r.text.find(s)
                if cut >= 0:
                    r.text = r.text[:cut]
                    r.finish_reason = "stop"
        r.stats.wall_time = time.perf_counter() - start
        r.stats.end_ns = time.perf_counter_ns()


def _expert_stats_to_host(batch: list[_Request]) -> None:
    """A finished batch's expert statistics (one [L, 4] tensor a verify step, shared by the batch's
    requests; on the target's device while it runs: no copy back a step) on the host, in one copy."""
    steps = {id(t): t for r in batch for t in r.stats.expert_stats if t.device.type != "cpu"}
    if not steps:
        return
    host = dict(zip(steps, torch.stack(list(steps.values())).cpu().unbind(0)))
    for r in batch:
        r.stats.expert_stats = [host.get(id(t), t) for t in r.stats.expert_stats]


def _local_tokenizer(path: Optional[Path]):
    """The tokenizer saved in a checkpoint folder, or None (token-id prompts only). Never downloads."""
    if path is None or not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)

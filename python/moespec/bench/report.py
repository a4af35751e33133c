"""Reports of ``moespec bench``: the JSON layout, its schema check, and the console text.

The JSON report mirrors trtllm-bench's ``--report_json`` (REFERENCE.md section 5; keys of
``ReportUtility.get_statistics_dict``): ``engine``, ``machine``, ``world_info``, ``request_info``,
``performance``, ``streaming_metrics`` (latency mode), ``decoding_stats`` (speculative policies),
``dataset``, plus ``expert_statistics`` and our own ``mode``, ``partial``, ``notes`` and per-request
``requests``. The console text is built from that dict alone, in trtllm-bench's section order, labels
and alignment (``ReportUtility.report_statistics``), with an EXPERT STATISTICS section in the same
``[TAG] KEY: value`` style. Schemas: ``schemas/report.schema.json`` and ``schemas/compare.schema.json``.
Metric definitions: :mod:`moespec.bench.metrics`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from moespec.bench import metrics as m

RULE = "=" * 59
SCHEMAS = Path(__file__).parent / "schemas"


# ---- building -----------------------------------------------------------------------------------


def make_report(*, mode: str, engine: dict[str, Any], machine: dict[str, Any], world_info: dict[str, Any],
                records: Sequence[m.RequestRecord], expert_steps: Sequence[m.ExpertStep], experts: dict[str, Any],
                dataset: dict[str, Any], max_draft_len: int, partial: bool, streaming: bool,
                notes: Sequence[str] = ()) -> dict[str, Any]:
    """The JSON report of one run over ``records`` (finished requests).

    ``world_info`` without ``issue_rate`` (computed here); ``experts`` holds the keyword arguments of
    :func:`metrics.expert_statistics` other than the steps and the generated-token count;
    ``dataset`` is :func:`metrics.dataset_stats` of the requests the run was asked to do.
    """
    report: dict[str, Any] = {
        "mode": mode,
        "partial": partial,
        "engine": engine,
        "machine": machine,
        "world_info": {**world_info, "issue_rate": m.issue_rate(records)},
        "request_info": m.request_info(records),
        "performance": m.performance(records, world_info.get("world_size", 1)),
    }
    if streaming:
        report["streaming_metrics"] = m.streaming_metrics(records)
    if max_draft_len > 0:
        report["decoding_stats"] = m.decoding_stats(records, max_draft_len, engine["policy"])
    report["expert_statistics"] = m.expert_statistics(
        expert_steps, generated_tokens=sum(r.output_tokens - 1 for r in records), **experts)
    report["dataset"] = dataset
    report["notes"] = list(notes)
    report["requests"] = [{"task_id": r.task_id, "input_tokens": r.input_tokens, "output_tokens": r.output_tokens,
                           "start_ns": r.start_ns, "first_token_ns": r.first_token_ns, "end_ns": r.end_ns,
                           "decode_iterations": r.decode_iterations} for r in records]
    return report


# ---- schemas and files --------------------------------------------------------------------------


def validate(obj: dict[str, Any], kind: str = "report") -> None:
    """Checks ``obj`` against ``schemas/<kind>.schema.json`` (kind "report" or "compare");
    ValueError naming the first offending JSON path."""
    import jsonschema
    from referencing import Registry, Resource

    if kind not in ("report", "compare"):
        raise ValueError(f"validate: kind must be 'report' or 'compare', got {kind!r}")
    schemas = {name: json.loads((SCHEMAS / f"{name}.schema.json").read_text()) for name in ("report", "compare")}
    registry = Registry().with_resources((s["$id"], Resource.from_contents(s)) for s in schemas.values())
    validator = jsonschema.Draft202012Validator(schemas[kind], registry=registry)
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        where = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        raise ValueError(f"{kind} JSON does not match {kind}.schema.json at {where}: {e.message}")


def _finite(x: Any) -> Any:
    """JSON has no inf/nan: they become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_json(path: Union[str, Path], obj: dict[str, Any], kind: str = "report") -> Path:
    """Validates ``obj`` and writes it (atomically) as indented JSON."""
    obj = _finite(obj)
    validate(obj, kind)
    return write_json_atomic(path, obj)


def write_json_atomic(path: Union[str, Path], obj: Any) -> Path:
    """Writes ``obj`` as indented JSON into a temporary file beside ``path``, then renames it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)
    return path


# ---- console text -------------------------------------------------------------------------------


def _header(title: str) -> str:
    return f"{RULE}\n= {title}\n{RULE}\n"


def _tagged(tag: str, stats: Optional[dict[str, float]], fmt: str) -> str:
    """``[TAG] KEY    : value`` lines in trtllm's printed order (minimum, maximum, average, p50 ...)."""
    if stats is None:
        return f"[{tag}] n/a"
    return "\n".join(f"[{tag}] {key.upper():<7}: {stats[key]:{fmt}}" for key in m.PRINT_KEYS)


def _num(x: Optional[float], fmt: str = ".4f") -> str:
    return "None" if x is None else f"{x:{fmt}}"


def _engine_text(e: dict[str, Any], machine: dict[str, Any]) -> str:
    tree = e.get("speculative_config") or {}
    budget = tree.get("budget")
    tree_text = (f"depth {tree['depth']}, top-k {tree['top_k']}, {e['max_draft_len']} draft nodes per step"
                 if e["max_draft_len"] > 0 else "None")
    budget_text = "None" if budget is None else f"{budget['max_experts']} experts per layer ({budget['policy']})"
    return ("\n\n" + _header("MOESPEC ENGINE")
            + f"Model:\t\t\t{e['model']}\n"
            f"Model Path:\t\t{e['model_path']}\n"
            f"Engine Directory:\t{e['engine_dir']}\n"
            f"moespec Version:\t{e['version']}\n"
            f"Dtype:\t\t\t{e['dtype']}\n"
            f"KV Cache Dtype:\t\t{e['kv_cache_dtype']}\n"
            f"Quantization:\t\t{e['quantization']}\n"
            f"Policy:\t\t\t{e['policy']}\n"
            f"Draft Tree:\t\t{tree_text}\n"
            f"Expert Budget:\t\t{budget_text}\n\n"
            + _header("MACHINE DETAILS ")
            + f"{machine['name']}, {machine['device']}, {machine['threads']} torch threads\n\n")


def _performance_text(r: dict[str, Any]) -> str:
    p = r["performance"]
    text = (_header("PERFORMANCE OVERVIEW ")
            + f"Request Throughput (req/sec):                     {p['request_throughput_req_s']:.4f}\n"
            f"Total Output Throughput (tokens/sec):             {p['system_output_throughput_tok_s']:.4f}\n"
            f"Total Token Throughput (tokens/sec):              {p['system_total_throughput_tok_s']:.4f}\n"
            f"Total Latency (ms):                               {p['total_latency_ms']:.4f}\n"
            f"Average request latency (ms):                     {p['avg_request_latency_ms']:.4f}\n"
            f"Per User Output Throughput [w/ ctx] (tps/user):   {p['output_throughput_per_user_tok_s']:.4f}\n"
            f"Per GPU Output Throughput (tps/gpu):              {p['output_throughput_per_gpu_tok_s']:.4f}\n")
    s = r.get("streaming_metrics")
    if s:
        text += (f"Average time-to-first-token [TTFT] (ms):          {s['avg_ttft_ms']:.4f}\n"
                 f"Average time-per-output-token [TPOT] (ms):        {s['avg_tpot_ms']:.4f}\n"
                 f"Per User Output Speed (tps/user):                 {s['token_output_speed_tok_s']:.4f}\n"
                 "\n-- Per-Request Time-per-Output-Token [TPOT] Breakdown (ms)\n\n"
                 f"{_tagged('TPOT', s['tpot_percentiles'], '.4f')}\n"
                 "\n-- Per-Request Time-to-First-Token [TTFT] Breakdown (ms) \n\n"
                 f"{_tagged('TTFT', s['ttft_percentiles'], '.4f')}\n"
                 "\n-- Per-Request Generation Throughput [GTPS] Breakdown (tps/user)\n\n"
                 f"{_tagged('GTPS', s['gen_tps_percentiles'], '.4f')}\n")
    latency = p["request_latency_percentiles_ms"]
    text += ("\n-- Request Latency Breakdown (ms) -----------------------\n\n"
             + "\n".join(f"[Latency] {key.upper():<7}: {latency[key]:.4f}" for key in m.PERCENTILE_KEYS) + "\n")
    return text


def _decoding_text(d: dict[str, Any]) -> str:
    return (_header(f"DECODING STATISTICS ({d['mode']})")
            + "\n-- Number of Draft Tokens Details --------------------------------\n\n\n"
            f"{_tagged('DT', d['num_draft_tokens_percentiles'], '.2f')}\n"
            "-- Number of Accepted Draft Tokens Details --------------------------------\n\n"
            f"{_tagged('ADT', d['num_accepted_draft_tokens_percentiles'], '.2f')}\n"
            "-- Draft Acceptance Rate Details --------------------------------\n\n"
            f"{_tagged('DAR', d['draft_acceptance_rate_percentiles'], '.2f')}\n"
            "-- Acceptance Length Details --------------------------------\n\n"
            f"{_tagged('AL', d['acceptance_length_percentiles'], '.2f')}\n"
            f"\nDraft Tokens per Step (max_draft_len): {d['max_draft_len']}\n"
            f"Global Draft Acceptance Rate:          {d['draft_acceptance_rate']:.4f}\n"
            f"Global Acceptance Length:              {d['acceptance_length']:.4f}\n"
            + RULE + "\n")


def _expert_text(x: dict[str, Any], policy: str) -> str:
    text = "\n" + _header(f"EXPERT STATISTICS ({policy})")
    if x["moe_layers"] == 0:
        return text + "The target has no MoE layers.\n" + RULE + "\n"
    steps = f"{x['verify_steps']}"
    if x["estimated_steps"]:
        steps += f" (+{x['estimated_steps']} decode steps not recorded: estimated, see notes)"
    budget = "None" if x["budget"] is None else str(x["budget"])
    text += (f"MoE Layers:                         {x['moe_layers']}\n"
             f"Experts per Layer:                  {x['experts_per_layer']}\n"
             f"Top-k:                              {x['top_k']}\n"
             f"Expert Budget:                      {budget}\n"
             f"Bytes per Expert:                   {x['bytes_per_expert']}\n"
             f"Verify Steps:                       {steps}\n"
             f"Budget Binding Rate:                {_num(x['budget_binding_rate'])}\n"
             f"Slots Re-routed:                    {x['slots_rerouted']}\n"
             f"Slots Dropped:                      {x['slots_dropped']}\n"
             f"Expert Bytes Read:                  {x['expert_bytes_read']}\n"
             f"Expert Bytes per Output Token:      {_num(x['expert_bytes_per_output_token'])}\n"
             f"Predicted Unique per Layer (eco):   {_num(x['predicted_unique_per_layer'])}\n"
             f"Predicted Unique Error (eco):       {_num(x['predicted_unique_error'])}\n"
             "\n-- Natural Unique Experts per Layer per Verify Step ------------\n\n"
             f"{_tagged('NUE', x['natural_unique_per_layer_percentiles'], '.2f')}\n"
             "-- Kept Unique Experts per Layer per Verify Step ---------------\n\n"
             f"{_tagged('KUE', x['kept_unique_per_layer_percentiles'], '.2f')}\n")
    if x["kept_unique_by_layer"]:
        text += "-- Mean Unique Experts by MoE Layer (natural / kept) -----------\n\n"
        text += "\n".join(f"[Layer {i:<3}] {n:7.2f} / {k:7.2f}"
                          for i, (n, k) in enumerate(zip(x["natural_unique_by_layer"], x["kept_unique_by_layer"])))
        text += "\n"
    return text + RULE + "\n"


def _form(value: float) -> str:
    """trtllm's DatasetMetadata._format_number: 9 characters, scientific from 1e5."""
    return f"{value:9.2e}".ljust(9) if value >= 100000 else f"{value:9.4f}".ljust(9)


def _dataset_text(d: dict[str, Any]) -> str:
    rows = [("MIN", "minimum"), ("MAX", "maximum"), ("AVG", "average"), ("P50", "p50"), ("P90", "p90"),
            ("P95", "p95"), ("P99", "p99")]
    text = ("\n" + _header("DATASET DETAILS")
            + f"Dataset Path:         {d['dataset_path']}\n"
            f"Number of Sequences:  {d['num_requests']}\n"
            "\n-- Percentiles statistics ---------------------------------\n\n"
            "        Input              Output           Seq. Length\n"
            "-----------------------------------------------------------\n")
    for label, key in rows:
        text += (f"{label}:  {_form(d['isl_stats'][key])}          {_form(d['osl_stats'][key])}          "
                 f"{_form(d['seq_len_stats'][key])}\n")
    return text + RULE + "\n"


def format_report(r: dict[str, Any]) -> str:
    """The console report of a :func:`make_report` dict, in trtllm-bench's layout."""
    w, q = r["world_info"], r["request_info"]
    kv = w.get("kv_cache_percentage")
    issue = "None" if w["issue_rate"] is None else f"{w['issue_rate']:.4E}"
    text = ""
    if r["partial"]:
        text += (f"\n*** PARTIAL REPORT: interrupted; {q['num_requests']} of {r['dataset']['num_requests']} "
                 "requests finished ***\n")
    text += _engine_text(r["engine"], r["machine"])
    text += (_header("REQUEST DETAILS ")
             + f"Number of requests:             {q['num_requests']}\n"
             f"Number of concurrent requests:  {q['avg_num_concurrent_requests']:.4f}\n"
             f"Average Input Length (tokens):  {q['avg_input_length']:.4f}\n"
             f"Average Output Length (tokens): {q['avg_output_length']:.4f}\n")
    text += (_header("WORLD + RUNTIME INFORMATION ")
             + f"TP Size:                {w['tp_size']}\n"
             f"PP Size:                {w['pp_size']}\n"
             f"EP Size:                {w['ep_size']}\n"
             f"Max Runtime Batch Size: {w['max_batch_size']}\n"
             f"Max Runtime Tokens:     {w['max_num_tokens']}\n"
             f"Scheduling Policy:      {w['scheduling_policy']}\n"
             f"KV Memory Percentage:   {'None' if kv is None else f'{kv * 100.0:.2f}%'}\n"
             f"Issue Rate (req/sec):   {issue}\n\n")
    text += _performance_text(r)
    if r.get("decoding_stats"):
        text += _decoding_text(r["decoding_stats"])
    text += _expert_text(r["expert_statistics"], r["engine"]["policy"])
    text += _dataset_text(r["dataset"])
    for note in r.get("notes", ()):
        text += f"Note: {note}\n"
    return text


# ---- bench compare ------------------------------------------------------------------------------

COMPARE_COLUMNS = (  # (header, key, format); None values print as "-"
    ("policy", "label", "<18"),
    ("tok/s", "tokens_per_s", ">9.2f"),
    ("x ar", "speedup_vs_ar", ">6.3f"),
    ("x eagle3", "speedup_vs_eagle3", ">8.3f"),
    ("dec x ar", "decode_speedup_vs_ar", ">8.3f"),
    ("AL", "acceptance_length", ">6.3f"),
    ("experts/layer", "kept_unique_per_layer", ">13.2f"),
    ("natural", "natural_unique_per_layer", ">8.2f"),
    ("predicted", "predicted_unique_per_layer", ">9.2f"),
    ("identical", "identical_share", ">9.3f"),
    ("match", "token_match_rate", ">6.3f"),
    ("logp/token", "mean_logprob", ">10.4f"),
    ("d logp", "logprob_delta", ">8.4f"),
)


def _cell(value: Any, fmt: str) -> str:
    width = "".join(c for c in fmt.split(".")[0] if c.isdigit())
    if value is None:
        return f"{'-':>{width}}"
    return f"{value:{fmt}}"


def format_compare(c: dict[str, Any]) -> str:
    """The one table of ``moespec bench compare``, under a short header."""
    e, s = c["engine"], c["settings"]
    text = ""
    if c["partial"]:
        text += f"\n*** PARTIAL COMPARISON: interrupted; {c['num_requests']} requests compared ***\n"
    text += ("\n" + _header("POLICY COMPARISON ")
             + f"Model:                {e['model']}\n"
             f"Engine Directory:     {e['engine_dir']}\n"
             f"Dataset Path:         {c['dataset']['dataset_path']}\n"
             f"Requests:             {c['num_requests']} (interleaved, {s['max_batch_size']} per batch, "
             f"{s['warmup']} warm-up)\n"
             f"Draft Tree:           depth {s['depth']}, top-k {s['top_k']}, {s['total_tokens']} nodes\n"
             + (f"Byte Profile:         a decode token reads {e['byte_profile']['decode_mb']:.0f} MB of weights, a "
                f"verify pass touching every expert {e['byte_profile']['full_union_mb']:.0f} MB "
                f"({e['byte_profile']['ratio']:.2f}x)\n" if e.get("byte_profile") else "")
             + f"Reference Policy:     {c['reference_policy']} (greedy; agreement and logp are against it)\n"
             + RULE + "\n")
    label_width = max([18] + [len(row["label"]) for row in c["policies"]])  # the policy column fits its labels
    columns = [(h, key, f"<{label_width}" if key == "label" else f) for h, key, f in COMPARE_COLUMNS]
    head = "  ".join(f"{h:{'<' if f.startswith('<') else '>'}{''.join(ch for ch in f.split('.')[0] if ch.isdigit())}}"
                     for h, _, f in columns)
    text += head + "\n" + "-" * len(head) + "\n"
    for row in c["policies"]:
        cells = []
        for _, key, fmt in columns:
            cell = _cell(row[key], fmt)
            if key == "kept_unique_per_layer" and row.get("experts_estimated"):
                cell = cell[1:] + "*"
            cells.append(cell)
        text += "  ".join(cells) + "\n"
    text += "-" * len(head) + "\n"
    for note in c.get("notes", ()):
        text += f"Note: {note}\n"
    for plot in c.get("plots", ()):
        text += f"Plot: {plot}\n"
    return text

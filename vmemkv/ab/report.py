"""Formats an A/B result: the table, an honest summary, ``ab.md``, ``ab.json`` and PNG plots.

(About 480 lines: the summary's bullets, one per comparison the variants run allow, beside the
table, the files and the plots they describe.)"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
from pathlib import Path

from vmemkv.ab.variants import VARIANTS

# (header, metric key, format of the median, scale)
COLUMNS = (
    ("tok/s", "output_tokens_per_s", "{:.0f}", 1.0),
    ("tok/CPU-s", "output_tokens_per_cpu_s", "{:.0f}", 1.0),
    ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}", 1.0),
    ("TPOT p50 ms", "tpot_p50_ms", "{:.1f}", 1.0),
    ("ITL p99 ms", "itl_p99_ms", "{:.0f}", 1.0),
    ("peak KV MiB", "peak_kv_mib", "{:.2f}", 1.0),
    ("KV/req KiB", "peak_kv_bytes_per_request", "{:.0f}", 1 / 1024),
    ("KV B/token/layer", "kv_bytes_per_token_per_layer", "{:.0f}", 1.0),
    ("running", "most_running", "{:.0f}", 1.0),
    ("fit", "requests_fit", "{:.0f}", 1.0),
    ("frag %", "internal_fragmentation", "{:.1f}", 100.0),
    ("hit %", "prefix_hit_rate", "{:.1f}", 100.0),
    ("tokens computed", "tokens_computed", "{:.0f}", 1.0),
    ("preempt", "preemptions", "{:.0f}", 1.0),
    ("map calls", "map_calls", "{:.0f}", 1.0),
    ("mapping %", "mapping_share", "{:.2f}", 100.0),
    ("KV mgr %", "kv_manager_share", "{:.1f}", 100.0),
    ("attn %", "attention_share", "{:.0f}", 100.0),
)
# What the terminal shows (at most 100 columns): the main numbers, short headers, no ranges; the
# Markdown report has every column.
CONSOLE_HEADERS = {"output_tokens_per_s": "tok/s", "output_tokens_per_cpu_s": "tok/CPU-s",
                   "ttft_p50_ms": "TTFT", "tpot_p50_ms": "TPOT", "peak_kv_mib": "KV MiB",
                   "requests_fit": "fit", "prefix_hit_rate": "hit %", "preemptions": "preempt"}
CONSOLE_COLUMNS = tuple((CONSOLE_HEADERS[key], key, fmt, scale) for _, key, fmt, scale in COLUMNS
                        if key in CONSOLE_HEADERS)
CONSOLE_WIDTH = 100
# Columns that also show their min-max over repeats.
WITH_RANGE = {"output_tokens_per_s", "output_tokens_per_cpu_s"}
COLORS = {"vmem": "#1f77b4", "paged": "#ff7f0e", "vmem-per-layer": "#2ca02c", "paged-per-layer": "#d62728",
          "vmem-keep": "#9467bd", "paged-keep": "#8c564b"}


# --- machine ---------------------------------------------------------------------------------------
def machine_info() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"cpu": cpu, "cores": os.cpu_count(), "load_average_1_5_15": load,
            "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


# --- text ----------------------------------------------------------------------------------------
NOT_RECORDED = {"median": None}  # a metric a run recorded before it was measured: shown as "-"


def _cell(spread: dict, fmt: str, scale: float, with_range: bool) -> str:
    median = spread["median"]
    if median is None or (isinstance(median, float) and math.isnan(median)):
        return "-"
    text = fmt.format(median * scale)
    if with_range and spread["min"] != spread["max"]:
        text += f" ({fmt.format(spread['min'] * scale)}-{fmt.format(spread['max'] * scale)})"
    return text


def table_rows(result: dict, columns=COLUMNS, ranges: bool = True) -> tuple[list[str], list[list[str]]]:
    headers = ["workload", "variant"] + [c[0] for c in columns] + ["same tokens"]
    rows = []
    for workload, per_variant in result["results"].items():
        for variant, data in per_variant.items():
            cells = [workload, variant]
            cells += [_cell(data["metrics"].get(key, NOT_RECORDED), fmt, scale, ranges and key in WITH_RANGE)
                      for _, key, fmt, scale in columns]
            equal, identical = data["tokens_equal"], data.get("requests_identical")
            lossy = result.get("variants", {}).get(variant, {}).get("cold_tier", "off") != "off"
            cells.append("ref" if variant == "vmem" else "-" if equal is None
                         else "yes" if equal else f"{identical[0]}/{identical[1]} lossy" if lossy and identical
                         else "NO")
            rows.append(cells)
    return headers, rows


def format_table(result: dict) -> str:
    """The terminal's table (``CONSOLE_COLUMNS``; every column is in the Markdown report)."""
    headers, rows = table_rows(result, CONSOLE_COLUMNS, ranges=False)
    headers[-1] = "same"
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i > 1 else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line(headers), "  ".join("-" * w for w in widths)]
    previous = None
    for row in rows:
        if previous is not None and row[0] != previous:
            out.append("")
        out.append(line(row))
        previous = row[0]
    out += ["", "TTFT, TPOT: p50 in ms; fit: requests the pool holds at once.",
            "Every column, with ranges over the repeats: the Markdown report (--out)."]
    return "\n".join(out)


def markdown_table(result: dict) -> str:
    headers, rows = table_rows(result)
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(
        "---" if i < 2 else "---:" for i in range(len(headers))) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _metric(result: dict, workload: str, variant: str, key: str) -> dict | None:
    data = result["results"].get(workload, {}).get(variant)
    return None if data is None else data["metrics"][key]


def _compare(a: dict, b: dict) -> tuple[float, str]:
    """Ratio of medians a/b, and whether the min-max ranges separate them."""
    ratio = a["median"] / b["median"] if b["median"] else float("nan")
    if a["min"] > b["max"]:
        verdict = "higher"
    elif a["max"] < b["min"]:
        verdict = "lower"
    else:
        verdict = "overlapping"
    return ratio, verdict


RATIO_CONVENTION = ("Ratios: the faster side over the slower one, so at least 1.00x, named after the "
                    "side they favour (\"paged 1.05x faster\": paged's tokens per CPU-second are 1.05x "
                    "vmem's, or its time 1/1.05 of vmem's).")


def _faster(a: str, b: str, a_over_b: float, lower_is_faster: bool = False) -> str:
    """``a_over_b`` (a rate, or a time with ``lower_is_faster``) as the side it favours:
    "vmem 1.13x faster", never a bare ratio below 1 (``RATIO_CONVENTION``)."""
    if lower_is_faster:
        a_over_b = 1 / a_over_b if a_over_b else float("nan")
    if math.isnan(a_over_b) or math.isclose(a_over_b, 1.0, abs_tol=0.005):
        return "level"
    if a_over_b > 1:
        return f"{a} {a_over_b:.2f}x faster"
    return f"{b} {1 / a_over_b:.2f}x faster"


def _throughput_verdict(result: dict, a: str, b: str, lead: str) -> str:
    """Tokens per CPU-second of variants ``a`` and ``b`` on each workload, with a verdict per
    workload when there are repeats to judge the noise by; the bullet starts with ``lead``."""
    repeats = result["config"]["repeats"]
    wins, losses, ties = [], [], []
    for w in result["results"]:
        ratio, verdict = _compare(_metric(result, w, a, "output_tokens_per_cpu_s"),
                                  _metric(result, w, b, "output_tokens_per_cpu_s"))
        if repeats < 2:
            verdict = "overlapping"  # one run each: no noise estimate, no verdict
        (wins if verdict == "higher" else losses if verdict == "lower" else ties).append(
            f"{w} ({_faster(a, b, ratio)})")
    if repeats < 2:
        return f"{lead}, {a} against {b} (one run each, so no verdict): {', '.join(ties)}."
    return (f"{lead}, {a} against {b} (a win only where the min-max ranges of {repeats} repeats "
            f"separate): " + "; ".join(filter(None, [
                f"{a} wins on {', '.join(wins)}" if wins else "",
                f"{b} wins on {', '.join(losses)}" if losses else "",
                f"within noise on {', '.join(ties)}" if ties else ""])) + ".")


# How each attention kind reads a block table, against a slot view (the run's config says which ran).
_PAGED_READS = {
    "native": ("in place, as vmem reads its slots, through the same native CPU routines for "
               "decodes and for plain float32 prefills (AVX-512); other prefills go through SDPA, "
               "which reads paged blocks gathered into a copy"),
    "sdpa": ("gathered into a contiguous copy for SDPA every layer and step, where vmem hands SDPA "
             "the strided slot view as is"),
    "gpu": "in place, as vmem reads its slots, through the same GPU kernels",
}


def _paged_reads(config: dict) -> str:
    attention = config.get("attention") or "sdpa"  # runs that did not record it predate native
    if "native" in attention:
        return _PAGED_READS["native"]
    if str(config.get("device", "cpu")).startswith("cuda") and "sdpa" not in attention:
        return _PAGED_READS["gpu"]
    return _PAGED_READS["sdpa"]


def summary_bullets(result: dict) -> list[str]:
    """Short sentences, one per comparison the variants run allow: where each backend wins, with
    the caveats that apply. Ratios follow ``RATIO_CONVENTION``."""
    workloads = list(result["results"])
    variants = result["config"]["variants"]
    repeats = result["config"]["repeats"]
    parts = [RATIO_CONVENTION]
    if "vmem" in variants and "paged" in variants:
        parts.append(_throughput_verdict(result, "vmem", "paged", lead="Throughput per CPU-second"))
        attention = [(w, _metric(result, w, "vmem", "attention_seconds")["median"],
                      _metric(result, w, "paged", "attention_seconds")["median"]) for w in workloads]
        times = [f"{w} ({_faster('vmem', 'paged', v / p, lower_is_faster=True)})"
                 for w, v, p in attention if v and p]
        parts.append("Attention time, vmem against paged: " + ", ".join(times) + ".")
        parts.append(f"How paged reads its blocks in this run: {_paged_reads(result['config'])}.")
        shares = [_metric(result, w, "vmem", "mapping_share")["median"] for w in workloads]
        managers = [(_metric(result, w, "vmem", "kv_manager_share")["median"],
                     _metric(result, w, "paged", "kv_manager_share")["median"]) for w in workloads]
        where = ("a worker maps the lookahead blocks during the forward pass"
                 if str(result["config"].get("device", "cpu")).startswith("cuda") else
                 "all of it: on CPU the lookahead blocks are mapped on the step thread")
        parts.append(f"What vmem pays for its mapping: at most {100 * max(shares):.2f}% of step time "
                     f"on the critical path ({where}). All KV-manager work: "
                     f"{_span(100 * v for v, _ in managers)}% of step time for vmem, "
                     f"{_span(100 * p for _, p in managers)}% for paged.")
        peaks = [(w, _metric(result, w, "vmem", "peak_kv_bytes")["median"],
                  _metric(result, w, "paged", "peak_kv_bytes")["median"]) for w in workloads]
        same_peak = all(v == p for _, v, p in peaks)
        hits = all(abs(_metric(result, w, "vmem", "prefix_hit_rate")["median"]
                       - _metric(result, w, "paged", "prefix_hit_rate")["median"]) < 1e-9
                   for w in workloads)
        preempt = all(_metric(result, w, "vmem", "preemptions")["median"]
                      == _metric(result, w, "paged", "preemptions")["median"] for w in workloads)
        page = result["config"].get("workload_tokens_per_page", 16)
        parts.append(f"Memory ties by construction (the same pool's pages, {page} tokens each): peak "
                     "KV bytes " + ("identical" if same_peak else "within a page or two (vmem's "
                                    "lookahead takes a decoding sequence's next page one step early)")
                     + ", prefix hit rates " + ("equal" if hits else "NOT equal")
                     + ", preemption counts " + ("equal" if preempt else "differ") + ".")
    if "vmem-per-layer" in variants and "vmem" in variants:
        calls = [(w, _metric(result, w, "vmem", "map_calls")["median"],
                  _metric(result, w, "vmem-per-layer", "map_calls")["median"]) for w in workloads]
        ratios = [pl / v for _, v, pl in calls if v]
        tpc = [_compare(_metric(result, w, "vmem-per-layer", "output_tokens_per_cpu_s"),
                        _metric(result, w, "vmem", "output_tokens_per_cpu_s")) for w in workloads]
        named = [f"{w} ({_faster('per-layer', 'token-major', r)})" for w, (r, _) in zip(workloads, tpc)]
        text = (f"vAttention's per-layer layout: {_span(ratios, '{:.0f}')}x the map calls of "
                "token-major (one call per layer and K/V per page, against one coalesced call per "
                "page); per CPU-second")
        if repeats < 2:
            text += " (one run each, no verdict): " + ", ".join(named)
        else:
            wins = [n for n, (_, verdict) in zip(named, tpc) if verdict != "overlapping"]
            text += (": " + ", ".join(wins) + " beyond noise" if wins else
                     ", the two are within noise of each other everywhere")
        parts.append(text + ".")
    if "vmem-per-layer" in variants and "paged-per-layer" in variants:
        parts.append(_throughput_verdict(
            result, "vmem-per-layer", "paged-per-layer",
            lead="Throughput in the per-layer layout (the same bytes, other addressing)"))
    for kv_dtype in ("int8", "fp8"):  # quantized live KV over slots and over block tables
        if f"vmem-{kv_dtype}" in variants and f"paged-{kv_dtype}" in variants:
            parts.append(_throughput_verdict(
                result, f"vmem-{kv_dtype}", f"paged-{kv_dtype}",
                lead=f"Throughput over {kv_dtype} rows (the same bytes and scales, other addressing)"))
    parts += _release_against_keep(result)
    failures = result.get("failures") or []
    lossy = [v for v in variants if v in VARIANTS and VARIANTS[v].lossy]
    exact = "the exact variants" if lossy else "variants"
    parts.append(f"Greedy token ids were identical across {exact} on every greedy workload."
                 if not failures else "PROBLEMS: " + "; ".join(failures) + ".")
    if lossy:
        parts.append(f"The lossy variants ({', '.join(lossy)}) may give other tokens: the tokens column "
                     "says whether they matched the reference, and is not required to.")
    load = result.get("machine", {}).get("load_average_1_5_15")
    if load:
        parts.append(f"Load average {load[0]} (1 min) on {result['machine']['cores']} cores: "
                     "wall-clock numbers (tok/s, TTFT, TPOT) carry other processes' noise; tokens "
                     "per CPU-second is the steadier comparison.")
    return parts


def _span(values, fmt: str = "{:.1f}") -> str:
    """"lo-hi", or one number when they are equal as printed."""
    values = list(values)
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def summary(result: dict) -> str:
    """The bullets as one paragraph, for the terminal."""
    return " ".join(summary_bullets(result))


def _release_against_keep(result: dict) -> list[str]:
    """On each sliding-window workload: KV per request and the requests the pool fits, releasing
    the blocks behind the window against keeping every block, per KV backend."""
    sentences = []
    variants = result["config"]["variants"]
    for w in result["results"]:
        if not result["workloads"][w].get("sliding_window"):
            continue
        pairs = []
        for base in ("vmem", "paged"):
            keep = f"{base}-keep"
            if base not in variants or keep not in variants:
                continue
            kv, fit, preempted = ({v: _metric(result, w, v, key)["median"] for v in (base, keep)}
                                  for key in ("peak_kv_bytes_per_request", "requests_fit", "preemptions"))
            pairs.append(f"{base} holds {kv[base] / 1024:.0f} KiB per request releasing (the "
                         f"pool fits {fit[base]:.0f}), {kv[keep] / 1024:.0f} KiB keeping every "
                         f"block ({kv[keep] / kv[base]:.2f}x as much; {keep}: fits "
                         f"{fit[keep]:.0f}, {preempted[keep]:.0f} preemptions)")
        if pairs:
            sentences.append(f"On {w}, {'; '.join(pairs)}.")
    return sentences


# --- files ---------------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    machine = result.get("machine", {})
    config = result["config"]
    lines = ["# vmemkv A/B: virtually contiguous KV (vmem) against block tables (paged)", "",
             ("Same engine, model and requests; one flag changes the KV backend or layout. "
             "Medians over the repeats; throughput columns show (min-max)."), "",
             "```bash", result.get("command", ""), "```", "",
             (f"Model `{config['model']}`, {config['repeats']} repeat(s) per variant (variants "
             f"alternating, rotated each repeat), seed {config['seed']}, torch threads "
             f"{config['torch_threads']}{', quick sizes' if config['quick'] else ''}, "
             f"device {config.get('device', 'cpu')}, attention {config.get('attention') or 'not recorded'}, "
             f"policy {config.get('policy', 'fcfs')}, "
             f"host tier {config.get('host_cache_bytes', 0):,} bytes, tensor-parallel ranks "
             f"{config.get('tensor_parallel_size', 1)}, "
             f"workloads sized for pages of "
             f"{config.get('workload_tokens_per_page', 16)} tokens; "
             f"whole run {result['runtime_s']:.0f} s."), "",
             "## Results", "", markdown_table(result), "",
             "## Summary", "", *(f"- {line}" for line in summary_bullets(result)), "",
             "## Variants", ""]
    lines += [f"- `{name}`: kv_backend={v['kv_backend']}, layout={v['layout']} — {_description(name, v)}"
              for name, v in result["variants"].items()]
    lines += ["", "## Workloads", ""]
    for name, w in result["workloads"].items():
        engine = ", ".join(f"{k}={v}" for k, v in w["engine"].items())
        lines.append(f"- `{name}`: {w['description']}; {w['num_requests']} requests, "
                     f"{w['prompt_tokens']} prompt / {w['output_tokens']} output tokens; "
                     f"engine: {engine}")
    lines += ["", "## Metrics", "",
              ("- Every request is added at once (an offline batch); token counts are timestamped "
              "after each `engine.step()`. TTFT includes queueing behind the batch; TPOT is per "
              "completion (last - first token) / (tokens - 1); ITL is every gap between a "
              "completion's consecutive tokens."),
              ("- tok/CPU-s: output tokens per CPU-second of this process (all threads), steadier "
              "than wall time when other processes share the cores."),
              ("- KV/req KiB: the most KV bytes held per running request (both layout groups of a "
              "hybrid model); running: the most requests running at once; fit: the pool's bytes "
              "over KV/req, the requests it holds at that size side by side."),
              ("- peak KV MiB: the most pool pages held at once x page bytes; frag %: bytes held by "
              "running sequences past the bytes their tokens fill, over the bytes filled "
              "(averaged over steps)."),
              ("- hit %: prompt tokens served by prefix hits, over prompt tokens; tokens computed: "
              "positions the forward passes computed (prompt tokens not hit, recomputed ones after "
              "a preemption, one per output token after the first)."),
              ("- mapping %: backend map/unmap time on the step thread plus time the step waited "
              "for the lookahead mapping worker, over step time. KV mgr %: all KV-manager "
              "operations on the step thread (admission, prefix queries, growth, commit, free, "
              "fork, preemption, block tables, inline mapping) plus that wait, over step time; "
              "both timed by the library (`vmemkv.KVMetricsCollector`). attn %: attention (K/V write, "
              "any gather of paged blocks, the kernel) over step time."),
              "", "## Machine", ""]
    lines += [f"- {key}: {value}" for key, value in machine.items()]
    return "\n".join(lines) + "\n"


def _description(name: str, recorded: dict) -> str:
    """The variant's text as the code says it now (a result rendered again from its ab.json gets
    the current wording); a variant the code no longer has keeps its recorded text."""
    return VARIANTS[name].description if name in VARIANTS else recorded["description"]


def _grouped_bars(ax, result: dict, key: str, scale: float = 1.0, log: bool = False,
                  label_values: bool = False) -> None:
    import numpy as np

    workloads = list(result["results"])
    variants = result["config"]["variants"]
    width = 0.8 / len(variants)
    x = np.arange(len(workloads))
    for i, variant in enumerate(variants):
        spreads = [_metric(result, w, variant, key) for w in workloads]
        med = np.array([s["median"] * scale for s in spreads], dtype=float)
        low = np.array([s["min"] * scale for s in spreads], dtype=float)
        high = np.array([s["max"] * scale for s in spreads], dtype=float)
        positions = x + (i - (len(variants) - 1) / 2) * width
        bars = ax.bar(positions, med, width, label=variant, color=COLORS.get(variant),
                      yerr=np.vstack([med - low, high - med]), capsize=3,
                      error_kw={"elinewidth": 1})
        if label_values:
            for bar, value in zip(bars, med):
                text = f"{value:.0f}" if value >= 10 or value == int(value) else f"{value:.2f}"
                y = bar.get_height() if value > 0 else (1 if log else 0)
                # upright, so the labels of narrow neighbouring bars never overlap
                ax.annotate(text, (bar.get_x() + bar.get_width() / 2, y), ha="center",
                            va="bottom", fontsize=7, rotation=90, xytext=(0, 2),
                            textcoords="offset points")
    if label_values:
        ax.margins(y=0.12)  # room above the tallest bar for its label
    ax.set_xticks(x, workloads, rotation=15)
    if log:
        ax.set_yscale("log")
        ax.set_ylim(bottom=0.7)  # room for the "0" labels of variants that map nothing
    ax.grid(axis="y", alpha=0.3)


def write_plots(result: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model = result["config"]["model"]
    repeats = result["config"]["repeats"]
    specs = [
        ("ab_throughput.png", (f"Throughput ({model}; median, error bars: min-max over "
                              f"{repeats} run{'s' if repeats > 1 else ''})"),
         [("output tokens / s (wall)", "output_tokens_per_s", 1.0, False, False),
          ("output tokens / CPU-second", "output_tokens_per_cpu_s", 1.0, False, False)]),
        ("ab_latency.png", f"Latency ({model}, p50 per run, median and min-max over runs)",
         [("TTFT p50 (ms)", "ttft_p50_ms", 1.0, False, False),
          ("TPOT p50 (ms)", "tpot_p50_ms", 1.0, False, False)]),
        ("ab_memory.png", f"KV memory and mapping ({model})",
         [("peak KV (MiB)", "peak_kv_mib", 1.0, False, True),
          ("map calls (log; paged maps nothing)", "map_calls", 1.0, True, True)]),
    ]
    paths = []
    for filename, title, panels in specs:
        fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2))
        for ax, (ylabel, key, scale, log, labels) in zip(axes, panels):
            _grouped_bars(ax, result, key, scale, log, labels)
            ax.set_ylabel(ylabel)
        axes[0].legend(fontsize=8)
        fig.suptitle(title)
        fig.tight_layout()
        path = out_dir / filename
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def write_all(result: dict, out_dir: str | Path, plots: bool = True) -> list[Path]:
    """``ab.md``, ``ab.json`` and (with ``plots``) the PNG plots under ``out_dir``; returns their
    paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab.json").write_text(to_json(result) + "\n")
    (out / "ab.md").write_text(markdown(result))
    paths = [out / "ab.md", out / "ab.json"]
    if plots:
        paths += write_plots(result, out)
    return paths


def _json_default(value):
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {value!r}")


def _finite(value):
    """NaN (a latency with no samples) becomes null: strict JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def to_json(result: dict) -> str:
    return json.dumps(_finite(result), indent=1, default=_json_default, allow_nan=False)

"""The A/B harness: deterministic workloads, and a --quick run that writes complete results.

One quick run (two small workloads x every variant, one repeat) is shared by the tests below;
nothing here asserts timings, only what must hold whatever the machine's speed.
"""

from __future__ import annotations

import io
import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

from vmemkv.ab import METRIC_KEYS, VARIANTS, WORKLOADS, make_workload, report
from vmemkv.ab.cli import main
from vmemkv.ab.runner import failures
from vmemkv.ab.variants import DEFAULT_VARIANTS, KEEP_VARIANTS, default_variants
from vmemkv.ab.workloads import TOKEN_MAX, TOKEN_MIN, full_length_pages, pages

QUICK_WORKLOADS = ("shared-prefix", "pressure")
# 16: CPU's default page; 1024: tiny-llama in fp32 on a 2 MiB CUDA page.
PAGE_TOKENS = (16, 64, 1024)


def _as_data(workload):
    return ([(rid, ids, vars(params)) for rid, ids, params in workload.requests], workload.engine)


@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.parametrize("quick", [True, False])
def test_workloads_are_deterministic_for_a_seed(name, quick):
    first, again = make_workload(name, seed=3, quick=quick), make_workload(name, seed=3, quick=quick)
    assert _as_data(first) == _as_data(again)
    assert _as_data(first) != _as_data(make_workload(name, seed=4, quick=quick))


@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.parametrize("page", PAGE_TOKENS)
def test_workloads_stay_in_the_byte_vocabulary_and_fit_the_engine(name, page):
    workload = make_workload(name, tokens_per_page=page)
    assert workload.tokens_per_page == page
    ids = set()
    for request_id, prompt, params in workload.requests:
        ids.update(prompt)
        assert params.ignore_eos
        assert len(prompt) + params.max_tokens <= workload.engine["max_model_len"], request_id
    assert TOKEN_MIN <= min(ids) and max(ids) <= TOKEN_MAX
    assert len({rid for rid, _, _ in workload.requests}) == len(workload.requests)


@pytest.mark.parametrize("quick", [True, False])
@pytest.mark.parametrize("page", PAGE_TOKENS)
def test_pressure_cannot_give_every_request_its_next_page(page, quick):
    workload = make_workload("pressure", quick=quick, tokens_per_page=page)
    prompts = [len(ids) for _, ids, _ in workload.requests]
    output = workload.requests[0][2].max_tokens
    pool = workload.engine["num_blocks"]
    # every prompt fits at once and prefills in one step ...
    assert sum(pages(n, page) for n in prompts) <= pool
    assert workload.engine["max_num_batched_tokens"] >= sum(prompts)
    # ... and ends short of a page boundary that its first output/2 tokens cross ...
    assert all(0 < page - n % page <= output // 2 for n in prompts if n % page)
    # ... but only half the requests can then get their next page
    assert pool - sum(pages(n, page) for n in prompts) <= len(prompts) // 2
    assert pool < workload.pages_at_full_length(page)


@pytest.mark.parametrize("quick", [True, False])
@pytest.mark.parametrize("page", PAGE_TOKENS)
def test_shared_prefix_spans_whole_pages_and_the_pool_holds_everything(page, quick):
    workload = make_workload("shared-prefix", quick=quick, tokens_per_page=page)
    first = workload.requests[0][1]
    system = next(n for n in range(len(first), 0, -1)
                  if all(ids[:n] == first[:n] for _, ids, _ in workload.requests[:3]))
    system -= system % page  # the shared whole pages
    assert system // page >= 4
    assert workload.engine["max_num_batched_tokens"] == system
    assert workload.engine["num_blocks"] >= workload.pages_at_full_length(page)


def test_a_variant_with_another_page_gets_a_pool_of_the_same_tokens():
    chat = make_workload("chat", quick=True, tokens_per_page=16)
    assert chat.engine_for(16) == chat.engine
    coarse = chat.engine_for(1024)  # no pressure: still room for everything at once
    assert coarse["num_blocks"] >= max(chat.pages_at_full_length(1024),
                                       pages(chat.engine["num_blocks"] * 16, 1024))
    pressure = make_workload("pressure", quick=True, tokens_per_page=16)
    assert pressure.engine_for(64)["num_blocks"] == pages(pressure.engine["num_blocks"] * 16, 64)


def test_a_variant_on_another_page_is_not_held_to_preempting():
    workload = make_workload("pressure", quick=True)
    none = {"preemptions": {"median": 0.0, "min": 0.0, "max": 0.0},
            "prefix_hit_rate": {"median": 0.0, "min": 0.0, "max": 0.0}}
    results = {"pressure": {v: {"metrics": none, "tokens_equal": True} for v in DEFAULT_VARIANTS}}
    assert len(failures({"pressure": workload}, results)) == len(DEFAULT_VARIANTS)
    checks = {"pressure": {"other_page_size": {"vmem-per-layer": 8192, "paged-per-layer": 8192}}}
    assert [f.split(":")[1].split()[0] for f in failures({"pressure": workload}, results, checks)] \
        == ["vmem", "paged"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ab")
    capture = pytest.MonkeyPatch()
    stdout = io.StringIO()
    capture.setattr(sys, "stdout", stdout)
    try:
        status = main(["--quick", "--json", "--no-progress", "--workloads", ",".join(QUICK_WORKLOADS),
                       "--out", str(out)])
    finally:
        capture.undo()
    return status, json.loads(stdout.getvalue()), out


def test_quick_run_passes_its_checks(quick_run):
    status, result, _ = quick_run
    assert result["failures"] == []
    assert status == 0


def test_the_terminal_output_fits_100_columns(quick_run):
    _, result, _ = quick_run
    table, summary = report.format_table(result), textwrap.fill(report.summary(result), report.CONSOLE_WIDTH)
    assert "tok/s" in table and len(table.splitlines()) > 2
    assert max(len(line) for line in [*table.splitlines(), *summary.splitlines()]) <= 100


def test_quick_run_reports_every_metric_for_every_variant(quick_run):
    _, result, _ = quick_run
    assert set(result["results"]) == set(QUICK_WORKLOADS)
    for per_variant in result["results"].values():
        assert set(per_variant) == set(DEFAULT_VARIANTS)  # no keep variants without a window
        for data in per_variant.values():
            assert set(data["metrics"]) == set(METRIC_KEYS)
            for spread in data["metrics"].values():
                assert set(spread) == {"median", "min", "max"}
            assert len(data["runs"]) == 1


def test_every_variant_reports_the_kv_bytes_per_token_per_layer_of_its_model(quick_run):
    """The same model on every variant caches the same bytes per token per layer; the Markdown
    table shows them."""
    _, result, _ = quick_run
    for per_variant in result["results"].values():
        values = {data["metrics"]["kv_bytes_per_token_per_layer"]["median"] for data in per_variant.values()}
        assert len(values) == 1 and values.pop() > 0
    assert "KV B/token/layer" in report.markdown_table(result)


def test_greedy_tokens_are_identical_across_variants(quick_run):
    _, result, _ = quick_run
    for name in QUICK_WORKLOADS:
        assert result["workloads"][name]["greedy"]
        for variant, data in result["results"][name].items():
            assert data["tokens_equal"] is True, (name, variant)


def test_vmem_and_paged_hit_the_prefix_cache_alike(quick_run):
    _, result, _ = quick_run
    rates = {v: result["results"]["shared-prefix"][v]["metrics"]["prefix_hit_rate"]["median"]
             for v in DEFAULT_VARIANTS}
    assert rates["vmem"] > 0
    assert rates["vmem"] == rates["paged"] == rates["vmem-per-layer"]


def test_pressure_preempts_and_only_vmem_maps(quick_run):
    _, result, _ = quick_run
    pressure = result["results"]["pressure"]
    for data in pressure.values():
        assert data["metrics"]["preemptions"]["min"] > 0
    assert pressure["paged"]["metrics"]["map_calls"]["median"] == 0
    assert 0 < pressure["vmem"]["metrics"]["map_calls"]["median"] < \
        pressure["vmem-per-layer"]["metrics"]["map_calls"]["median"]


def test_quick_run_writes_its_files(quick_run):
    _, result, out = quick_run
    names = {p.name for p in out.iterdir()}
    assert {"ab.md", "ab.json", "ab_throughput.png", "ab_latency.png", "ab_memory.png"} <= names
    assert json.loads((out / "ab.json").read_text())["results"].keys() == result["results"].keys()
    markdown = (out / "ab.md").read_text()
    assert "vmemkv ab --workloads shared-prefix,pressure" in markdown
    assert "| shared-prefix | paged |" in markdown
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_plots_writes_the_tables_only(quick_run, tmp_path):
    _, result, _ = quick_run
    paths = report.write_all(result, tmp_path, plots=False)
    assert sorted(p.name for p in paths) == sorted(p.name for p in tmp_path.iterdir()) \
        == ["ab.json", "ab.md"]


def test_quick_run_on_coarse_pages_still_hits_and_preempts(tmp_path, capsys):
    """Pages of 64 tokens (as a 2 MiB CUDA page holds 1024): the workloads are sized from the
    engine's real page, so the checks still bite. `gpu_check.sh --dry-run` runs the same at 1024."""
    status = main(["--quick", "--json", "--no-progress", "--no-plots", "--variants", "vmem,paged",
                   "--workloads", ",".join(QUICK_WORKLOADS), "--tokens-per-page", "64",
                   "--out", str(tmp_path)])
    result = json.loads(capsys.readouterr().out)
    assert result["failures"] == [] and status == 0
    assert result["config"]["tokens_per_page"] == {"vmem": 64, "paged": 64}
    assert result["workloads"]["pressure"]["tokens_per_page"] == 64
    assert result["results"]["shared-prefix"]["vmem"]["metrics"]["prefix_hit_rate"]["median"] > 0
    for data in result["results"]["pressure"].values():
        assert data["metrics"]["preemptions"]["min"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ab.json", "ab.md"]  # --out, no plots


def test_unknown_names_are_refused(capsys):
    assert main(["--quick", "--workloads", "chat,nope"]) == 2
    assert "nope" in capsys.readouterr().err


# --- the host tier and tensor parallelism, applied to every variant -----------------------------
@pytest.mark.parametrize("page", PAGE_TOKENS)
def test_multi_turn_resends_each_conversation_and_its_traffic_outgrows_the_pool(page):
    workload = make_workload("multi-turn", quick=True, tokens_per_page=page)
    prompts = dict((rid, ids) for rid, ids, _ in workload.requests)
    turns = sorted(rid for rid in prompts if rid.startswith("turn-"))
    for rid in turns:  # turn t re-sends turn t-1's prompt (and a recorded answer) first
        chat, turn = map(int, rid.split("-")[1:])
        if turn:
            previous = prompts[f"turn-{chat}-{turn - 1}"]
            assert prompts[rid][:len(previous)] == previous and len(prompts[rid]) > len(previous)
    order = [rid for rid, _, _ in workload.requests]
    assert order.index("traffic-0-0") < order.index("turn-0-1")  # traffic between two turns
    engine = workload.engine
    running = engine["max_num_seqs"] * max(pages(len(ids) + p.max_tokens, page)
                                           for _, ids, p in workload.requests)
    traffic = sum(pages(len(ids), page) for rid, ids, _ in workload.requests
                  if rid.startswith("traffic-0-"))
    # the running requests always fit (no preemption), but not one round of traffic beside them
    assert running <= engine["num_blocks"] < running + traffic


def test_the_host_tier_turns_multi_turn_evictions_into_hits_for_every_variant(capsys):
    def run(host_cache_bytes: int) -> dict:
        status = main(["--quick", "--json", "--no-progress", "--no-plots", "--variants",
                       "vmem,paged", "--workloads", "multi-turn", "--out", "",
                       "--host-cache-bytes", str(host_cache_bytes)])
        result = json.loads(capsys.readouterr().out)
        assert status == 0 and result["failures"] == []
        assert result["config"]["host_cache_bytes"] == host_cache_bytes
        return {v: {k: s["median"] for k, s in data["metrics"].items()}
                for v, data in result["results"]["multi-turn"].items()}

    without, with_tier = run(0), run(1 << 24)
    for variant in ("vmem", "paged"):
        assert without[variant]["evictions"] > 0
        assert without[variant]["host_promotions"] == without[variant]["prefix_hit_rate_host"] == 0
        assert with_tier[variant]["host_promotions"] > 0
        assert with_tier[variant]["prefix_hit_rate_host"] > 0
        assert with_tier[variant]["prefix_hit_rate"] > without[variant]["prefix_hit_rate"]
    assert with_tier["vmem"]["prefix_hit_rate"] == with_tier["paged"]["prefix_hit_rate"]


def test_the_cold_tier_variants_turn_evictions_into_lossy_hits_and_count_their_answers(capsys):
    status = main(["--quick", "--json", "--no-progress", "--no-plots", "--variants",
                   "vmem,vmem-cold-int8,vmem-cold-int4", "--workloads", "multi-turn", "--out", "",
                   "--cold-cache-bytes", str(1 << 22)])
    result = json.loads(capsys.readouterr().out)
    assert status == 0 and result["failures"] == []  # lossy tokens are counted, not failures
    assert result["config"]["cold_cache_bytes"] == 1 << 22
    assert "--cold-cache-bytes 4194304" in result["command"]
    runs = result["results"]["multi-turn"]
    medians = {v: {k: s["median"] for k, s in data["metrics"].items()} for v, data in runs.items()}
    assert medians["vmem"]["cold_promotions"] == medians["vmem"]["prefix_hit_rate_cold"] == 0
    for variant in ("vmem-cold-int8", "vmem-cold-int4"):
        assert medians[variant]["cold_promotions"] > 0 and medians[variant]["prefix_hit_rate_cold"] > 0
        assert medians[variant]["prefix_hit_rate"] > medians["vmem"]["prefix_hit_rate"]
        identical, total = runs[variant]["requests_identical"]
        assert total > 0 and 0 <= identical <= total
    from vmemkv.ab.report import table_rows

    cells = {row[1]: row[-1] for row in table_rows(result)[1]}
    for variant in ("vmem-cold-int8", "vmem-cold-int4"):
        identical, total = runs[variant]["requests_identical"]
        assert cells[variant] in ("yes", f"{identical}/{total} lossy")


def test_the_quantized_variants_run_over_slots_and_over_block_tables(capsys):
    """vmem-int8 and paged-int8: the same int8 rows addressed both ways, so the same answers
    (counted against vmem's, lossy) and the same bytes a token."""
    status = main(["--quick", "--json", "--no-progress", "--no-plots", "--variants", "vmem,vmem-int8,paged-int8",
                   "--workloads", "chat", "--out", ""])
    result = json.loads(capsys.readouterr().out)
    assert status == 0 and result["failures"] == []
    runs = result["results"]["chat"]
    medians = {v: {k: s["median"] for k, s in data["metrics"].items()} for v, data in runs.items()}
    assert runs["paged-int8"]["requests_identical"] == runs["vmem-int8"]["requests_identical"]
    assert medians["paged-int8"]["kv_bytes_per_token_per_layer"] == medians["vmem-int8"]["kv_bytes_per_token_per_layer"]
    assert medians["vmem-int8"]["kv_bytes_per_token_per_layer"] < medians["vmem"]["kv_bytes_per_token_per_layer"]
    from vmemkv.ab.report import summary_bullets

    assert any(line.startswith("Throughput over int8 rows") for line in summary_bullets(result))


def test_bad_host_tier_and_rank_counts_are_refused(capsys):
    assert main(["--quick", "--host-cache-bytes", "-1"]) == 2
    assert main(["--quick", "--tensor-parallel-size", "0"]) == 2
    assert capsys.readouterr().err.count("--tensor-parallel-size") == 2
    assert main(["--quick", "--cold-cache-bytes", "0"]) == 2


@pytest.mark.slow
@pytest.mark.spawns
def test_two_ranks_give_the_tokens_and_hits_of_one():
    """One quick workload on the vmem variant, once on one rank and once on two (the engine
    starts the second rank and every rank loads the model by name)."""
    from vmemkv.ab.runner import run_once
    from vmemkv.engine.models.zoo import load_model

    model, tokenizer = load_model("tiny-llama")
    workload = make_workload("shared-prefix", quick=True)
    runs = [run_once(model, tokenizer, "tiny-llama", workload, VARIANTS["vmem"],
                     overrides={"tensor_parallel_size": size, "tensor_parallel_check": True})
            for size in (1, 2)]
    assert runs[0].tokens == runs[1].tokens and len(runs[1].tokens) == len(workload.requests)
    assert runs[1].metrics["prefix_hit_rate"] == runs[0].metrics["prefix_hit_rate"] > 0


def test_host_tier_and_ranks_reach_every_variants_engine(monkeypatch):
    """The options become the EngineConfig fields of every variant's engine (refused here before
    it starts anything)."""
    from vmemkv.ab import runner

    class Built(Exception):
        pass

    configs = []

    def engine(config, *model_and_tokenizer):
        configs.append((config, model_and_tokenizer))
        raise Built

    monkeypatch.setattr(runner, "LLMEngine", engine)
    with pytest.raises(Built):
        main(["--quick", "--no-progress", "--variants", "paged", "--workloads", "chat", "--out", "",
              "--host-cache-bytes", "4096", "--tensor-parallel-size", "2", "--policy", "lpm"])
    (config, model_and_tokenizer), = configs
    assert (config.host_cache_bytes, config.tensor_parallel_size, config.policy,
            config.kv_backend) == (4096, 2, "lpm", "paged")
    assert model_and_tokenizer == ()  # two ranks: each loads the model by name


# --- long generations on a sliding-window model ---------------------------------------------------
@pytest.mark.parametrize("quick", [True, False])
@pytest.mark.parametrize("page", (16, 64))
def test_window_pool_holds_every_request_only_with_release(page, quick):
    workload = make_workload("window", quick=quick, tokens_per_page=page)
    count, window = len(workload.requests), workload.sliding_window
    held = pages(window, page) + 3  # the window, its partial first page, the written one, lookahead
    assert workload.engine["num_blocks"] == count * held
    # every output is at least two windows long, and the whole lengths outgrow the pool
    assert all(p.max_tokens >= 2 * window for _, _, p in workload.requests)
    assert workload.pages_at_full_length(page) > workload.engine["num_blocks"]


def test_window_needs_a_sliding_window_model(capsys):
    assert main(["--quick", "--no-progress", "--out", "", "--workloads", "window",
                 "--variants", "vmem"]) == 2  # tiny-llama: no window
    assert "tiny-mistral" in capsys.readouterr().err


@pytest.mark.slow
def test_window_runs_every_request_at_once_holding_about_a_window_each(capsys):
    """On tiny-mistral (window 128), both variants give back the blocks behind the window: all
    requests run at once, none is preempted, each holds at most its window plus two pages (plus
    the engine's lookahead page), and the greedy tokens agree; keeping every block, fewer fit."""
    assert main(["--quick", "--json", "--no-progress", "--out", "", "--workloads", "window",
                 "--variants", "vmem,paged,vmem-keep", "--model", "tiny-mistral"]) == 0
    result = json.loads(capsys.readouterr().out)
    workload = result["workloads"]["window"]
    page = workload["tokens_per_page"]
    page_bytes = page * 4 * 2 * 2 * 32 * 4  # tiny-mistral: 4 layers x K,V x 2 heads x dim 32, fp32
    for variant in ("vmem", "paged"):
        metrics = {key: spread["median"] for key, spread in result["results"]["window"][variant]["metrics"].items()}
        assert metrics["preemptions"] == 0 and metrics["most_running"] == workload["num_requests"]
        assert 0 < metrics["peak_kv_bytes_per_request"] <= (pages(128, page) + 3) * page_bytes
    assert result["checks"]["window"]["tokens_equal"] == {"paged": True, "vmem-keep": True}
    keep = {key: spread["median"] for key, spread in result["results"]["window"]["vmem-keep"]["metrics"].items()}
    assert keep["requests_fit"] < workload["num_requests"] and keep["preemptions"] > 0


# --- local and global layers (the engine's two layout groups) ------------------------------------
@pytest.mark.parametrize("quick", [True, False])
@pytest.mark.parametrize("page", (16, 64))
def test_hybrid_pool_holds_every_request_only_with_release(page, quick):
    """The pool, split as the engine splits it (``layer_groups.group_configs``), gives the global
    layers every request at full length; keeping every block, fewer requests fit."""
    import torch

    from vmemkv import CacheConfig
    from vmemkv.cache.layer_groups import LayerGroups, group_configs

    workload = make_workload("hybrid", quick=quick, tokens_per_page=page)
    engine, count = workload.engine, len(workload.requests)
    config = CacheConfig(num_layers=4, num_kv_heads=2, head_dim=32, dtype=torch.float32,  # tiny-gemma2
                         tokens_per_page=page, num_blocks=engine["num_blocks"],
                         max_num_seqs=engine["max_num_seqs"], max_model_len=engine["max_model_len"])
    windows = [workload.sliding_window, None] * 2
    global_group, _ = group_configs(config, LayerGroups.from_windows(windows),
                                    engine["max_num_batched_tokens"])
    each = full_length_pages(workload.requests, page)
    assert global_group.num_blocks >= sum(each) + count  # and a lookahead page each
    assert max(each) * count > engine["num_blocks"]  # whole-model pages, every block kept
    assert all(p.max_tokens >= 2 * workload.sliding_window for _, _, p in workload.requests)


def test_hybrid_needs_a_model_with_local_and_global_layers(capsys):
    assert main(["--quick", "--no-progress", "--out", "", "--workloads", "hybrid",
                 "--variants", "vmem", "--model", "tiny-mistral"]) == 2  # every layer slides
    assert "tiny-gemma2" in capsys.readouterr().err


def test_the_keep_every_block_variants_join_sliding_window_workloads_only():
    assert default_variants(["chat", "pressure"]) == list(DEFAULT_VARIANTS)
    assert default_variants(["hybrid"]) == default_variants(["window"]) == [*DEFAULT_VARIANTS, *KEEP_VARIANTS]


@pytest.mark.slow
def test_hybrid_fits_every_request_only_releasing_on_both_backends(capsys):
    """tiny-gemma2 (two local layers, window 128, two global): releasing, the local layers hold
    a window each, all requests run at once with no preemption, the same tokens; keeping every
    block costs more KV per request and fits fewer, on slots and on block tables alike."""
    assert main(["--quick", "--json", "--no-progress", "--out", "", "--workloads", "hybrid",
                 "--model", "tiny-gemma2"]) == 0
    result = json.loads(capsys.readouterr().out)
    count = result["workloads"]["hybrid"]["num_requests"]
    medians = {v: {key: spread["median"] for key, spread in data["metrics"].items()}
               for v, data in result["results"]["hybrid"].items()}
    assert set(medians) == {*DEFAULT_VARIANTS, *KEEP_VARIANTS}
    for base in ("vmem", "paged"):
        release, keep = medians[base], medians[f"{base}-keep"]
        assert release["preemptions"] == 0 and release["most_running"] == count <= release["requests_fit"]
        assert keep["requests_fit"] < count and keep["preemptions"] > 0
        assert keep["peak_kv_bytes_per_request"] > 1.4 * release["peak_kv_bytes_per_request"]
    assert all(result["checks"]["hybrid"]["tokens_equal"].values())
    summary = report.summary(result)
    assert "KiB keeping every block (" in summary and "; vmem-keep: fits" in summary


# --- where a run writes ----------------------------------------------------------------------------

def test_each_run_without_out_gets_its_own_folder(tmp_path, monkeypatch):
    from vmemkv.ab.cli import DEFAULT_OUT, link_latest, output_dir

    monkeypatch.chdir(tmp_path)
    first = output_dir(None, ["chat"], now=0)
    first.mkdir(parents=True)
    second = output_dir(None, ["chat"], now=0)  # the same second: a suffix, not the same folder
    assert first.parent == second.parent == Path(DEFAULT_OUT)
    assert first.name.endswith("-chat") and second.name == first.name + "-2"
    second.mkdir()
    link_latest(first)
    assert link_latest(second).resolve() == second.resolve()
    assert output_dir("somewhere", ["chat"]) == Path("somewhere")
    assert output_dir("", ["chat"]) is None


def test_a_run_without_out_keeps_the_last_and_says_where_it_wrote(tmp_path, monkeypatch, capsys):
    from vmemkv.ab.cli import DEFAULT_OUT

    monkeypatch.chdir(tmp_path)
    earlier = tmp_path / DEFAULT_OUT / "20000101-000000-chat"
    earlier.mkdir(parents=True)
    (earlier / "ab.md").write_text("an earlier run")
    assert main(["--quick", "--no-progress", "--no-plots", "--variants", "paged", "--workloads",
                 "chat"]) == 0
    out = capsys.readouterr().out
    latest = tmp_path / DEFAULT_OUT / "latest"
    run_dir = latest.resolve()
    assert run_dir != earlier and (earlier / "ab.md").read_text() == "an earlier run"
    assert sorted(p.name for p in run_dir.iterdir()) == ["ab.json", "ab.md"]
    assert f"wrote {DEFAULT_OUT}/{run_dir.name}/: ab.md, ab.json" in out and "latest links to it" in out
    assert "--out" not in json.loads((run_dir / "ab.json").read_text())["command"]


# --- the summary, rendered again from the committed results --------------------------------------
RECORDED = sorted((Path(__file__).resolve().parents[1] / "experiments" / "results").glob("ab*/ab.json"))


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.parent.name)
def test_every_summary_ratio_names_the_side_it_favours(path):
    """A bare "0.78x" says nothing of who won: each ratio is at least 1.00x and follows the name
    of the variant it favours."""
    result = json.loads(path.read_text())
    bullets = report.summary_bullets(result)
    assert bullets[0] == report.RATIO_CONVENTION
    names = "|".join(sorted(map(re.escape, result["variants"]), key=len, reverse=True))
    for bullet in bullets[1:]:
        for ratio in re.findall(r"(\d+\.\d+)x faster", bullet):
            assert float(ratio) >= 1.0, bullet
        assert len(re.findall(rf"(?:{names}) \d+\.\d+x faster", bullet)) \
            == len(re.findall(r"\d+\.\d+x faster", bullet)), bullet


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.parent.name)
def test_the_committed_summary_is_the_one_its_json_renders(path):
    """The committed ab.md's summary and variants are what report.py writes from its ab.json, so
    the two texts cannot drift apart."""
    section = re.compile(r"## Summary\n.*?(?=## Workloads)", re.S)
    rendered = report.markdown(json.loads(path.read_text()))
    assert section.search(path.with_name("ab.md").read_text()).group(0) == section.search(rendered).group(0)


@pytest.mark.parametrize(("attention", "reads"), [("native", "in place"), ("sdpa", "gathered"), (None, "gathered")])
def test_the_summary_and_the_variants_say_how_paged_reads_its_blocks(attention, reads):
    """Runs before the native routine recorded no attention: they ran SDPA, which gathers."""
    result = json.loads(RECORDED[0].read_text())
    result["config"]["attention"] = attention
    how = next(b for b in report.summary_bullets(result) if b.startswith("How paged reads"))
    assert how.split(": ", 1)[1].startswith(reads)
    assert "read the blocks in place" in VARIANTS["paged"].description
    assert "SDPA reads them gathered into a copy" in VARIANTS["paged"].description


def test_a_ratio_below_one_is_turned_to_the_side_it_favours():
    assert report._faster("vmem", "paged", 0.8) == "paged 1.25x faster"
    assert report._faster("vmem", "paged", 1.25) == "vmem 1.25x faster"
    assert report._faster("vmem", "paged", 0.8, lower_is_faster=True) == "vmem 1.25x faster"
    assert report._faster("vmem", "paged", 1.001) == "level"

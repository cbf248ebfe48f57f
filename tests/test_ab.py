"""The A/B harness: deterministic workloads, and a --quick run that writes complete results.

One quick run (two small workloads x every variant, one repeat) is shared by the tests below;
nothing here asserts timings, only what must hold whatever the machine's speed.
"""

from __future__ import annotations

import io
import json
import sys

import pytest

from vmemkv.ab import METRIC_KEYS, VARIANTS, WORKLOADS, make_workload
from vmemkv.ab.cli import main
from vmemkv.ab.workloads import TOKEN_MAX, TOKEN_MIN

QUICK_WORKLOADS = ("shared-prefix", "pressure")


def _as_data(workload):
    return ([(rid, ids, vars(params)) for rid, ids, params in workload.requests], workload.engine)


@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.parametrize("quick", [True, False])
def test_workloads_are_deterministic_for_a_seed(name, quick):
    first, again = make_workload(name, seed=3, quick=quick), make_workload(name, seed=3, quick=quick)
    assert _as_data(first) == _as_data(again)
    assert _as_data(first) != _as_data(make_workload(name, seed=4, quick=quick))


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_workloads_stay_in_the_byte_vocabulary_and_fit_the_engine(name):
    workload = make_workload(name)
    ids = set()
    for request_id, prompt, params in workload.requests:
        ids.update(prompt)
        assert params.ignore_eos
        assert len(prompt) + params.max_tokens <= workload.engine["max_model_len"], request_id
    assert TOKEN_MIN <= min(ids) and max(ids) <= TOKEN_MAX
    assert len({rid for rid, _, _ in workload.requests}) == len(workload.requests)


def test_pressure_pool_is_smaller_than_its_working_set():
    workload = make_workload("pressure")
    pages = sum(-(-(len(p) + s.max_tokens) // 16) for _, p, s in workload.requests)
    assert workload.engine["num_blocks"] < pages


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


def test_quick_run_reports_every_metric_for_every_variant(quick_run):
    _, result, _ = quick_run
    assert set(result["results"]) == set(QUICK_WORKLOADS)
    for per_variant in result["results"].values():
        assert set(per_variant) == set(VARIANTS)
        for data in per_variant.values():
            assert set(data["metrics"]) == set(METRIC_KEYS)
            for spread in data["metrics"].values():
                assert set(spread) == {"median", "min", "max"}
            assert len(data["runs"]) == 1


def test_greedy_tokens_are_identical_across_variants(quick_run):
    _, result, _ = quick_run
    for name in QUICK_WORKLOADS:
        assert result["workloads"][name]["greedy"]
        for variant, data in result["results"][name].items():
            assert data["tokens_equal"] is True, (name, variant)


def test_vmem_and_paged_hit_the_prefix_cache_alike(quick_run):
    _, result, _ = quick_run
    rates = {v: result["results"]["shared-prefix"][v]["metrics"]["prefix_hit_rate"]["median"]
             for v in VARIANTS}
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


def test_unknown_names_are_refused(capsys):
    assert main(["--quick", "--workloads", "chat,nope"]) == 2
    assert "nope" in capsys.readouterr().err

"""docs/PERFORMANCE.md's cost table against its evidence: every row that cites a recording
(`fixture: tests/fixtures/...#part` in its method cell) states the figures that recording holds,
recomputed here from its raw runs or pairs where it has them (medians, means, counts as the row
states them), so the table cannot drift from what was measured. Also the table's shape (one latest
figure per row: a date, a host, a command) and that no GPU-host recording sits unread: each is cited
by the table or read by a test."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "PERFORMANCE.md"
COLUMNS = ["what", "cost", "method", "host", "date", "command"]
HOSTS = ("dev VM, 2 vCPU", "H100 host, 16 CPUs", "H200 host, 16 CPUs")
FIXTURE = re.compile(r"fixture: `(tests/fixtures/[^`#]+)(?:#([^`]*))?`")
MAX_LINES = 400  # a reference, not a diary: superseded figures live in git history


def table() -> list[dict[str, str]]:
    text = DOC.read_text()
    section = text[text.index("\n## What it costs\n"):]
    section = section[:section.index("\n## ", 1)]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == COLUMNS, header
    rows = []
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        assert len(cells) == len(COLUMNS), f"a cell holds '|' or one is missing: {ln}"
        rows.append(dict(zip(COLUMNS, cells)))
    return rows


def load(path: str):
    return json.loads((REPO / path).read_text())


def median(rows, key):
    return statistics.median(r[key] for r in rows)


# ---- what each recording says, in the table's words -------------------------------------------------
# Each check takes the loaded recording and returns the strings the row's cells must contain
# ({"cost": [...], "method": [...], "what": [...]}) and, where the recording says, its date and host.

STARTUP = "tests/fixtures/cuda/h100_startup_early_2026-12-07.json"
STARTUP_CALL = "call3_new_9a9652c"  # the latest call: tree 9a9652c on a fresh H100 host


def startup_runs(data, kind):
    rows = [r for r in data[STARTUP_CALL]["rows"] if r["kind"] == kind]
    assert rows, f"no {kind} runs in {STARTUP_CALL}"
    return rows


def startup_common(data):
    machine = data[STARTUP_CALL]["machine"]
    assert "H100" in data["note"]
    return {"date": machine["date"][:10], "host": f"H100 host, {machine['cpus']} CPUs"}


def startup_start(kind):
    def check(data):
        rows = startup_runs(data, kind)
        att = [r["attached_s"] for r in rows]
        return {**startup_common(data),
                "cost": [f"{median(rows, 'attached_s'):.2f} s median (max {max(att):.2f}) to every probe attached",
                         f"READY=1 {median(rows, 'start_s'):.2f} s",
                         f"compile line {median(rows, 'compile_s'):.2f} s"],
                "method": [f"{len(rows)} runs"]}
    return check


def startup_stop(data):
    rows = startup_runs(data, "plain")
    return {**startup_common(data),
            "cost": [f"{median(rows, 'stop_s'):.2f} s median (max {max(r['stop_s'] for r in rows):.2f})"]}


def startup_memory(data):
    first, cached = startup_runs(data, "plain"), startup_runs(data, "cached")
    return {**startup_common(data),
            "cost": [f"{median(first, 'rss_mb'):.0f} / {median(first, 'pss_mb'):.0f} MB first start",
                     f"{median(cached, 'rss_mb'):.0f} / {median(cached, 'pss_mb'):.0f} MB cached start"]}


def toggled(segment):
    def check(data):
        t = data["toggled"]
        seg = t["segments"][segment]
        ratios = [p["on"] / p["off"] for p in seg["pairs"]]
        mean, med = statistics.fmean(ratios), statistics.median(ratios)
        assert abs(mean - seg["mean"]) < 1e-9 and abs(med - seg["median"]) < 1e-9  # the recording's own summary
        ci_mean, ci_med = seg["ci95_mean"], seg["ci95_median"]
        budget = seg["gov_start"]["budget"]
        out = {"host": "H200 host, 16 CPUs" if "H200" in t["worker"]["device"] else t["worker"]["device"],
               "method": [f"{len(ratios)} pairs"]}
        if budget == 1:
            per_op_us = t["ns_per_op_first"] / 1000
            out["cost"] = [f"mean {mean:.3f} (95% CI {ci_mean[0]:.3f}-{ci_mean[1]:.3f}), median {med:.3f}",
                           f"~{(mean - 1) * per_op_us:.1f} us per launch at {per_op_us:.1f} us per op"]
            out["method"].append("budget 1")
        else:
            out["cost"] = [f"median {med:.3f} (95% CI {ci_med[0]:.3f}-{ci_med[1]:.3f}), "
                           f"mean {mean:.3f} ({ci_mean[0]:.3f}-{ci_mean[1]:.3f})"]
            out["what"] = [f"budget ({budget:g})"]
        about = data.get("about", "")
        if m := re.search(r"MCP_TOGGLE_S=(\d+)", about):
            out["method"].append(f"{m.group(1)} s")
        if m := re.search(r"\d{4}-\d{2}-\d{2}", about):
            out["date"] = m.group(0)
        return out
    return check


def coverage_default(data):
    cov = data["coverage"]
    spans = cov["spans_joined"]
    per = cov["per_symbol"]
    for sym, s in per.items():  # the row says so: no false 0, every exact count the profiler's
        assert all(s["passed"].values()), sym
        assert s["check_b_exact_equals_truth"]["mismatches"] == 0 and s["check_a_false_zero"]["violations"] == 0, sym
    unknown = cov["span_classes"]["some_unknown"] / spans
    est = [per[s]["check_d_estimate_over_truth"]["all"]["median"] for s in ("cuLaunchKernel", "cuLaunchKernelEx")]
    gov = cov["governor_series"]
    weight, cost_ns = round(1 / gov["duty"][-1][1]), gov["cost_ns"][-1][1]
    run_s = round(cov["workers"]["A"]["done"]["seconds"])
    devices = {w["device"] for w in cov["workers"].values()}
    assert all("H100" in d for d in devices), devices
    return {"host": "H100 host, 16 CPUs",
            "cost": [f"{unknown:.0%} of spans have some launch count unknown",
                     f"exact counts {per['cuLaunchKernel']['classes']['exact']:,} (`cuLaunchKernel`) and "
                     f"{per['cuLaunchKernelEx']['classes']['exact']:,} (`cuLaunchKernelEx`), all the profiler's",
                     "no false 0",
                     f"estimates' median {est[0]:.2f} / {est[1]:.2f} of the truth",
                     f"weight {weight} at {cost_ns:,.0f} ns per hit"],
            "method": [f"{run_s} s", f"{spans:,} spans"]}


def calibration(data):
    med = {k: statistics.median(v) for k, v in data["cost_ns"].items()}
    assert med == data["median_ns"] or all(abs(med[k] - data["median_ns"][k]) < 0.05 for k in med)
    base = med["child_ours"]
    return {"cost": [f"{med['standin']:,.0f} ns per hit vs {base:,.0f} ns on the real libcuda in a child "
                     f"({med['standin'] / base:.2f}x)",
                     f"`labs` fallback {med['labs']:,.0f} ns ({med['labs'] / base:.1f}x)"],
            "method": [f"{len(data['cost_ns']['standin'])} runs"]}


CHECKS = {
    f"{STARTUP}#{STARTUP_CALL}/plain": startup_start("plain"),
    f"{STARTUP}#{STARTUP_CALL}/cached": startup_start("cached"),
    f"{STARTUP}#{STARTUP_CALL}/plain/stop": startup_stop,
    f"{STARTUP}#{STARTUP_CALL}": startup_memory,
    "tests/fixtures/cuda/h200_toggled_overhead.json#1": toggled("1"),
    "tests/fixtures/cuda/h200_toggled_overhead_long.json#0.005": toggled("0.005"),
    "tests/fixtures/cuda/h100_coverage_default_2026-12-05.json": coverage_default,
    "tests/fixtures/cuda/h200_calibration_result.json": calibration,
}


def cited() -> list[tuple[str, dict]]:
    out = []
    for row in table():
        m = FIXTURE.search(row["method"])
        if m:
            out.append((m.group(1) + (f"#{m.group(2)}" if m.group(2) else ""), row))
    return out


def test_the_table_has_one_dated_row_per_figure_with_its_host_and_command():
    rows = table()
    assert len(rows) >= 30
    for row in rows:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"]), row
        assert row["host"] in HOSTS, row
        assert row["cost"] and row["command"], row
    keys = [(r["what"], r["host"]) for r in rows]
    assert len(keys) == len(set(keys)), "a thing measured twice on one host: keep only the latest figure"
    assert len(DOC.read_text().splitlines()) <= MAX_LINES


def test_every_row_that_cites_a_recording_states_what_it_holds():
    seen = set()
    for ref, row in cited():
        path = ref.split("#")[0]
        assert (REPO / path).is_file(), f"{row['what']}: {path} is gone"
        assert ref in CHECKS, f"{row['what']}: no check for {ref}; add one to this test"
        seen.add(ref)
        want = CHECKS[ref](load(path))
        for cell in ("cost", "method", "what"):
            for s in want.get(cell, []):
                assert s in row[cell], f"{row['what']} ({row['host']}): its {cell} should say {s!r}; it says {row[cell]!r}"
        if "date" in want:
            assert row["date"] == want["date"], (row["what"], row["date"], want["date"])
        if m := re.search(r"_(\d{4}-\d{2}-\d{2})\.", path):
            assert row["date"] == m.group(1), (row["what"], path)
        if "host" in want:
            assert row["host"] == want["host"], (row["what"], row["host"], want["host"])
    assert seen == set(CHECKS), f"checks for recordings the table no longer cites: {sorted(set(CHECKS) - seen)}"


def test_no_gpu_host_recording_sits_unread():
    """A recording under tests/fixtures/cuda is evidence for a row of the table or data a test reads;
    one that is neither goes (git keeps it)."""
    table_refs = {ref.split("#")[0].rsplit("/", 1)[-1] for ref, _ in cited()}
    here = Path(__file__).resolve()
    sources = [p.read_text() for p in (REPO / "tests").rglob("*.py")
               if "fixtures" not in p.relative_to(REPO / "tests").parts and p.resolve() != here]
    sources += [p.read_text() for p in (REPO / "bench").rglob("*.py")]
    unread = [p.name for p in sorted((REPO / "tests" / "fixtures" / "cuda").iterdir())
              if p.suffix in (".json", ".txt", ".log") and p.name not in table_refs
              and not any(p.name in s for s in sources)]
    assert unread == []

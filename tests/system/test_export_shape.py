"""What the agent exports, by shape, against a recording: every span name with its attributes, resource
attributes, events and links, and every metric with its kind, unit and point attributes, from one
scripted run of the real `mcp-agent run` (marked requests of a child; zero-code requests of an
unmodified Go server; a marked request, GPU steps and allocations on the stand-in libcuda).

The recording (tests/fixtures/export_shape.json) was taken from the tree before a restructure that
must keep behaviour (the capability protocol); this test holds every later tree to it:
  - no span or metric name, attribute, event or link attribute that the recording lacks (a rename or
    an addition is made in the recording too, on purpose: MCP_RECORD_SHAPE=1 rewrites it);
  - every attribute that every recorded span of a name carried is carried by every such span now;
  - every recorded span and metric name is exported now.
Values are not compared: counts differ from run to run; their checks are each capability's tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(TESTS, "http"))
import rawclient as rc  # noqa: E402
import realservers as rs  # noqa: E402
from test_bpf_requests import TP, Child  # noqa: E402
from test_reliability import Agent, jsonl_requests  # noqa: E402

pytestmark = pytest.mark.bpf
RECORDING = os.path.join(TESTS, "fixtures", "export_shape.json")
# attributes whose presence depends on what the host did in the window (a counter left off at 0), or
# on this machine (a GPU, a container): never required, only allowed
OPTIONAL_PREFIXES = ("hostagent.reclaim.", "hostagent.offcpu.", "hostagent.oncpu", "hostagent.page_cache.",
                     "hostagent.numa.", "hostagent.cuda.", "hostagent.nvidia.", "hostagent.context_switches.",
                     "hostagent.faults.", "hostagent.request.process.", "hostagent.request.group.",
                     "hostagent.request.gpu_steps.", "hostagent.finding.", "hostagent.http.request.head_",
                     "hostagent.http.response.interim", "hostagent.http.head_", "http.response.status_code",
                     "container.", "k8s.", "hostagent.kswapd", "hostagent.gpu.")


def _value_kind(v: dict) -> str:
    return next(iter(v))


def shape_of(reqs: list[dict]) -> dict:
    spans: dict = {}
    metrics: dict = {}
    for req in reqs:
        for rsp in req.get("resourceSpans", []):
            res = {kv["key"] for kv in rsp.get("resource", {}).get("attributes", [])}
            for ss in rsp["scopeSpans"]:
                for s in ss["spans"]:
                    e = spans.setdefault(s["name"], {"n": 0, "resource": set(), "attributes": {}, "events": {},
                                                     "links": set(), "kinds": set()})
                    e["n"] += 1
                    e["resource"] |= res
                    e["kinds"].add(s.get("kind", 0))
                    for kv in s.get("attributes", []):
                        e["attributes"].setdefault(kv["key"], [0, set()])
                        e["attributes"][kv["key"]][0] += 1
                        e["attributes"][kv["key"]][1].add(_value_kind(kv["value"]))
                    for ev in s.get("events", []):
                        e["events"].setdefault(ev["name"], set()).update(kv["key"] for kv in ev.get("attributes", []))
                    for ln in s.get("links", []):
                        e["links"].update(kv["key"] for kv in ln.get("attributes", []))
        for rm in req.get("resourceMetrics", []):
            for sm in rm["scopeMetrics"]:
                for m in sm["metrics"]:
                    kind = next(k for k in ("sum", "gauge", "histogram", "exponentialHistogram") if k in m)
                    e = metrics.setdefault(m["name"], {"kind": kind, "unit": m.get("unit", ""), "attributes": set()})
                    for dp in m[kind].get("dataPoints", []):
                        e["attributes"].update(kv["key"] for kv in dp.get("attributes", []))
    return {"spans": {k: {"n": v["n"], "kinds": sorted(v["kinds"]), "resource": sorted(v["resource"]),
                          "attributes": {a: {"seen": c, "types": sorted(t)} for a, (c, t) in sorted(v["attributes"].items())},
                          "events": {k2: sorted(v2) for k2, v2 in sorted(v["events"].items())},
                          "links": sorted(v["links"])} for k, v in sorted(spans.items())},
            "metrics": {k: {"kind": v["kind"], "unit": v["unit"], "attributes": sorted(v["attributes"])}
                        for k, v in sorted(metrics.items())}}


def optional(name: str) -> bool:
    return name.startswith(OPTIONAL_PREFIXES)


def compare(rec: dict, now: dict) -> list[str]:
    out = []
    for name, r in rec["spans"].items():
        n = now["spans"].get(name)
        if n is None:
            out.append(f"span {name}: not exported")
            continue
        for a, info in n["attributes"].items():
            if a not in r["attributes"]:
                out.append(f"span {name}: attribute {a} not in the recording")
            elif set(info["types"]) - set(r["attributes"][a]["types"]):
                out.append(f"span {name}: attribute {a} types {info['types']} vs {r['attributes'][a]['types']}")
        for a, info in r["attributes"].items():
            if info["seen"] == r["n"] and not optional(a) and n["attributes"].get(a, {}).get("seen") != n["n"]:
                out.append(f"span {name}: attribute {a} on every recorded span, now on "
                           f"{n['attributes'].get(a, {}).get('seen', 0)} of {n['n']}")
        for a in set(n["resource"]) - set(r["resource"]):
            out.append(f"span {name}: resource attribute {a} not in the recording")
        for ev, keys in n["events"].items():
            if ev not in r["events"] or set(keys) - set(r["events"][ev]):
                out.append(f"span {name}: event {ev} {keys} vs {r['events'].get(ev)}")
        if set(n["links"]) - set(r["links"]):
            out.append(f"span {name}: link attributes {sorted(set(n['links']) - set(r['links']))} not in the recording")
        if n["kinds"] != r["kinds"]:
            out.append(f"span {name}: kinds {n['kinds']} vs {r['kinds']}")
    for name in set(now["spans"]) - set(rec["spans"]):
        out.append(f"span {name}: not in the recording")
    for name, r in rec["metrics"].items():
        n = now["metrics"].get(name)
        if n is None:
            out.append(f"metric {name}: not exported")
            continue
        if (n["kind"], n["unit"]) != (r["kind"], r["unit"]):
            out.append(f"metric {name}: {n['kind']} {n['unit']!r} vs {r['kind']} {r['unit']!r}")
        if set(n["attributes"]) - set(r["attributes"]):
            out.append(f"metric {name}: attributes {sorted(set(n['attributes']) - set(r['attributes']))} not in the recording")
    for name in set(now["metrics"]) - set(rec["metrics"]):
        out.append(f"metric {name}: not in the recording")
    return out


def _cc(args):
    subprocess.run(["cc", "-O2", "-Wall", "-Werror", *args], check=True)


def scripted_run(tmp_path) -> list[dict]:
    from mcp_hostagent.core.records import bpf_source_dir

    d = tmp_path / "cuda"
    d.mkdir()
    src = os.path.join(TESTS, "c")
    _cc(["-shared", "-fPIC", "-fno-ipa-icf", "-o", str(d / "libcuda.so.1"), os.path.join(src, "fake_libcuda.c"),
         "-lpthread"])
    _cc([f"-I{bpf_source_dir()}", "-o", str(d / "cuda_driver"), os.path.join(src, "cuda_driver.c"), "-ldl", "-lpthread"])
    srv = rs.start("go")
    jsonl = tmp_path / "telemetry.jsonl"
    agent = Agent(tmp_path, env={"MCP_AGENT_EXPORT_JSONL_PATH": str(jsonl), "MCP_AGENT_EXPORT_METRIC_INTERVAL_S": "1",
                                 "MCP_AGENT_PROCESS_PIDS": str(srv.pid), "MCP_AGENT_NIC_ENABLED": "false"})
    child = Child()
    drv = subprocess.Popen([str(d / "cuda_driver")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def do(cmd):
        drv.stdin.write(cmd + "\n")
        drv.stdin.flush()
        out = drv.stdout.readline().split()
        assert out and out[0] == "ok", (cmd, out)
        return out[1:]
    try:
        agent.ready(timeout=90)
        child.do("spin 1")
        for i in range(5):
            child.do(f"begin {0x5000 + i} {TP}", "touch 200", f"end {0x5000 + i}")
        reqs = [rc.build_request("GET", "/fast" if i % 2 else "/slow?ms=5",
                                 {"traceparent": f"00-{0x5A000 + i:032x}-{0x5A000 + i:016x}-01"}) for i in range(10)]
        assert len(rc.keepalive(srv.port, reqs).final) == 10
        do(f"lib {d / 'libcuda.so.1'}")
        time.sleep(3)  # the finder arms the library's uprobes
        do("sym cuCtxSetCurrent 1")
        do("thread begin 777;launch 20;syncns 1000000;sym cuStreamSynchronize 2;syncns 0;sym cuMemAlloc_v2 2;"
           "sym cuMemFree_v2 2;end 777")
        steps = subprocess.Popen([str(d / "cuda_driver")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 bufsize=1)  # a process that marks nothing: zero-touch GPU steps
        for cmd in (f"lib {d / 'libcuda.so.1'}", "sym cuCtxSetCurrent 1", "steps 3 5", "exit"):
            steps.stdin.write(cmd + "\n")
            steps.stdin.flush()
            if cmd != "exit":
                assert steps.stdout.readline().startswith("ok"), cmd
        steps.wait(10)
        time.sleep(4)  # two metric exports, the spans flushed
    finally:
        drv.stdin.write("exit\n")
        drv.stdin.flush()
        drv.wait(10)
        child.close()
        agent.p.send_signal(15)
        agent.p.wait(10)
        agent.close()
        srv.close()
    return jsonl_requests(jsonl)


def test_the_agent_exports_what_the_recording_says(tmp_path):
    now = shape_of(scripted_run(tmp_path))
    if os.environ.get("MCP_RECORD_SHAPE") == "1":
        with open(RECORDING, "w") as f:
            json.dump(now, f, indent=1, sort_keys=True)
            f.write("\n")
        pytest.skip(f"recorded {RECORDING}")
    with open(RECORDING) as f:
        rec = json.load(f)
    diffs = compare(rec, now)
    assert not diffs, "\n".join(diffs)

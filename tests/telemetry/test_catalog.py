"""docs/TELEMETRY.md's metric tables against the instruments the capabilities declare
(agent/catalog.py): same names, kinds and units, none missing on either side. The table
had drifted from the export before (units in names and unit fields that disagreed)."""

from __future__ import annotations

import re
from pathlib import Path

from mcp_hostagent.exporters.prometheus import metric_name
from mcp_hostagent.catalog import all_instruments

DOC = Path(__file__).resolve().parents[2] / "docs" / "TELEMETRY.md"
ROW = re.compile(r"^\| `([a-z][a-z0-9_.]*)` \| (counter|gauge|histogram) \| ([^|]*) \|")
KIND = {"counter": "counter", "gauge": "gauge", "histogram": "histogram", "log2_ns": "histogram"}


def documented() -> dict[str, tuple[str, str]]:
    text = DOC.read_text()
    metrics = text[text.index("## Metrics"):]
    out = {}
    for line in metrics.splitlines():
        m = ROW.match(line)
        if m:
            assert m.group(1) not in out, f"{m.group(1)} documented twice"
            out[m.group(1)] = (m.group(2), m.group(3).strip())
    return out


def declared() -> dict[str, tuple[str, str]]:
    out = {}
    for inst in all_instruments():
        assert inst.name not in out, f"{inst.name} declared twice"
        out[inst.name] = (KIND[inst.kind], inst.unit)
    return out


def test_every_declared_metric_is_documented_with_its_kind_and_unit():
    doc, code = documented(), declared()
    assert len(code) >= 45
    assert {n: code[n] for n in code if doc.get(n) != code[n]} == {}
    assert set(doc) - set(code) == set(), "documented but not exported"


def test_names_follow_the_conventions():
    for inst in all_instruments():
        assert not inst.name.startswith("mcp."), inst.name  # OpenTelemetry's MCP namespace
        assert inst.name.split(".")[0] in {"hostagent", "process", "system", "hw"}, inst.name
        # units only in the unit field: no _ns/_ms/_bytes/_pct/_mhz/_mw/_s/_c suffix in a name
        assert not re.search(r"_(ns|ms|s|bytes|pct|mhz|mw|c|ratio)$", inst.name), inst.name
        assert inst.unit in {"", "1", "s", "By", "By/s", "Hz", "W", "Cel"} or re.fullmatch(r"\{[a-z_]+\}", inst.unit), \
            (inst.name, inst.unit)
        assert inst.description, f"{inst.name} has no description"


def test_prometheus_names_are_unique_and_carry_one_unit_suffix():
    names = [metric_name(i.name, i.unit, KIND[i.kind]) for i in all_instruments()]
    assert len(names) == len(set(names))
    assert "hostagent_reclaim_stall_time_seconds_total" in names
    assert "hw_gpu_memory_usage_bytes" in names
    assert "hostagent_gpu_pcie_throughput_bytes_per_second" in names and "process_disk_io_bytes_total" in names
    assert not [n for n in names if "_seconds_seconds" in n or "_ns_" in n or "nanoseconds" in n]

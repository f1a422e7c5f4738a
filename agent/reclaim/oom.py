"""OOM kills from oom:mark_victim (bpf/reclaim.bpf.c copies the record; decoded with the format tracefs
gives at run time, like the GPU and PCIe health events). Pure but for reading a cgroup's limit.

mark_victim fires once per OOM kill, global or memcg (mm/oom_kill.c mark_oom_victim(), called by
__oom_kill_process() for both), in the context of the task whose allocation failed. Which of the two
it was is not in the record: `scope` says memcg when the victim's memory cgroup has a limit below
the machine's memory (the cgroup's own memory.max / memory.limit_in_bytes), host otherwise.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from ..core.identity import sanitize_text
from ..core.tracefs import RecordError, TracepointFormat, decode_captured, parse_format
from . import memstat

# include/trace/events/oom.h TRACE_EVENT(mark_victim), kernel 6.x (the fields after pid came in 6.8);
# older kernels' files have only pid and comm, which decode too
MARK_VICTIM_FORMAT_TEXT = """name: mark_victim
ID: 0
format:
	field:unsigned short common_type;	offset:0;	size:2;	signed:0;
	field:unsigned char common_flags;	offset:2;	size:1;	signed:0;
	field:unsigned char common_preempt_count;	offset:3;	size:1;	signed:0;
	field:int common_pid;	offset:4;	size:4;	signed:1;

	field:int pid;	offset:8;	size:4;	signed:1;
	field:__data_loc char[] comm;	offset:12;	size:4;	signed:0;
	field:unsigned long total_vm;	offset:16;	size:8;	signed:0;
	field:unsigned long anon_rss;	offset:24;	size:8;	signed:0;
	field:unsigned long file_rss;	offset:32;	size:8;	signed:0;
	field:unsigned long shmem_rss;	offset:40;	size:8;	signed:0;
	field:uid_t uid;	offset:48;	size:4;	signed:0;
	field:unsigned long pgtables;	offset:56;	size:8;	signed:0;
	field:short oom_score_adj;	offset:64;	size:2;	signed:1;

print fmt: "pid=%d comm=%s total-vm=%lukB anon-rss=%lukB file-rss:%lukB shmem-rss:%lukB uid=%u pgtables=%lukB oom_score_adj=%hd"
"""
MARK_VICTIM_FORMAT = dataclasses.replace(parse_format(MARK_VICTIM_FORMAT_TEXT), id=None)


@dataclass(frozen=True)
class OomKill:
    victim: int  # the killed task's pid (as the kernel chose it: a thread group's task holding its mm)
    comm: str  # the victim's comm, identity.sanitize_text'd
    anon_rss_kb: int | None  # None on kernels whose record lacks the field
    file_rss_kb: int | None
    shmem_rss_kb: int | None
    oom_score_adj: int | None
    trigger: int = 0  # tid whose allocation failed: common_pid, which core/rawtp.py rebuilds from the BPF header
    ts_ns: int = 0
    scope: str = "unknown"  # memcg | host | unknown (the capability decides: module docstring)

    def attributes(self) -> dict:
        kb = {"anon": self.anon_rss_kb, "file": self.file_rss_kb, "shmem": self.shmem_rss_kb}
        return {"hostagent.oom.victim.pid": self.victim, "hostagent.oom.victim.name": self.comm,
                "hostagent.oom.scope": self.scope,
                **{f"hostagent.oom.victim.rss.{k}": v * 1024 for k, v in kb.items() if v is not None}}


def decode_mark_victim(raw: bytes, fmt: TracepointFormat = MARK_VICTIM_FORMAT, captured: bool = False) -> OomKill:
    rec, _ = decode_captured(raw, fmt, captured)

    def num(name):
        v = rec.get(name)
        return None if v is None else int(v)

    try:
        return OomKill(int(rec["pid"]), sanitize_text(str(rec.get("comm", "")), 64), num("anon_rss"),
                       num("file_rss"), num("shmem_rss"), num("oom_score_adj"), int(rec.get("common_pid", 0)))
    except (KeyError, ValueError, TypeError) as e:
        raise RecordError(f"{fmt.name}: field {e} missing or not a number") from None


def memcg_limited(limit_files: list[str], mem_total_bytes: int) -> bool | None:
    """Whether the first readable limit file (v2 memory.max, v1 memory.limit_in_bytes) is below the
    machine's memory; None when none can be read."""
    for path in limit_files:
        try:
            with open(path) as f:
                v = f.read().strip()
        except OSError:
            continue
        return v != "max" and v.isdigit() and int(v) < mem_total_bytes
    return None


def mem_total_bytes(proc_root: str = "/proc") -> int:
    return memstat.parse_meminfo(memstat.read_text(f"{proc_root}/meminfo")).get("MemTotal", 1 << 62)


def limit_files(v2_dir: str | None, v1_memory_path: str | None, cgroup_root: str = "/sys/fs/cgroup") -> list[str]:
    out = []
    if v1_memory_path:
        out.append(os.path.join(cgroup_root, "memory", v1_memory_path.lstrip("/"), "memory.limit_in_bytes"))
    if v2_dir:
        out.append(os.path.join(v2_dir, "memory.max"))
    return out

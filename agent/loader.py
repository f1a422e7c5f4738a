"""Compile the BPF programs with bcc (LLVM at start-up) and attach their probes.

bcc is imported here and nowhere else outside the pipeline's map reads, after tracefs is mounted:
bcc picks its tracefs path at import time. LLVM's diagnostics on near-miss headers are many and
harmless; they are captured and shown only when compilation fails.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable

from .probes import ATTACHED, MISSING, ProbePlan
from .records import bpf_source_dir


class LoadError(RuntimeError):
    pass


@dataclass
class Loaded:
    bpf: object  # bcc.BPF
    program: str
    compile_s: float


def _bpf_class():
    from bcc import BPF

    class ManualAttachBPF(BPF):
        # bcc attaches every tracepoint__* function while constructing, and one failure raises for
        # all; we attach one by one so that each probe gets its own status.
        def _trace_autoload(self):
            pass

    return ManualAttachBPF


def cflags_for(plan: ProbePlan, program: str, settings: dict[str, int]) -> list[str]:
    flags = [f"-I{bpf_source_dir()}"]
    flags += [f"-D{k}={int(v)}" for k, v in sorted(settings.items())]
    flags += [f"-D{spec.macro}=1" for spec in plan.enabled(program)]
    return flags


def source_path(program: str) -> str:
    return os.path.join(bpf_source_dir(), program)


def _compile_quietly(path: str, cflags: list[str], progress: Callable[[str], None] | None):
    """Compile with fd 2 redirected (libbcc prints clang diagnostics there), ticking progress."""
    BPF = _bpf_class()
    saved = os.dup(2)
    done = threading.Event()
    t0 = time.monotonic()

    def tick():
        while not done.wait(0.25):
            if progress:
                progress(f"compiling {os.path.basename(path)} with LLVM... {time.monotonic() - t0:.1f}s")

    with tempfile.TemporaryFile() as diag:
        sys.stderr.flush()
        os.dup2(diag.fileno(), 2)
        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            bpf = BPF(src_file=path.encode(), cflags=cflags)
        except Exception as e:
            os.dup2(saved, 2)
            diag.seek(0)
            errors = [ln for ln in diag.read().decode(errors="replace").splitlines() if "error:" in ln]
            raise LoadError(f"compile {path}: {e}: {'; '.join(errors[:3]) or 'no compiler error line'}") from e
        finally:
            done.set()
            os.dup2(saved, 2)
            os.close(saved)
    return bpf, time.monotonic() - t0


def load(plan: ProbePlan, settings: dict[str, int], progress: Callable[[str], None] | None = None) -> list[Loaded]:
    """Compile each program that has enabled probes, then attach those probes one by one.
    Statuses in `plan` are updated in place; a program that fails to compile marks its probes missing."""
    loaded = []
    for program in dict.fromkeys(s.program for s in plan.enabled()):
        try:
            bpf, secs = _compile_quietly(source_path(program), cflags_for(plan, program, settings), progress)
        except LoadError as e:
            for spec in plan.enabled(program):
                plan.mark(spec.name, MISSING, str(e), "check kernel headers (mcp-agent probes --dump shows the source and flags)")
            continue
        for spec in plan.enabled(program):
            try:
                bpf.attach_tracepoint(tp=spec.tracepoint.encode(), fn_name=spec.fn_name.encode())
                plan.mark(spec.name, ATTACHED, "")
            except Exception as e:  # bcc raises bare Exception with the kernel's reason
                plan.mark(spec.name, MISSING, f"attach {spec.tracepoint}: {e}", spec.hint)
        loaded.append(Loaded(bpf, program, secs))
    return loaded

"""The `mcp-agent` command: run, probes, version.

Settings: flag > MCP_AGENT_*/OTEL_* environment > config file (TOML) > default; every one is listed
in packaging/config.example.toml. A bad setting exits 2 with one line and attaches nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import click

from . import __version__, config as config_mod

EXIT_CONFIG = 2
START_SWITCH_INTERVAL_S = 0.0005  # sys.setswitchinterval while `run` starts (see run)


def _fail(msg: str, code: int = 1):
    click.echo(f"mcp-agent: error: {msg}", err=True)
    sys.exit(code)


def _checked(config_path, overrides, env=None) -> config_mod.Config:
    """The validated config, or ConfigError (one line). Also what SIGHUP re-reads."""
    from .registry import UNIT

    cfg = config_mod.load_config(config_path, env=env, overrides={k: v for k, v in overrides.items()})
    names = UNIT.probe_names()
    unknown = [n for n in cfg.probes_disable if n not in names]
    if unknown:
        raise config_mod.ConfigError(f"probes.disable names unknown probe {unknown[0]!r} "
                                     f"(known: {', '.join(names)})")
    return cfg


def _load(config_path, overrides, env=None) -> config_mod.Config:
    try:
        cfg = _checked(config_path, overrides, env)
    except config_mod.ConfigError as e:
        _fail(str(e), EXIT_CONFIG)
    logging.basicConfig(level=cfg.log_level.upper(), format="mcp-agent: %(levelname)s: %(message)s")
    return cfg


class _Progress:
    """One self-overwriting line on a TTY; silence otherwise (logs stay clean under systemd)."""

    def __init__(self, enabled: bool):
        self.tty = enabled and sys.stderr.isatty()

    def __call__(self, text: str) -> None:
        if self.tty:
            sys.stderr.write("\r\033[K" + text)
            sys.stderr.flush()

    def clear(self) -> None:
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


config_option = click.option("--config", "config_path", type=click.Path(dir_okay=False),
                             help="TOML config file (default /etc/mcp-hostagent/config.toml if present; env MCP_AGENT_CONFIG).")


class OneLineErrors(click.Group):
    """Usage errors (bad flag, bad choice) as one line and exit 2, like config errors."""

    def main(self, *args, **kwargs):
        try:
            return super().main(*args, standalone_mode=False, **kwargs)
        except click.UsageError as e:
            cmd = e.ctx.command_path if e.ctx else "mcp-agent"
            click.echo(f"mcp-agent: error: {e.format_message()} (see {cmd} --help)", err=True)
            sys.exit(EXIT_CONFIG)
        except click.Abort:
            sys.exit(130)


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "-V", "--version", prog_name="mcp-agent", message="%(prog)s (mcp-hostagent) %(version)s")
def main():
    """eBPF host-level observability for GPU inference hosts.

    Counts what the host does to each inference request in the kernel (page faults, context switches,
    off-CPU time, reclaim stalls, CUDA driver calls and NVIDIA ioctls), next to reclaim storms and
    GPU, PCIe and NIC health, and exports it as OpenTelemetry spans that join the application's own
    traces, plus per-process, host and agent-health metrics.

    \b
    Start here:
      sudo mcp-agent probes            what this host supports, and why not
      sudo mcp-agent run               run; telemetry to a local OTLP-JSON lines file
      sudo mcp-agent run --otlp-endpoint http://tempo:4317
    """


@main.command()
@config_option
@click.option("--otlp-endpoint", help="OTLP collector URL, e.g. http://127.0.0.1:4317 (gRPC) or http://127.0.0.1:4318 (HTTP). Env: OTEL_EXPORTER_OTLP_ENDPOINT.")
@click.option("--otlp-protocol", type=click.Choice(["grpc", "http/protobuf"]), help="OTLP transport (default grpc). Env: OTEL_EXPORTER_OTLP_PROTOCOL.")
@click.option("--jsonl", "jsonl_path", help="OTLP-JSON lines file; 'none' disables it. Default /var/lib/mcp-hostagent/telemetry.jsonl.")
@click.option("--console/--no-console", default=None, help="Also print one line per span, and per metric interval one summary line per metric, on stdout.")
@click.option("--prometheus", "prometheus_listen", metavar="ADDR",
              help="Serve metrics for Prometheus on http://ADDR/metrics, e.g. 127.0.0.1:9464 or [::1]:9464; no "
                   "authentication (docs/PROMETHEUS.md); 'none' disables it. Default off. Env: MCP_AGENT_EXPORT_PROMETHEUS_LISTEN.")
@click.option("--strict/--no-strict", default=None, help="Exit non-zero if any enabled probe is missing.")
@click.option("--watch", type=click.Choice(["all", "gpu", "marked"]), help="Per-process counters for: all processes, GPU processes (default), or only those that mark requests.")
@click.option("--pid", "pids", type=int, multiple=True, help="Also watch this pid (repeatable).")
@click.option("--comm", "comms", multiple=True, help="Also watch processes with this name (repeatable).")
@click.option("--disable-probe", "disable", multiple=True, help="Do not attach this probe (see `mcp-agent probes`).")
@click.option("--kernel-headers", type=click.Path(file_okay=False), help="Kernel source tree for bcc (default: found automatically).")
@click.option("--link-modules-build", is_flag=True, default=None, help="Allowed to symlink /lib/modules/$(uname -r)/build to the headers found.")
@click.option("--status/--no-status", default=None, help="One-line live status on stderr (default on).")
@click.option("--duration", type=click.FloatRange(min=0.1), help="Stop after this many seconds (default: until SIGINT/SIGTERM).")
@click.option("--show-config", is_flag=True, help="Print the effective settings with their sources, then exit.")
def run(config_path, otlp_endpoint, otlp_protocol, jsonl_path, console, prometheus_listen, strict, watch, pids, comms,
        disable, kernel_headers, link_modules_build, status, duration, show_config):
    """Attach the probes and export spans and metrics until stopped.

    With no collector configured, telemetry goes to an OTLP-JSON lines file (one OTLP export request
    per line, the collector's file-exporter format). Serving processes mark requests with
    `from mcp_hostagent.marker import request` (or the ioctl wire format in docs/MARKER.md); their
    request spans become children of the application's span named by the W3C traceparent.

    SIGINT/SIGTERM: drain, detach every probe, flush exporters, exit 0 within 5 s. SIGHUP: re-read the
    config; a bad one is refused (one line, counted in hostagent.agent.config.reload_failed) and the agent
    runs on; a good one restarts the pipeline with it. Under systemd (Type=notify) READY=1 is sent once
    the probes are attached, WATCHDOG=1 every status tick.

    Start-up compiles the BPF programs with LLVM and keeps them in /var/cache/mcp-hostagent/bpf:
    the next start on this kernel with these settings loads them without a compile
    (MCP_HOSTAGENT_COMPILE_CACHE: another directory, or off).
    """
    overrides = {
        "export.otlp_endpoint": otlp_endpoint, "export.otlp_protocol": otlp_protocol,
        "export.jsonl_path": jsonl_path, "export.console": console,
        "export.prometheus_listen": prometheus_listen, "probes.strict": strict,
        "process.watch": watch, "process.pids": pids or None, "process.comms": comms or None,
        "probes.disable": disable or None, "kernel.headers": kernel_headers,
        "kernel.link_modules_build": link_modules_build, "status.enabled": status,
    }
    env0 = dict(os.environ)  # SIGHUP re-reads with this (the agent itself later sets BCC_KERNEL_SOURCE)
    cfg = _load(config_path, overrides, env0)
    from .otlpheaders import check_env

    try:  # before the SDK parses them: it logs an entry it cannot parse, token and all
        check_env(env0)
    except ValueError as e:
        _fail(str(config_mod.ConfigError(str(e))), EXIT_CONFIG)
    if show_config:
        click.echo("\n".join(config_mod.describe(cfg)))
        return
    if os.geteuid() != 0:
        _fail("mcp-agent must run as root (BPF, tracefs); HINT: sudo mcp-agent run")
    progress = _Progress(cfg.status_enabled)
    echo = lambda s: click.echo(s, err=True)
    echo(f"mcp-agent {__version__} on {os.uname().nodename}, kernel {os.uname().release}")
    from .core import imports_behind, loader
    from .registry import UNIT

    # Until READY, the compile thread (cache reads, one bpf(2) load per program) and this one (importing
    # the pipeline) both run Python: a thread back from a C call waits up to the switch interval (5 ms
    # by default) for the GIL each time. Shorter while starting; the default once started.
    switch = sys.getswitchinterval()
    sys.setswitchinterval(START_SWITCH_INTERVAL_S)
    loader.compile_ahead_for(UNIT, cfg, progress)  # LLVM in a thread while the pipeline below is imported
    try:  # from here until the load, fds 1 and 2 may be the compile's: restored before any traceback
        from . import exporters
        from .core.agent import StartError
        from .sdnotify import Notifier

        # after the pipeline's own import, which the attach needs: begun before it, they share the GIL
        # with it and slow it where the compile is short (a cached start)
        # pynvml: NVML's warm-up then only inits; pyroute2 waits for the attach (Agent.start)
        imports_behind.start(f"{__package__}.telemetry.otel", *exporters.modules_for(cfg),
                             *(m for d in UNIT.declarations for m in d.imports(cfg)))
    except BaseException:  # Ctrl-C, a broken install: fds 1 and 2 restored before the traceback
        loader.drop_ahead()
        raise

    notifier = Notifier()  # systemd Type=notify: READY=1 once the probes are attached, WATCHDOG=1 per tick
    stop = threading.Event()  # wakes the loop: SIGINT/SIGTERM (stop) or SIGHUP (reload)
    want = {"stop": False, "reload": False}
    reloads = {"ok": 0, "failed": 0}

    def on_signal(signum, frame):
        want["stop"] = True
        stop.set()

    def on_hup(signum, frame):
        want["reload"] = True
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_hup)
    try:
        try:
            agent, ctl = _start_agent(cfg, progress, echo, reloads)
        finally:
            loader.drop_ahead()  # a start that failed before the load: fds 1 and 2 restored before printing
            sys.setswitchinterval(switch)
            imports_behind.wait()  # done on success (Agent.start waited); on failure, before the error line
            imports_behind.wait_after_load()
    except StartError as e:
        progress.clear()
        notifier.notify(f"STATUS=failed to start: {e}")
        _fail(str(e))
    notifier.ready(agent.status_line())

    last_plain = [0.0]

    def on_tick(a):
        notifier.ping()
        notifier.status(a.status_line())
        if progress.tty and a.cfg.status_enabled:
            progress(a.status_line())
        elif a.cfg.status_enabled:
            if time.monotonic() - last_plain[0] >= 30:
                last_plain[0] = time.monotonic()
                echo("status: " + a.status_line())

    deadline = time.monotonic() + duration if duration else None
    try:
        while not want["stop"]:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            agent.run(stop, on_tick=on_tick, duration_s=left)
            if want["stop"] or not want["reload"]:
                break
            want["reload"] = False
            stop.clear()
            progress.clear()
            agent, ctl = _reload(agent, ctl, config_path, overrides, env0, progress, echo, notifier, reloads)
    finally:
        progress.clear()
        notifier.stopping("stopping: draining, detaching, flushing")
        if ctl is not None:
            ctl.stop()
        flushed = agent.stop(timeout_s=3.0)
        echo("stopped: " + agent.status_line() + ("" if flushed else " | exporters did not flush within 3 s"))
        notifier.close()
    if not flushed:
        # An exporter is stuck on an unreachable collector: the SDK's atexit shutdown would join its
        # threads for up to the export timeout. Probes are detached and the loss is counted and printed;
        # exit now, within the 5 s that SIGTERM promises.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _start_agent(cfg, progress, echo, reloads):
    """Start an Agent for cfg, print what it attached, serve the control socket. StartError on failure."""
    from .control import serve
    from .exporters.files import UnsafeFileError, check_jsonl_path
    from .core.agent import StartError
    from .core.probes import UPROBE_STATES
    from .registry import make_agent

    if cfg.export_jsonl_path:
        try:  # refused here, one line, before any probe loads; later (rotation) it is counted instead
            check_jsonl_path(cfg.export_jsonl_path)
        except OSError as e:
            what = str(e) if isinstance(e, UnsafeFileError) else (e.strerror or str(e))
            raise StartError(f"export.jsonl_path {cfg.export_jsonl_path}: {what}") from None
    agent = make_agent(cfg, progress=progress)
    try:
        rep = agent.start()
    finally:
        progress.clear()
    for line in rep.tracefs:
        echo(f"  tracefs:  {line}")
    echo(f"  headers:  {rep.headers}")
    how = f" {rep.compile_processes};" if rep.compile_processes else ""
    echo(f"  bpf:      compiled in {rep.compile_s:.2f}s;{how} probes {rep.plan.summary()}")
    for s in rep.plan.missing():
        echo(f"  missing:  {s.spec.name}: {s.reason}" + (f" (HINT: {s.hint})" if s.hint else ""))
    ups: dict[tuple[str, str], list[str]] = {}  # the libcuda uprobe families: (state, detail) -> names
    for s in rep.plan.statuses.values():
        if s.state in UPROBE_STATES:
            ups.setdefault((s.state, s.reason), []).append(s.spec.name)
    for (state, detail), names in ups.items():
        echo(f"  uprobes:  {', '.join(names)} {state}" + (f" ({detail})" if detail else ""))
    if rep.sources:
        echo("  sources:  " + ", ".join(f"{s.name} {s.state}" + (f" ({s.reason})" if s.reason and s.state != "attached" else "")
                                       for s in rep.sources))
    for sink in rep.sinks:
        echo(f"  export:   {sink}")
    echo("  mark requests: python -c 'from mcp_hostagent.marker import request' (docs/MARKER.md); Ctrl-C stops")
    _reload_metrics(agent, reloads)
    return agent, serve(agent.snapshots, echo, cfg.control_socket, cfg.control_group, rejected=agent.health.rejected)


def _reload_metrics(agent, reloads) -> None:
    """hostagent.agent.config.reloads / reload_failed: process-lifetime counts, on each new Agent's meter."""
    if agent.telemetry is None:
        return
    from dataclasses import replace

    from .catalog import RELOAD_INSTRUMENTS

    ok, failed = RELOAD_INSTRUMENTS
    agent.telemetry.declare([replace(ok, read=lambda: [(reloads["ok"], {})]),
                             replace(failed, read=lambda: [(reloads["failed"], {})])])


def _reload(agent, ctl, config_path, overrides, env0, progress, echo, notifier, reloads):
    """SIGHUP: re-read the config (same --config, environment and flags). Invalid: keep running as is.
    Valid: stop this Agent (drain, detach, flush) and start a new one with it; if that fails, start
    one with the previous config again. Returns the (agent, control server) now running."""
    from .core.agent import StartError

    notifier.reloading()
    try:
        new = _checked(config_path, overrides, env0)
    except config_mod.ConfigError as e:
        reloads["failed"] += 1
        echo(f"reload: kept the running config: {e}")
        notifier.ready(f"reload failed (config error); running with the previous config | {agent.status_line()}")
        return agent, ctl
    echo("reload: config valid; restarting the pipeline with it (probes detach and attach again)")
    if ctl is not None:
        ctl.stop()
    flushed = agent.stop(timeout_s=3.0)
    echo("reload: stopped: " + agent.status_line() + ("" if flushed else " | exporters did not flush within 3 s"))
    old_cfg = agent.cfg
    logging.getLogger().setLevel(new.log_level.upper())
    try:
        agent, ctl = _start_agent(new, progress, echo, reloads)
        reloads["ok"] += 1
    except StartError as e:
        reloads["failed"] += 1
        echo(f"reload: the new config failed to start ({e}); starting again with the previous config")
        logging.getLogger().setLevel(old_cfg.log_level.upper())
        try:
            agent, ctl = _start_agent(old_cfg, progress, echo, reloads)
        except StartError as e2:
            notifier.notify(f"STATUS=failed to restart: {e2}")
            _fail(f"reload: cannot start again with the previous config either: {e2}")
    notifier.ready(agent.status_line())
    return agent, ctl


@main.command()
@config_option
@click.option("--dump", is_flag=True, help="Print the BPF source and compiler flags instead of loading them.")
def probes(config_path, dump):
    """Show each probe on this host: attached, missing (with reason and hint) or disabled.

    Compiles and attaches every enabled tracepoint probe for real, then detaches. The libcuda uprobe
    families are only resolved, not attached: found (their symbols in a libcuda.so mapped now; `run`
    arms them) or waiting (none mapped now). Exits 0 even when some are missing: this is the
    question, not the verdict (`run --strict` is the verdict).
    """
    cfg = _load(config_path, {})
    from .core import loader, probes as probes_mod
    from .core.agent import StartError, prepare_kernel
    from .core.kernel import TRACEFS
    from .core.unit import NAME
    from .registry import UNIT

    if dump:
        # tracefs is root-only and may not be mounted yet: a tracepoint we cannot see from here is
        # assumed present, so the flags are the agent's, not a probe-less unit's.
        tracefs_visible = os.access(os.path.join(TRACEFS, "events"), os.X_OK)
        plan = UNIT.plan(cfg, **({} if tracefs_visible else {"exists": lambda cat, ev: True}))
        click.echo(f"// {NAME}: {', '.join(p for _, p in UNIT.sources())}")
        click.echo(f"// cflags: {' '.join(UNIT.cflags(plan, UNIT.settings(cfg)))}")
        click.echo(UNIT.text())
        return
    try:
        hc, mounted = prepare_kernel(cfg)
    except StartError as e:
        _fail(str(e))
    plan = UNIT.plan(cfg)
    progress = _Progress(True)
    loaded = loader.load(UNIT, plan, UNIT.settings(cfg), progress)
    progress.clear()
    reports = []
    if loaded:  # what each capability finds on the host now (libcuda files and their symbols: found, not attached)
        reports = [r for r in (d.make().report(loaded[0].bpf, plan) for d in UNIT.declarations) if r]
    for x in loaded:
        x.bpf.cleanup()
    click.echo(f"kernel {os.uname().release}; headers: {hc.description}")
    click.echo(f"compile: {sum(x.compile_s for x in loaded):.2f}s" + "".join(f"; {x.processes}" for x in loaded))
    click.echo(probes_mod.render_table(plan))
    for r in reports:
        click.echo("\n" + r)


@main.command()
@config_option
@click.option("--socket", "socket_path", help="A running agent's control socket (default: the control.socket setting).")
@click.option("--local", is_flag=True, help="Start the probes here even when an agent's socket answers.")
@click.option("--interval", type=click.FloatRange(min=0.2, max=60), default=1.0, show_default=True, help="Seconds between refreshes.")
@click.option("--once", is_flag=True, help="Print one frame as plain text and exit.")
@click.option("--json", "as_json", is_flag=True, help="Print one snapshot as JSON and exit.")
@click.option("--watch", type=click.Choice(["all", "gpu", "marked"]), help="With local probes: which processes get counters (as `run --watch`).")
def top(config_path, socket_path, local, interval, once, as_json, watch):
    """Live view: host memory, PSI, kswapd and storms, GPUs and links, processes, findings.

    Attaches to a running agent's control socket when one answers, else starts the probes here
    (as root; nothing is exported). Keys: h help, q quit, < > sort, / filter, p pause, Enter expand.
    """
    from . import top as top_mod

    def cfg_loader():
        return _load(config_path, {"process.watch": watch, "status.enabled": False, "status.interval_s": interval,
                                   "export.jsonl_path": "", "export.console": False})

    sys.exit(top_mod.main(cfg_loader=cfg_loader, socket_path=socket_path, local=local, interval_s=interval,
                          once=once, as_json=as_json))


@main.command()
def version():
    """Print the version and exit."""
    click.echo(f"mcp-agent (mcp-hostagent) {__version__}")


if __name__ == "__main__":
    main()

"""core/imports_behind.py: imports begun in threads so that the start's critical path does not wait
for them, and whose failures are left to the importer that follows."""

from __future__ import annotations

import importlib
import sys
import threading
import time

from mcp_hostagent.core import imports_behind


def _module(tmp_path, monkeypatch, name: str, body: str) -> None:
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, name, None)  # recorded, so the test's import is undone after it
    del sys.modules[name]


def test_after_load_imports_in_its_own_thread_and_a_second_importer_waits_for_it(tmp_path, monkeypatch):
    """The NIC watch imports pyroute2 itself: begun by after_load, that import waits on the module's
    import lock for the thread's and gets the one module, imported once."""
    _module(tmp_path, monkeypatch, "mcp_slow_mod", "import threading, time\n"
            "THREAD = threading.current_thread().name\ntime.sleep(0.3)\nCOUNT = [1]\n")
    imports_behind.after_load("mcp_slow_mod")
    t0 = time.monotonic()
    while "mcp_slow_mod" not in sys.modules and time.monotonic() - t0 < 5:
        time.sleep(0.005)
    m = importlib.import_module("mcp_slow_mod")  # while the thread is still in its sleep
    # imported there, and this import returned the whole module (COUNT is set after the sleep)
    assert m.THREAD == "mcp-import-after-load" and m.COUNT == [1]


def test_a_failing_import_is_left_to_the_next_importer(tmp_path, monkeypatch):
    """The thread's import ran (and failed) without an uncaught exception; the importer that follows
    sees the failure itself."""
    ran = tmp_path / "ran"
    _module(tmp_path, monkeypatch, "mcp_broken_mod", "import threading\n"
            f"open({str(ran)!r}, 'a').write(threading.current_thread().name + '\\n')\n"
            "raise ImportError('no such thing here')\n")
    uncaught = []
    monkeypatch.setattr(threading, "excepthook", lambda args: uncaught.append(args))
    threads = set(threading.enumerate())
    imports_behind.after_load("mcp_broken_mod")
    for t in set(threading.enumerate()) - threads:
        t.join(5)
    assert ran.read_text().split() == ["mcp-import-after-load"] and not uncaught
    assert "mcp_broken_mod" not in sys.modules
    try:
        importlib.import_module("mcp_broken_mod")
    except ImportError as e:
        assert "no such thing here" in str(e)
    else:
        raise AssertionError("the importer that follows must see the failure")


def test_wait_after_load_returns_once_the_import_is_whole(tmp_path, monkeypatch):
    """Agent.start joins the import before the NIC watch starts, whose 5 s to come up must not
    include it; the CLI joins it before a failed start's error line."""
    _module(tmp_path, monkeypatch, "mcp_slow_mod2", "import time\ntime.sleep(0.3)\nDONE = True\n")
    imports_behind.after_load("mcp_slow_mod2")
    imports_behind.wait_after_load()
    assert getattr(sys.modules.get("mcp_slow_mod2"), "DONE", False)

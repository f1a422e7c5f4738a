"""Pure: the GPU-step log a request reads its batching engine's steps from."""


def _step(end, begin, cg=7, tgid=1, launches=4, sync_ns=1000):
    from mcp_hostagent.core.decode import Counters, Header
    from mcp_hostagent.cuda.steps import GpuStep

    return GpuStep(Header(10, tgid, tgid, 0, end, cg, b"engine"), begin, sync_ns, "stream", Counters(cu_launch=launches))


def test_step_log_sums_the_groups_steps_overlapping_the_window():
    from mcp_hostagent.cuda.steps import StepLog

    log = StepLog()
    for s in (_step(100, 50), _step(200, 150, tgid=2, launches=6), _step(300, 250, cg=8), _step(400, 350)):
        log.add(s)
    got = log.summary(lambda cg, tgid: cg == 7, 120, 360)  # overlaps the 150-200 and 350-400 steps of cgroup 7, not cgroup 8's
    assert got == {"hostagent.request.gpu_steps.count": 2, "hostagent.request.gpu_steps.duration.max": 50 / 1e9,
                   "hostagent.request.gpu_steps.launches": 10, "hostagent.request.gpu_steps.sync.time": 2000 / 1e9,
                   "hostagent.request.gpu_steps.processes": 2}
    assert log.summary(lambda cg, tgid: cg == 7, 100, 150) == {}  # touching is not overlapping
    assert log.summary(lambda cg, tgid: cg == 9, 0, 10**9) == {}
    assert log.summary(lambda cg, tgid: tgid == 2, 0, 10**9)["hostagent.request.gpu_steps.count"] == 1  # by process tree


def test_step_log_forgets_old_steps():
    from mcp_hostagent.cuda.steps import StepLog

    log = StepLog()
    log.add(_step(1, 0))
    log.add(_step(StepLog.KEEP_NS + 10, StepLog.KEEP_NS + 5))
    assert log.summary(lambda cg, tgid: cg == 7, 0, 2) == {}  # the first is gone: over KEEP_NS older than the newest

"""``parallel.comm.teardown.release``: what a distributed process runs at exit (registered by
``init_distributed``) ends this package's threads, so nothing of ours runs while the interpreter
and MindSpore tear down."""
import threading

from ms_llm.launch.msrun import launch_env
from ms_llm.parallel.comm import comm_thread, watchdog
from ms_llm.parallel.comm.teardown import release


def _threads(prefix):
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


def test_release_stops_the_watchdog_and_communication_threads():
    ran = []
    watchdog.set_collective_timeout(30.0)
    try:
        assert _threads("ms_llm-collective-watchdog")
        work = comm_thread.submit(lambda: ran.append(1))
        work.wait()
        assert _threads("ms_llm-comm")
        comm_thread.submit(lambda: ran.append(2))      # queued, not waited for
        release()
        assert ran == [1, 2]                          # queued work finished first
        assert not _threads("ms_llm-collective-watchdog")
        assert not _threads("ms_llm-comm")
        release()                                      # twice is harmless
        # both start again when used after a release
        watchdog.set_collective_timeout(30.0)
        assert _threads("ms_llm-collective-watchdog")
        comm_thread.submit(lambda: ran.append(3)).wait()
        assert ran == [1, 2, 3]
    finally:
        watchdog.set_collective_timeout(None)
        release()
    assert not _threads("ms_llm-collective-watchdog")


def test_msrun_workers_get_the_fault_handler():
    assert launch_env({})["PYTHONFAULTHANDLER"] == "1"
    assert launch_env({"PYTHONFAULTHANDLER": ""})["PYTHONFAULTHANDLER"] == ""   # user's choice

"""rings.affinity.line_transfer_ns (csrc/probe.h): what one cache line costs to move between two CPUs, the fact
benchmarks/interleaved.py labels each round with. Its value is the machine's and is not asserted beyond being a
time; what is asserted is that it refuses what it cannot measure with a typed error, never hangs, and leaves the
calling thread where it was."""
import math
import os
import threading
import time

import pytest

from rings.affinity import line_transfer_ns
from rings.errors import ConfigError, VringError

CPUS = sorted(os.sched_getaffinity(0))
two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs this process may run on")


@two_cpus
def test_a_line_moves_in_a_positive_finite_time_both_ways():
    a, b = CPUS[0], CPUS[-1]
    for x, y in ((a, b), (b, a)):
        ns = line_transfer_ns(x, y, seconds=0.01)
        assert math.isfinite(ns) and ns > 0


@two_cpus
def test_the_calling_thread_gets_its_cpu_set_back():
    """The probe pins the calling thread to cpu_a while it runs: afterwards its own set is back, from the main
    thread and from another thread (pthread_setaffinity_np on itself, not on the process)."""
    before = os.sched_getaffinity(0)
    line_transfer_ns(CPUS[-1], CPUS[0], seconds=0.01)
    assert os.sched_getaffinity(0) == before
    seen = {}

    def other():
        os.sched_setaffinity(0, {CPUS[0]})
        line_transfer_ns(CPUS[-1], CPUS[0], seconds=0.01)
        seen["after"] = os.sched_getaffinity(0)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen["after"] == {CPUS[0]}
    assert os.sched_getaffinity(0) == before


@pytest.mark.parametrize("args,says", [
    ((0, 0), "two different CPUs"),
    ((0, 4096), "is not a CPU number"),
    ((-1, 0), "is not a CPU number"),
    ((0, 2**70), "is not a CPU number"),
    ((0, 1.0), "is not a CPU number"),
    ((0, 1000), "could not run a thread on CPU"),   # a number, but no CPU of this machine
    ((0, 1, 0), "outside (0, 10]"),
    ((0, 1, -1), "outside (0, 10]"),
    ((0, 1, 11), "outside (0, 10]"),
    ((0, 1, float("nan")), "outside (0, 10]"),
])
def test_what_cannot_be_measured_is_refused(args, says):
    if len(CPUS) < 2 and "outside" in says:
        pytest.skip("needs two CPUs to reach the time check")
    args = tuple(CPUS[-1] if (i == 1 and a == 1 and type(a) is int) else a for i, a in enumerate(args))
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace("]", r"\]")):
        line_transfer_ns(*args)


def test_the_refusals_are_vring_errors():
    assert issubclass(ConfigError, VringError)


@two_cpus
def test_a_busy_partner_cpu_ends_the_probe_in_bounded_time():
    """The partner's CPU held by a process spinning there (another benchmark's pair, say): the probe returns within
    a few seconds, a number or VringError, never hangs, and the caller's CPU set is back. (With a real-time task on
    that CPU the partner may never run: it is then left detached and frees its state itself; probe.h.)"""
    import subprocess
    import sys
    import time
    spin = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{CPUS[-1]}}})\nwhile True: pass"])
    try:
        time.sleep(0.2)
        before = os.sched_getaffinity(0)
        t0 = time.monotonic()
        try:
            ns = line_transfer_ns(CPUS[0], CPUS[-1], seconds=0.02)
            assert ns > 0
        except VringError as e:
            assert "never answered" in str(e)
        assert time.monotonic() - t0 < 5
        assert os.sched_getaffinity(0) == before
    finally:
        spin.kill()
        spin.wait()
# --- attack-61 additions --------------------------------------------------------------------------------------
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("args", [(True, False), (0, 1, True), (0, 1, "0.01"), (0, 1, None), (0, 1, 1j)])
def test_what_is_not_a_number_is_refused_typed(args):
    with pytest.raises(ConfigError):
        line_transfer_ns(*args)


class _NeverEqual(int):
    def __eq__(self, other):
        return False

    __hash__ = int.__hash__


def test_an_int_subclass_cannot_slip_two_equal_cpus_through():
    with pytest.raises(ConfigError, match="two different CPUs"):
        line_transfer_ns(_NeverEqual(0), _NeverEqual(0))


@two_cpus
def test_numpy_cpus_and_a_tiny_time_are_measured():
    np = pytest.importorskip("numpy")
    assert line_transfer_ns(np.int64(CPUS[0]), np.int32(CPUS[-1]), seconds=1e-10) > 0


def _in_child(prefix, code, timeout=30):
    return subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": ROOT})


_PROBE = ("import time\nfrom rings.affinity import line_transfer_ns\nt = time.monotonic()\n"
          "try:\n    print(line_transfer_ns({a}, {b}, 0.01), time.monotonic() - t)\n"
          "except Exception as e:\n    print(type(e).__name__, e, time.monotonic() - t)\n")


@two_cpus
@pytest.mark.skipif(not shutil.which("taskset"), reason="no taskset")
def test_a_process_restricted_with_taskset_is_refused_the_other_cpu():
    r = _in_child(["taskset", "-c", str(CPUS[0])], _PROBE.format(a=CPUS[0], b=CPUS[-1]))
    assert r.stdout.startswith("ConfigError"), r.stdout + r.stderr


@two_cpus
@pytest.mark.skipif(not shutil.which("chrt") or os.geteuid() != 0, reason="needs chrt and root")
def test_a_real_time_caller_is_measured():
    """The partner used to start on cpu_a, where a SCHED_FIFO caller spins without yielding: never answered."""
    r = _in_child(["chrt", "-f", "1"], _PROBE.format(a=CPUS[0], b=CPUS[-1]))
    ns, took = r.stdout.split()
    assert float(ns) > 0 and float(took) < 0.9, r.stdout + r.stderr


@two_cpus
def test_threads_of_one_process_probe_one_after_the_other(monkeypatch):
    """Two probes at once would each measure the other's bouncing too: threads of one process take turns (the C
    call releases the GIL, so without the lock they would overlap)."""
    import rings._virtq as engine
    inside, most = [0], [0]
    guard = threading.Lock()

    class Lib:
        @staticmethod
        def probe_line_transfer_ns(a, b, budget):
            with guard:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.02)   # long enough for every other thread to arrive
            with guard:
                inside[0] -= 1
            return 42.0

    monkeypatch.setattr(engine, "lib", Lib)
    got = []
    threads = [threading.Thread(target=lambda: got.append(line_transfer_ns(CPUS[0], CPUS[-1]))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [42.0] * 4 and most[0] == 1

"""CPU pinning of a whole process (`vring driver --pin`, `vring vhost --pin`), and what a cache line costs to
move between two CPUs."""
import math
import numbers
import operator
import os
import threading

# one probe at a time in this process: two at once measure each other (helper-61 saw 10-28 us where 50 ns was true)
_PROBE_LOCK = threading.Lock()


def pin_error(cpu):
    """Why ``--pin cpu`` cannot be done, or None: a CPU this process may not run on (a number past a C long
    included: sched_setaffinity would raise OverflowError on it)."""
    allowed = os.sched_getaffinity(0)
    if cpu not in allowed:
        return f"--pin {cpu} is not a CPU this process may run on ({sorted(allowed)})"
    return None


def pin_all_threads(cpu):
    """Pin every thread of this process (numpy's BLAS threads too, created at import) to one CPU: a thread left
    unpinned keeps the CPU the other side forwards on within its reach. The caller checks the CPU first (pin_error; a
    thread that cannot be pinned is skipped here)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except (ProcessLookupError, OSError):
            pass


def line_transfer_ns(cpu_a, cpu_b, seconds=0.02):
    """How long one cache line takes to move from ``cpu_a`` to ``cpu_b``, in ns (the median of five samples
    spread over ``seconds``; csrc/probe.h). The calling thread runs on ``cpu_a`` for that time, then gets its
    CPU set back. Both CPUs should be free: what else runs there is measured too.

    Every ring publication and completion of a two-process pair is such a move. On a shared VM the host places
    the two vCPUs on cores that share a cache or on cores that do not, and moves them every few seconds (this
    VM: ~35-50 ns or ~200-240 ns), so a rate means little without the placement it was measured in
    (benchmarks/interleaved.py labels each round with it). ConfigError for two equal CPUs, a CPU this process
    may not run on (its cpuset: a thread pinned elsewhere may still probe) or a time outside (0, 10] s; VringError
    when the thread on ``cpu_b`` never answered. Threads of one process probe one after the other; two processes
    probing at once still measure each other."""
    from rings.errors import ConfigError, VringError
    from rings._virtq import lib

    cpus = []
    for cpu in (cpu_a, cpu_b):
        # a plain int from here on (numpy's too); a bool is not a CPU number, nor an int subclass's own == or <
        n = operator.index(cpu) if isinstance(cpu, numbers.Integral) and not isinstance(cpu, bool) else None
        if n is None or not 0 <= n < 1024:   # glibc's CPU_SETSIZE
            raise ConfigError(f"line_transfer_ns: {cpu!r} is not a CPU number")
        cpus.append(n)
    cpu_a, cpu_b = cpus
    if cpu_a == cpu_b:
        raise ConfigError(f"line_transfer_ns: two different CPUs needed, got {cpu_a} twice")
    allowed = os.sched_getaffinity(os.getpid())   # the process's set (its main thread's: taskset's), not this thread's
    if not {cpu_a, cpu_b} <= allowed:
        raise ConfigError(f"line_transfer_ns: could not run a thread on CPU {cpu_a} and one on CPU {cpu_b}: this "
                          f"process may run on {sorted(allowed)} only")
    s = float(seconds) if isinstance(seconds, numbers.Real) and not isinstance(seconds, bool) else math.nan
    if not 0 < s <= 10:
        raise ConfigError(f"line_transfer_ns: seconds {seconds!r} outside (0, 10]")
    with _PROBE_LOCK:   # cffi lets go of the GIL during the call: without it, threads would probe at once
        ns = lib.probe_line_transfer_ns(cpu_a, cpu_b, max(1, round(s * 1e9)))
    if ns == -1:
        raise ConfigError(f"line_transfer_ns: could not run a thread on CPU {cpu_a} and one on CPU {cpu_b} "
                          f"(not CPUs this process may run on?)")
    if ns < 0:
        raise VringError(f"line_transfer_ns: CPU {cpu_b} never answered (something else holds it)")
    return ns

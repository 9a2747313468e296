"""CPU pinning of a whole process (`vring driver --pin`, `vring vhost --pin`)."""
import os


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

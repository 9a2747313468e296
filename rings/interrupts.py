"""Signals that end a run the way Ctrl-C does, and clean-ups they must not cut short (one place for every
command: `vring bench`, `vring demo`, `vring conform`, rings.twoproc)."""
import contextlib
import os
import signal

#: what a supervisor (SIGTERM) or a closed terminal (SIGHUP) sends, beside Ctrl-C (SIGINT)
ENDING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _raise_interrupt(_signum, _frame):
    raise KeyboardInterrupt   # unwinds through every finally: children stopped, files and segments removed


@contextlib.contextmanager
def ending_like_ctrl_c(sigs=(signal.SIGTERM, signal.SIGHUP)):
    """Within the block, ``sigs`` raise KeyboardInterrupt (main thread only); the handlers before are restored."""
    old = {s: signal.signal(s, _raise_interrupt) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def held_back():
    """Within the block, SIGINT/SIGTERM/SIGHUP wait (blocked in this thread), so that a second signal cannot leave
    a clean-up half done; they are delivered when it ends."""
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, set(ENDING))
    except (AttributeError, ValueError, OSError):
        old = None
    try:
        yield
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


class SignalWakeup:
    """A pipe the C-level signal handler writes to (signal.set_wakeup_fd): a select on its read end returns as
    soon as a signal arrives, where PEP 475 would resume the sleep after the Python handler ran. Main thread only;
    only signals with a Python handler write their number."""

    def __init__(self):
        self.rfd, self.wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.old = signal.set_wakeup_fd(self.wfd, warn_on_full_buffer=False)

    def drain(self):
        """Empty the pipe; the signal numbers it held (one byte each)."""
        got = b""
        try:
            while chunk := os.read(self.rfd, 64):
                got += chunk
        except BlockingIOError:
            pass
        return set(got)

    def close(self):
        signal.set_wakeup_fd(self.old)
        os.close(self.rfd)
        os.close(self.wfd)

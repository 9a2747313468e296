"""Signals that end a run the way Ctrl-C does, and clean-ups they must not cut short (one place for every
command: `vring bench`, `vring demo`, `vring conform`, rings.twoproc)."""
import contextlib
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

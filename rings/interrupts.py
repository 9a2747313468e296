"""Signals that end a run the way Ctrl-C does, and clean-ups they must not cut short (one place for every
command: `vring bench`, `vring demo`, `vring conform`, rings.twoproc)."""
import contextlib
import errno
import math
import os
import select
import signal
import threading

#: what a supervisor (SIGTERM) or a closed terminal (SIGHUP) sends, beside Ctrl-C (SIGINT)
ENDING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def install(handler, sigs=ENDING, into=None):
    """``handler`` for each of ``sigs`` (main thread only); returns the handlers before, for ``restore``, in
    ``into`` if given: each is recorded before its signal gets ``handler``, so that a handler that raises at once
    (a signal that comes half-way) leaves a record of everything to put back. A SIGHUP that whoever started us
    ignores (`nohup`) stays ignored: a hangup is then not ours to act on."""
    old = {} if into is None else into
    for s in sigs:
        old[s] = signal.getsignal(s)
        if not (s == signal.SIGHUP and old[s] == signal.SIG_IGN):
            signal.signal(s, handler)
    return old


def restore(old, after=None):
    """Put back the handlers ``install`` returned, or ``after`` for each (the command line of our own process:
    SIG_IGN, so that a late signal cannot cut its report short or turn its exit status into -N)."""
    for s, h in old.items():
        signal.signal(s, h if after is None else after)


def _raise_interrupt(_signum, _frame):
    raise KeyboardInterrupt   # unwinds through every finally: children stopped, files and segments removed


@contextlib.contextmanager
def ending_like_ctrl_c(sigs=(signal.SIGTERM, signal.SIGHUP)):
    """Within the block, ``sigs`` raise KeyboardInterrupt (main thread only); the handlers before are restored."""
    old = install(_raise_interrupt, sigs)
    try:
        yield
    finally:
        restore(old)


@contextlib.contextmanager
def held_back():
    """Within the block, SIGINT/SIGTERM/SIGHUP wait, so that a second signal cannot leave a clean-up half done;
    they are delivered when it ends, to the handlers before. In the main thread they are recorded by a handler of
    ours: Python runs it in the main thread whichever thread the kernel picked, where a signal mask would hold
    them only if every thread (numpy's, a --ctl server's) blocked them. Elsewhere, this thread's mask."""
    if threading.current_thread() is not threading.main_thread():
        old = signal.pthread_sigmask(signal.SIG_BLOCK, set(ENDING))
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        return
    got, old = [], {}
    try:
        install(lambda signum, _frame: got.append(signum), into=old)
        yield
    finally:
        restore(old)
        for signum in got:   # the first whose handler raises ends the delivery
            signal.raise_signal(signum)


def readable(waits, timeout=None):
    """The members of ``waits`` (fds, or objects with fileno()) that are readable, hung up or in error: select()'s
    first list, waiting up to ``timeout`` s (None: for good; rounded up to whole ms, so that a short wait is one).
    poll(), not select(): select refuses fds numbered 1024 or more, which an embedding process may well hand us.
    A closed fd is an OSError (EBADF), as select has it."""
    p = select.poll()
    by_fd = {}
    for w in waits:
        fd = w if isinstance(w, int) else w.fileno()
        by_fd[fd] = w
        p.register(fd, select.POLLIN)
    ready = []
    ms = None if timeout is None else min(max(0, math.ceil(timeout * 1000)), 2**31 - 1)   # (poll takes an int)
    for fd, ev in p.poll(ms):
        if ev & select.POLLNVAL:
            raise OSError(errno.EBADF, f"fd {fd}: {os.strerror(errno.EBADF)}")
        ready.append(by_fd[fd])
    return ready


class SignalWakeup:
    """A pipe the C-level signal handler writes to (signal.set_wakeup_fd): a wait on its read end returns as
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

    def stops(self):
        """Empty the pipe; the stop signals (ENDING) among those it held. Their Python handlers may not have run
        yet: a caller that took the bytes acts on them itself."""
        return self.drain().intersection(ENDING)

    def close(self):
        signal.set_wakeup_fd(self.old)
        os.close(self.rfd)
        os.close(self.wfd)

"""Our standard streams as a pipe's writer: `vring dump ... | head`, `vring demo | head -1` and
`vring tap --decode LOG | head` are no error; a closed or failing stream never turns an exit status into a
traceback's."""
import collections
import contextlib
import io
import logging
import os
import sys
import threading
import time


class StdoutClosed(Exception):
    """Whoever reads our output closed it (or there was no stdout to begin with: `>&-`)."""


def out(what):
    """Print ``what`` (text, or a function that prints) and flush. A closed stdout is StdoutClosed (only ours:
    the EPIPE of a socket raised while ``what`` runs is a BrokenPipeError too, so callers keep sockets out);
    any other failure to write (a full disk) is an OSError that says so."""
    if sys.stdout is None:
        raise StdoutClosed()
    try:
        what() if callable(what) else print(what)
        sys.stdout.flush()
    except BrokenPipeError:
        raise StdoutClosed() from None
    except OSError as e:
        _stdout_to_devnull()   # what is still buffered would fail again at exit, as a second error
        raise OSError(f"cannot write the output: {e.strerror or e}") from None


def result(what, prog):
    """Print a command's result with ``out``. True if it was written or its reader went away (`| head`: the
    command's exit status stands, and what follows goes nowhere); False, after a one-line error on stderr, if
    stdout could not be written otherwise (a full disk)."""
    try:
        out(what)
    except StdoutClosed:
        closed_quietly()
    except OSError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return False
    return True


def closed_quietly():
    """After StdoutClosed: exit status 0, with no second error when the interpreter flushes stdout at exit."""
    _stdout_to_devnull()
    return 0


def _stdout_to_devnull():
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(fd, 1)
    finally:
        os.close(fd)


def usage_error(prog, what):
    """A usage error: one line on stderr, if it can be written; exit status 2 whatever happens to the line."""
    if sys.stderr is None:   # `2>&-`: print(file=None) would write it on stdout
        return 2
    try:
        print(f"{prog}: {what}", file=sys.stderr, flush=True)
    except (OSError, ValueError):   # fd 2 open, but not for writing (`2>&-` through a shell script)
        pass
    return 2


def _lines_in(text):
    """Lines in a queued chunk: whole ones, or the one part of a line that a flush queued."""
    return text.count("\n" if isinstance(text, str) else b"\n") or 1


class Unblocked:
    """A standard stream for a process that must go on while its reader does not read (`vring vhost | less`, a
    terminal held by Ctrl-S): complete lines are queued and a thread of its own writes them, so a stalled reader
    holds up neither the data path nor a stop. Past LIMIT bytes queued, whole lines are dropped and counted.
    ``close()`` gives the reader CLOSE_LIMIT_S to take the rest.

    The thread writes to a duplicate of the stream's fd with os.write (a thread blocked inside the stream object
    would hold its lock, which the interpreter's last flush at exit then cannot take). A write error of the thread
    (EPIPE, a full disk) is kept in ``error``; with ``raise_errors`` the next write or flush raises it."""

    LIMIT = 1 << 20
    CLOSE_LIMIT_S = 1.0

    def __init__(self, stream, raise_errors=True):
        stream.flush()
        self.stream, self.raise_errors = stream, raise_errors
        self.encoding = getattr(stream, "encoding", None) or "utf-8"
        try:
            self._fd = os.dup(stream.fileno())
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            self._fd = None   # not a file (a test's capture): the thread writes to the object, which never blocks
        self.dropped = 0   # lines the reader did not get: too far behind, or gone (error)
        self.error = None
        self._part = ""
        self._lines = collections.deque()
        self._queued = 0
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="unblocked-writer", daemon=True)
        self._thread.start()

    def write(self, s):
        with self._cond:
            self._raise()
            self._part += s
            cut = self._part.rfind("\n") + 1
            if cut:
                self._queue(self._part[:cut])
                self._part = self._part[cut:]
        return len(s)

    def flush(self):
        with self._cond:
            self._raise()
            if self._part:
                self._queue(self._part)
                self._part = ""

    def _raise(self):
        if self.error is not None and self.raise_errors:
            raise OSError(self.error.errno, self.error.strerror)   # EPIPE: a BrokenPipeError

    def _queue(self, text):
        data = text.encode(self.encoding, "backslashreplace")
        if self._closed or self.error is not None or self._queued + len(data) > self.LIMIT:
            self.dropped += _lines_in(text)
            return
        self._lines.append(data)
        self._queued += len(data)
        self._cond.notify()

    def _run(self):
        while True:
            with self._cond:
                while not self._lines and not self._closed:
                    self._cond.wait()
                if not self._lines:
                    return
                data = self._lines.popleft()
                self._busy = True
            try:
                self._put(data)
            except (OSError, ValueError) as e:
                with self._cond:
                    self.error = e if isinstance(e, OSError) else OSError(0, str(e))
                    self.dropped += sum(map(_lines_in, (data, *self._lines)))
                    self._lines.clear()
                    self._queued = len(data)
            with self._cond:
                self._queued -= len(data)
                self._busy = False
                self._cond.notify_all()

    def _put(self, data):
        if self._fd is None:
            self.stream.write(data.decode(self.encoding))
            self.stream.flush()
            return
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]

    def close(self):
        """Write out what is queued, waiting up to CLOSE_LIMIT_S for the reader; what it did not take is counted
        in ``dropped``. The stream underneath stays open (it is the process's)."""
        if self._closed:
            return
        with contextlib.suppress(OSError):
            self.flush()
        deadline = time.monotonic() + self.CLOSE_LIMIT_S
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while (self._lines or self._busy) and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            if self._lines or self._busy:   # the thread may stay in its write(): a daemon, it ends with us
                self.dropped += sum(map(_lines_in, self._lines)) + self._busy   # (the one being written: 1)
                self._lines.clear()
            elif self._fd is not None:
                os.close(self._fd)
                self._fd = None


@contextlib.contextmanager
def unblocked(stdout=True, stderr=True):
    """sys.stdout and/or sys.stderr as ``Unblocked`` streams for the block, with the root logger's handlers that
    wrote to them; yields them (None for one left alone or closed: `>&-`). At the end each gets its
    CLOSE_LIMIT_S, and the streams are put back. stderr's write errors are not raised: nobody is left to tell."""
    saved = sys.stdout, sys.stderr
    out = Unblocked(saved[0]) if stdout and saved[0] is not None else None
    err = Unblocked(saved[1], raise_errors=False) if stderr and saved[1] is not None else None
    handlers = [(h, h.stream) for h in logging.getLogger().handlers
                if type(h) is logging.StreamHandler and h.stream is not None and h.stream in saved]
    for h, stream in handlers:
        h.setStream((out if stream is saved[0] else err) or stream)
    sys.stdout, sys.stderr = out or saved[0], err or saved[1]
    try:
        yield out, err
    finally:
        for h, stream in handlers:
            h.setStream(stream)
        sys.stdout, sys.stderr = saved
        for u in (out, err):
            if u is not None:
                u.close()

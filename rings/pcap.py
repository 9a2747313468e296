"""Packet capture files: the frames that cross the rings, in the classic pcap format (Ethernet link type,
microsecond timestamps) that tcpdump, tshark and Wireshark read.

``PcapWriter(path, count)`` writes at most ``count`` frames (None: no limit) and counts what it had to
leave out. The frames handed to it are Ethernet frames: the virtio-net header already stripped. Used by
``vring tap --pcap`` (frames read from a peer's rings), ``vring driver --pcap`` and ``vring vhost --pcap``
(frames of their own bursts). The file layout is dpkt's (a small, long-lived pure-Python library): we
hand it whole frames with their time, truncated to whole microseconds first so that its rounding never
produces a microsecond field of 1000000.
"""
import collections
import errno
import logging
import os
import select
import stat
import time

import dpkt

from .errors import ConfigError

log = logging.getLogger(__name__)

SNAPLEN = 262144  # tcpdump's default; a virtio-net frame (64 KiB + header at most) always fits whole


class _Sink:
    """The file object dpkt's Writer writes to: each write() is one whole record (or the file header)."""

    def __init__(self, writer):
        self.write = writer._take


def is_socket(path):
    """A unix socket is there (open() says ENXIO, as for a FIFO nobody reads)."""
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


class PcapWriter:
    """Frames are serialised into a private backlog and written to a non-blocking fd. A regular file takes every
    write whole. A FIFO or pipe whose reader falls behind fills its buffer; the backlog then grows up to
    ``BACKLOG`` bytes, after which frames are dropped and counted (``dropped``) instead of blocking the data path:
    a capture must never be able to stop the rings, nor a signal from ending the process. Only whole records
    are dropped, so the file stays readable."""

    BACKLOG = 4 << 20      # bytes waiting for a slow reader before frames are dropped
    FLUSH_AT = 8192        # write the backlog out once it holds this much (a BufferedWriter's size)
    CLOSE_GRACE_S = 0.25   # at close, wait this long for a reader that makes no progress ...
    CLOSE_LIMIT_S = 1.0    # ... and this long in all for one that trickles: the rest is dropped

    def __init__(self, path, count=None):
        if count is not None and count < 0:
            raise ValueError(f"pcap count must be >= 0, not {count}")
        self.path = os.fspath(path)
        self.limit = count
        self.written = 0   # frames whole in the file
        self.left_out = 0  # frames that passed after the limit was reached (or the file failed): offered, or
        #                    counted by a caller that stops offering them (vhost's C data path, the driver)
        self.dropped = 0   # frames a reader too slow for the data path did not get (backlog full, or at close)
        self.error = None  # the write error that ended the capture (disk full, ...): the run goes on without it
        self.taken = 0     # frames accepted: written, or still in the backlog
        # packet data: private. Non-blocking open: a FIFO nobody reads is an error (ENXIO), not a hang. And it
        # stays non-blocking: see the class docstring
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        except OSError as e:
            if e.errno == errno.ENXIO:   # (a unix socket there says the same)
                if is_socket(self.path):
                    raise ConfigError(f"{self.path} is a unix socket, not a file or a FIFO") from None
                raise ConfigError(f"{self.path}: a FIFO that nobody reads; start its reader first") from None
            raise
        self._regular = stat.S_ISREG(os.fstat(self._fd).st_mode)
        self._backlog = bytearray()
        self._sent = 0               # bytes of the stream written to the fd so far
        self._whole = 0              # ... of which whole records (and the file header) end here
        self._ends = collections.deque()  # stream offset where each backlog record ends
        self._w = dpkt.pcap.Writer(_Sink(self), snaplen=SNAPLEN, linktype=dpkt.pcap.DLT_EN10MB)
        self._whole = self._ends.pop()  # the file header is not a frame
        self._drain()

    def _take(self, record):
        self._backlog += record
        self._ends.append(self._sent + len(self._backlog))

    @property
    def full(self):
        """No more frames are taken: the limit was reached, or the file failed."""
        return self.error is not None or self.limit is not None and self.taken >= self.limit

    def write(self, frame, t_ns):
        """One frame seen at ``t_ns`` (time.time_ns()). False if it was not taken: the limit had been reached, the
        file failed, or the reader is too far behind."""
        if self._fd is None or self.full:
            self.left_out += 1
            return False
        if len(self._backlog) >= self.BACKLOG:
            self._drain()
            if self._fd is None:   # the file failed just now (the reader left: EPIPE)
                self.left_out += 1
                return False
            if len(self._backlog) >= self.BACKLOG:
                self.dropped += 1
                return False
        sec, ns = divmod(int(t_ns), 1_000_000_000)
        self._w.writepkt_time(bytes(frame[:SNAPLEN]), sec + (ns // 1000) / 1e6)
        self.taken += 1
        if len(self._backlog) >= self.FLUSH_AT:
            self._drain()
        return True

    @property
    def pending(self):
        """Bytes taken and not yet written. The callers flush() now and then (vhost's loop, the driver's 0.1 s
        watch, tap's capture thread), so that a live reader has them soon even when no more frames come."""
        return len(self._backlog)

    def _drain(self):
        """Write what the fd takes now, without waiting. False if something is left."""
        while self._backlog and self._fd is not None:
            try:
                n = os.write(self._fd, self._backlog)
            except BlockingIOError:
                return False
            except OSError as e:
                self._failed(e)
                return False
            del self._backlog[:n]
            self._sent += n
            while self._ends and self._ends[0] <= self._sent:
                self._whole = self._ends.popleft()
                self.written += 1
        return not self._backlog

    def _failed(self, e):
        """A capture is a by-product: its file failing (ENOSPC, EIO, EPIPE) ends the capture, not the run. A regular
        file is cut back to its last whole frame, so that it stays readable."""
        self.error = f"{type(e).__name__}: {e}"
        if self._regular and self._sent > self._whole:
            try:
                os.ftruncate(self._fd, self._whole)
            except OSError:
                self.error += "; the file ends inside a frame"
        log.error("pcap %s: %s; capture stopped after %d frames", self.path, self.error, self.written)
        self._close_fd()

    def _close_fd(self):
        fd, self._fd = self._fd, None
        self.dropped += len(self._ends)   # taken, never whole in the file
        self._ends.clear()
        self._backlog.clear()
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def flush(self):
        """Write out the backlog, as far as the fd takes it now."""
        self._drain()

    def close(self):
        """Write out the backlog: waiting up to CLOSE_GRACE_S for a reader that makes no progress, and up to
        CLOSE_LIMIT_S in all (a trickling reader must not hold the exit up either: signals are not seen here)."""
        if self._fd is None:
            return
        limit = time.monotonic() + self.CLOSE_LIMIT_S
        poll = select.poll()   # (not select: no limit on the fd's number)
        poll.register(self._fd, select.POLLOUT)
        while not self._drain() and self._fd is not None:
            before, left = self._sent, limit - time.monotonic()
            if left > 0:
                poll.poll(1000 * min(self.CLOSE_GRACE_S, left))
            if self._drain() or self._fd is None:   # all written, or the file failed (EPIPE: said so)
                break
            late = time.monotonic() >= limit
            if late or self._sent == before:
                torn = self._sent > self._whole
                self.error = (f"the reader was too slow to take the rest within {self.CLOSE_LIMIT_S:g} s" if late
                              else "the reader stopped reading") + (
                              "; the file ends inside a frame" if torn else "")
                log.error("pcap %s: %s; %d frames not written", self.path, self.error, len(self._ends))
                break
        self._close_fd()

    def stats(self):
        return {"path": self.path, "written": self.written, "limit": self.limit, "left_out": self.left_out,
                "dropped": self.dropped, "error": self.error}

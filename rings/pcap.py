"""Packet capture files: the frames that cross the rings, in the classic pcap format (Ethernet link type,
microsecond timestamps) that tcpdump, tshark and Wireshark read.

``PcapWriter(path, count)`` writes at most ``count`` frames (None: no limit) and counts what it had to
leave out. The frames handed to it are Ethernet frames: the virtio-net header already stripped. Used by
``vring tap --pcap`` (frames read from a peer's rings), ``vring driver --pcap`` and ``vring vhost --pcap``
(frames of their own bursts). The file layout is dpkt's (a small, long-lived pure-Python library): we
hand it whole frames with their time, truncated to whole microseconds first so that its rounding never
produces a microsecond field of 1000000.
"""
import logging
import os

import dpkt

log = logging.getLogger(__name__)

SNAPLEN = 262144  # tcpdump's default; a virtio-net frame (64 KiB + header at most) always fits whole


class PcapWriter:
    def __init__(self, path, count=None):
        if count is not None and count < 0:
            raise ValueError(f"pcap count must be >= 0, not {count}")
        self.path = os.fspath(path)
        self.limit = count
        self.written = 0
        self.left_out = 0  # frames offered after the limit was reached (or the file failed)
        self.error = None  # the write error that ended the capture (disk full, ...): the run goes on without it
        # packet data: private. Non-blocking open: a FIFO nobody reads is an error (ENXIO), not a hang
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        os.set_blocking(fd, True)
        self._f = os.fdopen(fd, "wb")
        self._w = dpkt.pcap.Writer(self._f, snaplen=SNAPLEN, linktype=dpkt.pcap.DLT_EN10MB)

    @property
    def full(self):
        """No more frames are taken: the limit was reached, or the file failed."""
        return self.error is not None or self.limit is not None and self.written >= self.limit

    def write(self, frame, t_ns):
        """One frame seen at ``t_ns`` (time.time_ns()). False if the limit had been reached or the file failed."""
        if self._f is None or self.full:
            self.left_out += 1
            return False
        sec, ns = divmod(int(t_ns), 1_000_000_000)
        try:
            self._w.writepkt_time(bytes(frame[:SNAPLEN]), sec + (ns // 1000) / 1e6)
        except OSError as e:
            self._failed(e)
            self.left_out += 1
            return False
        self.written += 1
        return True

    def _failed(self, e):
        """A capture is a by-product: its file failing (ENOSPC, EIO) ends the capture, not the run."""
        self.error = f"{type(e).__name__}: {e}"
        log.error("pcap %s: %s; capture stopped after %d frames", self.path, self.error, self.written)
        f, self._f = self._f, None
        try:
            f.close()
        except OSError:
            pass

    def flush(self):
        if self._f is not None:
            try:
                self._f.flush()
            except OSError as e:
                self._failed(e)

    def close(self):
        if self._f is not None:
            f, self._f = self._f, None
            try:
                f.close()
            except OSError as e:
                self._f = f
                self._failed(e)

    def stats(self):
        return {"path": self.path, "written": self.written, "limit": self.limit, "left_out": self.left_out,
                "error": self.error}

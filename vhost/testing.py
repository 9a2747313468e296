"""Test helpers: a server in a thread, and a scripted vhost-user frontend with real rings in shared memory.

``ScriptedFrontend`` speaks exactly the sequence DPDK 22.11 virtio_user sends (shared/spec/vhost-user.md 2.1)
and drives the two queues with ``rings.virtq.DriverQueue`` over the same shared memory the backend maps, so a
test can move real packets through the backend without DPDK. Guest-physical and userspace addresses differ
and the region starts at a non-page-aligned ``mmap_offset``, so both translations are exercised.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np

from rings import vhost_user as vu
from rings.layout import (VHOST_USER_F_PROTOCOL_FEATURES, VIRTIO_F_IN_ORDER, VIRTIO_F_RING_PACKED,
                          VIRTIO_F_VERSION_1, VIRTIO_NET_F_MRG_RXBUF, QueueLayout, bit)
from rings.shm import MemoryTable, ShmRegion
from rings.virtq import DriverQueue

from .server import Server

R = vu.VhostUserRequest
HDR = 12
GPA_BASE = 0x4000_0000
UADDR_BASE = 0x7F12_3400_0000
MMAP_OFFSET = 0x1010            # not page aligned (DPDK maps from offset 0 and adds it), but 16-byte aligned:
                                # the rings must be aligned in the backend's mapping too
REGION_SIZE = 4 << 20
RING_AREA = 0x10000             # per vring
PKT_BASE = 0x40000              # packet buffers after the rings
PKT_SIZE = 2048


def features_for(packed=False, in_order=True, mrg_rxbuf=True):
    f = bit(VIRTIO_F_VERSION_1) | bit(VHOST_USER_F_PROTOCOL_FEATURES)
    if packed:
        f |= bit(VIRTIO_F_RING_PACKED)
    if in_order:
        f |= bit(VIRTIO_F_IN_ORDER)
    if mrg_rxbuf:
        f |= bit(VIRTIO_NET_F_MRG_RXBUF)
    return f


def frame(i, size=60):
    """An Ethernet frame: dst 02:00:00:00:00:01, src 02:00:00:00:00:02, then the sequence number."""
    body = bytes.fromhex("020000000001" "020000000002" "0800") + i.to_bytes(8, "little")
    return body + bytes(size - len(body))


class ThreadedServer:
    """``Server.serve`` in a daemon thread; ``close()`` stops it and removes the socket."""

    def __init__(self, path, options=None, **kw):
        self.server = Server(path, options, **kw)
        self.server.open()
        self.result = None
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.result = self.server.serve()
        except BaseException as e:   # surfaced by close()
            self.error = e

    def wait(self, cond, timeout=5.0):
        t = time.monotonic() + timeout
        while time.monotonic() < t:
            if cond(self.server):
                return True
            time.sleep(0.01)
        return False

    def close(self):
        self.server.stop()
        self.thread.join(10)
        if self.error is not None:
            raise self.error
        return self.result

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ScriptedFrontend:
    """A virtio_user-like frontend over one shared-memory region (closed by ``close()``)."""

    def __init__(self, path, packed=False, in_order=True, mrg_rxbuf=True, queue_size=256, timeout=5.0):
        self.path = path
        self.packed, self.in_order, self.mrg_rxbuf = packed, in_order, mrg_rxbuf
        self.size = queue_size
        self.timeout = timeout
        self.fmt = "packed" if packed else "split"
        self.shm = ShmRegion.create(MMAP_OFFSET + REGION_SIZE, prefix="vhost-test")
        self.mem = MemoryTable([(GPA_BASE, REGION_SIZE, self.shm.buf, MMAP_OFFSET)])
        self.layouts = [QueueLayout.contiguous(self.fmt, queue_size, GPA_BASE + i * RING_AREA) for i in range(2)]
        self.kickfds = [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in range(2)]
        self.callfds = [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in range(2)]
        self.conn = None
        self.features = None
        self.rxq = self.txq = None
        self.pkt_free = list(range((REGION_SIZE - PKT_BASE) // PKT_SIZE))

    # -- protocol ------------------------------------------------------------------------------

    def connect(self):
        self.conn = vu.connect_unix(self.path, timeout=self.timeout)
        return self

    def call(self, request, payload=b"", fds=(), need_reply=False):
        rep = vu.client_call(self.conn, request, payload, fds, need_reply=need_reply, timeout=self.timeout)
        if rep is None:
            return None
        value = vu.decode(rep, reply=True)
        rep.close_fds()
        return value

    def uaddr(self, gpa):
        return gpa - GPA_BASE + UADDR_BASE

    def vring_addr(self, i):
        lay = self.layouts[i]
        return vu.VringAddr(i, 0, self.uaddr(lay.desc), self.uaddr(lay.device), self.uaddr(lay.driver))

    def mem_region(self):
        return vu.MemRegion(GPA_BASE, REGION_SIZE, UADDR_BASE, MMAP_OFFSET)

    def negotiate(self):
        """Steps 1-10 of the DPDK sequence. Returns the negotiated features."""
        self.call(R.SET_OWNER)
        offered = self.call(R.GET_FEATURES)
        pf = self.call(R.GET_PROTOCOL_FEATURES)
        want_pf = pf & (bit(vu.VhostUserProtocolFeature.MQ) | bit(vu.VhostUserProtocolFeature.REPLY_ACK)
                        | bit(vu.VhostUserProtocolFeature.STATUS))
        self.call(R.SET_PROTOCOL_FEATURES, vu.pack_u64(want_pf))
        for i in range(2):
            self.call(R.SET_VRING_CALL, vu.VringFile(i).pack(), [self.callfds[i]])
        want = features_for(self.packed, self.in_order, self.mrg_rxbuf)
        assert want & ~offered == 0, f"backend does not offer {want & ~offered:#x}"
        self.call(R.SET_FEATURES, vu.pack_u64(want))
        self.features = want
        self.call(R.SET_STATUS, vu.pack_u64(0xB), need_reply=True)
        assert self.call(R.GET_STATUS) == 0xB
        assert self.call(R.GET_STATUS) == 0xB
        return want

    def start(self):
        """Steps 11-22: the driver halves of both queues (their rings initialised before the device may look at
        them: the device area is the device's from DRIVER_OK on, SPLIT-L-08 / EVT-22); then memory table, vrings,
        enable, DRIVER_OK."""
        self.rxq = DriverQueue(self.mem, self.layouts[0], self.features)
        self.txq = DriverQueue(self.mem, self.layouts[1], self.features)
        self.rxq.enable_calls(False)
        self.txq.enable_calls(False)
        self.call(R.SET_MEM_TABLE, vu.pack_mem_table([self.mem_region()]), [self.shm.fileno()], need_reply=True)
        for i in range(2):
            self.call(R.SET_VRING_NUM, vu.VringState(i, self.size).pack())
            self.call(R.SET_VRING_BASE, vu.VringState(i, 0x8000 if self.packed else 0).pack())
            self.call(R.SET_VRING_ADDR, self.vring_addr(i).pack())
            self.call(R.SET_VRING_KICK, vu.VringFile(i).pack(), [self.kickfds[i]])
        for i in range(2):
            self.call(R.SET_VRING_ENABLE, vu.VringState(i, 1).pack())
        self.call(R.SET_STATUS, vu.pack_u64(0xF), need_reply=True)
        self.rx_slots = {}
        self.tx_slots = {}

    def stop(self):
        """Steps 23-24: disable both, GET_VRING_BASE both. Returns the two bases."""
        for i in range(2):
            self.call(R.SET_VRING_ENABLE, vu.VringState(i, 0).pack())
        return [self.call(R.GET_VRING_BASE, vu.VringState(i, 0x55E4).pack()).num for i in range(2)]

    # -- traffic -------------------------------------------------------------------------------

    def _slot(self):
        return self.pkt_free.pop()

    def _gpa(self, slot):
        return GPA_BASE + PKT_BASE + slot * PKT_SIZE

    def post_rx(self, n, size=PKT_SIZE):
        """Post n writable Rx buffers of ``size`` bytes. Returns how many fitted."""
        slots = [self._slot() for _ in range(n)]
        addrs = np.array([self._gpa(s) for s in slots], np.uint64)
        got = self.rxq.add_simple(addrs, np.full(n, size, np.uint32), np.array(slots, np.uint64), writable=True)
        self.pkt_free.extend(slots[got:])
        self.rxq.publish()
        return got

    def send(self, frames, layout="one"):
        """Send frames on the Tx queue. ``layout``: 'one' (header + frame in one descriptor), 'split-hdr'
        (header alone, then the frame), 'scattered' (5 + 7 header bytes, then the frame in two pieces)."""
        addrs, lens, nread, tokens = [], [], [], []
        for f in frames:
            s = self._slot()
            gpa = self._gpa(s)
            data = bytes(HDR) + f
            self.mem.write(gpa, data)
            if layout == "one":
                cuts = [len(data)]
            elif layout == "split-hdr":
                cuts = [HDR, len(f)]
            else:
                half = len(f) // 2
                cuts = [5, 7, half, len(f) - half]
            off = 0
            for c in cuts:
                addrs.append(gpa + off)
                lens.append(c)
                off += c
            nread.append(len(cuts))
            tokens.append(s)
        got = self.txq.add(np.array(addrs, np.uint64), np.array(lens, np.uint32), np.array(nread, np.uint16),
                           np.zeros(len(nread), np.uint16), np.array(tokens, np.uint64))
        self.txq.publish()
        if self.txq.kick_prepare():
            os.eventfd_write(self.kickfds[1], 1)
        return got

    def reclaim_tx(self):
        tokens, lens = self.txq.reclaim()
        self.pkt_free.extend(int(t) for t in tokens)
        return lens.copy()

    def receive(self):
        """Used Rx buffers as (slot bytes, used len) pairs, in order; buffers return to the pool."""
        tokens, lens = self.rxq.reclaim()
        out = []
        for t, n in zip(tokens, lens):
            out.append((self.mem.read(self._gpa(int(t)), int(n)), int(n)))
            self.pkt_free.append(int(t))
        return out

    def receive_until(self, n, timeout=5.0):
        """``receive()`` until ``n`` buffers came back or ``timeout`` seconds passed: what came."""
        got, deadline = [], time.monotonic() + timeout
        while len(got) < n and time.monotonic() < deadline:
            got += self.receive()
            time.sleep(0.001)
        return got

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        for fd in self.kickfds + self.callfds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.kickfds = self.callfds = []
        self.rxq = self.txq = None
        self.mem = None
        self.shm.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class VhostProcess:
    """``vring vhost`` as a child process (its own session), for interop tests and the benchmark.

    ``stop()`` sends SIGINT (a clean exit that prints the final counters), falls back to SIGKILL, and returns
    the final JSON counters; the socket is removed by the backend itself."""

    def __init__(self, sock, *args, pin=None, stats_interval=None, verbose=False):
        import subprocess
        import sys
        import tempfile
        self.sock = sock
        self._stdout = tempfile.TemporaryFile()
        self._stderr = tempfile.TemporaryFile()
        argv = [sys.executable, "-m", "vring.cli", "vhost", "--socket", sock, "--json", *map(str, args)]
        if pin is not None:
            argv += ["--pin", str(pin)]
        if stats_interval:
            argv += ["--stats-interval", str(stats_interval)]
        if verbose:
            argv.append("-v")
        self.argv = argv
        self.proc = subprocess.Popen(argv, stdout=self._stdout, stderr=self._stderr, start_new_session=True)
        self.final = None

    def wait_socket(self, timeout=10.0):
        import stat
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if stat.S_ISSOCK(os.stat(self.sock).st_mode):
                    return
            except FileNotFoundError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"vring vhost exited ({self.proc.returncode}): {self.stderr()[-2000:]}")
            time.sleep(0.02)
        raise RuntimeError(f"vring vhost: no socket {self.sock} after {timeout}s")

    def wait_stderr(self, text, timeout=30.0):
        """Wait until the backend's log (``verbose``) says ``text``, e.g. "frontend connected (connection 1)"."""
        deadline = time.monotonic() + timeout
        while text not in self.stderr():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vring vhost never logged {text!r}: {self.stderr()[-2000:]}")
            time.sleep(0.05)

    def _read(self, f):
        # pread: the child writes through the same open file description, and a seek here would move its
        # write offset (stats lines written over each other while it runs)
        fd = f.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode("utf-8", "replace")

    def stdout(self):
        return self._read(self._stdout)

    def stderr(self):
        return self._read(self._stderr)

    def stop(self, timeout=10.0):
        import json
        import signal
        import subprocess
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        lines = [json.loads(x) for x in self.stdout().splitlines() if x.startswith("{")]
        finals = [x for x in lines if x.get("final")]
        self.final = finals[-1] if finals else None
        return self.final

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        self._stdout.close()
        self._stderr.close()

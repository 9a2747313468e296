"""The vhost-user frontend against a scripted in-process backend: the message sequence, every reply checked,
clear errors for refused features, NACKs, a closed socket and a silent backend (no hangs)."""
import os
import threading
import time

import pytest

from rings import vhost_user as vu
from rings.errors import PeerGone, ProtocolNack, ProtocolTimeout
from rings.layout import (VHOST_USER_F_PROTOCOL_FEATURES, VIRTIO_F_IN_ORDER, VIRTIO_F_RING_PACKED,
                          VIRTIO_F_VERSION_1, VIRTIO_NET_F_MRG_RXBUF, bit)
from virtio.frontend import FeatureRefused, VhostUserFrontend, want_features
from virtio.net import NetQueues

R = vu.VhostUserRequest
DPDK_FEATURES = 0xD7C66E7CB       # what net_vhost offers (spec 2.4)
DPDK_PROTOCOL = 0x10CBF


class FakeBackend(threading.Thread):
    def __init__(self, path, features=DPDK_FEATURES, protocol=DPDK_PROTOCOL, close_on=None, silent_on=None,
                 nack_on=None):
        super().__init__(daemon=True)
        self.path = path
        self.listener = vu.listen_unix(path)
        self.features, self.protocol = features, protocol
        self.close_on, self.silent_on, self.nack_on = close_on, silent_on, nack_on
        self.got = []          # (request, flags, value, nfds)
        self.fd_sizes = []
        self.status = 0
        self.error = None
        self.start()

    def run(self):
        try:
            conn = vu.accept_unix(self.listener, timeout=10)
        except Exception as e:  # noqa: BLE001
            self.error = e
            return
        with conn:
            while True:
                try:
                    msg = conn.recv(timeout=10)
                except (PeerGone, ProtocolTimeout):
                    return
                value = vu.decode(msg)
                self.got.append((msg.request, msg.flags, value, len(msg.fds)))
                for fd in msg.take_fds():
                    self.fd_sizes.append(os.fstat(fd).st_size)
                    os.close(fd)
                if msg.request == self.close_on:
                    return
                if msg.request == self.silent_on:
                    time.sleep(1.5)
                    return
                if msg.request == R.SET_STATUS:
                    self.status = value
                answer = {R.GET_FEATURES: self.features, R.GET_PROTOCOL_FEATURES: self.protocol,
                          R.GET_STATUS: self.status}.get(msg.request)
                if msg.request == R.GET_VRING_BASE:
                    conn.send(vu.reply(msg, vu.VringState(value.index, 0).pack()))
                elif answer is not None:
                    conn.send(vu.reply(msg, vu.pack_u64(answer)))
                elif vu.wants_ack(msg):
                    conn.send(vu.ack(msg, ok=msg.request != self.nack_on))

    def names(self):
        return [vu.request_name(r) for r, *_ in self.got]

    def close(self):
        self.listener.close()
        self.join(5)
        if os.path.exists(self.path):
            os.unlink(self.path)


@pytest.fixture
def sock(tmp_path):
    return str(tmp_path / "vhost.sock")


WANT = want_features(VERSION_1=True, RING_PACKED=False, IN_ORDER=True, MRG_RXBUF=True)


def test_full_sequence_like_virtio_user(sock):
    be = FakeBackend(sock)
    fe = VhostUserFrontend(sock, timeout=2)
    nq = None
    try:
        fe.connect()
        features = fe.negotiate(WANT)
        assert features == WANT | bit(VHOST_USER_F_PROTOCOL_FEATURES)
        assert fe.protocol == (1 << 3) | (1 << 16)            # REPLY_ACK and STATUS, as offered
        nq = NetQueues(features, size=128, nbufs=1024, kickfds=fe.kickfds, callfds=fe.callfds)
        nq.rx.fill()
        fe.start(nq.mem, nq.layouts())
        assert fe.stop() == {0: 0, 1: 0}
    finally:
        fe.close()
        if nq:
            nq.close()
        be.close()
    names = be.names()
    assert names == [
        "SET_OWNER", "GET_FEATURES", "GET_PROTOCOL_FEATURES", "SET_PROTOCOL_FEATURES",
        "SET_VRING_CALL", "SET_VRING_CALL", "SET_FEATURES", "SET_STATUS", "GET_STATUS", "SET_MEM_TABLE",
        "SET_VRING_NUM", "SET_VRING_BASE", "SET_VRING_ADDR", "SET_VRING_KICK",
        "SET_VRING_NUM", "SET_VRING_BASE", "SET_VRING_ADDR", "SET_VRING_KICK",
        "SET_VRING_ENABLE", "SET_VRING_ENABLE", "SET_STATUS",
        "SET_VRING_ENABLE", "SET_VRING_ENABLE", "GET_VRING_BASE", "GET_VRING_BASE"]
    got = {i: g for i, g in enumerate(be.got)}
    # after REPLY_ACK is negotiated every request without its own reply asks for an ack
    for req, flags, value, nfds in be.got[4:]:
        assert flags == (0x1 if vu.has_reply(req) else 0x9), vu.request_name(req)
    mem = next(g for g in be.got if g[0] == R.SET_MEM_TABLE)
    (region,) = mem[2]
    assert mem[3] == 1 and region.gpa == region.uaddr == 0x100000000 and region.mmap_offset == 0
    assert region.size in be.fd_sizes
    addrs = [g[2] for g in be.got if g[0] == R.SET_VRING_ADDR]
    lay = nq.layouts()
    for a in addrs:
        lo = lay[a.index]
        assert (a.desc, a.used, a.avail) == (lo.desc, lo.device, lo.driver)
    statuses = [g[2] for g in be.got if g[0] == R.SET_STATUS]
    assert statuses == [0xB, 0xF]
    assert got[6][2] == features


def test_refused_feature_is_named(sock):
    be = FakeBackend(sock, features=DPDK_FEATURES & ~bit(VIRTIO_F_RING_PACKED))
    fe = VhostUserFrontend(sock, timeout=2)
    try:
        fe.connect()
        with pytest.raises(FeatureRefused, match="RING_PACKED"):
            fe.negotiate(WANT | bit(VIRTIO_F_RING_PACKED))
    finally:
        fe.close()
        be.close()
    assert "SET_FEATURES" not in be.names()


def test_features_not_offered_are_never_accepted(sock):  # FEAT-02
    offered = bit(VIRTIO_F_VERSION_1) | bit(VIRTIO_NET_F_MRG_RXBUF)
    be = FakeBackend(sock, features=offered)
    fe = VhostUserFrontend(sock, timeout=2)
    try:
        fe.connect()
        got = fe.negotiate(WANT, required=bit(VIRTIO_F_VERSION_1))
    finally:
        fe.close()
        be.close()
    assert got == offered and not got & bit(VIRTIO_F_IN_ORDER)
    assert "GET_PROTOCOL_FEATURES" not in be.names()   # no bit 30 offered: no protocol features


def test_closed_socket_is_a_clear_error(sock):
    be = FakeBackend(sock, close_on=R.GET_FEATURES)
    fe = VhostUserFrontend(sock, timeout=2)
    try:
        fe.connect()
        with pytest.raises(PeerGone, match="closed the connection during GET_FEATURES"):
            fe.negotiate(WANT)
    finally:
        fe.close()
        be.close()


def test_silent_backend_times_out(sock):
    be = FakeBackend(sock, silent_on=R.GET_PROTOCOL_FEATURES)
    fe = VhostUserFrontend(sock, timeout=0.3)
    t0 = time.monotonic()
    try:
        fe.connect()
        with pytest.raises(ProtocolTimeout, match="did not answer GET_PROTOCOL_FEATURES"):
            fe.negotiate(WANT)
        assert time.monotonic() - t0 < 2.0
    finally:
        fe.close()
        be.close()


def test_nack_is_reported_where_it_happens(sock):
    be = FakeBackend(sock, nack_on=R.SET_MEM_TABLE)
    fe = VhostUserFrontend(sock, timeout=2)
    nq = None
    try:
        fe.connect()
        features = fe.negotiate(WANT)
        nq = NetQueues(features, size=64, nbufs=512)
        with pytest.raises(ProtocolNack, match="refused SET_MEM_TABLE"):
            fe.start(nq.mem, nq.layouts())
    finally:
        fe.close()
        if nq:
            nq.close()
        be.close()


def test_nobody_listening(sock):
    fe = VhostUserFrontend(sock, timeout=1)
    with pytest.raises(PeerGone, match="nobody listens"):
        fe.connect()


def test_mem_table_timeout_is_never_shorter_than_timeout(sock):
    """--timeout 60 (a slow backend) still gave SET_MEM_TABLE only 15 s: its own floor replaced the longer wait
    asked for (attack24). SET_MEM_TABLE waits max(15 s, timeout)."""
    assert VhostUserFrontend(sock, timeout=60).mem_timeout == 60
    assert VhostUserFrontend(sock, timeout=1).mem_timeout == 15


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_an_inflight_area_its_backend_would_not_let_us_seal_is_kept_as_a_sealed_copy(sock, monkeypatch, packed):
    """Found by attack43: a backend that hands out its inflight area unsealable (DPDK 22.11: memfd_create without
    MFD_ALLOW_SEALING) left the driver with an area every later `vring vhost` rightly refuses (it could shrink under
    its mapping): after a restart the run ended on that NACK. The driver now keeps a sealed copy of it, made before
    any backend used it, and hands that to every backend, the first one too."""
    import fcntl

    import vhost.device
    from rings.shm import F_GET_SEALS, F_SEAL_SHRINK
    from vhost.inflight import InflightArea, create_area
    from vhost.testing import ThreadedServer, features_for

    made = []

    def unsealable_area(num_queues, queue_size, is_packed):
        fd, size = create_area(num_queues, queue_size, is_packed)   # the initial contents a backend writes
        plain = os.memfd_create("dpdk-like-inflight", os.MFD_CLOEXEC)
        os.ftruncate(plain, size)
        os.pwrite(plain, os.pread(fd, size, 0), 0)
        os.close(fd)
        made.append(os.pread(plain, size, 0))
        return plain, size
    monkeypatch.setattr(vhost.device, "create_area", unsealable_area)
    srv = ThreadedServer(sock)
    fe = VhostUserFrontend(sock, timeout=2)
    nq = None
    try:
        fe.connect()
        features = fe.negotiate(features_for(packed))
        assert fe.has_inflight
        nq = NetQueues(features, size=64, nbufs=512)
        fe.get_inflight(nq.size)
        inf, fd = fe.inflight
        assert fcntl.fcntl(fd, F_GET_SEALS) & F_SEAL_SHRINK and inf.mmap_offset == 0
        assert os.pread(fd, inf.mmap_size, 0) == made[0]
        InflightArea(os.dup(fd), inf.mmap_size, 0, 2, nq.size, packed).close()   # what a successor accepts
        fe.start(nq.mem, nq.layouts())   # the first backend takes the copy too
        assert srv.wait(lambda s: s.device is not None and s.device.datapath is not None)
    finally:
        fe.close()
        if nq:
            nq.close()
        srv.close()


@pytest.mark.parametrize("lie", ["size-2^40", "size-past-the-file", "offset-2^63", "pipe", "write-only"])
def test_an_unsealable_inflight_area_that_lies_about_its_size_is_a_protocol_error(sock, monkeypatch, lie):
    """Found by attack44: the sealed copy read ``mmap_size`` bytes at ``mmap_offset`` as the backend announced them:
    2^40 was a MemoryError, 2^63 an OverflowError, a pipe "Illegal seek" (tracebacks). Checked against the file;
    a file we cannot read (write-only) is a ProtocolError too."""
    import vhost.device
    from rings.errors import ProtocolError
    from vhost.device import Reply
    from vhost.inflight import create_area
    from vhost.testing import ThreadedServer, features_for

    def lying_area(num_queues, queue_size, is_packed):
        fd, size = create_area(num_queues, queue_size, is_packed)
        os.close(fd)
        if lie == "pipe":
            r, w = os.pipe()
            os.close(w)
            return r, size
        plain = os.memfd_create("lying-inflight", os.MFD_CLOEXEC)
        os.ftruncate(plain, size)
        if lie == "write-only":   # (attack45: a bare OSError from pread, EBADF)
            wronly = os.open(f"/proc/self/fd/{plain}", os.O_WRONLY)
            os.close(plain)
            return wronly, size
        return plain, {"size-2^40": 1 << 40, "size-past-the-file": size + 4096}.get(lie, size)
    monkeypatch.setattr(vhost.device, "create_area", lying_area)
    if lie == "offset-2^63":
        real = vhost.device.NetDevice._get_inflight_fd

        def far(self, msg, inf):
            rep = real(self, msg, inf)
            got = vu.Inflight.unpack(rep.payload)
            return Reply(vu.Inflight(got.mmap_size, 1 << 63, got.num_queues, got.queue_size).pack(), rep.fds)
        monkeypatch.setattr(vhost.device.NetDevice, "_get_inflight_fd", far)
    srv = ThreadedServer(sock)
    fe = VhostUserFrontend(sock, timeout=2)
    try:
        fe.connect()
        fe.negotiate(features_for(False))
        with pytest.raises(ProtocolError, match="inflight area"):
            fe.get_inflight(64)
        assert fe.inflight is None
    finally:
        fe.close()
        srv.close()

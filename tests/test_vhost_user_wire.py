"""vhost-user wire layer (rings/vhost_user.py): payload layouts, framing, fd passing, validation, replies, sockets.

Everything runs over real socketpairs / unix sockets in tmp_path with real fds (eventfd, memfd, pipe).
"""
import os
import socket
import stat
import struct
import threading
import time

import pytest

from rings.errors import ConfigError, PeerGone, ProtocolError, ProtocolNack, ProtocolTimeout
from rings import vhost_user as vu
from rings.vhost_user import (
    Connection, ConfigSpace, Inflight, IotlbMsg, LogBase, MemRegion, Message, VhostUserRequest as R,
    VringAddr, VringFile, VringState,
)

T = 2.0  # every blocking call in these tests has a timeout: nothing can hang


# ------------------------------------------------------------------------------------------------
# fixtures and helpers
# ------------------------------------------------------------------------------------------------


def open_fds():
    return set(os.listdir("/proc/self/fd"))


def is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


@pytest.fixture
def fds():
    """Make real fds for a test and close them at teardown, even if the test fails."""
    made = []

    class Maker:
        def eventfd(self):
            fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            made.append(fd)
            return fd

        def memfd(self, size=4096, data=b""):
            fd = os.memfd_create("vu-test", os.MFD_CLOEXEC)
            made.append(fd)
            os.ftruncate(fd, size)
            if data:
                os.pwrite(fd, data, 0)
            return fd

        def pipe(self):
            r, w = os.pipe()
            made.extend((r, w))
            return r, w

    yield Maker()
    for fd in made:
        try:
            os.close(fd)
        except OSError:
            pass


@pytest.fixture
def pair():
    """Two connected Connections (frontend, backend) over a socketpair."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fe, be = Connection(a), Connection(b)
    yield fe, be
    fe.close()
    be.close()


@pytest.fixture
def sock_path(tmp_path):
    path = tmp_path / "vhost.sock"
    yield path
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def raw_header(request, flags, size):
    return struct.pack("<III", request, flags, size)


def roundtrip(pair, msg):
    fe, be = pair
    fe.send(msg, timeout=T)
    return be.recv(timeout=T)


def same_file(fd1, fd2):
    a, b = os.fstat(fd1), os.fstat(fd2)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


# ------------------------------------------------------------------------------------------------
# constants
# ------------------------------------------------------------------------------------------------


def test_request_ids_are_dpdk_22_11():
    expect = {
        "GET_FEATURES": 1, "SET_FEATURES": 2, "SET_OWNER": 3, "RESET_OWNER": 4, "SET_MEM_TABLE": 5,
        "SET_LOG_BASE": 6, "SET_LOG_FD": 7, "SET_VRING_NUM": 8, "SET_VRING_ADDR": 9, "SET_VRING_BASE": 10,
        "GET_VRING_BASE": 11, "SET_VRING_KICK": 12, "SET_VRING_CALL": 13, "SET_VRING_ERR": 14,
        "GET_PROTOCOL_FEATURES": 15, "SET_PROTOCOL_FEATURES": 16, "GET_QUEUE_NUM": 17, "SET_VRING_ENABLE": 18,
        "SEND_RARP": 19, "NET_SET_MTU": 20, "SET_SLAVE_REQ_FD": 21, "IOTLB_MSG": 22, "GET_CONFIG": 24,
        "SET_CONFIG": 25, "CRYPTO_CREATE_SESS": 26, "CRYPTO_CLOSE_SESS": 27, "POSTCOPY_ADVISE": 28,
        "POSTCOPY_LISTEN": 29, "POSTCOPY_END": 30, "GET_INFLIGHT_FD": 31, "SET_INFLIGHT_FD": 32,
        "SET_STATUS": 39, "GET_STATUS": 40,
    }
    assert {r.name: r.value for r in R} == expect
    assert set(vu.REQUEST_SPECS) == set(R)
    assert (vu.VERSION, vu.REPLY, vu.NEED_REPLY, vu.REPLY_FLAGS) == (1, 4, 8, 5)
    assert (vu.VRING_NOFD_MASK, vu.MAX_FDS, vu.MAX_REGIONS, vu.HEADER_SIZE) == (0x100, 8, 8, 12)
    pf = vu.VhostUserProtocolFeature
    assert (pf.MQ, pf.LOG_SHMFD, pf.REPLY_ACK, pf.SLAVE_REQ, pf.CONFIG, pf.INFLIGHT_SHMFD, pf.STATUS) == \
        (0, 1, 3, 5, 9, 12, 16)
    # what net_vhost offers / virtio_user asks for, per the spec
    assert sum(1 << b for b in (pf.MQ, pf.REPLY_ACK, pf.STATUS)) == 0x10009
    assert vu.request_name(8) == "SET_VRING_NUM" and vu.request_name(99) == "UNKNOWN(99)"


# ------------------------------------------------------------------------------------------------
# payload layouts
# ------------------------------------------------------------------------------------------------


def test_u64_roundtrip():
    assert vu.pack_u64(0xd7c66e7cb) == bytes.fromhex("cbe7667c0d000000")
    assert vu.unpack_u64(vu.pack_u64(2**64 - 1)) == 2**64 - 1
    with pytest.raises(ConfigError):
        vu.pack_u64(2**64)
    with pytest.raises(ProtocolError, match="payload is 4 bytes, expected 8"):
        vu.unpack_u64(b"\0" * 4)


def test_vring_state_roundtrip():
    s = VringState(1, 0x8000)
    assert s.pack() == bytes.fromhex("01000000 00800000")
    assert VringState.unpack(s.pack()) == s


def test_vring_addr_example_bytes_from_spec():
    # spec 1.2: SET_VRING_ADDR from virtio_user, vring 0, as seen on the wire
    wire = bytes.fromhex("09000000 01000000 28000000 | 00000000 00000000 00c02d1001000000 00e02d1001000000 "
                         "00d02d1001000000 0000000000000000".replace("|", ""))
    addr = VringAddr(index=0, flags=0, desc=0x1102dc000, used=0x1102de000, avail=0x1102dd000, log=0)
    msg = Message(R.SET_VRING_ADDR, vu.VERSION, addr.pack())
    assert vu.HEADER.pack(msg.request, msg.flags, msg.size) + msg.payload == wire
    assert VringAddr.unpack(wire[12:]) == addr
    assert len(addr.pack()) == 40


def test_vring_addr_wire_order_is_desc_used_avail():
    p = VringAddr(3, 1, desc=0x1111, used=0x2222, avail=0x3333, log=0x4444).pack()
    assert struct.unpack_from("<QQQQ", p, 8) == (0x1111, 0x2222, 0x3333, 0x4444)


def test_vring_file_roundtrip():
    assert VringFile(5).pack() == vu.pack_u64(5)
    assert VringFile(5, nofd=True).pack() == vu.pack_u64(0x105)
    assert VringFile.unpack(vu.pack_u64(0x1ff)) == VringFile(0xff, True)
    assert VringFile.unpack(vu.pack_u64(0x07)) == VringFile(7, False)
    with pytest.raises(ConfigError):
        VringFile(256).pack()
    with pytest.raises(ProtocolError, match="reserved bits"):
        VringFile.unpack(vu.pack_u64(0x200))


def test_mem_table_roundtrip():
    one = [MemRegion(gpa=0x10063a000, size=0x20000000, uaddr=0x10063a000, mmap_offset=0)]
    p = vu.pack_mem_table(one)
    assert len(p) == 8 + 32
    assert p[:8] == struct.pack("<II", 1, 0)
    assert p[8:] == struct.pack("<QQQQ", 0x10063a000, 0x20000000, 0x10063a000, 0)
    assert vu.unpack_mem_table(p) == one
    eight = [MemRegion(0x1000_0000 * (i + 1), 0x1000, 0x7f00_0000_0000 + 0x10000 * i, 0x200000 * i) for i in range(8)]
    p8 = vu.pack_mem_table(eight)
    assert len(p8) == 8 + 32 * 8 == 264
    assert vu.unpack_mem_table(p8) == eight
    with pytest.raises(ConfigError):
        vu.pack_mem_table([])
    with pytest.raises(ConfigError):
        vu.pack_mem_table(eight + eight[:1])


def test_log_inflight_config_iotlb_roundtrip():
    log = LogBase(0x1000, 0x200)
    assert log.pack() == struct.pack("<QQ", 0x1000, 0x200) and LogBase.unpack(log.pack()) == log
    inf = Inflight(8320, 0, 2, 256)
    p = inf.pack()
    assert len(p) == 24 == vu.INFLIGHT_SIZE
    assert p == struct.pack("<QQHH", 8320, 0, 2, 256) + b"\0" * 4
    assert Inflight.unpack(p) == inf
    with pytest.raises(ProtocolError, match="payload is 20 bytes, expected 24"):
        Inflight.unpack(p[:20])
    cfg = ConfigSpace(0, 6, 0, b"\x02\x00\x00\x00\x00\x01")
    assert ConfigSpace.unpack(cfg.pack()) == cfg
    with pytest.raises(ProtocolError):
        ConfigSpace.unpack(cfg.pack() + b"\0")
    io = IotlbMsg(0x1000, 0x2000, 0x7f0000, 3, 2)
    assert len(io.pack()) == 32
    assert IotlbMsg.unpack(io.pack()) == io == IotlbMsg.unpack(io.pack()[:26])


# every request with a valid payload and fd count; the decoded value after a trip over a real socket
def _valid_requests(fds):
    mem1 = [MemRegion(0x40000000, 0x200000, 0x7f0000000000, 0x200000)]
    return [
        (R.GET_FEATURES, b"", 0, None),
        (R.SET_FEATURES, vu.pack_u64(0xd50008000), 0, 0xd50008000),
        (R.SET_OWNER, b"", 0, None),
        (R.RESET_OWNER, b"", 0, None),
        (R.SET_MEM_TABLE, vu.pack_mem_table(mem1), 1, mem1),
        (R.SET_LOG_BASE, LogBase(0x1000, 0).pack(), 1, LogBase(0x1000, 0)),
        (R.SET_LOG_FD, b"", 1, None),
        (R.SET_VRING_NUM, VringState(0, 256).pack(), 0, VringState(0, 256)),
        (R.SET_VRING_ADDR, VringAddr(1, 0, 0x1000, 0x3000, 0x2000).pack(), 0, VringAddr(1, 0, 0x1000, 0x3000, 0x2000)),
        (R.SET_VRING_BASE, VringState(0, 0x8000).pack(), 0, VringState(0, 0x8000)),
        (R.GET_VRING_BASE, VringState(1, 0x55e4).pack(), 0, VringState(1, 0x55e4)),
        (R.SET_VRING_KICK, VringFile(0).pack(), 1, VringFile(0)),
        (R.SET_VRING_CALL, VringFile(1, nofd=True).pack(), 0, VringFile(1, True)),
        (R.SET_VRING_ERR, VringFile(2).pack(), 1, VringFile(2)),
        (R.GET_PROTOCOL_FEATURES, b"", 0, None),
        (R.SET_PROTOCOL_FEATURES, vu.pack_u64(0x10009), 0, 0x10009),
        (R.GET_QUEUE_NUM, b"", 0, None),
        (R.SET_VRING_ENABLE, VringState(1, 1).pack(), 0, VringState(1, 1)),
        (R.SEND_RARP, bytes.fromhex("525400123456") + b"\0\0", 0, bytes.fromhex("525400123456")),
        (R.NET_SET_MTU, vu.pack_u64(1500), 0, 1500),
        (R.SET_SLAVE_REQ_FD, b"", 1, None),
        (R.IOTLB_MSG, IotlbMsg(1, 2, 3, 3, 2).pack(), 0, IotlbMsg(1, 2, 3, 3, 2)),
        (R.GET_CONFIG, ConfigSpace(0, 4, 0, b"\0" * 4).pack(), 0, ConfigSpace(0, 4, 0, b"\0" * 4)),
        (R.SET_CONFIG, ConfigSpace(0, 2, 0, b"\x05\xdc").pack(), 0, ConfigSpace(0, 2, 0, b"\x05\xdc")),
        (R.CRYPTO_CREATE_SESS, b"x" * 100, 0, b"x" * 100),
        (R.CRYPTO_CLOSE_SESS, vu.pack_u64(7), 0, 7),
        (R.POSTCOPY_ADVISE, b"", 0, None),
        (R.POSTCOPY_LISTEN, b"", 0, None),
        (R.POSTCOPY_END, b"", 0, None),
        (R.GET_INFLIGHT_FD, Inflight(0, 0, 2, 256).pack(), 0, Inflight(0, 0, 2, 256)),
        (R.SET_INFLIGHT_FD, Inflight(8320, 0, 2, 256).pack(), 1, Inflight(8320, 0, 2, 256)),
        (R.SET_STATUS, vu.pack_u64(0xb), 0, 0xb),
        (R.GET_STATUS, b"", 0, None),
    ]


def test_every_request_roundtrips_over_a_socket(pair, fds):
    cases = _valid_requests(fds)
    assert {c[0] for c in cases} == set(R)
    for request, payload, nfds, value in cases:
        sent_fds = [fds.memfd() for _ in range(nfds)]
        got = roundtrip(pair, Message(request, vu.VERSION, payload, sent_fds))
        try:
            assert got.request is request and got.flags == vu.VERSION and got.payload == payload
            assert len(got.fds) == nfds
            assert all(same_file(a, b) for a, b in zip(sent_fds, got.fds))
            assert vu.decode(got) == value
            vu.validate(got)
        finally:
            got.close_fds()
        assert all(is_open(fd) for fd in sent_fds)  # send borrows, never closes


# ------------------------------------------------------------------------------------------------
# fd passing
# ------------------------------------------------------------------------------------------------


def test_pass_one_eventfd(pair, fds):
    efd = fds.eventfd()
    got = roundtrip(pair, Message(R.SET_VRING_KICK, payload=VringFile(0).pack(), fds=[efd]))
    try:
        assert vu.decode(got) == VringFile(0) and len(got.fds) == 1
        rfd = got.fds[0]
        assert rfd != efd and same_file(rfd, efd)
        os.eventfd_write(rfd, 3)           # a kick through the received fd arrives on ours
        assert os.eventfd_read(efd) == 3
        assert os.get_inheritable(rfd) is False   # MSG_CMSG_CLOEXEC
    finally:
        got.close_fds()


def test_pass_eight_memfds_in_order(pair, fds):
    mfds = [fds.memfd(4096, b"region-%d" % i) for i in range(8)]
    regions = [MemRegion(0x100000 * (i + 1), 4096, 0x7f0000000000 + 0x100000 * i) for i in range(8)]
    got = roundtrip(pair, Message(R.SET_MEM_TABLE, vu.VERSION | vu.NEED_REPLY, vu.pack_mem_table(regions), mfds))
    try:
        assert got.need_reply
        assert vu.decode(got) == regions
        assert len(got.fds) == 8
        for i, (mine, theirs) in enumerate(zip(mfds, got.fds)):
            assert same_file(mine, theirs)
            assert os.pread(theirs, 8, 0) == b"region-%d" % i
    finally:
        got.close_fds()


def test_send_refuses_more_than_eight_fds(pair, fds):
    fe, be = pair
    many = [fds.eventfd() for _ in range(9)]
    with pytest.raises(ConfigError, match="at most 8"):
        fe.send(Message(R.SET_MEM_TABLE, fds=many))
    with pytest.raises(ConfigError):
        fe.send(Message(R.SET_VRING_KICK, payload=VringFile(0).pack(), fds=[-1]))
    with pytest.raises(ProtocolTimeout):   # nothing went out
        be.recv(timeout=0.05)
    assert fe.broken is None and be.broken is None


def test_ctrunc_nine_fds_rejected_and_closed(pair, fds):
    fe, be = pair
    nine = [fds.eventfd() for _ in range(9)]
    payload = VringFile(0).pack()
    fe.sock.sendmsg([raw_header(R.SET_VRING_KICK, 1, 8) + payload],
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("9i", *nine))])
    fe.send(Message(R.GET_FEATURES), timeout=T)
    before = open_fds()
    with pytest.raises(ProtocolError, match="truncated"):
        be.recv(timeout=T)
    assert open_fds() == before          # the 8 fds that did arrive were closed
    assert be.broken is None             # the payload was consumed: still in step
    nxt = be.recv(timeout=T)
    assert nxt.request is R.GET_FEATURES and nxt.fds == []


def test_zero_length_scm_rights_like_virtio_user(pair):
    fe, be = pair
    try:
        fe.sock.sendmsg([raw_header(R.GET_FEATURES, 1, 0)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, b"")])
    except OSError as e:  # pragma: no cover - depends on the kernel
        pytest.skip(f"kernel refuses an empty SCM_RIGHTS: {e}")
    got = be.recv(timeout=T)
    assert got.request is R.GET_FEATURES and got.fds == []


def test_header_split_over_writes_with_fd_on_first_byte(pair, fds):
    fe, be = pair
    efd = fds.eventfd()
    data = raw_header(R.SET_VRING_CALL, 1, 8) + VringFile(1).pack()
    fe.sock.sendmsg([data[:3]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", efd))])
    result = {}

    def reader():
        try:
            result["msg"] = be.recv(timeout=T)
        except Exception as e:  # pragma: no cover - reported below
            result["err"] = e

    t = threading.Thread(target=reader)
    t.start()
    for i in range(3, len(data), 5):
        time.sleep(0.01)
        fe.sock.sendall(data[i:i + 5])
    t.join(T * 2)
    assert not t.is_alive()
    assert "err" not in result, result.get("err")
    msg = result["msg"]
    try:
        assert vu.decode(msg) == VringFile(1) and len(msg.fds) == 1 and same_file(msg.fds[0], efd)
    finally:
        msg.close_fds()


# ------------------------------------------------------------------------------------------------
# malformed messages
# ------------------------------------------------------------------------------------------------


def test_short_payload(pair):
    got = roundtrip(pair, Message(R.SET_VRING_NUM, payload=b"\0" * 4))
    with pytest.raises(ProtocolError, match=r"^SET_VRING_NUM: payload is 4 bytes, expected 8$"):
        vu.validate(got)


@pytest.mark.parametrize("request_, payload", [
    (R.SET_VRING_ADDR, b"\0" * 32),
    (R.SET_INFLIGHT_FD, b"\0" * 20),
    (R.GET_FEATURES, b"\0" * 8),
    (R.SET_LOG_BASE, b"\0" * 8),
])
def test_wrong_sizes(pair, request_, payload):
    got = roundtrip(pair, Message(request_, payload=payload))
    with pytest.raises(ProtocolError, match=f"{request_.name}: payload is {len(payload)} bytes"):
        vu.decode(got)


def test_mem_table_size_and_count_rules(pair, fds):
    one = MemRegion(0x1000, 0x1000, 0x1000)
    # nregions says 2, only one region follows
    bad = struct.pack("<II", 2, 0) + one.pack()
    got = roundtrip(pair, Message(R.SET_MEM_TABLE, payload=bad, fds=[fds.memfd(), fds.memfd()]))
    rfds = list(got.fds)
    with pytest.raises(ProtocolError, match=r"SET_MEM_TABLE: payload is 40 bytes, expected 72"):
        vu.validate(got)
    assert got.fds == [] and not any(is_open(fd) for fd in rfds)
    for n in (0, 9):
        got = roundtrip(pair, Message(R.SET_MEM_TABLE, payload=struct.pack("<II", n, 0) + one.pack() * max(n, 1)))
        with pytest.raises(ProtocolError, match=f"nregions is {n}, expected 1 to 8"):
            vu.validate(got)
    # one fd short
    two = vu.pack_mem_table([one, MemRegion(0x10000, 0x1000, 0x10000)])
    got = roundtrip(pair, Message(R.SET_MEM_TABLE, payload=two, fds=[fds.memfd()]))
    rfds = list(got.fds)
    with pytest.raises(ProtocolError, match="SET_MEM_TABLE: carries 1 fds, expected 2"):
        vu.validate(got)
    assert not any(is_open(fd) for fd in rfds)


@pytest.mark.parametrize("regions, match", [
    ([MemRegion(0x1000, 0, 0x1000)], "memory_size 0"),
    ([MemRegion(2**64 - 0x1000, 0x2000, 0x1000)], "wraps"),
    ([MemRegion(0x1000, 0x2000, 0x1000), MemRegion(0x2000, 0x1000, 0x9000)], "overlap in gpa"),
    ([MemRegion(0x1000, 0x1000, 0x5000), MemRegion(0x9000, 0x1000, 0x5800)], "overlap in uaddr"),
])
def test_mem_table_region_bounds(pair, fds, regions, match):
    got = roundtrip(pair, Message(R.SET_MEM_TABLE, payload=vu.pack_mem_table(regions),
                                  fds=[fds.memfd() for _ in regions]))
    rfds = list(got.fds)
    with pytest.raises(ProtocolError, match=match):
        vu.decode(got)
    assert not any(is_open(fd) for fd in rfds)


def test_fd_on_request_that_takes_none_is_closed(pair, fds):
    got = roundtrip(pair, Message(R.SET_VRING_NUM, payload=VringState(0, 256).pack(), fds=[fds.eventfd()]))
    (rfd,) = got.fds
    assert is_open(rfd)
    with pytest.raises(ProtocolError, match=r"^SET_VRING_NUM: carries 1 fds, expected 0$"):
        vu.validate(got)
    with pytest.raises(OSError):
        os.fstat(rfd)
    assert got.fds == []


def test_vring_file_fd_count_follows_nofd_bit(pair, fds):
    # no fd and no NOFD bit
    got = roundtrip(pair, Message(R.SET_VRING_CALL, payload=VringFile(0).pack()))
    with pytest.raises(ProtocolError, match="SET_VRING_CALL: carries 0 fds, expected 1"):
        vu.validate(got)
    # NOFD bit and an fd anyway
    got = roundtrip(pair, Message(R.SET_VRING_KICK, payload=VringFile(0, nofd=True).pack(), fds=[fds.eventfd()]))
    (rfd,) = got.fds
    with pytest.raises(ProtocolError, match="SET_VRING_KICK: carries 1 fds, expected 0"):
        vu.validate(got)
    with pytest.raises(OSError):
        os.fstat(rfd)
    # two fds
    got = roundtrip(pair, Message(R.SET_VRING_ERR, payload=VringFile(0).pack(), fds=[fds.eventfd(), fds.eventfd()]))
    rfds = list(got.fds)
    with pytest.raises(ProtocolError, match="carries 2 fds, expected 1"):
        vu.validate(got)
    assert not any(is_open(fd) for fd in rfds)


def test_pipe_fd_on_inflight(pair, fds):
    r, _w = fds.pipe()
    got = roundtrip(pair, Message(R.GET_INFLIGHT_FD, payload=Inflight(0, 0, 2, 256).pack(), fds=[r]))
    (rfd,) = got.fds
    with pytest.raises(ProtocolError, match="GET_INFLIGHT_FD: carries 1 fds, expected 0"):
        vu.decode(got)
    assert not is_open(rfd)


def test_vring_index_out_of_range(pair):
    got = roundtrip(pair, Message(R.SET_VRING_NUM, payload=VringState(256, 256).pack()))
    with pytest.raises(ProtocolError, match="vring index 256 out of range"):
        vu.validate(got)


def test_oversize_header_breaks_the_connection(pair, fds):
    fe, be = pair
    fe.sock.sendmsg([raw_header(R.SET_MEM_TABLE, 1, 5000)],
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fds.memfd()))])
    before = open_fds()
    with pytest.raises(ProtocolError, match="5000-byte payload"):
        be.recv(timeout=T)
    assert open_fds() == before
    assert be.broken
    with pytest.raises(ProtocolError, match="unusable"):
        be.recv(timeout=T)


@pytest.mark.parametrize("flags", [0x0, 0x2, 0x3, 0x9 & ~1])
def test_bad_version_bits(pair, fds, flags):
    fe, be = pair
    fe.send(Message(R.SET_VRING_KICK, flags, VringFile(0).pack(), [fds.eventfd()]), timeout=T)
    fe.send(Message(R.GET_STATUS), timeout=T)
    before = open_fds()
    with pytest.raises(ProtocolError, match="version bits"):
        be.recv(timeout=T)
    assert open_fds() == before
    assert be.broken is None                  # payload consumed, still in step
    assert be.recv(timeout=T).request is R.GET_STATUS


@pytest.mark.parametrize("code", [0, 23, 34, 35, 99, 0xFFFFFFFF])
def test_unknown_request_code(pair, code):
    got = roundtrip(pair, Message(code, vu.VERSION | vu.NEED_REPLY, vu.pack_u64(1)))
    assert got.request == code and not isinstance(got.request, R)  # recv hands it over, so a backend can NACK
    with pytest.raises(ProtocolError, match=f"unknown request {code}"):
        vu.validate(got)


def test_reply_where_request_expected_and_vice_versa(pair):
    got = roundtrip(pair, Message(R.GET_FEATURES, vu.REPLY_FLAGS, vu.pack_u64(1)))
    with pytest.raises(ProtocolError, match="expected a request"):
        vu.validate(got)
    got = roundtrip(pair, Message(R.GET_FEATURES, vu.VERSION, vu.pack_u64(1)))
    with pytest.raises(ProtocolError, match="expected a reply"):
        vu.validate(got, reply=True)


def test_clean_eof_is_peer_gone(pair):
    fe, be = pair
    fe.close()
    with pytest.raises(PeerGone):
        be.recv(timeout=T)


def test_peer_closes_mid_header(pair, fds):
    fe, be = pair
    fe.sock.sendmsg([raw_header(R.SET_VRING_KICK, 1, 8)[:5]],
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fds.eventfd()))])
    fe.close()
    before = open_fds()
    with pytest.raises(PeerGone, match="inside a message header"):
        be.recv(timeout=T)
    assert open_fds() == before


def test_peer_closes_mid_payload(pair, fds):
    fe, be = pair
    efds = [fds.eventfd() for _ in range(2)]
    fe.sock.sendmsg([raw_header(R.SET_MEM_TABLE, 9, 72) + b"\0" * 30],
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("2i", *efds))])
    fe.close()
    before = open_fds()
    with pytest.raises(PeerGone, match="30 of 72 payload bytes"):
        be.recv(timeout=T)
    assert open_fds() == before


def test_send_to_closed_peer_is_peer_gone(pair):
    fe, be = pair
    be.close()
    with pytest.raises(PeerGone):
        for _ in range(3):
            fe.send(Message(R.GET_FEATURES), timeout=T)


def test_timeout_with_nothing_sent_keeps_connection(pair):
    fe, be = pair
    t0 = time.monotonic()
    with pytest.raises(ProtocolTimeout, match="no message"):
        be.recv(timeout=0.2)
    assert 0.15 < time.monotonic() - t0 < 1.5
    assert be.broken is None
    fe.send(Message(R.GET_FEATURES), timeout=T)
    assert be.recv(timeout=T).request is R.GET_FEATURES
    with pytest.raises(ProtocolTimeout):
        be.recv(timeout=0)


def test_timeout_mid_message_breaks_connection(pair, fds):
    fe, be = pair
    fe.sock.sendmsg([raw_header(R.SET_VRING_KICK, 1, 8) + b"\0\0"],
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fds.eventfd()))])
    before = open_fds()
    t0 = time.monotonic()
    with pytest.raises(ProtocolTimeout, match="SET_VRING_KICK: timed out after 14 bytes"):
        be.recv(timeout=0.2)
    assert time.monotonic() - t0 < 1.5
    assert open_fds() == before
    assert be.broken
    with pytest.raises(ProtocolError, match="unusable"):
        be.recv(timeout=T)


def test_connection_needs_unix_stream():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        with pytest.raises(ConfigError):
            Connection(s)
    finally:
        s.close()


# ------------------------------------------------------------------------------------------------
# replies
# ------------------------------------------------------------------------------------------------


def test_reply_and_ack_flags_exactly_0x5(pair):
    fe, be = pair
    req = Message(R.SET_MEM_TABLE, vu.VERSION | vu.NEED_REPLY, b"")
    for rep in (vu.reply(req, vu.pack_u64(5)), vu.ack(req), vu.ack(req, ok=False)):
        assert rep.flags == 0x5 and rep.request is R.SET_MEM_TABLE
    assert vu.ack(req).payload == vu.pack_u64(0)
    assert vu.unpack_u64(vu.ack(req, ok=False).payload) != 0
    be.send(vu.ack(req), timeout=T)
    data = fe.sock.recv(64)
    assert data == struct.pack("<IIIQ", 5, 0x5, 8, 0)
    assert vu.wants_ack(req)
    assert not vu.wants_ack(Message(R.GET_FEATURES, vu.VERSION | vu.NEED_REPLY))   # the reply is the ack
    assert not vu.wants_ack(Message(R.SET_FEATURES, vu.VERSION, vu.pack_u64(0)))


def _queue_reply(be, request, payload, flags=vu.REPLY_FLAGS, fds=()):
    """Pre-load the backend->frontend direction so client_call finds its reply without a thread."""
    be.send(Message(request, flags, payload, list(fds)), timeout=T)


def test_client_call_get_features(pair):
    fe, be = pair
    _queue_reply(be, R.GET_FEATURES, vu.pack_u64(0xd7c66e7cb))
    rep = vu.client_call(fe, R.GET_FEATURES, timeout=T)
    assert vu.decode(rep, reply=True) == 0xd7c66e7cb
    sent = be.recv(timeout=T)
    assert sent.request is R.GET_FEATURES and sent.flags == 0x1 and sent.payload == b""


def test_client_call_no_reply_expected(pair):
    fe, be = pair
    assert vu.client_call(fe, R.SET_FEATURES, vu.pack_u64(1 << 32), timeout=T) is None
    assert be.recv(timeout=T).flags == 0x1


def test_client_call_need_reply_ack_and_nack(pair):
    fe, be = pair
    _queue_reply(be, R.SET_STATUS, vu.pack_u64(0))
    rep = vu.client_call(fe, R.SET_STATUS, vu.pack_u64(0xb), need_reply=True, timeout=T)
    assert vu.decode(rep, reply=True) == 0
    assert be.recv(timeout=T).flags == 0x9
    _queue_reply(be, R.SET_STATUS, vu.pack_u64(1))
    with pytest.raises(ProtocolNack, match="NACK") as ei:
        vu.client_call(fe, R.SET_STATUS, vu.pack_u64(0xf), need_reply=True, timeout=T)
    assert ei.value.request == R.SET_STATUS and ei.value.value == 1
    assert fe.broken is None          # a NACK leaves the connection usable


@pytest.mark.parametrize("flags", [0x1, 0x4, 0xd, 0x7, 0x15])
def test_client_call_rejects_reply_flags_other_than_0x5(pair, flags):
    fe, be = pair
    _queue_reply(be, R.GET_FEATURES, vu.pack_u64(1), flags=flags)
    with pytest.raises(ProtocolError):
        vu.client_call(fe, R.GET_FEATURES, timeout=T)
    assert fe.broken


def test_client_call_rejects_wrong_request_size_index_and_fds(pair, fds):
    fe, be = pair
    _queue_reply(be, R.GET_PROTOCOL_FEATURES, vu.pack_u64(1))
    with pytest.raises(ProtocolError, match="got a reply to GET_PROTOCOL_FEATURES"):
        vu.client_call(fe, R.GET_FEATURES, timeout=T)

    fe.broken = None
    _queue_reply(be, R.GET_STATUS, b"\x0b\0\0\0")
    with pytest.raises(ProtocolError, match="GET_STATUS reply: payload is 4 bytes, expected 8"):
        vu.client_call(fe, R.GET_STATUS, timeout=T)

    fe.broken = None
    _queue_reply(be, R.GET_VRING_BASE, VringState(0, 5).pack())
    with pytest.raises(ProtocolError, match="reply is for vring 0, asked for vring 1"):
        vu.client_call(fe, R.GET_VRING_BASE, VringState(1, 0).pack(), timeout=T)

    fe.broken = None
    efd = fds.eventfd()
    _queue_reply(be, R.GET_FEATURES, vu.pack_u64(1), fds=[efd])
    before = open_fds()
    with pytest.raises(ProtocolError, match="carries 1 fds, expected 0"):
        vu.client_call(fe, R.GET_FEATURES, timeout=T)
    assert open_fds() == before


def test_client_call_inflight_reply_with_fd(pair, fds):
    fe, be = pair
    mfd = fds.memfd(8320)
    _queue_reply(be, R.GET_INFLIGHT_FD, Inflight(8320, 0, 2, 256).pack(), fds=[mfd])
    rep = vu.client_call(fe, R.GET_INFLIGHT_FD, Inflight(0, 0, 2, 256).pack(), timeout=T)
    try:
        assert vu.decode(rep, reply=True) == Inflight(8320, 0, 2, 256)
        assert len(rep.fds) == 1 and same_file(rep.fds[0], mfd)
    finally:
        rep.close_fds()


def test_client_call_timeout_does_not_hang(pair):
    fe, be = pair
    t0 = time.monotonic()
    with pytest.raises(ProtocolTimeout, match="GET_FEATURES: no reply within"):
        vu.client_call(fe, R.GET_FEATURES, timeout=0.2)
    assert time.monotonic() - t0 < 1.5
    assert fe.broken     # a late reply would put every later call out of step


def test_client_call_peer_gone(pair):
    fe, be = pair
    be.close()
    with pytest.raises(PeerGone):
        vu.client_call(fe, R.GET_FEATURES, timeout=T)


# ------------------------------------------------------------------------------------------------
# sockets, and both sides talking through them
# ------------------------------------------------------------------------------------------------


def test_listen_unix_mode_0600(sock_path):
    lst = vu.listen_unix(sock_path)
    try:
        st = os.lstat(sock_path)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600
    finally:
        lst.close()


def test_listen_unix_replaces_stale_socket_only(sock_path):
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(os.fspath(sock_path))
    stale.close()
    assert stat.S_ISSOCK(os.lstat(sock_path).st_mode)
    lst = vu.listen_unix(sock_path)
    lst.close()
    os.unlink(sock_path)
    sock_path.write_text("not a socket")
    with pytest.raises(ConfigError, match="not a socket"):
        vu.listen_unix(sock_path)
    assert sock_path.read_text() == "not a socket"


def test_connect_and_accept(sock_path):
    with pytest.raises(PeerGone):
        vu.connect_unix(sock_path, timeout=T)
    lst = vu.listen_unix(sock_path)
    try:
        with pytest.raises(ProtocolTimeout):
            vu.accept_unix(lst, timeout=0.05)
        with vu.connect_unix(sock_path, timeout=T) as fe, vu.accept_unix(lst, timeout=T) as be:
            fe.send(Message(R.SET_OWNER), timeout=T)
            assert be.recv(timeout=T).request is R.SET_OWNER
    finally:
        lst.close()


def _mini_backend(conn, log):
    """A backend loop in the shape the module docstring gives, enough for the frontend test below."""
    status = 0
    try:
        while True:
            msg = conn.recv(timeout=T * 2)
            try:
                value = vu.decode(msg)
            except ProtocolError as e:
                log.append(("error", str(e)))
                if msg.need_reply:
                    conn.send(vu.ack(msg, ok=False), timeout=T)
                    continue
                return
            log.append((msg.name, value, len(msg.fds)))
            msg.close_fds()
            if msg.request is R.GET_FEATURES:
                conn.send(vu.reply(msg, vu.pack_u64((1 << 32) | (1 << 30))), timeout=T)
            elif msg.request is R.GET_PROTOCOL_FEATURES:
                conn.send(vu.reply(msg, vu.pack_u64(0x10009)), timeout=T)
            elif msg.request is R.SET_STATUS:
                status = value
            elif msg.request is R.GET_STATUS:
                conn.send(vu.reply(msg, vu.pack_u64(status)), timeout=T)
            elif msg.request is R.GET_VRING_BASE:
                conn.send(vu.reply(msg, VringState(value.index, 0x8001).pack()), timeout=T)
            if vu.wants_ack(msg):
                conn.send(vu.ack(msg, ok=True), timeout=T)
    except PeerGone:
        log.append(("gone",))
    finally:
        conn.close()


def test_frontend_and_backend_over_a_real_socket(sock_path, fds):
    lst = vu.listen_unix(sock_path)
    log = []
    try:
        fe = vu.connect_unix(sock_path, timeout=T)
        be = vu.accept_unix(lst, timeout=T)
        th = threading.Thread(target=_mini_backend, args=(be, log), daemon=True)
        th.start()
        try:
            call = lambda *a, **k: vu.client_call(fe, *a, timeout=T, **k)  # noqa: E731
            assert call(R.SET_OWNER) is None
            assert vu.decode(call(R.GET_FEATURES), reply=True) == (1 << 32) | (1 << 30)
            assert vu.decode(call(R.GET_PROTOCOL_FEATURES), reply=True) == 0x10009
            call(R.SET_PROTOCOL_FEATURES, vu.pack_u64(0x10009))
            call(R.SET_VRING_CALL, VringFile(0, nofd=True).pack())
            call(R.SET_FEATURES, vu.pack_u64((1 << 32) | (1 << 30)))
            call(R.SET_STATUS, vu.pack_u64(0xb), need_reply=True)
            assert vu.decode(call(R.GET_STATUS), reply=True) == 0xb
            mfd = fds.memfd(1 << 16)
            call(R.SET_MEM_TABLE, vu.pack_mem_table([MemRegion(0x10000, 1 << 16, 0x10000)]), fds=[mfd],
                 need_reply=True)
            call(R.SET_VRING_KICK, VringFile(0).pack(), fds=[fds.eventfd()])
            # unknown request with NEED_REPLY: NACK, connection kept
            with pytest.raises(ProtocolNack):
                call(99, need_reply=True)
            # bad fd count with NEED_REPLY: NACK too
            with pytest.raises(ProtocolNack):
                call(R.SET_VRING_NUM, VringState(0, 256).pack(), fds=[fds.eventfd()], need_reply=True)
            rep = call(R.GET_VRING_BASE, VringState(0, 0x55e4).pack())
            assert vu.decode(rep, reply=True) == VringState(0, 0x8001)
        finally:
            fe.close()
        th.join(T * 3)
        assert not th.is_alive()
    finally:
        lst.close()
    names = [e[0] for e in log]
    assert names[:3] == ["SET_OWNER", "GET_FEATURES", "GET_PROTOCOL_FEATURES"]
    assert ("SET_MEM_TABLE", [MemRegion(0x10000, 1 << 16, 0x10000)], 1) in log
    assert ("SET_VRING_CALL", VringFile(0, True), 0) in log
    assert [e for e in log if e[0] == "error"] == [
        ("error", "unknown request 99 (flags 0x9, size 0)"),
        ("error", "SET_VRING_NUM: carries 1 fds, expected 0"),
    ]
    assert names[-1] == "gone"

"""The vhost-user frontend (client): what DPDK's virtio_user does on the control plane, for one queue pair.

Sequence (shared/spec/vhost-user.md 2.1 and 3.1): SET_OWNER, GET_FEATURES, GET/SET_PROTOCOL_FEATURES
(REPLY_ACK, STATUS when offered), SET_VRING_CALL per vring, SET_FEATURES, SET_STATUS(FEATURES_OK) + GET_STATUS,
SET_MEM_TABLE with the region fd, per vring NUM/BASE/ADDR/KICK, SET_VRING_ENABLE, SET_STATUS(DRIVER_OK).
Stop: SET_VRING_ENABLE 0 and GET_VRING_BASE per vring. Every reply is checked and waited for with a
timeout; with REPLY_ACK every request asks for an ack, so a refusal is seen where it happens.

Across backend restarts (virtio/session.py) the frontend keeps what the rings need: the kick/call eventfds and,
with INFLIGHT_SHMFD, the inflight area's fd (GET_INFLIGHT_FD once, SET_INFLIGHT_FD to every backend after the
memory table and before the vrings); ``disconnect()`` drops only the socket, and ``start()`` takes the vring
bases from the driver's own ring state. The area is kept sealed against shrinking (a sealed copy of one its
backend made unsealable: a successor refuses such an area), and dropped when a backend without INFLIGHT_SHMFD
runs the rings (it no longer says what is in flight; the next tracking backend makes a fresh one).
"""
import collections
import os
import stat

from rings import vhost_user as vu
from rings.errors import (BackendBusy, ConfigError, FeatureRefused, PeerGone, ProtocolError, ProtocolNack,
                          ProtocolTimeout, ShmError)
from rings.layout import (VHOST_USER_F_PROTOCOL_FEATURES, VIRTIO_F_EVENT_IDX, VIRTIO_F_IN_ORDER,
                          VIRTIO_F_INDIRECT_DESC, VIRTIO_F_RING_PACKED, VIRTIO_F_VERSION_1,
                          VIRTIO_NET_F_MRG_RXBUF, bit, feature_names)
from rings.shm import ShmRegion, seal_shrink

R = vu.VhostUserRequest
PF = vu.VhostUserProtocolFeature
MAX_INFLIGHT = 64 << 20   # bytes: two packed queues of 32768 take about 2 MiB (the area is copied when unsealable)

# the features the command line turns on and off, by name
SELECTABLE = {
    "VERSION_1": VIRTIO_F_VERSION_1,
    "RING_PACKED": VIRTIO_F_RING_PACKED,
    "IN_ORDER": VIRTIO_F_IN_ORDER,
    "MRG_RXBUF": VIRTIO_NET_F_MRG_RXBUF,
    "EVENT_IDX": VIRTIO_F_EVENT_IDX,
    "INDIRECT_DESC": VIRTIO_F_INDIRECT_DESC,
}

# device status bits
ACKNOWLEDGE, DRIVER, DRIVER_OK, FEATURES_OK = 1, 2, 4, 8


def want_features(**on):
    """The feature mask for selectable features given as ``VERSION_1=True, RING_PACKED=False, ...``."""
    mask = 0
    for name, flag in on.items():
        if name not in SELECTABLE:
            raise ConfigError(f"unknown feature {name}; one of {sorted(SELECTABLE)}")
        if flag:
            mask |= bit(SELECTABLE[name])
    return mask


class VhostUserFrontend:
    """One connection to a vhost-user backend. ``timeout``: seconds for each reply; SET_MEM_TABLE gets
    ``mem_timeout`` (DPDK maps the region while we wait; 0.5-1.4 s seen on a 2-CPU box), or ``timeout`` if
    that is longer."""

    def __init__(self, path, timeout=5.0, mem_timeout=15.0, inflight=True):
        """``inflight``: negotiate INFLIGHT_SHMFD when the backend offers it."""
        self.path = os.fspath(path)
        self.want_inflight = inflight
        self.inflight = None      # (vu.Inflight, fd) from GET_INFLIGHT_FD, kept across backends
        self.timeout = timeout
        self.mem_timeout = max(mem_timeout, timeout, 5.0)   # never shorter than what every other reply gets
        self.conn = None
        self.offered = 0
        self.features = 0
        self.protocol_offered = 0
        self.protocol = 0
        self.status = 0
        self.nvrings = 2
        self.kickfds = [None, None]
        self.callfds = [None, None]
        self.started = False
        self.vring_bases = {}
        self.log = collections.deque(maxlen=256)   # (request name, detail) of the last requests sent, for debugging

    # ------------------------------------------------------------------ plumbing

    @property
    def reply_ack(self):
        return bool(self.protocol >> PF.REPLY_ACK & 1)

    @property
    def has_status(self):
        return bool(self.protocol >> PF.STATUS & 1)

    @property
    def has_inflight(self):
        return bool(self.protocol >> PF.INFLIGHT_SHMFD & 1)

    def call(self, request, payload=b"", fds=(), timeout=None, ack=None, keep_fds=False):
        """One request; with REPLY_ACK negotiated every request without a reply of its own asks for an ack.
        ``keep_fds``: return (value, fds of the reply), the fds the caller's."""
        if self.conn is None:
            raise ProtocolError("not connected")
        if ack is None:
            ack = self.reply_ack and not vu.has_reply(request)
        name = vu.request_name(request)
        self.log.append((name, bytes(payload).hex()))
        try:
            rep = vu.client_call(self.conn, request, payload, fds, need_reply=ack,
                                 timeout=self.timeout if timeout is None else timeout)
        except BackendBusy as e:
            raise BackendBusy(f"backend at {self.path} is busy: {e}") from e
        except PeerGone as e:
            raise PeerGone(f"backend at {self.path} closed the connection during {name}: {e}") from e
        except ProtocolTimeout as e:
            raise ProtocolTimeout(f"backend at {self.path} did not answer {name}: {e}") from e
        except ProtocolNack as e:
            raise ProtocolNack(f"backend at {self.path} refused {name} (NACK {e.value:#x})",
                               e.request, e.value) from e
        if rep is None:
            return None
        try:
            value = vu.decode(rep, reply=True)
            return (value, rep.take_fds()) if keep_fds else value
        finally:
            rep.close_fds()

    # ------------------------------------------------------------------ steps

    def connect(self):
        self.conn = vu.connect_unix(self.path, timeout=self.timeout)
        return self

    def attach(self, conn):
        """Use a connection accepted by a listening driver (``--server``: the backend connected to us)."""
        self.conn = conn
        return self

    def negotiate(self, want, required=None):
        """SET_OWNER, GET_FEATURES, protocol features, SET_VRING_CALL, SET_FEATURES (+ status).

        ``want``: the virtio feature mask asked for. ``required`` (default: ``want``): bits that must be
        offered, else FeatureRefused names them. Returns the negotiated mask."""
        required = want if required is None else required
        self.call(R.SET_OWNER)
        self.offered = self.call(R.GET_FEATURES)
        missing = required & ~self.offered
        if missing:
            raise FeatureRefused(f"backend at {self.path} does not offer {', '.join(feature_names(missing))} "
                                 f"(offered {self.offered:#x}: {', '.join(feature_names(self.offered))})")
        features = want & self.offered   # FEAT-02: never accept what was not offered
        if self.offered >> VHOST_USER_F_PROTOCOL_FEATURES & 1:
            features |= bit(VHOST_USER_F_PROTOCOL_FEATURES)
            self.protocol_offered = self.call(R.GET_PROTOCOL_FEATURES)
            mine = bit(PF.REPLY_ACK) | bit(PF.STATUS) | (bit(PF.INFLIGHT_SHMFD) if self.want_inflight else 0)
            self.protocol = self.protocol_offered & mine
            self.call(R.SET_PROTOCOL_FEATURES, vu.pack_u64(self.protocol), ack=False)
        # SET_VRING_CALL first, for every vring (as virtio_user: vhost allocates the queue pairs from it)
        for i in range(self.nvrings):
            if self.callfds[i] is None:
                self.callfds[i] = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            self.call(R.SET_VRING_CALL, vu.VringFile(i).pack(), fds=[self.callfds[i]])
        self.call(R.SET_FEATURES, vu.pack_u64(features))
        self.features = features
        if self.has_status:
            self._set_status(ACKNOWLEDGE | DRIVER | FEATURES_OK)
            got = self.call(R.GET_STATUS)
            if not got & FEATURES_OK:   # the device did not accept our feature set
                raise FeatureRefused(f"backend at {self.path} did not accept features {features:#x} "
                                     f"(status {got:#x} lacks FEATURES_OK)")
        return features

    def _set_status(self, status):
        self.call(R.SET_STATUS, vu.pack_u64(status), ack=self.reply_ack)
        self.status = status

    def set_mem_table(self, mem):
        """One region: gpa == uaddr == the fixed base, mmap_offset 0, its fd."""
        region = vu.MemRegion(gpa=mem.gpa, size=mem.size, uaddr=mem.gpa, mmap_offset=0)
        self.call(R.SET_MEM_TABLE, vu.pack_mem_table([region]), fds=[mem.fileno()], timeout=self.mem_timeout)

    def get_inflight(self, queue_size):
        """GET_INFLIGHT_FD once (after SET_FEATURES: the layout depends on the ring format); the area is kept
        (until ``drop_inflight``)."""
        if self.inflight is not None or not self.has_inflight:
            return
        inf, fds = self.call(R.GET_INFLIGHT_FD, vu.Inflight(0, 0, self.nvrings, queue_size).pack(), keep_fds=True)
        try:
            if inf.num_queues != self.nvrings or inf.queue_size != queue_size or inf.mmap_size == 0 or len(fds) != 1:
                raise ProtocolError(f"backend at {self.path} answered GET_INFLIGHT_FD with {inf}")
            if not seal_shrink(fds[0], "inflight area"):
                inf, fds[0] = self._sealed_copy(inf, fds[0])
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        self.inflight = (inf, fds[0])

    def _sealed_copy(self, inf, fd):
        """An area its backend did not let us seal (DPDK: a memfd without MFD_ALLOW_SEALING) is copied, still
        untouched, into a size-sealed memfd of ours: that is what every backend gets from then on (a successor
        rightly refuses an area that can shrink under its mapping). Returns (vu.Inflight, fd); closes ``fd``."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or inf.mmap_size > MAX_INFLIGHT or \
                inf.mmap_offset + inf.mmap_size > st.st_size:
            raise ProtocolError(f"backend at {self.path}: its inflight area ({inf.mmap_size:#x} bytes at offset "
                                f"{inf.mmap_offset:#x}) is not in its file ({st.st_size:#x} bytes"
                                f"{'' if stat.S_ISREG(st.st_mode) else ', not a regular file'}; at most "
                                f"{MAX_INFLIGHT:#x} bytes)")
        try:
            data = os.pread(fd, inf.mmap_size, inf.mmap_offset)
        except OSError as e:   # e.g. an fd opened write-only
            raise ProtocolError(f"backend at {self.path}: its inflight area cannot be read: {e}") from None
        if len(data) != inf.mmap_size:   # shrunk since the fstat
            raise ProtocolError(f"backend at {self.path}: its inflight area holds {len(data):#x} bytes at offset "
                                f"{inf.mmap_offset:#x}, not the {inf.mmap_size:#x} it announced")
        try:
            shm = ShmRegion.create_sealed(inf.mmap_size, name="vring-inflight")
        except ShmError as e:
            raise ProtocolError(f"cannot copy the inflight area: {e}") from None
        try:
            shm.buf[:len(data)] = data
            copy = os.dup(shm.fileno())
        finally:
            shm.close()
        os.close(fd)
        return vu.Inflight(inf.mmap_size, 0, inf.num_queues, inf.queue_size), copy

    def drop_inflight(self):
        """Forget the area: the next backend that tracks gets a fresh one (GET_INFLIGHT_FD)."""
        if self.inflight is not None:
            os.close(self.inflight[1])
            self.inflight = None

    def set_inflight(self):
        """SET_INFLIGHT_FD with the kept area, to every backend that negotiated INFLIGHT_SHMFD."""
        if self.inflight is not None and self.has_inflight:
            inf, fd = self.inflight
            self.call(R.SET_INFLIGHT_FD, inf.pack(), fds=[fd])

    def setup_vring(self, index, layout, base=None):
        """NUM, BASE (``base``: split avail index, packed slot | wrap << 15; default a fresh ring), ADDR, KICK."""
        packed = layout.packed
        if base is None:
            base = 0x8000 if packed else 0
        self.call(R.SET_VRING_NUM, vu.VringState(index, layout.size).pack())
        self.call(R.SET_VRING_BASE, vu.VringState(index, base).pack())
        # wire order: desc, used (device area), avail (driver area)
        self.call(R.SET_VRING_ADDR, vu.VringAddr(index, 0, desc=layout.desc, used=layout.device,
                                                 avail=layout.driver).pack())
        if self.kickfds[index] is None:
            self.kickfds[index] = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self.call(R.SET_VRING_KICK, vu.VringFile(index).pack(), fds=[self.kickfds[index]])

    def start(self, mem, layouts, bases=None):
        """SET_MEM_TABLE, SET_INFLIGHT_FD (if negotiated), the vrings (Rx then Tx) at ``bases`` (default: fresh
        rings), enable them, DRIVER_OK."""
        self.set_mem_table(mem)
        if not self.has_inflight:   # this backend will not keep the area: it no longer says what is in flight
            self.drop_inflight()
        self.set_inflight()
        for i in range(self.nvrings):
            self.setup_vring(i, layouts[i], None if bases is None else bases[i])
        if self.features >> VHOST_USER_F_PROTOCOL_FEATURES & 1:
            for i in range(self.nvrings):
                self.call(R.SET_VRING_ENABLE, vu.VringState(i, 1).pack())
        if self.has_status:
            self._set_status(ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK)
        self.started = True

    def stop(self, timeout=None):
        """SET_VRING_ENABLE 0 and GET_VRING_BASE for every vring; returns {index: base}. ``timeout``: for each
        answer, instead of the connection's."""
        if not self.started:
            return {}
        self.started = False
        if self.features >> VHOST_USER_F_PROTOCOL_FEATURES & 1:
            for i in range(self.nvrings):
                self.call(R.SET_VRING_ENABLE, vu.VringState(i, 0).pack(), timeout=timeout)
        for i in range(self.nvrings):
            st = self.call(R.GET_VRING_BASE, vu.VringState(i, 0).pack(), timeout=timeout)
            self.vring_bases[i] = st.num
        return dict(self.vring_bases)

    def disconnect(self):
        """Drop the connection only (the backend went away): eventfds and the inflight area stay."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        self.started = False

    def close(self):
        self.disconnect()
        self.drop_inflight()
        for fds in (self.kickfds, self.callfds):
            for i, fd in enumerate(fds):
                if fd is not None:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                    fds[i] = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

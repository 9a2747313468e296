"""The virtio-net device model behind the vhost-user server: what each request means.

One ``NetDevice`` per connection. ``handle(msg)`` applies one decoded request and returns the reply payload
(or None); it raises ``Refused`` when the request is valid on the wire but cannot be honoured (a feature not
offered, a region outside its file, a ring outside the memory table, a vring index we do not have, ...). The
server turns that into a NACK (NEED_REPLY) or closes the connection (no NEED_REPLY), as DPDK does.

One queue pair: vring 0 is the driver's Rx queue (the device writes), vring 1 its Tx queue (the device reads).
No MQ, no control queue. The data path starts when both vrings are ready the way DPDK 22.11 decides it
(``vq_is_ready`` + ``virtio_is_ready``: mem table, num, addr, kick, call, enabled, and DRIVER_OK if STATUS was
negotiated) and stops as soon as that no longer holds; the ring positions are kept as the vring base
(split: used idx; packed: used slot | used wrap << 15, which equals the avail position minus what was polled
and not yet used), so a restart resumes exactly there.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from rings import vhost_user as vu
from rings.errors import ConfigError, GuestMemoryFault, RingError, ShmError, VringError
from rings.layout import (VHOST_USER_F_PROTOCOL_FEATURES, VIRTIO_F_EVENT_IDX, VIRTIO_F_IN_ORDER,
                          VIRTIO_F_INDIRECT_DESC, VIRTIO_F_RING_PACKED, VIRTIO_F_VERSION_1,
                          VIRTIO_NET_F_MRG_RXBUF, QueueLayout, area_sizes, bit, feature_names, has)
from rings.shm import MemoryTable, ShmRegion, seal_shrink
from rings.virtq import CMemory, DeviceQueue

from .datapath import Datapath, GuardedMemoryTable, Options, add_stats, enable_kicks_guarded
from .inflight import InflightArea, InflightError, QueueTracking, create_area

log = logging.getLogger("vhost")

R = vu.VhostUserRequest
PF = vu.VhostUserProtocolFeature

#: Virtio features this device offers. No MQ/CTRL_VQ (one pair, no control queue), no LOG_ALL, no MTU/MAC
#: (no config space), no offloads (headers are written with flags 0 and read without parsing).
OFFERED_FEATURES = (bit(VIRTIO_NET_F_MRG_RXBUF) | bit(VIRTIO_F_INDIRECT_DESC) | bit(VIRTIO_F_EVENT_IDX)
                    | bit(VHOST_USER_F_PROTOCOL_FEATURES) | bit(VIRTIO_F_VERSION_1)
                    | bit(VIRTIO_F_RING_PACKED) | bit(VIRTIO_F_IN_ORDER))
#: Protocol features: REPLY_ACK, STATUS and INFLIGHT_SHMFD (MQ is not offered: we serve one pair).
OFFERED_PROTOCOL_FEATURES = bit(PF.REPLY_ACK) | bit(PF.STATUS) | bit(PF.INFLIGHT_SHMFD)

NUM_VRINGS = 2
STATUS_DRIVER_OK = 0x4
STATUS_FEATURES_OK = 0x8
UNSET = -2     # a kick/call fd never received (DPDK's VIRTIO_UNINITIALIZED_EVENTFD)
NOFD = -1      # received with the NOFD flag: no notifications


class Refused(VringError):
    """A request that is well-formed but cannot be honoured; the server NACKs it or drops the connection."""


@dataclass
class Reply:
    """A reply payload that carries fds (GET_INFLIGHT_FD); the server sends them, then closes them."""
    payload: bytes
    fds: list


@dataclass
class Vring:
    index: int
    num: int | None = None
    addr: vu.VringAddr | None = None
    base: int = 0                 # SET_VRING_BASE encoding (packed: bit 15 = wrap)
    base_set: bool = False
    kickfd: int = UNSET
    callfd: int = UNSET
    enabled: bool = False
    broken: Exception | None = None

    def close_fds(self):
        for attr in ("kickfd", "callfd"):
            fd = getattr(self, attr)
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
            setattr(self, attr, UNSET)


def _without_frames(e):
    """The error, kept, without the frames it was raised through: they hold the queue that failed to start and
    through it the guest memory mapping, which a later SET_MEM_TABLE or disconnect could then not unmap (its
    fd stayed open until a garbage collection)."""
    seen, x = set(), e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        x.__traceback__ = None
        x = x.__cause__ or x.__context__
    return e


class NetDevice:
    """State of one vhost-user connection: features, memory table, two vrings, and the running data path."""

    #: The frontend's memory as Python sees it: guarded copies (a truncated region is GuestMemoryFault, not SIGBUS,
    #: at a queue start or a --ctl dump). A harness that reads rings through numpy views uses MemoryTable.
    memory_table: type[MemoryTable] = GuardedMemoryTable

    def __init__(self, options: Options | None = None, features=OFFERED_FEATURES,
                 protocol_features=OFFERED_PROTOCOL_FEATURES):
        self.options = options or Options()
        self.offered = features
        self.offered_pf = protocol_features
        self.features = 0
        self.features_set = False
        self.protocol_features = 0
        self.status = 0
        self.owner = False
        self.regions: list[tuple[vu.MemRegion, ShmRegion]] = []
        self.mem: MemoryTable | None = None
        self.cmem: CMemory | None = None
        self.vrings = [Vring(i) for i in range(NUM_VRINGS)]
        self.datapath: Datapath | None = None
        self.totals: dict = {}      # counters of data paths that have stopped (this connection)
        self.ring_errors: list[RingError] = []
        self.inflight: InflightArea | None = None   # SET_INFLIGHT_FD: the frontend-kept tracking area
        self._handlers = {
            R.GET_FEATURES: self._get_features, R.SET_FEATURES: self._set_features,
            R.SET_OWNER: self._set_owner, R.RESET_OWNER: self._reset_owner,
            R.SET_MEM_TABLE: self._set_mem_table,
            R.SET_VRING_NUM: self._set_vring_num, R.SET_VRING_ADDR: self._set_vring_addr,
            R.SET_VRING_BASE: self._set_vring_base, R.GET_VRING_BASE: self._get_vring_base,
            R.SET_VRING_KICK: self._set_vring_kick, R.SET_VRING_CALL: self._set_vring_call,
            R.SET_VRING_ERR: self._set_vring_err,
            R.GET_PROTOCOL_FEATURES: self._get_protocol_features,
            R.SET_PROTOCOL_FEATURES: self._set_protocol_features,
            R.GET_QUEUE_NUM: self._get_queue_num, R.SET_VRING_ENABLE: self._set_vring_enable,
            R.SET_STATUS: self._set_status, R.GET_STATUS: self._get_status,
            R.GET_INFLIGHT_FD: self._get_inflight_fd, R.SET_INFLIGHT_FD: self._set_inflight_fd,
        }

    # -- entry point -----------------------------------------------------------------------------

    def handle(self, msg: vu.Message, value):
        """Apply a decoded request. Returns the reply payload (bytes) for requests that have one, else None.
        Raises Refused. The message's fds are taken or closed here, whatever happens."""
        handler = self._handlers.get(msg.request)
        try:
            if handler is None:
                raise Refused(f"{msg.name} is not supported by this device "
                              f"(its protocol feature was not offered)")
            return handler(msg, value)
        finally:
            msg.close_fds()   # whatever a handler did not take
            self.update()

    # -- features --------------------------------------------------------------------------------

    def _get_features(self, msg, value):
        return vu.pack_u64(self.offered)

    def _set_features(self, msg, value):
        extra = value & ~self.offered
        if extra:
            raise Refused(f"SET_FEATURES {value:#x} acks bits that were not offered: {feature_names(extra)}")
        if value != self.features:   # also the first SET_FEATURES, if the rings already run (under features 0)
            self._stop("features changed")
        self.features = value
        self.features_set = True
        log.info("features %#x: %s", value, " ".join(feature_names(value)))
        for v in self.vrings:   # split -> packed: a base stored before now reads as slot | wrap << 15
            self._check_base(v, "SET_FEATURES")

    def _get_protocol_features(self, msg, value):
        return vu.pack_u64(self.offered_pf)

    def _set_protocol_features(self, msg, value):
        extra = value & ~self.offered_pf
        if extra:
            raise Refused(f"SET_PROTOCOL_FEATURES {value:#x} acks bits that were not offered ({extra:#x})")
        self.protocol_features = value

    def _set_owner(self, msg, value):
        self.owner = True   # DPDK ignores it too; a reconnecting virtio_user server never sends it

    def _reset_owner(self, msg, value):
        self._stop("RESET_OWNER")
        for v in self.vrings:
            v.close_fds()
        self.vrings = [Vring(i) for i in range(NUM_VRINGS)]
        self.features, self.features_set, self.status = 0, False, 0

    def _get_queue_num(self, msg, value):
        return vu.pack_u64(1)

    def _set_status(self, msg, value):
        if value > 0xFF:
            raise Refused(f"SET_STATUS {value:#x}: the device status is one byte")
        if value == 0:
            self._stop("device reset (status 0)")
        self.status = value

    def _get_status(self, msg, value):
        return vu.pack_u64(self.status)

    # -- inflight tracking (INFLIGHT_SHMFD) --------------------------------------------------------

    def _inflight_allowed(self, msg):
        if not has(self.protocol_features, PF.INFLIGHT_SHMFD):
            raise Refused(f"{msg.name}: INFLIGHT_SHMFD was not negotiated")

    def _get_inflight_fd(self, msg, inf):
        """A new zeroed area for ``num_queues`` x ``queue_size``, laid out for the negotiated ring format (send
        SET_FEATURES first, as DPDK needs too)."""
        self._inflight_allowed(msg)
        if inf.num_queues != NUM_VRINGS:   # the area is ours to fill (all of it touched): only what we serve
            raise Refused(f"GET_INFLIGHT_FD: {inf.num_queues} queues; this device has {NUM_VRINGS}")
        try:
            fd, size = create_area(inf.num_queues, inf.queue_size, self.packed)
        except (InflightError, OSError) as e:
            raise Refused(f"GET_INFLIGHT_FD: {e}") from None
        log.info("inflight area created: %d %s queues of %d, %d bytes", inf.num_queues,
                 "packed" if self.packed else "split", inf.queue_size, size)
        return Reply(vu.Inflight(size, 0, inf.num_queues, inf.queue_size).pack(), [fd])

    def _set_inflight_fd(self, msg, inf):
        self._inflight_allowed(msg)
        if inf.num_queues < NUM_VRINGS:
            raise Refused(f"SET_INFLIGHT_FD: {inf.num_queues} queues; this device tracks {NUM_VRINGS}")
        fd = msg.take_fds()[0]
        try:
            area = InflightArea(fd, inf.mmap_size, inf.mmap_offset, inf.num_queues, inf.queue_size, self.packed)
        except InflightError as e:
            raise Refused(str(e)) from None
        self._stop("new inflight area")
        self._close_inflight()
        self.inflight = area
        log.info("inflight area: %d %s queues of %d (%#x bytes at offset %#x)", inf.num_queues,
                 "packed" if self.packed else "split", inf.queue_size, inf.mmap_size, inf.mmap_offset)

    def _close_inflight(self):
        if self.inflight is not None:
            self.inflight.close()
            self.inflight = None

    # -- memory ----------------------------------------------------------------------------------

    def _set_mem_table(self, msg, regions):
        fds = msg.take_fds()
        mapped, table = [], None
        try:
            for i, (r, fd) in enumerate(zip(regions, fds)):
                # sealed first, checked second: a size checked before the seal could still shrink afterwards
                seal_shrink(fd, f"SET_MEM_TABLE region {i}")
                try:
                    st = os.fstat(fd)
                except OSError as e:
                    raise Refused(f"SET_MEM_TABLE: region {i}: bad fd ({e.strerror})") from None
                end = r.mmap_offset + r.size
                if end > st.st_size:
                    raise Refused(f"SET_MEM_TABLE: region {i} (mmap_offset {r.mmap_offset:#x} + size {r.size:#x})"
                                  f" ends outside its file ({st.st_size:#x} bytes)")
                fds[i] = -1   # from_fd owns it now, mapped or not
                try:   # mapped from offset 0, as DPDK does: mmap_offset need not be page aligned
                    shm = ShmRegion.from_fd(fd, end, 0)
                except ShmError as e:
                    raise Refused(f"SET_MEM_TABLE: region {i}: {e}") from None
                mapped.append((r, shm))
            table = self.memory_table()
            for r, shm in mapped:
                table.add(r.gpa, r.size, shm.buf, r.mmap_offset, file=(shm.fileno(), r.mmap_offset + r.size))
            cmem = CMemory(table)
        except BaseException as e:
            if table is not None:
                table.release()
            for _r, shm in mapped:
                shm.close()
            for fd in fds:
                if fd >= 0:
                    os.close(fd)
            if isinstance(e, VringError) and not isinstance(e, Refused):
                raise Refused(f"SET_MEM_TABLE: {e}") from None
            raise
        self._stop("new memory table")
        old, old_mem = self.regions, self.mem
        self.regions, self.mem, self.cmem = mapped, table, cmem
        if old_mem is not None:
            old_mem.release()
        for _r, shm in old:
            shm.close()
        for r, _shm in mapped:
            log.info("region gpa=%#x size=%#x uaddr=%#x mmap_offset=%#x", r.gpa, r.size, r.uaddr, r.mmap_offset)

    def uaddr_to_gpa(self, uaddr, length, what):
        """Translate a ring address (frontend userspace address) into guest-physical; the whole area must lie in
        one region."""
        for r, _shm in self.regions:
            if r.uaddr <= uaddr < r.uaddr + r.size:
                if length > r.uaddr + r.size - uaddr:
                    break
                return r.gpa + (uaddr - r.uaddr)
        raise Refused(f"{what} at userspace address {uaddr:#x} (+{length:#x}) is outside the memory table")

    # -- vrings ----------------------------------------------------------------------------------

    def _vring(self, msg, index):
        if not 0 <= index < NUM_VRINGS:
            raise Refused(f"{msg.name}: vring {index} does not exist (this device has {NUM_VRINGS}; no MQ)")
        return self.vrings[index]

    @property
    def packed(self):
        return has(self.features, VIRTIO_F_RING_PACKED)

    def _set_vring_num(self, msg, st):
        v = self._vring(msg, st.index)
        fmt = "packed" if self.packed else "split"
        try:
            area_sizes(fmt, st.num)
        except ConfigError as e:
            raise Refused(f"SET_VRING_NUM {st.index}: {e}") from None
        self._stop(f"vring {st.index} resized")
        v.num = st.num
        v.broken = None
        self._check_base(v, f"SET_VRING_NUM {st.num}")

    def _check_base(self, v, why):
        """A packed base must stay a slot of the ring when the ring size or the format changes after it was
        stored (GET_VRING_BASE stores the used position; a careless frontend then shrinks the ring). Such a
        vring is not started (the C engine refuses the base too) until SET_VRING_BASE names a slot in it."""
        if self.packed and v.num is not None and (v.base & 0x7FFF) >= v.num:
            log.warning("vring %d: after %s the packed base %#x (slot %d) is outside the ring of %d; it will "
                        "not start until SET_VRING_BASE names a slot inside it", v.index, why, v.base,
                        v.base & 0x7FFF, v.num)

    def _set_vring_addr(self, msg, a):
        v = self._vring(msg, a.index)
        if a.flags & vu.VHOST_VRING_F_LOG:
            raise Refused(f"SET_VRING_ADDR {a.index}: used-ring logging requested but LOG_ALL was not offered")
        if self.mem is not None and v.num is not None:
            self._layout(v, a)   # check now: refuse a ring outside the table
        self._stop(f"vring {a.index} moved")
        v.addr = a
        v.broken = None

    def _layout(self, v, a):
        fmt = "packed" if self.packed else "split"
        try:   # a size set under the other format (SET_FEATURES changed it since) may not fit this one
            dsz, drv, dev = area_sizes(fmt, v.num)
        except ConfigError as e:
            raise Refused(f"vring {v.index}: {e} (send SET_VRING_NUM again)") from None
        desc = self.uaddr_to_gpa(a.desc, dsz, f"vring {v.index} descriptor area")
        driver = self.uaddr_to_gpa(a.avail, drv, f"vring {v.index} driver area")
        device = self.uaddr_to_gpa(a.used, dev, f"vring {v.index} device area")
        try:
            return QueueLayout(fmt, v.num, desc, driver, device)
        except ConfigError as e:
            raise Refused(f"vring {v.index}: {e}") from None

    def _set_vring_base(self, msg, st):
        v = self._vring(msg, st.index)
        if self.packed:
            idx = st.num & 0x7FFF
            if v.num is not None and idx >= v.num:
                raise Refused(f"SET_VRING_BASE {st.index}: packed index {idx} is outside the ring ({v.num})")
        elif st.num > 0xFFFF:
            raise Refused(f"SET_VRING_BASE {st.index}: split index {st.num:#x} does not fit 16 bits")
        self._stop(f"vring {st.index} rebased")
        v.base = st.num & 0xFFFF
        v.base_set = True
        v.broken = None

    def _get_vring_base(self, msg, st):
        v = self._vring(msg, st.index)   # st.num is garbage from virtio_user: ignored
        self._stop(f"GET_VRING_BASE {st.index}")
        # DPDK: the ring stops, its kick/call fds are closed and its addresses forgotten (22.11.7+)
        v.close_fds()
        v.addr = None
        return vu.VringState(st.index, v.base).pack()

    def _take_fd(self, msg, f):
        """The kick/call fd (NOFD with the flag). It must be an eventfd: the data path writes and reads it in C,
        and a pipe or socket the frontend never drains would block that write and hang the whole server. It is
        made non-blocking (the flag belongs to the file, shared with the frontend, which could clear it again)."""
        if f.nofd:
            return NOFD
        fd = msg.take_fds()[0]
        kind = vu.fd_kind(fd)
        if kind != vu.EVENTFD:
            os.close(fd)
            raise Refused(f"{msg.name} {f.index}: the fd is {kind}, not an eventfd")
        # non-blocking, as every frontend we know makes them (DPDK, QEMU, ours): on a blocking call eventfd whose
        # counter the frontend filled to its limit, the data path's write(1) would block the whole server, and a
        # kick counter drained by the frontend between our select() and read() would block the read
        os.set_blocking(fd, False)
        return fd

    def _set_vring_kick(self, msg, f):
        v = self._vring(msg, f.index)
        fd = self._take_fd(msg, f)
        if v.kickfd >= 0:
            os.close(v.kickfd)
        v.kickfd = fd
        v.broken = None
        if not has(self.features, VHOST_USER_F_PROTOCOL_FEATURES):
            v.enabled = True   # without bit 30 a ring starts enabled at KICK

    def _set_vring_call(self, msg, f):
        v = self._vring(msg, f.index)
        fd = self._take_fd(msg, f)
        old = v.callfd
        v.callfd = fd
        if self.datapath is not None:   # swap the fd in the running loop
            if f.index == 0:
                self.datapath.n.rx_callfd = max(fd, -1)
            else:
                self.datapath.n.tx_callfd = max(fd, -1)
        if old >= 0:
            os.close(old)

    def _set_vring_err(self, msg, f):
        self._vring(msg, f.index)   # accepted; errors are logged, not signalled (the fd is closed)

    def _set_vring_enable(self, msg, st):
        v = self._vring(msg, st.index)
        if st.num not in (0, 1):
            raise Refused(f"SET_VRING_ENABLE {st.index}: num must be 0 or 1, not {st.num}")
        v.enabled = bool(st.num)

    # -- the data path ---------------------------------------------------------------------------

    def ready(self):
        """DPDK's readiness rule (vq_is_ready for vrings 0 and 1, then virtio_is_ready)."""
        if self.cmem is None:
            return False
        if has(self.protocol_features, PF.STATUS) and not self.status & STATUS_DRIVER_OK:
            return False
        return all(v.num is not None and v.addr is not None and v.kickfd != UNSET and v.callfd != UNSET
                   and v.enabled for v in self.vrings)

    def update(self):
        """Start or stop the data path to match ``ready()``."""
        if self.ready():
            if self.datapath is None:
                self._start()
        elif self.datapath is not None:
            self._stop("not ready")

    def _queue(self, v):
        """(DeviceQueue at the vring's base, its inflight tracking or None), or (None, None)."""
        if v.broken is not None:
            return None, None
        try:
            layout = self._layout(v, v.addr)
            # one used entry per batch only on the Tx queue, as DPDK does (virtio PMD reads Rx per buffer)
            q = DeviceQueue(self.cmem, layout, self.features,
                            in_order_batch=self.options.in_order_batch and v.index == 1)
            base = v.base
            if not self.packed:
                used_idx = int.from_bytes(self.mem.read(layout.device + 2, 2), "little")
                if used_idx != base:   # pitfall 25 / DPDK: resync to the used ring in memory
                    log.warning("vring %d: base %d but used->idx is %d; resuming at %d", v.index, base,
                                used_idx, used_idx)
                    base = used_idx
            q.set_base(base)   # the ring engine bounds it (BaseOutOfRange), whatever was checked above
        except GuestMemoryFault:
            raise   # not this vring's fault: the frontend's memory is gone, and the frontend is dropped
        except (Refused, VringError) as e:
            v.broken = _without_frames(e)
            log.error("vring %d cannot start: %s: %s", v.index, type(e).__name__, e)
            return None, None
        enable_kicks_guarded(q, False, v.index)   # we poll (as net_vhost does): the driver need not kick
        tracking = None
        if self.inflight is not None:
            try:
                tracking = QueueTracking(self.inflight, v.index, v.num)
                again = tracking.start(q, self.mem)
            except GuestMemoryFault:
                raise
            except VringError as e:   # InflightError, or a ring error the replay met (BufferIdInUse, ...)
                v.broken = _without_frames(e)
                log.error("vring %d cannot start: %s: %s", v.index, type(e).__name__, e)
                return None, None
            if again:
                log.warning("vring %d: %d chains taken by the previous backend and not completed: taking them "
                            "again first", v.index, again)
        return q, tracking

    def _start(self):
        (rx, rx_trk), (tx, tx_trk) = (self._queue(v) for v in self.vrings)
        if rx is None and tx is None:
            return
        fds = [max(v.callfd, -1) for v in self.vrings]
        self.datapath = Datapath(rx, tx, self.features, self.options, fds[0], fds[1], tracking=(rx_trk, tx_trk))
        log.info("data path started: %s rings, %s, hdr %d bytes, features %s",
                 "packed" if self.packed else "split",
                 "in-order" if has(self.features, VIRTIO_F_IN_ORDER) else "normal",
                 self.datapath.n.hdr_len, " ".join(feature_names(self.features)))

    def _stop(self, why):
        """Stop the data path (if running): drop what waits in the intermediate queue, keep the ring
        positions as the vring bases, fold the counters into ``totals``."""
        dp = self.datapath
        if dp is None:
            return
        self.datapath = None
        dropped = dp.discard()
        for v, q in zip(self.vrings, (dp.rxq, dp.txq)):
            if q is None:
                continue
            c = q.c
            if q.broken is None:
                v.base = (c.used_idx | (c.used_wrap << 15)) if self.packed else c.used_idx
        add_stats(self.totals, dp.stats())
        log.info("data path stopped (%s)%s", why, f"; {dropped} queued packets dropped" if dropped else "")

    def run(self, budget_us):
        """One time slice of the data path; logs and records any queue that broke."""
        dp = self.datapath
        errors = dp.run(budget_us)
        for idx, e in errors.items():
            self.vrings[idx].broken = e
            self.ring_errors.append(e)
            log.error("vring %d broken: %s [%s]: %s (the other queue keeps running)", idx,
                      type(e).__name__, e.spec, e)
        return errors

    def memory_fault(self):
        """The GuestMemoryFault a guarded access to the frontend's memory met, from any thread, or None."""
        return getattr(self.mem, "fault", None)

    def sleep_fd(self):
        """--idle sleep: vring 1's kick eventfd once the data path has asked to block on it; -1 when it asked but
        the frontend gave no kick fd (the server naps instead); None while it polls."""
        dp = self.datapath
        if dp is None or not dp.sleeping:
            return None
        return max(self.vrings[1].kickfd, -1)

    def kicked(self):
        """The kick eventfd is readable: consume it (its counter is the kicks since the last read)."""
        try:
            count = vu.eventfd_take(self.vrings[1].kickfd)
        except OSError:
            count = 0
        if self.datapath is not None:
            self.datapath.kicked(count)

    def stats(self):
        """Counters of this connection so far (stopped data paths plus the running one)."""
        total = dict(self.totals)
        if self.datapath is not None:
            add_stats(total, self.datapath.stats())
        return total

    def close(self):
        """The connection ended: stop, close every fd, unmap every region."""
        self._stop("connection closed")
        for v in self.vrings:
            v.close_fds()
        regions, mem, self.regions, self.mem, self.cmem = self.regions, self.mem, [], None, None
        if mem is not None:
            mem.release()
        for _r, shm in regions:
            shm.close()
        self._close_inflight()

"""One exception hierarchy for the whole project.

RingError and its subclasses mean the *peer* broke a ring rule (hostile or buggy input). Raising one
puts the queue into a sticky broken state: every later call on that queue raises the same error.
The numeric codes are shared with the C hot path (``VQ_ERR_*`` in csrc/virtq.h).
"""


class VringError(Exception):
    """Base of every error this project raises on purpose."""


class ConfigError(VringError, ValueError):
    """A wrong argument or configuration (queue size, layout, feature combination)."""


class FrameDoesNotFit(ConfigError):
    """Frames of the configured size could never be carried by the queues as configured: ``fit_buf_size`` is the
    smallest buffer size that would carry them, all else equal (None when none would), and ``mrg_rxbuf_helps``
    says whether negotiating VIRTIO_NET_F_MRG_RXBUF would."""

    def __init__(self, message, fit_buf_size=None, mrg_rxbuf_helps=False):
        super().__init__(message)
        self.fit_buf_size = fit_buf_size
        self.mrg_rxbuf_helps = mrg_rxbuf_helps


class FeatureRefused(ConfigError):
    """The vhost-user peer does not offer (or did not accept) a feature we were asked to use."""


class ShmError(VringError):
    """A shared-memory region could not be created, attached or mapped."""


class MemoryTableError(VringError):
    """A memory table is inconsistent (overlapping regions, too many regions, bad bounds)."""


class UsageError(VringError):
    """The local caller broke the API contract (e.g. completing a buffer that was never polled)."""


class ProtocolError(VringError):
    """A vhost-user message broke the protocol (size, flags, fd count, bounds, unknown request)."""


class PeerGone(ProtocolError):
    """The vhost-user peer closed the socket."""


class BackendBusy(PeerGone):
    """The vhost-user backend serves another frontend and refused this connection (it serves one at a time)."""


class ProtocolTimeout(ProtocolError):
    """The vhost-user peer did not answer in time."""


class ProtocolNack(ProtocolError):
    """The vhost-user peer answered a request with a non-zero REPLY_ACK value. The connection is still usable.

    ``request`` is the request code that was refused, ``value`` the u64 the peer sent back.
    """

    def __init__(self, message, request=0, value=0):
        super().__init__(message)
        self.request = request
        self.value = value


class RingError(VringError):
    """The peer broke a ring rule. ``code`` is the C error code; ``a``/``b`` carry the offending values."""

    code = 0
    spec = ""

    def __init__(self, message, a=0, b=0, side=""):
        super().__init__(message)
        self.a = a
        self.b = b
        self.side = side
        self.snapshot_path = None


class HeadOutOfRange(RingError):
    code, spec = 1, "SPLIT-V-14"


class NextOutOfRange(RingError):
    code, spec = 2, "SPLIT-V-14"


class ChainTooLong(RingError):
    code, spec = 3, "SPLIT-D-05/PACKED-D-09"


class AvailIdxJump(RingError):
    code, spec = 4, "SPLIT-V-13"


class IndirectEmpty(RingError):
    code, spec = 5, "SPLIT-D-09"


class IndirectLength(RingError):
    code, spec = 6, "SPLIT-D-09/PACKED-D-21"


class NestedIndirect(RingError):
    code, spec = 7, "SPLIT-D-07/PACKED-D-18"


class IndirectWithNext(RingError):
    code, spec = 8, "SPLIT-D-08/PACKED-D-20"


class WritableBeforeReadable(RingError):
    code, spec = 9, "SPLIT-D-02/PACKED-D-10"


class PackedIdOutOfRange(RingError):
    code, spec = 10, "PACKED-D-23"


class BufferIdInUse(RingError):
    code, spec = 11, "SPLIT-D-13/PACKED-D-23"


class AddressOutOfBounds(RingError):
    code, spec = 12, "FEAT-07"


class UsedIdNotInFlight(RingError):
    code, spec = 13, "SPLIT-D-17/SPLIT-V-15"


class UsedLenTooLarge(RingError):
    code, spec = 14, "SPLIT-D-15"


class UsedIdxJump(RingError):
    code, spec = 15, "SPLIT-D-17"


class SlotInFlight(RingError):
    """Packed: the driver made a slot available again while the chain holding it is still in flight."""
    code, spec = 16, "PACKED-D-11/PACKED-D-05"


class BaseOutOfRange(RingError):
    """A vring base (vhost-user SET_VRING_BASE) that is no position of this ring (packed: slot >= size)."""
    code, spec = 17, "vhost-user SET_VRING_BASE"


class InflightMismatch(RingError):
    """vhost inflight tracking laid out for another ring format or size than the vring it is used with."""
    code, spec = 18, "vhost-user SET_INFLIGHT_FD"


class GuestMemoryFault(RingError):
    """The peer's memory vanished under the ring (SIGBUS caught in the C data path): it shrank the file behind a
    region after handing it over. What the interrupted burst was doing is half done, so the queues of that
    connection are never touched again; the connection is dropped. ``code`` is the C side's GF_FAULT."""
    code, spec = -1, "vhost-user SET_MEM_TABLE"


RING_ERRORS = {cls.code: cls for cls in RingError.__subclasses__()}

"""Results per checklist ID: pass (with how many observations), fail (with the evidence), warn (a SHOULD-level
deviation, with the evidence), or not exercised; rendered as a table or as JSON.

The IDs and their levels are those of shared/spec/virtio-checklist.md; ``CATALOG`` holds the ones the two
harnesses can observe, with a short statement of each (the checklist has the spec text).
"""
from __future__ import annotations

import json
import math

from rings.errors import ConfigError

MAX_EVIDENCE = 5     # evidence lines kept per ID (the count of observations is kept in full)

#: ID -> (level, what is checked). Level as in the checklist (MUST, DESC and DERIVED bind like MUST).
CATALOG = {
    # --- device (the backend under test), observed by our driver ---------------------------------------------
    "FEAT-05": ("MUST", "the device offers VIRTIO_F_VERSION_1"),
    "GEN-01": ("MUST NOT", "no buffer consumed and no used notification before DRIVER_OK"),
    "SPLIT-L-01": ("DESC", "descriptor, driver and device areas at three separate addresses (reverse order)"),
    "SPLIT-L-02": ("DESC", "avail ring only 2-aligned, used ring only 4-aligned: the device still works; it writes "
                           "nothing outside the areas' sizes (used ring 6+8*QS)"),
    "SPLIT-L-05": ("DESC", "used element id is a 32-bit field (high bytes 0)"),
    "SPLIT-L-08": ("DESC", "each area written by one side only (device: not the avail ring; driver: not the used ring)"),
    "SPLIT-V-01": ("MUST NOT", "no assumption on descriptor layout: the header split anywhere works"),
    "SPLIT-V-02": ("MUST NOT", "no write to a device-readable buffer (nor outside the writable ones)"),
    "SPLIT-V-04": ("MUST NOT", "no write to any descriptor table entry (direct or indirect)"),
    "SPLIT-V-05": ("MUST", "WRITE on a descriptor that refers to an indirect table is ignored"),
    "SPLIT-V-07": ("DESC", "an indirect table is walked by next (0->2->1), not in array order"),
    "SPLIT-V-08": ("MUST", "used len is set before used idx"),
    "SPLIT-V-09": ("MUST", "len bytes written into the buffer before used idx"),
    "SPLIT-V-11": ("DESC", "used len = bytes written (Tx: 0; Rx: header + packet)"),
    "SPLIT-V-12": ("DESC", "used idx moves by the buffers used, wraps at 65536"),
    "SPLIT-V-13": ("DERIVED", "only avail slots in [last_avail, avail idx) are consumed"),
    "SPLIT-V-15": ("DESC", "a used id names a head made available and not yet used"),
    "EVT-04": ("MUST", "without EVENT_IDX the device ignores used_event"),
    "EVT-05": ("MUST", "without EVENT_IDX: flags 0 -> a used buffer notification (flags 1 -> none: SHOULD NOT)"),
    "EVT-06": ("MUST", "with EVENT_IDX the device ignores the lower bit of avail flags"),
    "EVT-07": ("MUST", "with EVENT_IDX: used idx passing used_event -> a notification (otherwise SHOULD NOT)"),
    "EVT-15": ("MUST", "without EVENT_IDX the device sets used flags to 0 or 1"),
    "EVT-16": ("MUST", "with EVENT_IDX the device sets used flags to 0"),
    "EVT-17": ("MUST", "spurious available buffer notifications are handled (nothing consumed twice)"),
    "EVT-19": ("DESC", "event suppression: reserved flag bits written as 0"),
    "EVT-21": ("DESC", "event flags: 0x2 only with EVENT_IDX, 0x3 never"),
    "EVT-22": ("DESC", "each event suppression area written by its owner only"),
    "EVT-23": ("DESC", "DESC mode: notify when the descriptor at off/wrap is used / made available"),
    "EVT-24": ("DESC", "packed: ENABLE -> a notification per publication (DISABLE -> none, reported as warn)"),
    "PACKED-L-03": ("DESC", "descriptor ring 16*QS, event areas 4 bytes: the device writes nothing outside them"),
    "PACKED-V-01": ("DESC", "device wrap counter starts at 1 and toggles after the last slot"),
    "PACKED-V-02": ("DESC", "a used descriptor has AVAIL == USED == the device wrap counter"),
    "PACKED-V-03": ("MUST NOT", "no write to a device-readable buffer (nor outside the writable ones)"),
    "PACKED-V-04": ("MUST NOT", "a descriptor is used only once its AVAIL bit changed (zero ring, stale slots)"),
    "PACKED-V-05": ("MUST NOT", "no change of a descriptor after its USED bit changed"),
    "PACKED-V-08": ("MUST", "the descriptors of a list are used in ring order (also across the ring end)"),
    "PACKED-V-09": ("DESC", "one used descriptor per list, then skip by the list length (skipped slots untouched)"),
    "PACKED-V-10": ("DESC", "the buffer id is taken from the last descriptor of a list"),
    "PACKED-V-11": ("DESC", "used descriptors at the next used position, naming a buffer made available"),
    "PACKED-V-12": ("DESC", "used WRITE flag: set with len = bytes written (Rx), clear (Tx)"),
    "PACKED-V-13": ("DESC", "indirect table: only WRITE counts, other flags and ids ignored"),
    "PACKED-V-14": ("DESC", "WRITE on a descriptor with INDIRECT is ignored"),
    "PACKED-V-15": ("DERIVED", "an indirect buffer occupies one ring slot"),
    "PACKED-V-16": ("DESC", "multi-buffer packets: the first buffer's used descriptor is made visible last"),
    "PACKED-V-18": ("DERIVED", "availability needs AVAIL == driver wrap; stale slots are not consumed again"),
    "INORDER-02": ("MUST", "with IN_ORDER buffers are used in the order they were made available"),
    "INORDER-07": ("DESC", "a batch entry moves used idx by the size of the batch"),
    "INORDER-08": ("DESC", "a batch entry sits at the batch's first slot; the other slots are not written"),
    "INORDER-10": ("DERIVED", "a skipped (batched) buffer was used completely: never a partly written Rx buffer"),
    "INORDER-13": ("DESC", "packed: the batch's used descriptor overwrites the batch's first descriptor"),
    "INORDER-15": ("DERIVED", "without IN_ORDER: one used entry per buffer"),
    "INORDER-16": ("DERIVED", "with IN_ORDER, chains of varying length (1, 3, 2, ...) are parsed from the ring"),
    "MEM-07": ("MUST", "packed: id, len and data written before the used flags"),
    "NET-02": ("MUST", "the Rx virtio-net header has the size the features give (12 bytes without HASH_REPORT)"),
    "NET-03": ("DESC", "with VERSION_1 the Rx header is 12 bytes, not the legacy 10, even without MRG_RXBUF"),
    "NET-17": ("MUST NOT", "without NEEDS_CSUM, csum_start/csum_offset are not used (frame unchanged)"),
    "NET-18": ("MUST NOT", "hdr_len is not relied on (garbage hdr_len: frame unchanged)"),
    "NET-21": ("DESC", "Tx: header and packet in any number of descriptors; used len 0"),
    "NET-27": ("MUST", "without MRG_RXBUF one buffer per packet; a 12-byte header descriptor + data works"),
    "NET-28": ("MUST", "without MRG_RXBUF num_buffers is 1"),
    "NET-29": ("MUST", "with MRG_RXBUF num_buffers = the buffers the packet is spread over"),
    "NET-30": ("MUST", "all buffers of a packet but the last are filled completely"),
    "NET-31": ("MUST", "all num_buffers buffers of a packet are made visible together"),
    "NET-33": ("MUST", "without GUEST_CSUM, Rx header flags are 0"),
    "NET-34": ("MUST", "without GUEST_TSO*/UFO/USO, Rx gso_type is NONE"),
    "NET-35": ("MUST NOT", "without RSC_EXT, no RSC_INFO flag"),
    # --- driver (the frontend under test), observed by our device --------------------------------------------
    "FEAT-02": ("MUST NOT", "the driver accepts only features that were offered"),
    "FEAT-07": ("MUST", "descriptor addresses lie in the memory the driver shared (physical addresses)"),
    "NOTIF-08": ("MUST NOT", "no available buffer notification before DRIVER_OK"),
    "SPLIT-D-01": ("MUST", "desc 16-, avail 2-, used 4-byte aligned"),
    "SPLIT-D-02": ("MUST", "device-writable descriptors after the readable ones"),
    "SPLIT-D-04": ("MUST NOT", "no chain over 2^32 bytes, no loops"),
    "SPLIT-D-05": ("MUST NOT", "no chain longer than the queue size"),
    "SPLIT-D-06": ("MUST NOT", "no INDIRECT without VIRTIO_F_INDIRECT_DESC"),
    "SPLIT-D-07": ("MUST NOT", "no INDIRECT inside an indirect table"),
    "SPLIT-D-08": ("MUST NOT", "not INDIRECT and NEXT together"),
    "SPLIT-D-09": ("DESC", "indirect table length a non-zero multiple of 16, next inside the table"),
    "SPLIT-D-10": ("MUST NOT", "avail idx never decremented (moves by at most the queue size)"),
    "SPLIT-D-13": ("DESC", "each new avail entry is the head of a chain not already outstanding"),
    "SPLIT-D-14": ("DERIVED", "descriptors of an exposed buffer are not changed before it is used"),
    "SPLIT-D-15": ("MUST NOT", "only the first len bytes of a used buffer are taken"),
    "SPLIT-D-16": ("DESC", "buffers used out of order all come back, each once"),
    "MEM-02": ("MUST", "descriptors and avail ring complete when avail idx is published"),
    "MEM-04": ("MUST", "packed: descriptor contents complete when the flags are published"),
    "MEM-11": ("DESC", "buffer contents final when the buffer is made available"),
    "EVT-01": ("MUST", "without EVENT_IDX the driver sets avail flags to 0 or 1"),
    "EVT-02": ("MUST", "with EVENT_IDX the driver sets avail flags to 0"),
    "EVT-03": ("MUST", "spurious used buffer notifications are handled"),
    "EVT-10": ("MUST", "used flags initialised to 0"),
    "EVT-11": ("MUST", "without EVENT_IDX the driver ignores avail_event"),
    "EVT-12": ("MUST", "without EVENT_IDX: used flags 0 -> a kick after publishing (flags 1 -> none: SHOULD NOT)"),
    "EVT-13": ("MUST", "with EVENT_IDX the driver ignores the lower bit of used flags"),
    "EVT-14": ("MUST", "with EVENT_IDX: avail idx passing avail_event -> a kick (otherwise SHOULD NOT)"),
    "PACKED-L-05": ("DESC", "the descriptor ring is zero-initialised"),
    "PACKED-D-01": ("MUST", "desc 16-, event areas 4-byte aligned"),
    "PACKED-D-02": ("DESC", "driver wrap counter starts at 1 and toggles after the last slot"),
    "PACKED-D-03": ("DESC", "available descriptor: AVAIL == driver wrap, USED == !wrap"),
    "PACKED-D-04": ("MUST NOT", "a descriptor is not changed until it is used"),
    "PACKED-D-10": ("MUST", "device-writable descriptors after the readable ones"),
    "PACKED-D-12": ("MUST NOT", "the first descriptor of a list made available last"),
    "PACKED-D-14": ("DESC", "AVAIL/USED set correctly in every descriptor of a list"),
    "PACKED-D-15": ("DESC", "the driver skips by list length (lists of different lengths, out of order)"),
    "PACKED-D-18": ("MUST NOT", "indirect: only with the feature; entries carry only WRITE"),
    "PACKED-D-20": ("MUST NOT", "no INDIRECT descriptor inside a NEXT list"),
    "PACKED-D-21": ("DESC", "indirect table length a non-zero multiple of 16"),
    "PACKED-D-23": ("DERIVED", "buffer ids < queue size and unique among outstanding buffers"),
    "PACKED-D-26": ("DESC", "used descriptors in completion order are mapped by id"),
    "INORDER-03": ("DESC", "split: descriptors used in ring order"),
    "INORDER-04": ("MUST", "split: next = x + 1 (0 after the last) in a chain"),
    "INORDER-05": ("MUST", "split: indirect entries sequential (next = i + 1)"),
    "INORDER-06": ("DESC", "split: one used entry for a batch returns every buffer of the batch"),
    "INORDER-09": ("DESC", "split: the driver advances by the batch size, never reads skipped used slots"),
    "INORDER-11": ("DESC", "packed: one used descriptor (last id) returns every buffer of the batch"),
    "INORDER-12": ("DESC", "packed: the driver skips by the batch's descriptors"),
    "NET-06": ("MUST", "Tx num_buffers is 0"),
    "NET-07": ("MUST", "without CSUM, Tx header flags are 0"),
    "NET-08": ("MUST", "without HOST_TSO*/UFO/USO, Tx gso_type is NONE"),
    "NET-14": ("MUST NOT", "Tx flags without DATA_VALID and RSC_INFO"),
    "NET-24": ("SHOULD", "without MRG_RXBUF, Rx buffers of at least 1526 bytes"),
    "NET-25": ("MUST", "with MRG_RXBUF every Rx buffer holds at least the header"),
    "NET-32": ("DESC", "merged packets reassembled from buffer1[hdr:] + buffer2 + ... (frames come back intact)"),
}

STATUSES = ("pass", "fail", "warn", "not exercised")


class Result:
    __slots__ = ("id", "passes", "fails", "warns", "nfail", "nwarn", "note")

    def __init__(self, id_):
        self.id = id_
        self.passes = 0
        self.fails: list[str] = []
        self.warns: list[str] = []
        self.nfail = 0
        self.nwarn = 0
        self.note = ""

    @property
    def status(self):
        if self.nfail:
            return "fail"
        if self.nwarn:
            return "warn"
        return "pass" if self.passes else "not exercised"

    def as_dict(self):
        level, what = CATALOG.get(self.id, ("", ""))
        d = {"id": self.id, "level": level, "what": what, "status": self.status, "passes": self.passes,
             "fails": self.nfail, "warns": self.nwarn, "evidence": self.fails + self.warns}
        if self.note:
            d["note"] = self.note
        return d


MAX_SECONDS = 86400.0   # a day: more is no test run (and socket timeouts overflow long before inf)


def check_seconds(**durations):
    """ConfigError unless every duration is a finite number of seconds in (0, MAX_SECONDS] (NaN would turn a
    timeout or the stall detector off)."""
    for name, v in durations.items():
        if not (isinstance(v, (int, float)) and math.isfinite(v) and 0 < v <= MAX_SECONDS):
            raise ConfigError(f"--{name.replace('_', '-')} must be a number of seconds in (0, {MAX_SECONDS:g}], "
                              f"not {v}")


class Report:
    """Observations of one run, per checklist ID. ``ids``: the IDs this role checks, in table order."""

    def __init__(self, role, ids):
        unknown = [i for i in ids if i not in CATALOG]
        if unknown:
            raise ValueError(f"IDs without a catalog entry: {unknown}")
        self.role = role
        self.results = {i: Result(i) for i in ids}
        self.context: dict = {}
        self.scenarios: list[dict] = []
        self.notes: list[str] = []
        self.error: str | None = None   # a connection/protocol error that ended the run early
        # asked before a fail or warn is recorded: False drops it (evidence read from memory the peer took away)
        self.evidence_valid = lambda: True
        self._sound = dict.fromkeys(self.results, 0)   # passes at the last checkpoint

    def _get(self, id_):
        try:
            return self.results[id_]
        except KeyError:
            raise ValueError(f"{id_} is not checked by the {self.role} harness") from None

    def ok(self, id_, n=1):
        """n observations that satisfied the requirement."""
        self._get(id_).passes += n

    def checkpoint(self):
        """The passes so far are sound: what they were read from was still there after them."""
        self._sound = {i: r.passes for i, r in self.results.items()}

    def drop_passes_since_checkpoint(self):
        """What the passes since the last checkpoint were read from turned out gone (read as zeros): no evidence."""
        for i, n in self._sound.items():
            self.results[i].passes = n

    def fail(self, id_, evidence):
        r = self._get(id_)
        if not self.evidence_valid():
            return
        r.nfail += 1
        if len(r.fails) < MAX_EVIDENCE and str(evidence) not in r.fails:
            r.fails.append(str(evidence))

    def warn(self, id_, evidence):
        """A SHOULD-level deviation: shown with its evidence, not a failure."""
        r = self._get(id_)
        if not self.evidence_valid():
            return
        r.nwarn += 1
        if len(r.warns) < MAX_EVIDENCE and str(evidence) not in r.warns:
            r.warns.append(str(evidence))

    def check(self, id_, ok, evidence):
        """``ok`` -> one pass; otherwise a fail with ``evidence`` (a string or a callable giving one)."""
        if ok:
            self.ok(id_)
        else:
            self.fail(id_, evidence() if callable(evidence) else evidence)
        return ok

    def set_note(self, id_, note):
        self._get(id_).note = note

    def status(self, id_):
        return self._get(id_).status

    def failed(self):
        return [r.id for r in self.results.values() if r.nfail]

    def nfail(self):
        """Failed observations so far, all IDs together."""
        return sum(r.nfail for r in self.results.values())

    def exit_code(self):
        """1 when a requirement failed; 2 when the run ended on a connection/protocol error; else 0."""
        if self.failed():
            return 1
        return 2 if self.error else 0

    def counts(self):
        out = dict.fromkeys(STATUSES, 0)
        for r in self.results.values():
            out[r.status] += 1
        return out

    def as_dict(self):
        return {"role": self.role, "context": self.context, "counts": self.counts(),
                "results": [r.as_dict() for r in self.results.values()], "scenarios": self.scenarios,
                "notes": self.notes, "error": self.error, "exit_code": self.exit_code()}

    def to_json(self):
        return json.dumps(self.as_dict(), indent=1)

    def table(self):
        lines = []
        for k, v in self.context.items():
            lines.append(f"{k}: {v}")
        if self.scenarios:
            lines.append("scenarios: " + ", ".join(
                f"{s['name']} ({s.get('buffers', 0)} buffers{', ' + s['status'] if s.get('status', 'ok') != 'ok' else ''})"
                for s in self.scenarios))
        lines.append("")
        lines.append(f"{'ID':12s} {'level':9s} {'status':14s} {'checks':>7s}  requirement / evidence")
        for r in self.results.values():
            level, what = CATALOG[r.id]
            st = r.status.upper() if r.status in ("fail", "warn") else r.status
            lines.append(f"{r.id:12s} {level:9s} {st:14s} {r.passes:7d}  {what}" + (f" [{r.note}]" if r.note else ""))
            for e in r.fails:
                lines.append(f"{'':45s}FAIL: {e}")
            if r.nfail > len(r.fails):
                lines.append(f"{'':45s}({r.nfail} failed observations in all)")
            for e in r.warns:
                lines.append(f"{'':45s}warn: {e}")
            if r.nwarn > len(r.warns):
                lines.append(f"{'':45s}({r.nwarn} deviations in all)")
        c = self.counts()
        lines.append("")
        lines.append(f"{c['pass']} pass, {c['fail']} fail, {c['warn']} warn, {c['not exercised']} not exercised")
        for n in self.notes:
            lines.append(f"note: {n}")
        if self.error:
            lines.append(f"error: {self.error}")
        return "\n".join(lines)

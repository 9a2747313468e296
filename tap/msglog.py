"""The message log of `vring tap --log FILE`: one JSON object per line, and `vring tap --decode FILE`.

Lines (keys in this order; ``t`` is Unix seconds, ``seq`` counts lines from 1):

* a message: ``{"t", "seq", "conn", "dir": "F>B" | "B>F", "request": name, "code": int, "flags": int,
  "flag_names": [...], "size": payload bytes, "payload": decoded (or null), "hex": payload as hex,
  "fds": [{"fd", "what", "size"}], "error": why the tap thinks it breaks the protocol (only if so),
  "fds_sent": the tap's own fds that went on instead (``--notify-tap`` only)}``. F>B is frontend to
  backend (requests), B>F the other way (replies).
* a notification (``--notify-tap``): ``{"t", "seq", "conn", "dir", "notify": "kick" | "call", "vring",
  "count"}``: one eventfd read of ``count`` writes, as the tap passed it on.
* a session event: ``{"t", "seq", "conn", "event": "connected" | "disconnected" | ..., ...}``.

Payloads are decoded with rings.vhost_user's per-request decoders, fds aside (they are described: the
kind of file and its size).
"""
import dataclasses
import json
import os
import stat
import threading
import time

from rings import vhost_user as vu
from rings.errors import ProtocolError
from rings.layout import feature_names

from .picture import STATUS_NAMES, decode_base

R = vu.VhostUserRequest
U64_FEATURES = {R.SET_FEATURES, R.GET_FEATURES}
U64_PROTOCOL = {R.SET_PROTOCOL_FEATURES, R.GET_PROTOCOL_FEATURES}
U64_STATUS = {R.SET_STATUS, R.GET_STATUS}


def decode_payload(msg, reply):
    """(value, error): the payload as rings.vhost_user decodes it, checked like vhost_user.decode would
    check it (size, fd count, index range), without touching the message's fds."""
    clone = vu.Message(msg.request, msg.flags, msg.payload, [-1] * len(msg.fds))  # closing -1 is harmless
    try:
        return vu.decode(clone, reply=reply), None
    except ProtocolError as e:
        value = None
        spec = (vu.REPLY_SPECS.get(msg.request, vu.ACK_SPEC) if reply else vu.REQUEST_SPECS.get(msg.request))
        if spec is not None:
            try:
                value = spec.decode(msg.payload)
            except ProtocolError:
                pass
        return value, str(e)


def _protocol_name(bit):
    try:
        return vu.VhostUserProtocolFeature(bit).name
    except ValueError:
        return f"bit{bit}"


def _names(value, table):
    return [table.get(1 << b, f"bit{b}") for b in range(64) if value >> b & 1]


def payload_json(msg, value, reply, packed=False):
    """A JSON-able form of a decoded payload, with names for feature and status bits."""
    if value is None:
        return None
    if isinstance(value, int):
        out = {"u64": value, "hex": hex(value)}
        carries = vu.has_reply(msg.request) if reply else True  # a reply to a SET_* is an ack, not a value
        if carries and msg.request in U64_FEATURES:
            out["names"] = feature_names(value)
        elif carries and msg.request in U64_PROTOCOL:
            out["names"] = [_protocol_name(b) for b in range(64) if value >> b & 1]
        elif carries and msg.request in U64_STATUS:
            out["names"] = _names(value, STATUS_NAMES)
        elif reply:
            out["ack"] = "ok" if value == 0 else "NACK"
        return out
    if isinstance(value, list):
        return [dataclasses.asdict(r) for r in value]
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    out = dataclasses.asdict(value)
    if packed and msg.request in (R.SET_VRING_BASE, R.GET_VRING_BASE) and (reply or msg.request == R.SET_VRING_BASE):
        out["decoded"] = decode_base(value.num, packed)
    return out


def describe_fd(fd):
    """What an fd received from a peer is: the link /proc shows (memfd:..., anon_inode:[eventfd], socket:...)
    and, for a regular file or memfd, its size."""
    out = {"fd": fd}
    try:
        out["what"] = os.readlink(f"/proc/self/fd/{fd}")
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            out["size"] = st.st_size
    except OSError as e:
        out["what"] = f"? ({e.strerror})"
    return out


class MessageLog:
    """Appends JSON lines to a file (created 0600), from any thread."""

    def __init__(self, path):
        fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self.f = os.fdopen(fd, "w", buffering=1)
        self.lock = threading.Lock()
        self.seq = 0

    def write(self, record):
        with self.lock:
            self.seq += 1
            line = {"t": round(time.time(), 6), "seq": self.seq, **record}
            self.f.write(json.dumps(line, separators=(",", ":")) + "\n")

    def message(self, conn, direction, msg, value, error, fds, fds_sent=None, packed=False):
        reply = direction == "B>F"
        rec = {"conn": conn, "dir": direction, "request": msg.name, "code": int(msg.request),
               "flags": msg.flags, "flag_names": _flag_names(msg.flags), "size": msg.size,
               "payload": payload_json(msg, value, reply, packed), "hex": msg.payload.hex(), "fds": fds}
        if error:
            rec["error"] = error
        if fds_sent is not None:
            rec["fds_sent"] = fds_sent
        self.write(rec)

    def close(self):
        with self.lock:
            self.f.close()


def _flag_names(flags):
    names = [f"VERSION_{flags & vu.VERSION_MASK}"]
    if flags & vu.REPLY:
        names.append("REPLY")
    if flags & vu.NEED_REPLY:
        names.append("NEED_REPLY")
    if flags & ~(vu.VERSION_MASK | vu.REPLY | vu.NEED_REPLY):
        names.append(hex(flags & ~(vu.VERSION_MASK | vu.REPLY | vu.NEED_REPLY)))
    return names


# --- --decode ------------------------------------------------------------------------------------------------

def _value(v):
    if isinstance(v, bool) or not isinstance(v, int):
        return str(v)
    return hex(v) if v >= 0x10000 else str(v)


def _fmt_payload(p):
    if p is None:
        return ""
    if isinstance(p, list):
        return " ".join("[" + " ".join(f"{k}={_value(v)}" for k, v in r.items()) + "]" for r in p)
    if "u64" in p:
        text = p["hex"]
        if "names" in p:
            text += " (" + "|".join(p["names"]) + ")"
        if "ack" in p:
            text += f" {p['ack']}"
        return text
    return " ".join(f"{k}={_value(v)}" for k, v in p.items())


def format_line(rec):
    """One log record as one line of text."""
    t = rec.get("t", 0)
    when = time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1e6) % 1000000:06d}"
    head = f"{when} #{rec.get('seq', '?')} conn {rec.get('conn', '?')}"
    if "event" in rec:
        rest = " ".join(f"{k}={v}" for k, v in rec.items() if k not in ("t", "seq", "conn", "event"))
        return f"{head} -- {rec['event']} {rest}".rstrip()
    if "notify" in rec:
        return f"{head} {rec['dir']} {rec['notify']} vring {rec['vring']} x{rec['count']}"
    fds = ", ".join(f"{d.get('what', '?')}" + (f" ({d['size']} bytes)" if "size" in d else "")
                    for d in rec.get("fds", ())) or "-"
    line = (f"{head} {rec['dir']} {rec['request']} [{'|'.join(rec.get('flag_names', ()))}] "
            f"{_fmt_payload(rec.get('payload'))} fds: {fds}")
    if rec.get("fds_sent"):
        line += f" (passed on as the tap's {', '.join(rec['fds_sent'])})"
    if rec.get("error"):
        line += f"  !! {rec['error']}"
    return line


MAX_RECORD = 1 << 20   # bytes: a record is one message (at most a few KiB of payload, as text); a longer line
#                        ends the decoding (a file of no newlines, sparse or not, would otherwise be read whole)


def decode_file(path, out):
    """Print a --log file readably. Returns the number of lines that were not log records. Only a regular file is
    read (opened non-blocking: a FIFO without a writer cannot hang us, nor /dev/zero fill memory): OSError."""
    bad = 0
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path}: not a regular file")
    with open(fd, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(iter(lambda: f.readline(MAX_RECORD + 1), ""), 1):
            if len(line) > MAX_RECORD:
                print(f"line {n}: longer than {MAX_RECORD} bytes: not a tap log; decoding stopped", file=out)
                return bad + 1
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise ValueError("not an object")
                text = format_line(rec)
            except (ValueError, KeyError, TypeError, RecursionError) as e:
                bad += 1
                text = f"line {n}: not a tap log record ({type(e).__name__}: {' '.join(str(e).split())[:80]})"
            print(text, file=out)
    return bad

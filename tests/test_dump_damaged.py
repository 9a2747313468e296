"""Damaged raw snapshot files (issue 12): the loader checks every header key, type and range before it
decodes anything, and `vring dump --from` answers every damaged file with a one-line error and exit 1.

The named cases are the ones an independent decoder found crashing the old loader; the hypothesis tests
damage real snapshots at random (header values replaced by values of other types and ranges, bytes
flipped or cut) and require a ConfigError or a complete decode, text and diagnosis included.
"""
import importlib
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rings import errors, rawdump
from rings.diagnose import diagnose, format_findings
from rings.layout import VIRTIO_F_IN_ORDER, VIRTIO_F_RING_PACKED, QueueLayout, bit
from rings.shm import MemoryTable
from rings.snapshot import format_snapshot
from vring import cli

BASE = 0x100000


def _queue_pair(fmt, features, size=8):
    impl = importlib.import_module("rings.reference")
    mem = MemoryTable([(BASE, 1 << 16, bytearray(1 << 16))])
    lay = QueueLayout.contiguous(fmt, size, BASE)
    drv, dev = impl.DriverQueue(mem, lay, features), impl.DeviceQueue(mem, lay, features)
    k = 3
    drv.add(BASE + 0x8000 + 128 * np.arange(k + 1), np.full(k + 1, 100), np.array([2, 1, 1]) * 0,
            np.array([2, 1, 1]), np.arange(k))
    drv.publish()
    ch = dev.poll()
    dev.push_used(ch.id[:1], ch.wlen[:1])
    dev.flush()
    return mem, lay, drv, dev


def _files():
    """Raw snapshot bytes of every kind and format."""
    out = []
    for fmt in ("split", "packed"):
        feats = (bit(VIRTIO_F_RING_PACKED) if fmt == "packed" else 0)
        for extra in (0, bit(VIRTIO_F_IN_ORDER)):
            mem, lay, drv, dev = _queue_pair(fmt, feats | extra)
            out += [rawdump.capture(drv, meta={"name": "tx0", "pid": 1}).dumps(),
                    rawdump.capture(dev).dumps(), rawdump.capture_memory(mem, lay, feats | extra).dumps()]
    return out


FILES = _files()


def split_file(data):
    magic, header, rest = data.split(b"\n", 2)
    return json.loads(header), rest


def join_file(header, rest):
    return rawdump.MAGIC + json.dumps(header, separators=(",", ":")).encode() + b"\n" + rest


def decode_all(data):
    """What `vring dump --from` does with a file: load, decode, text, diagnose. Returns the text."""
    raw = rawdump.loads(data)
    snap = raw.snapshot()
    json.dumps(snap)
    return format_snapshot(snap) + format_findings(diagnose(snap))


def check_damaged(data, tmp_path, capsys):
    """A damaged file: ConfigError from the loader, and from the command one line on stderr, exit 1."""
    with pytest.raises(errors.ConfigError):
        rawdump.loads(data)
    path = tmp_path / "bad.raw"
    path.write_bytes(data)
    for extra in ([], ["--json"]):
        with pytest.raises(SystemExit) as ei:
            cli.main(["dump", "--from", str(path)] + extra)
        msg = str(ei.value.code)
        assert msg.startswith("vring dump: ") and "\n" not in msg, msg
    assert capsys.readouterr().out == ""


def _mutate(data, **changes):
    """The file with header values changed: ``layout__size=0`` sets h["layout"]["size"]."""
    h, rest = split_file(data)
    for key, value in changes.items():
        *parents, last = key.split("__")
        d = h
        for p in parents:
            d = d[p]
        d[last] = value
    return join_file(h, rest)


DRIVER_SPLIT, DRIVER_PACKED = FILES[0], FILES[6]


@pytest.mark.parametrize("case", [
    "nested", "state_empty", "state_strings", "state_huge", "free_next_out_of_range", "time_string",
    "time_nan", "time_huge", "kind_list", "size_zero", "features_negative", "in_order_disagrees",
    "blob_count", "trailing_bytes", "truncated", "not_utf8", "meta_name_list", "broken_not_class",
    "layout_unaligned", "layout_wraps", "ndesc_out_of_range", "inflight_out_of_range", "packed_index_past_size",
    "header_not_object", "unknown_key"])
def test_damaged_file_one_line_error(case, tmp_path, capsys):
    h, rest = split_file(DRIVER_SPLIT)
    n = h["layout"]["size"]
    data = {
        "nested": rawdump.MAGIC + b"[" * 100000 + b"]" * 100000 + b"\n",
        "state_empty": _mutate(DRIVER_SPLIT, state={}),
        "state_strings": _mutate(DRIVER_SPLIT, state={k: str(v) for k, v in h["state"].items()}),
        "state_huge": _mutate(DRIVER_SPLIT, state__next_avail=1 << 80),
        "time_string": _mutate(DRIVER_SPLIT, time="yesterday"),
        "time_nan": DRIVER_SPLIT.replace(f'"time":{json.dumps(h["time"])}'.encode(), b'"time":NaN'),
        "time_huge": _mutate(DRIVER_SPLIT, time=1e300),
        "kind_list": _mutate(DRIVER_SPLIT, kind=["driver"]),
        "size_zero": _mutate(DRIVER_SPLIT, layout__size=0),
        "features_negative": _mutate(DRIVER_SPLIT, features=-1),
        "in_order_disagrees": _mutate(DRIVER_SPLIT, in_order=True),
        "blob_count": _mutate(DRIVER_SPLIT, blobs=h["blobs"][:-1]),
        "trailing_bytes": DRIVER_SPLIT + b"x",
        "truncated": DRIVER_SPLIT[:-1],
        "not_utf8": rawdump.MAGIC + b'{"kind":"\xff"}\n',
        "meta_name_list": _mutate(DRIVER_SPLIT, meta={"name": ["x"]}),
        "broken_not_class": _mutate(DRIVER_SPLIT, broken={"error": "a b", "message": "m"}),
        "layout_unaligned": _mutate(DRIVER_SPLIT, layout__desc=BASE + 1),
        "layout_wraps": _mutate(DRIVER_SPLIT, layout__desc=(1 << 64) - 16),
        "packed_index_past_size": _mutate(DRIVER_PACKED, state__next_avail=8),
        "header_not_object": rawdump.MAGIC + b"[1, 2]\n",
        "unknown_key": _mutate(DRIVER_SPLIT, extra=1),
    }.get(case)
    if case in ("free_next_out_of_range", "ndesc_out_of_range", "inflight_out_of_range"):
        name, value = {"free_next_out_of_range": ("free_next", 60000), "ndesc_out_of_range": ("id_ndesc", n + 1),
                       "inflight_out_of_range": ("id_inflight", 7)}[case]
        raw = rawdump.loads(DRIVER_SPLIT)
        arr = np.array(raw.arrays[name])
        arr[0] = value
        raw.arrays[name] = arr
        data = raw.dumps()
    check_damaged(data, tmp_path, capsys)


def test_damaged_diff_one_line_error(tmp_path, capsys):
    good, bad = tmp_path / "good.raw", tmp_path / "bad.raw"
    good.write_bytes(DRIVER_SPLIT)
    bad.write_bytes(_mutate(DRIVER_SPLIT, state={}))
    with pytest.raises(SystemExit) as ei:
        cli.main(["dump", "--diff", str(good), str(bad)])
    assert str(ei.value.code).startswith("vring dump: ") and "\n" not in str(ei.value.code)


def test_undamaged_files_decode():
    for data in FILES:
        decode_all(data)
        assert rawdump.loads(data).dumps() == data


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() |
                     st.text(max_size=8), lambda inner: st.lists(inner, max_size=3) |
                     st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


def _paths(h, prefix=()):
    for k, v in h.items():
        yield prefix + (k,)
        if isinstance(v, dict):
            yield from _paths(v, prefix + (k,))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(FILES), st.data())
def test_header_values_replaced_at_random(data, draw):
    """Any header value replaced by any JSON value (ints of every range included): ConfigError or a full
    decode, never another exception."""
    h, rest = split_file(data)
    paths = list(_paths(h))
    for _ in range(draw.draw(st.integers(1, 3))):
        path = draw.draw(st.sampled_from(paths))
        d = h
        for p in path[:-1]:
            d = d[p] if isinstance(d, dict) and isinstance(d.get(p), dict) else {}
        d[path[-1]] = draw.draw(_JSON | st.integers(0, 70000))
    out = join_file(h, rest)
    try:
        rawdump.loads(out)
    except errors.ConfigError:
        return
    decode_all(out)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(FILES), st.data())
def test_bytes_flipped_or_cut_at_random(data, draw):
    """Random byte changes anywhere (the ring areas and private arrays too) or a cut: ConfigError or a full
    decode. Blob bytes are not checked by the loader beyond ranges: the decoders must cope with any ring."""
    buf = bytearray(data)
    start = draw.draw(st.sampled_from([0, data.index(b"\n", len(rawdump.MAGIC)) + 1]))  # anywhere, or the blobs
    for _ in range(draw.draw(st.integers(1, 8))):
        i = draw.draw(st.integers(start, len(buf) - 1))
        buf[i] = draw.draw(st.integers(0, 255))
    if draw.draw(st.booleans()):
        buf = buf[:draw.draw(st.integers(0, len(buf)))]
    try:
        rawdump.loads(bytes(buf))
    except errors.ConfigError:
        return
    decode_all(bytes(buf))

"""The fuzz targets of fuzz/ (issue 8): listed, their seeds reach the states they were written for, the committed
seed corpora are what the targets generate, and each target runs ~10^4 executions under ASan + UBSan without a
finding (the long runs, >= 10^6 executions each, are fuzz/run.py's job, not CI's)."""
import functools
import importlib
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUZZ = os.path.join(ROOT, "fuzz")
TARGETS = ["frontend_replies", "ring_device", "ring_driver", "vhost_backend"]


def run_py(*args, timeout=600):
    return subprocess.run([sys.executable, os.path.join(FUZZ, "run.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def targets():
    sys.path.insert(0, FUZZ)
    try:
        yield {name: importlib.import_module(f"targets.{name}") for name in TARGETS}
    finally:
        sys.path.remove(FUZZ)


def test_list_names_the_targets():
    r = run_py("--list")
    assert r.returncode == 0
    assert [line.split()[0] for line in r.stdout.splitlines()] == TARGETS


def test_committed_seeds_are_the_generated_ones(targets):
    for name, mod in targets.items():
        d = os.path.join(FUZZ, "corpus", name)
        committed = sorted(f for f in os.listdir(d) if f.startswith("seed-"))
        seeds = mod.seeds()
        assert committed == [f"seed-{i:02d}" for i in range(len(seeds))], name
        for i, data in enumerate(seeds):
            with open(os.path.join(d, f"seed-{i:02d}"), "rb") as f:
                assert f.read() == data, f"{name} seed-{i:02d}: run `python3 fuzz/run.py --write-seeds`"


def test_ring_device_seeds_move_traffic(targets):
    for data in targets["ring_device"].seeds():
        h = targets["ring_device"].TestOneInput(data)
        st = h.q.state()
        assert h.q.broken is None and st["inflight"] == 0 and st["shadow_count"] == 0
        assert st["used_idx"] == st["last_avail"] and (st["used_idx"] or st["used_wrap"] == 0)


def test_ring_driver_seeds_reclaim_everything(targets):
    for data in targets["ring_driver"].seeds():
        h = targets["ring_driver"].TestOneInput(data)
        if hasattr(h, "q"):
            assert h.q.broken is None and h.token == 8 and not h.outstanding
        else:
            rx, tx = h.rx.counters(), h.tx.counters()
            assert h.rx.vq.broken is None and h.tx.vq.broken is None
            assert rx["bytes"] and rx["packets"] == 2 - rx["merged"] and tx["reclaimed_bufs"] == 3



def test_ring_driver_rx_header_lands_in_the_buffers_headroom(targets):
    """The ring_driver target's rx_header op (a device writing a virtio-net header into posted buffer b) wrote at
    b * 256, the pool's 256-byte buffers; since 776b010 they are pool_stride(256) = 320 apart, so the header went
    into another buffer (or between two) and the op no longer reached num_buffers. It writes at b's headroom."""
    from common import Reader
    h = targets["ring_driver"].TestOneInput(bytes([1, 0]))  # the net harness, split ring of 2, no operation
    hdr = bytes(range(1, 13))
    h.header(Reader(bytes([3, 1, len(hdr)]) + hdr))  # buffer 3, a header
    pool = h.mem.pool
    at = 3 * pool.stride + pool.headroom - 12
    assert pool.stride == 320 and bytes(pool.mem[at:at + 12]) == hdr


def test_vhost_backend_seeds_forward_a_packet(targets):
    for data in targets["vhost_backend"].seeds():
        st = targets["vhost_backend"].TestOneInput(data).srv.stats()
        assert st["refused"] == 0 and st["ring_errors"] == 0
        assert st["txq1"]["tx_packets"] == 1 and st["rxq0"]["rx_packets"] == 1


def test_frontend_replies_seeds_complete_a_session(targets):
    for data in targets["frontend_replies"].seeds():
        fe = targets["frontend_replies"].TestOneInput(data)
        assert sorted(fe.vring_bases) == [0, 1]


@functools.lru_cache(maxsize=None)
def _skip_reason():
    try:
        import atheris  # noqa: F401
    except ImportError:
        return "atheris is not installed (pip install -e '.[test]')"
    if shutil.which("clang") is None:
        return "clang is not installed (.ci/run installs it)"
    r = subprocess.run(["clang", "-x", "c", "-fsanitize=address,undefined", "-o", os.devnull, "-"],
                       input="int main(void) { return 0; }", capture_output=True, text=True)
    if r.returncode:
        return ("clang cannot link the sanitizers' runtime (Debian: libclang-rt-N-dev; .ci/run installs it): "
                + (r.stderr.strip().splitlines() or ["?"])[0])
    return None


@pytest.mark.skipif(bool(_skip_reason()), reason=_skip_reason() or "ok")
@pytest.mark.parametrize("target", TARGETS)
def test_fuzz_target_runs_clean_under_sanitizers(target, tmp_path):
    r = run_py(target, "--runs", "10000", "--corpus", str(tmp_path), "--seed", "1")
    tail = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == 0, tail
    assert "Done 10000 runs" in r.stderr, tail
    assert "ERROR: AddressSanitizer" not in r.stderr and "runtime error" not in r.stderr, tail


REGRESSIONS = sorted((t, f) for t in TARGETS if os.path.isdir(os.path.join(FUZZ, "regressions", t))
                     for f in os.listdir(os.path.join(FUZZ, "regressions", t)))


@pytest.mark.skipif(bool(_skip_reason()), reason=_skip_reason() or "ok")
@pytest.mark.parametrize("target,name", REGRESSIONS, ids=[f"{t}/{f}" for t, f in REGRESSIONS])
def test_fuzz_findings_stay_fixed(target, name):
    """Every input a fuzz run found is replayed under the sanitizers (fuzz/regressions/TARGET/)."""
    r = run_py(target, "--repro", os.path.join(FUZZ, "regressions", target, name))
    assert r.returncode == 0 and "ran without a finding" in r.stdout, (r.stdout + r.stderr)[-4000:]


def test_vhost_backend_oracle_sees_an_internal_error(targets, monkeypatch):
    """The server catches a bug of its own (and keeps serving): the target must still call it a finding."""
    from vhost.device import NetDevice

    def broken(self, msg, value):
        raise RuntimeError("a bug")
    monkeypatch.setattr(NetDevice, "_get_features", broken)
    with pytest.raises(AssertionError, match="internal error"):
        targets["vhost_backend"].TestOneInput(targets["vhost_backend"].seeds()[0])

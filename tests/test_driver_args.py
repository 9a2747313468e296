"""`vring driver` argument validation (attack24): values no run can use are a one-line usage error, exit 2,
before anything connects (the socket here has nobody listening: reaching it would say PeerGone instead)."""
import os

import pytest

from vring import cli


@pytest.mark.parametrize("argv, words", [
    # --ring-size 0 / -1 used to pass to a warning about "a None-byte frame" and "a ring size of at least 0",
    # then a connect; 3 (split) was refused only after the whole vhost-user handshake
    (["--ring-size", "0"], "--ring-size: queue size must be 1..32768"),
    (["--ring-size", "-1"], "--ring-size: queue size must be 1..32768"),
    (["--ring-size", "65536"], "--ring-size: queue size must be 1..32768"),
    (["--ring-size", "3"], "--ring-size: split queue size must be a power of 2"),
    # a CPU this process cannot run on was ignored silently (pin_all_threads swallows the OSError)
    (["--pin", "99999"], "--pin 99999 is not a CPU"),
])
def test_unusable_values_are_usage_errors(tmp_path, capsys, argv, words):
    rc = cli.main(["driver", "--socket", str(tmp_path / "nobody.sock")] + argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("vring driver: ") and err.count("\n") == 1, err
    assert words in err and "PeerGone" not in err, err


def test_packed_any_size_and_allowed_cpu_pass_the_check(tmp_path, capsys):
    allowed = os.sched_getaffinity(0)
    try:   # run() pins every thread of this (the test) process: put them back afterwards
        rc = cli.main(["driver", "--socket", str(tmp_path / "nobody.sock"), "--packed", "--ring-size", "3",
                       "--pin", str(min(allowed))])
    finally:
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), allowed)
            except OSError:
                pass
    assert rc == 2 and "PeerGone" in capsys.readouterr().err   # got as far as connecting


@pytest.mark.parametrize("n", ["0", "-1"])
def test_vhost_max_connections_below_one_is_a_usage_error(tmp_path, capsys, n):
    """`vring vhost --max-connections 0` (or -1) listened, served nobody and exited 0 at once (attack24)."""
    rc = cli.main(["vhost", "--socket", str(tmp_path / "v.sock"), "--max-connections", n])
    err = capsys.readouterr().err
    assert rc == 2 and "--max-connections must be >= 1" in err, err
    assert not (tmp_path / "v.sock").exists()

"""`vring driver` argument validation (attack24): values no run can use are a one-line usage error, exit 2,
before anything connects (the socket here has nobody listening: reaching it would say PeerGone instead)."""
import json
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


@pytest.mark.parametrize("argv, rc, out_words, err_words", [
    # what the queues can carry: exit 0, nothing connected (nobody listens on the socket; no PeerGone)
    ([], 0, "the configuration checks out (0 warnings); not connected", None),
    # NET-24 (a SHOULD): 256-byte Rx buffers without MRG_RXBUF, a warning and still exit 0
    (["--no-mrg-rxbuf", "--buf-size", "384"], 0, "(1 warning)", "NET-24"),
    # NET-27: a 1500-byte frame in one 256-byte Rx buffer: refused, with the buffer size that would carry it
    (["--no-mrg-rxbuf", "--buf-size", "384", "--pkt-size", "1500", "--mode", "macfwd", "--count", "32"], 2, None,
     "FrameDoesNotFit: a 1500-byte frame and its 12-byte header do not fit one 256-byte Rx buffer"),
    (["--headroom", "2000"], 2, None, "ConfigError: pool: need 12 <= headroom"),
    (["--ring-size", "3"], 2, None, "--ring-size: split queue size must be a power of 2"),
    # attack64: these passed --check and were refused by the run, after the handshake or once the device ran
    (["--tx-hdr", "indirect", "--no-indirect"], 2, None, "indirect Tx headers need VIRTIO_F_INDIRECT_DESC"),
    (["--tx-hdr", "indirect", "--packed", "--ring-size", "1"], 2, None, "indirect tables of at least 2 entries"),
    (["--pcap", "/nonexistent/dir/x.pcap"], 2, None, "--pcap /nonexistent/dir/x.pcap: there is no directory"),
    (["--ctl", "/nonexistent/dir/ctl.sock"], 2, None, "--ctl /nonexistent/dir/ctl.sock: there is no directory"),
    # helper-72: the paced loop runs in C; the capture took 28 of 20000 frames and said nothing
    (["--mode", "rate", "--rate", "1000", "--pcap", "x.pcap"], 2, None, "--pcap cannot capture --mode rate"),
])
def test_check_says_whether_a_run_could_start_without_connecting(tmp_path, capsys, argv, rc, out_words, err_words):
    got = cli.main(["driver", "--socket", str(tmp_path / "nobody.sock"), "--check"] + argv)
    out, err = capsys.readouterr()
    assert got == rc, (out, err)
    assert "PeerGone" not in err and not (tmp_path / "nobody.sock").exists()
    if out_words:
        assert out_words in out, out
    else:
        assert out == "", out
    if err_words:
        assert err.startswith("vring driver: ") and err_words in err, err
    else:
        assert err == "", err


def test_check_refuses_paths_the_run_could_not_create(tmp_path, capsys):
    """attack65: each of these passed --check and failed once the run reached it (after connecting, or, --server,
    at its listen): a --pcap that is a directory, --pcap and --ctl on one path, a --ctl (or --server socket) that
    is a file or a socket somebody listens on."""
    import socket
    live = tmp_path / "live.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(live))
    server.listen(1)
    plain = tmp_path / "plain"
    plain.write_text("")
    try:
        for argv, words in (
                (["--pcap", str(tmp_path)], f"--pcap {tmp_path} is a directory"),
                (["--pcap", str(tmp_path / "x"), "--ctl", str(tmp_path / "x")], "--pcap and --ctl are the same path"),
                (["--ctl", str(plain)], f"--ctl {plain} exists and is not a socket"),
                (["--ctl", str(live)], f"--ctl {live}: a server is listening on this socket already"),
                (["--server"], f"--socket {live}: a server is listening on this socket already")):
            sock = str(live) if "--server" in argv else str(tmp_path / "nobody.sock")
            rc = cli.main(["driver", "--socket", sock, "--check"] + argv)
            out, err = capsys.readouterr()
            assert rc == 2 and out == "" and words in err, (argv, out, err)
    finally:
        server.close()
    assert plain.read_text() == "" and live.exists()   # nothing replaced or removed


def test_check_refuses_a_socket_path_too_long_for_sun_path(tmp_path, capsys):
    """A --socket, --ctl or --server socket longer than sun_path passed --check and failed at the run's connect or
    listen ("AF_UNIX path too long"). The longest path that fits (107 bytes) binds, and passes."""
    import socket
    from rings.vhost_user import SUN_PATH_MAX
    base = str(tmp_path) + "/"
    fits, long = base + "s" * (SUN_PATH_MAX - len(base)), base + "l" * (SUN_PATH_MAX + 1 - len(base))
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.bind(fits)   # what the run's listen would do: the limit is the one bind has
    finally:
        probe.close()
        os.unlink(fits)
    nobody = str(tmp_path / "nobody.sock")
    for argv, words in ((["--socket", long], f"--socket {long}: {SUN_PATH_MAX + 1} bytes"),
                        (["--socket", long, "--server"], f"--socket {long}: {SUN_PATH_MAX + 1} bytes"),
                        (["--socket", nobody, "--ctl", long], f"--ctl {long}: {SUN_PATH_MAX + 1} bytes")):
        rc = cli.main(["driver", "--check"] + argv)
        out, err = capsys.readouterr()
        assert rc == 2 and out == "" and words in err, (argv, out, err)
    for argv in (["--socket", fits], ["--socket", fits, "--server"], ["--socket", nobody, "--ctl", fits]):
        rc = cli.main(["driver", "--check"] + argv)
        out, err = capsys.readouterr()
        assert rc == 0, (argv, out, err)


def test_check_json_is_one_document(tmp_path, capsys):
    rc = cli.main(["driver", "--socket", str(tmp_path / "nobody.sock"), "--check", "--json", "--no-mrg-rxbuf",
                   "--buf-size", "384"])
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert rc == 0 and doc["checked"] and not doc["connected"], (out, err)
    assert len(doc["warnings"]) == 1 and "NET-24" in doc["warnings"][0] and "NET-24" in err


@pytest.mark.parametrize("n", ["0", "-1"])
def test_vhost_max_connections_below_one_is_a_usage_error(tmp_path, capsys, n):
    """`vring vhost --max-connections 0` (or -1) listened, served nobody and exited 0 at once (attack24)."""
    rc = cli.main(["vhost", "--socket", str(tmp_path / "v.sock"), "--max-connections", n])
    err = capsys.readouterr().err
    assert rc == 2 and "--max-connections must be >= 1" in err, err
    assert not (tmp_path / "v.sock").exists()

@pytest.mark.parametrize("server", [False, True], ids=["client", "server"])
def test_check_refuses_an_empty_socket_path(capsys, server):
    """--socket "" passed --check; the run then failed at connect ("Invalid argument") or listen ("No such file")."""
    rc = cli.main(["driver", "--check", "--socket", ""] + ["--server"] * server)
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and "empty path" in err, (out, err)


def test_vhost_refuses_an_empty_socket_path(capsys):
    assert cli.main(["vhost", "--socket", ""]) == 2
    assert "empty path" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["driver", "vhost"])
@pytest.mark.parametrize("option", ["--ctl", "--pcap"])
def test_an_empty_ctl_or_pcap_path_is_refused_by_both_commands(tmp_path, capsys, command, option):
    """`--ctl ""` and `--pcap ""` meant "off" in the driver, where `vring vhost` refused `--ctl ""` (helper-68):
    both commands refuse both, before anything runs."""
    argv = [command, "--socket", str(tmp_path / "s.sock"), option, ""] + ["--check"] * (command == "driver")
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and option in err and "empty" in err, (out, err)
    assert not (tmp_path / "s.sock").exists()


@pytest.mark.parametrize("case", ["ctl-is-server-socket", "pcap-is-server-socket", "pcap-is-ctl-by-symlink",
                                  "server-dir-missing", "ctl-trailing-slash", "server-socket-under-a-file"])
def test_check_refuses_what_the_run_would_refuse(tmp_path, capsys, case):
    """helper-68: each passed --check and failed once the run was under way (or, the last, with a traceback)."""
    sock = str(tmp_path / "s.sock")
    (tmp_path / "plain").write_text("")
    (tmp_path / "link").symlink_to(tmp_path)
    argv = {"ctl-is-server-socket": ["--server", "--socket", sock, "--ctl", sock],
            "pcap-is-server-socket": ["--server", "--socket", sock, "--pcap", sock],
            "pcap-is-ctl-by-symlink": ["--socket", sock, "--pcap", str(tmp_path / "link" / "p"),
                                       "--ctl", str(tmp_path / "p")],
            "server-dir-missing": ["--server", "--socket", str(tmp_path / "nodir" / "s.sock")],
            "ctl-trailing-slash": ["--socket", sock, "--ctl", str(tmp_path / "c.sock") + "/"],
            "server-socket-under-a-file": ["--server", "--socket", str(tmp_path / "plain" / "s.sock")]}[case]
    rc = cli.main(["driver", "--check"] + argv)
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.startswith("vring driver: --") and "Traceback" not in err, (argv, out, err)


def test_vhost_socket_under_a_plain_file_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "plain").write_text("")
    assert cli.main(["vhost", "--socket", str(tmp_path / "plain" / "s.sock")]) == 2
    assert "Not a directory" in capsys.readouterr().err

"""`vring dump --ctl` against live processes: `vring vhost` and `vring driver` moving packets, each
answering on its control socket while the data path runs (issue 5: attach without stopping the queue)."""
import json
import signal
import subprocess
import sys
import time

import pytest

from rings import ctl

from procs import wait_for

VRING = [sys.executable, "-m", "vring.cli"]


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_dump_running_vhost_and_driver(tmp_path, capsys, fmt):
    sock, vctl, dctl = tmp_path / "vhost.sock", tmp_path / "vhost.ctl", tmp_path / "driver.ctl"
    procs = []
    try:
        vhost = subprocess.Popen(VRING + ["vhost", "--socket", str(sock), "--ctl", str(vctl),
                                          "--max-connections", "1"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(vhost)
        wait_for(sock, vhost)
        driver = subprocess.Popen(VRING + ["driver", "--socket", str(sock), "--ctl", str(dctl), f"--{fmt}",
                                           "--mode", "macfwd", "--count", "64", "--seconds", "4", "--json"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(driver)
        wait_for(dctl, driver)
        time.sleep(1.0)  # traffic is flowing
        names = {q["name"]: q for q in ctl.query(str(dctl))}
        assert set(names) == {"rx", "tx"} and names["tx"]["side"] == "driver"
        tx = ctl.query(str(dctl), "tx").snapshot()
        assert tx["format"] == fmt and tx["side"] == "driver" and len(tx["descriptors"]) == 256
        dev = ctl.query(str(vctl), "rx").snapshot()
        assert dev["side"] == "device" and dev["format"] == fmt
        from vring.cli import main
        assert main(["dump", "--ctl", str(vctl), "tx", "--json"]) == 0
        (doc,) = json.loads(capsys.readouterr().out)
        assert doc["name"] == "tx" and doc["snapshot"]["side"] == "device"
        assert doc["snapshot"]["format"] == fmt and isinstance(doc["diagnosis"], list)
        out, err = driver.communicate(timeout=30)
        assert driver.returncode == 0, err
        assert json.loads(out)["rx"]["packets"] > 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.communicate(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.communicate()

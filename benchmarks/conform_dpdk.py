"""`vring conform` against DPDK's dpdk-testpmd, both ways, over the whole feature matrix; one table at the end.

    python3 benchmarks/conform_dpdk.py [--out DIR] [--ring-size 256] [--seconds 6] [--roles device,driver]

* device: `vring conform device` against net_vhost (testpmd --forward-mode=io), split/packed x
  in-order/not x MRG_RXBUF on/off, each on a new connection to one testpmd;
* driver: `vring conform driver` against virtio_user (testpmd --forward-mode=mac, a new testpmd per run),
  packed_vq x in_order x mrg_rxbuf; packed rings a second time without INDIRECT_DESC, because virtio_user's
  packed indirect tables break the ring at the first multi-segment frame (PACKED-D-10), which ends the run.

Each run's JSON report is written to DIR; the table has one row per checklist ID and one column per run:
P pass, F fail, W warn, . not exercised. Then the first evidence of every failure.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from vring import dpdk  # noqa: E402


def conform(args, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "vring.cli", "conform", *args, "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def collect(proc, timeout=600):
    out, err = proc.communicate(timeout=timeout)
    rep = json.loads(out) if out.strip() else {"error": err.strip(), "results": [], "exit_code": proc.returncode}
    rep["exit_code"] = proc.returncode
    return rep


def device_runs(out, ring_size):
    sock = os.path.join(out, "nv.sock")
    cpus = sorted(os.sched_getaffinity(0))
    tp = dpdk.Testpmd.vhost(sock, fwd="io", fwd_cpu=cpus[0])
    runs = {}
    try:
        tp.start()
        cases = [(p, o, m, False) for p in (False, True) for o in (True, False) for m in (False, True)]
        cases += [(p, True, True, True) for p in (False, True)]   # and EVENT_IDX (virtio_user never asks for it)
        for packed, in_order, mrg, event_idx in cases:
            name = (f"dev-{'packed' if packed else 'split'}-{'io' if in_order else 'nio'}-"
                    f"{'mrg' if mrg else 'nomrg'}{'-ei' if event_idx else ''}")
            args = ["device", "--socket", sock, "--ring-size", str(ring_size),
                    "--packed" if packed else "--split", "--in-order" if in_order else "--no-in-order",
                    "--mrg-rxbuf" if mrg else "--no-mrg-rxbuf", "--event-idx" if event_idx else "--no-event-idx"]
            t0 = time.monotonic()
            runs[name] = collect(conform(args))
            runs[name]["argv"] = "vring conform " + " ".join(args)
            print(f"{name}: exit {runs[name]['exit_code']} in {time.monotonic() - t0:.1f}s", flush=True)
    finally:
        tp.close()
        runs["_testpmd_errors"] = tp.error_lines()
    return runs


def driver_runs(out, seconds):
    runs = {}
    cpus = sorted(os.sched_getaffinity(0))
    for packed in (False, True):
        for in_order in (True, False):
            for mrg in (True, False):
                for indirect in ((True, False) if packed else (True,)):
                    name = (f"drv-{'packed' if packed else 'split'}-{'io' if in_order else 'nio'}-"
                            f"{'mrg' if mrg else 'nomrg'}{'' if indirect else '-noind'}")
                    sock = os.path.join(out, f"{name}.sock")
                    args = ["driver", "--socket", sock, "--seconds", str(seconds)] + ([] if indirect else
                                                                                       ["--no-indirect"])
                    proc = conform(args)
                    t0 = time.monotonic()
                    while not os.path.exists(sock) and proc.poll() is None:
                        time.sleep(0.02)
                    tp = dpdk.Testpmd.virtio_user(sock, packed=packed, in_order=in_order, mrg_rxbuf=mrg, fwd="mac",
                                                  tx_first=False, fwd_cpu=cpus[-1])
                    try:
                        tp.start(60)
                        runs[name] = collect(proc)
                    finally:
                        if proc.poll() is None:
                            proc.kill()
                            proc.communicate()
                        final = tp.close()
                    # testpmd's own drops explain frames the harness reports as never back (see conform/README.md)
                    runs[name]["testpmd_fwd"] = {p: st.as_dict() for p, st in final.fwd.items()}
                    runs[name]["argv"] = "vring conform " + " ".join(args) + (
                        f"  <->  testpmd virtio_user0,path=S,packed_vq={int(packed)},in_order={int(in_order)},"
                        f"mrg_rxbuf={int(mrg)} --forward-mode=mac")
                    print(f"{name}: exit {runs[name]['exit_code']} in {time.monotonic() - t0:.1f}s", flush=True)
    return runs


def table(runs):
    names = [n for n in runs if not n.startswith("_")]
    ids = []
    for n in names:
        for r in runs[n].get("results", []):
            if r["id"] not in ids:
                ids.append(r["id"])
    mark = {"pass": "P", "fail": "F", "warn": "W", "not exercised": "."}
    cells = {n: {r["id"]: mark[r["status"]] for r in runs[n].get("results", [])} for n in names}
    lines = ["columns: " + "  ".join(f"{i + 1}={n}" for i, n in enumerate(names)), ""]
    lines.append(f"{'ID':12s} " + " ".join(f"{i + 1:>2d}" for i in range(len(names))))
    for rid in ids:
        lines.append(f"{rid:12s} " + " ".join(f"{cells[n].get(rid, ' '):>2s}" for n in names))
    lines.append("")
    for n in names:
        rep = runs[n]
        lines.append(f"{n}: exit {rep['exit_code']}; {rep.get('context', {}).get('traffic', '')}")
        lines.append(f"    {rep.get('argv', '')}")
        if rep.get("error"):
            lines.append(f"    error: {rep['error']}")
        for r in rep.get("results", []):
            if r["status"] == "fail":
                lines.append(f"    {r['id']}: {r['evidence'][0]}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="directory for the JSON reports (default: a temporary one)")
    ap.add_argument("--ring-size", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=6.0, help="driver role: seconds per run")
    ap.add_argument("--roles", default="device,driver")
    a = ap.parse_args()
    if dpdk.skip_reason():
        sys.exit(f"cannot run: {dpdk.skip_reason()}")
    out = a.out or tempfile.mkdtemp(prefix="conform-dpdk-")
    os.makedirs(out, exist_ok=True)
    runs = {}
    if "device" in a.roles:
        runs.update(device_runs(out, a.ring_size))
    if "driver" in a.roles:
        runs.update(driver_runs(out, a.seconds))
    with open(os.path.join(out, "conform_dpdk.json"), "w") as f:
        json.dump(runs, f, indent=1)
    print(table(runs))
    print(f"\nreports: {out}/conform_dpdk.json")


if __name__ == "__main__":
    main()

"""`vring bench --study NAME`: the design choices our seeds took from DPDK, OVS and the kernel, each measured side
by side in one run, with the effect the original authors reported printed beside ours.

Every variant is a real code path of our driver or backend, chosen once per queue by a command-line option (the
option is in the table and the JSON); nothing is simulated. Variants of one group run one after the other within
a repeat (order reversed every other repeat), so the ratio to the baseline is taken between runs that saw the
same machine; the table shows the median of those per-repeat ratios.

    tx-cleanup   driver Tx cleanup, normal vs in-order (one used entry per buffer, or one per batch)
    hdr-prepend  Tx virtio-net header in the headroom (1 descriptor) vs chained (2) vs indirect
    hdr-init     Tx header cleared once per burst vs once per packet
    doorbell     one kick per burst vs one per packet, notifications on (the device sleeps when idle)
    retries      backend Rx enqueue retries 0..8, a receiver slower than the sender (open loop)
    txq          backend intermediate Tx queue: none, threshold, per Rx batch, threshold + timer, at low and
                 high offered load (open loop)
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from vring.bench import Point, _fmt, _pct, _rate_label


@dataclass(frozen=True)
class Variant:
    label: str
    driver_args: tuple = ()
    device_args: tuple = ()
    in_order: bool | None = None   # tx-cleanup: the variant decides the path's in-order half
    reported: str = ""             # the original authors' effect, on the row it belongs to ...
    reported_on: str = ""          # ... in the groups starting with this ("": all)


@dataclass(frozen=True)
class Study:
    name: str
    what: str
    authors: str            # what the original authors reported (printed above the table)
    variants: tuple
    columns: tuple          # metric columns of the table (see COLUMNS)
    plot_metrics: tuple     # what the plot shows, one panel each
    ratio: str = "mpps"     # the metric compared with the baseline: mpps, delivered_mpps, p50_us
    mode: str = "poll"
    rates: tuple = ()       # default offered loads (open loop); (): closed loop
    default_paths: tuple = ("split-normal", "packed-normal")
    per_format: bool = False
    devices: tuple = ("ours",)   # devices the variants may face: "dpdk" too when they differ in the driver only
    tx_hdr_fixed: str = ""       # why --tx-hdr must stay at its default for this study ("": it may be set)
    descs_per_packet: int = 1    # the most ring entries a variant takes per packet (the rings are sized for it)

    def check_pairs(self, pairs):
        """ValueError unless every pair is our driver in front of a device this study may face."""
        allowed = [f"ours/{d}" for d in self.devices]
        bad = [p for p in pairs if p not in allowed]
        if bad:
            raise ValueError(f"--study {self.name} runs {' and '.join(allowed)} only, not {', '.join(bad)}")

    @property
    def baseline(self):
        return self.variants[0].label

    def paths(self, cfg):
        if not self.per_format:
            return list(cfg.paths)
        fmts = []
        for p in cfg.paths:
            f = p.split("-")[0]
            if f not in fmts:
                fmts.append(f)
        return fmts

    def points(self, cfg):
        rates = list(cfg.rates) or list(self.rates) or [None]
        for rep in range(cfg.repeat):
            for pair in cfg.pairs:
                for where in self.paths(cfg):
                    for size in cfg.pkt_sizes:
                        for rate in rates:
                            group = where + ("" if pair == "ours/ours" else f" {pair}") \
                                + ("" if rate is None else f" @ {_rate_label(rate)} fps")
                            variants = self.variants if rep % 2 == 0 else self.variants[::-1]
                            for v in variants:
                                path = where
                                if self.per_format:
                                    path = f"{where}-{'in-order' if v.in_order else 'normal'}"
                                yield Point(rep, path, size, pair, self.mode, rate, group=group, variant=v.label,
                                            driver_args=v.driver_args, device_args=v.device_args)

    def summary(self, cfg, points):
        """Rows (group, variant, metrics, ratio to the baseline in the same group) for the table and the JSON."""
        rows = []
        by = {(p["group"], p["pkt_size"], p["variant"]): p for p in points}
        for p in points:
            base = by.get((p["group"], p["pkt_size"], self.baseline))
            v = next((x for x in self.variants if x.label == p["variant"]), None)
            row = {"group": p["group"], "pair": p["pair"], "pkt_size": p["pkt_size"], "variant": p["variant"],
                   "path": p["path"],
                   "offered_pps": p["offered_pps"], "driver_args": list(v.driver_args) if v else [],
                   "device_args": list(v.device_args) if v else [],
                   "reported": v.reported if v and p["group"].startswith(v.reported_on) else "",
                   "loss_check_ok": p["loss_check_ok"], "noisy": p.get("noisy", False), "repeats": p["repeats"]}
            for col in self.columns:
                row[col] = COLUMNS[col][1](p)
            row["vs_baseline"] = None
            if base is not None and p["variant"] != self.baseline:
                same = [x / y for x, y in zip(_per_repeat(p, self.ratio), _per_repeat(base, self.ratio)) if x and y]
                row["vs_baseline"] = {"median_of_per_repeat": round(statistics.median(same), 3) if same else None,
                                      "per_repeat": [round(x, 3) for x in same]}
            rows.append(row)
        return {"name": self.name, "what": self.what, "authors": self.authors, "baseline": self.baseline,
                "columns": list(self.columns), "rows": rows,
                "variants": [{"label": v.label, "driver_args": list(v.driver_args),
                              "device_args": list(v.device_args), "reported": v.reported} for v in self.variants]}


def _per_repeat(p, metric):
    """The study's ratio metric of point p, one value per repeat (in repeat order)."""
    if metric == "p50_us":
        return p["latency"].get("p50_us_per_repeat") or []
    per = p["pps"]["per_repeat"]
    if metric == "delivered_mpps":
        share = p.get("delivered_share_per_repeat") or []
        return [x * s if x is not None and s is not None else None for x, s in zip(per, share)]
    return per


def _mpps(p):
    m = p["pps"]["median"]
    return None if m is None else round(m / 1e6, 4)


def _delivered_mpps(p):
    m, s = p["pps"]["median"], p.get("delivered_share")
    return None if m is None or s is None else round(m * s / 1e6, 4)


# name -> (header, value from an aggregated point, format)
COLUMNS = {
    "mpps": ("Mpps", _mpps, lambda x: _fmt(x, ".3f")),
    "offered": ("offered", lambda p: p["offered_pps"], lambda x: _rate_label(x)),
    "delivered_mpps": ("delivered Mpps", _delivered_mpps, lambda x: _fmt(x, ".3f")),
    "delivered": ("delivered", lambda p: p.get("delivered_share"), lambda x: _pct(x)),
    "drops": ("drops", lambda p: p["drops"], lambda x: _fmt(x, "d")),
    "retries": ("retries", lambda p: p["retries"], lambda x: _fmt(x, "d")),
    "attempts": ("attempts", lambda p: p.get("retry_attempts"), lambda x: _fmt(x, ".0f")),
    "p50_us": ("p50 us", lambda p: p["latency"]["p50_us"], lambda x: _fmt(x, ".1f")),
    "p99_us": ("p99 us", lambda p: p["latency"]["p99_us"], lambda x: _fmt(x, ".1f")),
    "p99.9_us": ("p99.9 us", lambda p: p["latency"]["p99.9_us"], lambda x: _fmt(x, ".1f")),
    "kicks_per_packet": ("kick/pkt", lambda p: p["notifications"]["kicks_per_packet"], lambda x: _fmt(x, ".4f")),
    "calls_per_packet": ("call/pkt", lambda p: p["notifications"]["calls_per_packet"], lambda x: _fmt(x, ".4f")),
    "cpu_device": ("cpu dev", lambda p: p["cpu"].get("measured_device"), lambda x: _pct(x)),
    "cpu_driver": ("cpu drv", lambda p: p["cpu"].get("measured_driver"), lambda x: _pct(x)),
    "cleanups_per_kpkt": ("cleanups/kpkt", lambda p: p.get("tx_cleanups_per_kpkt"), lambda x: _fmt(x, ".2f")),
    "descs_per_cleanup": ("descs/cleanup", lambda p: p.get("tx_descs_per_cleanup"), lambda x: _fmt(x, ".1f")),
    "descs_per_packet": ("Tx descs/pkt", lambda p: p.get("tx_descs_per_packet"), lambda x: _fmt(x, ".2f")),
}

STUDIES = {s.name: s for s in (
    Study("tx-cleanup", "driver Tx cleanup: normal (free list, one used entry per buffer) vs in-order (one used entry "
          "may stand for a batch: the backend's --in-order-batch, as DPDK's vhost writes it)",
          "DPDK virtio PMD, packed ring: in-order Tx cleanup, 10.9 -> 11.3 Mpps (+3.7%)",
          (Variant("normal", in_order=False),
           Variant("in-order", in_order=True),
           Variant("in-order, batched used", device_args=("--in-order-batch",), in_order=True,
                   reported="+3.7% (10.9 -> 11.3)", reported_on="packed")),
          ("mpps", "cleanups_per_kpkt", "descs_per_cleanup"), ("mpps", "descs_per_cleanup"),
          default_paths=("split-normal", "packed-normal"), per_format=True),
    Study("hdr-prepend", "where the driver puts the Tx virtio-net header: the packet's headroom (1 descriptor), a "
          "descriptor of its own chained before the data (2), or one indirect descriptor for both (--tx-hdr); the "
          "rings hold twice --inject entries unless --ring-size says otherwise",
          "DPDK virtio PMD: the header pushed into the mbuf headroom saves a descriptor per packet (the issue "
          "quotes no figure)",
          (Variant("headroom", driver_args=("--tx-hdr", "headroom"), reported="1 descriptor"),
           Variant("chain", driver_args=("--tx-hdr", "chain"), reported="2 descriptors"),
           Variant("indirect", driver_args=("--tx-hdr", "indirect"))),
          ("mpps", "descs_per_packet", "drops"), ("mpps",), devices=("ours", "dpdk"),
          tx_hdr_fixed="its variants set --tx-hdr", descs_per_packet=2),
    Study("hdr-init", "the driver's Tx header cleared once per packet (in place) vs once per burst (a template "
          "copied per packet) (--hdr-init)",
          "OVS, packet metadata initialised once per batch instead of once per packet: 11.30 -> 11.70 Mpps (+3.5%)",
          (Variant("per packet", driver_args=("--hdr-init", "packet")),
           Variant("per burst", driver_args=("--hdr-init", "burst"), reported="+3.5%")),
          ("mpps",), ("mpps",), devices=("ours", "dpdk"),
          tx_hdr_fixed="both variants write the header into the headroom (--tx-hdr headroom)"),
    Study("doorbell", "one doorbell (publish + kick when asked) per packet vs per burst, notifications on: both "
          "sides sleep when idle, the backend after its first empty poll (--idle-polls 1) (--doorbell)",
          "Linux xmit_more: one doorbell per batch of packets instead of one per packet (the issue quotes no "
          "figure)",
          (Variant("per packet", driver_args=("--doorbell", "packet"), device_args=("--idle-polls", "1")),
           Variant("per burst", driver_args=("--doorbell", "burst"), device_args=("--idle-polls", "1"),
                   reported="fewer kicks")),
          ("mpps", "kicks_per_packet", "calls_per_packet", "cpu_device", "cpu_driver"),
          ("mpps", "kicks_per_packet"), mode="notify"),
    Study("retries", "backend Rx enqueue retries (each only after an attempt that delivered something), with a "
          "receiver slower than the sender: the driver offers frames open loop and takes at most 8 per step "
          "(--rx-burst 8) (--retries)",
          "OVS: vhost enqueue retries configurable 0..8, retried only after progress, default 0 (the issue quotes "
          "no figure)",
          tuple(Variant(f"retries {k}", driver_args=("--rx-burst", "8"), device_args=("--retries", str(k)),
                        reported="OVS default" if k == 0 else "") for k in (0, 1, 2, 4, 8)),
          ("offered", "mpps", "delivered_mpps", "delivered", "drops", "retries", "attempts"),
          ("delivered_mpps", "delivered"), ratio="delivered_mpps", rates=(2e6,)),
    Study("txq", "the backend's intermediate Tx queue: none (each frame straight from the Tx buffer into an Rx "
          "buffer), threshold 32 (drained when the Tx queue runs dry), drained after every Rx batch, threshold 32 + "
          "a 500 us timer, at a low and a high offered load (--txq-flush)",
          "OVS: a threshold alone adds up to ~0.5 ms at low load; draining per Rx batch keeps latency",
          (Variant("per rx batch", device_args=("--txq-flush", "rx-batch"), reported="keeps latency"),
           Variant("none", device_args=("--txq-flush", "none")),
           Variant("threshold 32", device_args=("--txq-flush", "threshold", "--txq-threshold", "32")),
           Variant("threshold 32 + timer 500 us", device_args=("--txq-flush", "timer:500", "--txq-threshold", "32"),
                   reported="+~0.5 ms at low load")),
          ("offered", "mpps", "p50_us", "p99_us", "p99.9_us"), ("p50_us", "p99_us"), ratio="p50_us",
          rates=(1e4, 1e6)),
)}


def get(name):
    try:
        return STUDIES[name]
    except KeyError:
        raise ValueError(f"unknown study {name!r}: one of {', '.join(STUDIES)}") from None


def format_study(result):
    """The study's table: one row per group and variant, its metrics, the ratio to the baseline variant measured
    in the same repeats, and the effect the original authors reported."""
    st = result["study"]
    cols = [(c, COLUMNS[c]) for c in st["columns"]]
    ratio_name = COLUMNS[get(st["name"]).ratio][0]
    gw = max([28] + [len(r["group"]) for r in st["rows"]])
    head_cells = [f"{'group':{gw}s}", f"{'variant':28s}"] + [f"{h:>14s}" for _, (h, _f, _x) in cols] \
        + [f"{'vs ' + st['baseline']:>22s}", f"{'reported':>26s}", f"{'loss':>5s}"]
    head = " ".join(head_cells)
    lines = [f"study {st['name']}: {st['what']}", f"reported by the original authors: {st['authors']}",
             result.get("pinning") or "", head, "-" * len(head)]
    prev = None
    for r in st["rows"]:
        if prev is not None and (r["group"], r["pkt_size"]) != prev:
            lines.append("")
        prev = (r["group"], r["pkt_size"])
        vs = (r["vs_baseline"] or {}).get("median_of_per_repeat")
        vs_text = "(baseline)" if r["variant"] == st["baseline"] else \
            "-" if vs is None else f"{vs:.3f} ({(vs - 1) * 100:+.1f}%)"
        cells = [f"{r['group']:{gw}s}", f"{r['variant'][:28]:28s}"] \
            + [f"{fmt(r[c]):>14s}" for c, (_h, _f, fmt) in cols] \
            + [f"{vs_text:>22s}", f"{r['reported'][:26]:>26s}", f"{'ok' if r['loss_check_ok'] else 'FAIL':>5s}"]
        lines.append(" ".join(cells) + ("  noisy" if r.get("noisy") else ""))
    lines.append(f"vs {st['baseline']}: {ratio_name} of the variant / the baseline's, median of the ratios of runs "
                 f"made in the same repeat; options per variant:")
    for v in st["variants"]:
        opts = [f"{who} {' '.join(v[who + '_args'])}" for who in ("driver", "device") if v[who + "_args"]]
        lines.append(f"  {v['label']}: {'; '.join(opts) or 'defaults'}")
    from vring.bench import _footer
    lines += [x for x in _footer(result) if not x.startswith("vs dpdk")]
    return "\n".join(lines)


def plot_study(result, plt):
    """Bars per group, one per variant, one panel per metric of the study."""
    st = result["study"]
    rows = st["rows"]
    metrics = get(st["name"]).plot_metrics
    groups = []
    for r in rows:
        if (r["group"], r["pkt_size"]) not in groups:
            groups.append((r["group"], r["pkt_size"]))
    variants = [v["label"] for v in st["variants"]]
    fig, axes = plt.subplots(len(metrics), 1, figsize=(max(8, 2.4 * len(groups)), 4 * len(metrics)), squeeze=False)
    w = 0.8 / len(variants)
    by = {(r["group"], r["pkt_size"], r["variant"]): r for r in rows}
    for ax, m in zip(axes[:, 0], metrics):
        for i, v in enumerate(variants):
            xs, ys = [], []
            for g, (grp, size) in enumerate(groups):
                r = by.get((grp, size, v))
                if r is None or r.get(m) is None:
                    continue
                xs.append(g + (i - (len(variants) - 1) / 2) * w)
                ys.append(r[m])
            ax.bar(xs, ys, w, label=v)
        ax.set_xticks(range(len(groups)), [g for g, _ in groups])
        ax.set_ylabel(COLUMNS[m][0])
        if m.startswith("p") and m.endswith("_us"):
            ax.set_yscale("log")
        ax.legend(fontsize="small")
    axes[0, 0].set_title(f"vring bench --study {st['name']}\nreported: {st['authors']}", fontsize="small")
    return fig


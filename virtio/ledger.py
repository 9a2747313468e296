"""The frame ledger of a resilient macfwd ``--verify`` run (``vring driver --reconnect|--server``).

Every injected frame carries its sequence number in the low 32 bits of the u64 at ``packets.SEQ_OFF``; the
ledger keeps the high 32 bits as the frame's lap: the driver writes lap k+1 as it sends the frame back out.
A frame that arrives with a lap that is not the current one of its sequence number is a copy: a restarted
backend took again a chain its predecessor had already delivered (and not completed). Copies are counted and
freed, so the population stays what was injected and every duplicate is counted exactly once.

At the end (``drain``) the ledger counts what comes back: each sequence number should be present exactly
once; one that is absent is put on the first restart after which it was never seen again. Python once per
burst (numpy), as the rest of the verify path.
"""
import time

import numpy as np

from . import packets
from .pool import NONE

SEQ_MASK = 0xFFFFFFFF
SEQ_BAD = 0xFFFFFFFFFFFFFFFF   # vn_check's seqs entry for a bad frame (VN_SEQ_BAD): its seq is never tracked


def count_seqs(counts, seqs):
    """counts[seq] += 1 for each sequence number in ``seqs`` (vn_check's u64s); out of range (SEQ_BAD) skipped."""
    s = (seqs & SEQ_MASK).astype(np.int64)
    np.add.at(counts, s[s < len(counts)], 1)


def population(final, sent=None):
    """What came back at the end (``final``: arrivals per sequence number while draining), against ``sent`` (which
    went out; default all): the population, and the mask of the absent ones."""
    present, copies = int((final > 0).sum()), int(final.sum())
    lost = final == 0 if sent is None else sent & (final == 0)
    return {"copies": copies, "present": present, "absent": int(lost.sum()), "extra": copies - present}, lost


class Ledger:
    def __init__(self, count):
        self.laps = np.zeros(count, np.uint32)        # the current lap of each sequence number
        self.last_seen = np.zeros(count)              # CLOCK_MONOTONIC of its last arrival
        self.final = np.zeros(count, np.int64)        # copies that came back while draining
        self.duplicates = 0

    @staticmethod
    def _lap_bytes(pool, idx):
        """Where the lap (the u64's high half at packets.SEQ_OFF) of each packet lies in pool.mem: (4, n), -1 when
        the packet is shorter. Segments are followed: with small buffers (--buf-size 192: 52 data bytes a buffer
        after the headroom) the field straddles the first two."""
        at = np.full((4, len(idx)), -1, np.int64)
        for k in range(4):
            b, pos = idx.astype(np.int64), np.full(len(idx), packets.SEQ_OFF + 4 + k, np.int64)
            live = np.arange(len(idx))
            while len(live):
                ln = pool.data_len[b[live]].astype(np.int64)
                here = pos[live] < ln
                h = live[here]
                at[k, h] = b[h] * pool.stride + pool.data_off[b[h]] + pos[h]
                live = live[~here]
                pos[live] -= ln[~here]
                b[live] = pool.next[b[live]]
                live = live[b[live] != NONE]
        return at

    def _tracked(self, seq, at):
        # the lap is written in place: where the whole field is in the frame
        return (seq < len(self.laps)) & (at >= 0).all(axis=0)

    def dedupe(self, pool, idx, lens, seqs, n, advance=True, restart=None):
        """Frames idx[:n] (with lens, and seqs as vn_check extracted them): free and count the copies,
        compacting the three arrays in place; with ``advance`` write the next lap into the others.
        ``restart``: the record of the latest restart (its ``duplicates`` are counted too). Returns n left."""
        s = seqs[:n]
        seq = (s & SEQ_MASK).astype(np.int64)
        lap = (s >> 32).astype(np.uint32)
        ix = idx[:n]
        self.last_seen[seq[seq < len(self.laps)]] = time.monotonic()
        tracked = self._tracked(seq, self._lap_bytes(pool, ix))
        keep = ~tracked | (lap == self.laps[np.where(tracked, seq, 0)])
        first = np.zeros(n, bool)   # two current copies in one burst: the first one counts
        _, at = np.unique(np.where(keep & tracked, seq, -1 - np.arange(n)), return_index=True)
        first[at] = True
        keep &= first
        dups = n - int(keep.sum())
        if dups:
            self.duplicates += dups
            if restart is not None:
                restart["duplicates"] = restart.get("duplicates", 0) + dups
            pool.free(ix[~keep])
            m = n - dups
            idx[:m], lens[:m], seqs[:m] = ix[keep], lens[:n][keep], s[keep]
            n = m
        if advance and n:
            seq = (seqs[:n] & SEQ_MASK).astype(np.int64)
            at = self._lap_bytes(pool, idx[:n])
            tracked = self._tracked(seq, at)
            seq, at = seq[tracked], at[:, tracked]
            self.laps[seq] += 1
            for k in range(4):
                pool.mem[at[k]] = (self.laps[seq] >> (8 * k)) & 0xFF
        return n

    def count_final(self, seqs, n):
        count_seqs(self.final, seqs[:n])

    def summary(self, restarts, tx_inflight, held, sent=None):
        """The population at the end, and each restart's losses (``restarts``: the loop's records, updated).
        ``sent``: which sequence numbers went out (default all); one never sent is not absent."""
        pop, lost = population(self.final, sent)
        gone = [r["gone_t"] for r in restarts]
        for r in restarts:
            r.setdefault("lost", 0)
            r.setdefault("duplicates", 0)
        # copies are a restart's (its successor took again chains already delivered): any other is the backend's
        alone = self.duplicates - sum(r["duplicates"] for r in restarts)
        for seq in np.flatnonzero(lost):
            k = int(np.searchsorted(gone, self.last_seen[seq]))
            if k < len(restarts):
                restarts[k]["lost"] += 1
        return {"duplicates": self.duplicates, "duplicates_without_restart": alone,
                "population": {**pop, "tx_inflight": tx_inflight, "held": held}}

/* The backend's data path: dequeue from the driver's Tx queue, forward, enqueue into its Rx queue.
 * One C call runs many poll iterations; C runs once per packet / descriptor, nothing is allocated.
 * Semantics: vhost/README.md (and issue 4). Ring primitives: rings/csrc/virtq.h. */
#ifndef VHOST_NET_H
#define VHOST_NET_H

#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "virtq.h"
#include "guest_fault.h"
#include "vhost_net_types.h"
#include "vhost_inflight.h"

enum { VH_FWD_MACSWAP = 0, VH_FWD_IO = 1, VH_FWD_RXONLY = 2 };
enum { VH_FLUSH_RX_BATCH = 0, VH_FLUSH_TIMER = 1, VH_FLUSH_THRESHOLD = 2 };
enum { VH_BROKEN_RX = 1, VH_BROKEN_TX = 2 };
#define VH_PREFETCH 8   /* packets ahead */

/* The header and a short frame usually straddle two cache lines (virtio PMD puts the header right
 * before the frame, at headroom - 12): fetch both. */
static inline void vh_prefetch2(const uint8_t *p, int write)
{
    if (write) {
        __builtin_prefetch(p, 1);
        __builtin_prefetch(p + 64, 1);
    } else {
        __builtin_prefetch(p);
        __builtin_prefetch(p + 64);
    }
}

static inline uint64_t vh_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline void vh_notify(struct vq_device *q, int fd, uint64_t *count)
{   /* at most once per burst, and only when the driver asks (EVT-05/06, packed event suppression) */
    if (vq_dev_call_prepare(q) && fd >= 0) {
        uint64_t one = 1;
        if (write(fd, &one, sizeof one) == sizeof one)
            (*count)++;
    }
}

/* ------------------------------------------------------------------------------------------- */
/* Dequeue: the driver's Tx queue                                                              */
/* ------------------------------------------------------------------------------------------- */

/* Copy the readable bytes of chain k after the first hdr_len (wherever the header lies: one
 * descriptor with the frame, its own descriptor, or split over several) into dst. */
static inline void vh_copy_out(const struct vq_chains *c, uint32_t k, uint32_t skip, uint8_t *dst)
{
    uint32_t s = c->seg_start[k], e = s + c->nseg[k];
    for (; s < e; s++) {
        uint32_t len = c->seg_len[s];
        if (c->seg_write[s])
            break;   /* readable segments come first (checked by poll) */
        if (skip >= len) {
            skip -= len;
            continue;
        }
        memcpy(dst, c->seg_host[s] + skip, len - skip);
        dst += len - skip;
        skip = 0;
    }
}

static inline void vh_macswap(uint8_t *p)
{
    uint8_t t[6];
    memcpy(t, p, 6);
    memcpy(p, p + 6, 6);
    memcpy(p + 6, t, 6);
}

/* Copy a frame without a libc call for the sizes a loopback moves most (16..128 bytes): two fixed-size moves,
 * the second overlapping the first (never past either end). */
static inline void vh_copy(uint8_t *dst, const uint8_t *src, uint32_t len)
{
    if (len >= 16 && len <= 32) {
        __builtin_memcpy(dst, src, 16);
        __builtin_memcpy(dst + len - 16, src + len - 16, 16);
    } else if (len > 32 && len <= 64) {
        __builtin_memcpy(dst, src, 32);
        __builtin_memcpy(dst + len - 32, src + len - 32, 32);
    } else if (len > 64 && len <= 128) {
        __builtin_memcpy(dst, src, 64);
        __builtin_memcpy(dst + len - 64, src + len - 64, 64);
    } else {
        memcpy(dst, src, len);
    }
}

/* Room in the long-frame area for a frame longer than a slot, or NULL. It holds pkt_cap frames of pkt_max bytes
 * (each rounded up to 64) and only queued frames take room in it, so it does not run out; the check is the C's own. */
static inline uint8_t *vh_long_slot(struct vh_net *n, uint32_t plen, uint32_t queued)
{
    uint64_t need = (plen + 63u) & ~63u;
    if (n->long_fill + need > n->long_size)
        return 0;
    uint8_t *p = n->pkt_long + n->long_fill;
    if (queued)   /* rxonly (not capturing): the frame is dropped, its copy overwritten by the next */
        n->long_fill += need;
    return p;
}

/* One dequeue burst into the intermediate queue; the used entries wait in the shadow (vh_tx_complete).
 * Returns chains taken, or -1 (Tx queue broke). */
static inline int vh_dequeue_burst(struct vh_net *n)
{
    struct vq_device *q = n->txq;
    struct vq_chains *c = n->txc;
    uint32_t room = n->pkt_cap - n->npkts, max = n->burst < room ? n->burst : room;
    if (!q || max == 0)
        return 0;
    c->n = 0;
    c->nsegs = 0;
    int got = vhi_poll(q, c, max, n->tx_inf);
    if (got < 0) {
        n->broken |= VH_BROKEN_TX;
        n->txq = 0;
        return -1;
    }
    if (got == 0)
        return 0;
    /* locals: every copy into pkt_data may alias any field read through n or c */
    uint32_t hdr = n->hdr_len, size = n->pkt_size, max_frame = n->pkt_max, fwd = n->fwd, pk = n->npkts;
    uint32_t fit = size < max_frame ? size : max_frame;   /* a slot may be longer than the longest frame taken */
    uint32_t per_buffer = n->per_buffer, direct = n->direct && !per_buffer;   /* per buffer: a chain is completed
                                                                                 before the enqueue */
    uint32_t tracked = n->tx_inf != 0, keep = fwd != VH_FWD_RXONLY || n->capture;   /* rxonly: dropped here */
    const uint16_t *cid = c->id, *nseg = c->nseg;
    const uint32_t *rlens = c->rlen, *start = c->seg_start;
    uint8_t *const *host = c->seg_host;
    uint32_t *ids = n->ids, *lens = n->lens, *pkt_len = n->pkt_len;
    const uint8_t **src = n->pkt_src;
    uint8_t *data = n->pkt_data;
    uint64_t bytes = 0, moved = 0, runt = 0, oversize = 0;
    if (pk == 0 && n->flush_mode == VH_FLUSH_TIMER)
        n->first_ns = vh_now_ns();
    for (uint32_t k = 0; k < VH_PREFETCH && k < (uint32_t)got; k++)
        vh_prefetch2(host[start[k]], 0);
    for (uint32_t k = 0; k < (uint32_t)got; k++) {
        uint32_t rlen = rlens[k];
        if (k + VH_PREFETCH < (uint32_t)got)   /* the frames are in the driver's cache: overlap the misses */
            vh_prefetch2(host[start[k + VH_PREFETCH]], 0);
        ids[k] = cid[k];
        lens[k] = 0;   /* NET-21: nothing written into a Tx buffer */
        uint32_t plen = rlen - hdr;   /* wraps round when rlen <= hdr */
        uint8_t *dst = data + (uint64_t)pk * size;
        if (__builtin_expect(plen - 1u >= fit, 0)) {   /* a runt, or a frame longer than a slot (or MAX_FRAME) */
            if (rlen <= hdr) {
                runt++;
                goto complete;
            }
            /* copied, never left in the Tx buffer */
            if (plen > max_frame || !(dst = vh_long_slot(n, plen, keep))) {
                oversize++;
                goto complete;
            }
        } else if (direct && nseg[k] == 1) {   /* read by the enqueue, MACs swapped in the Rx buffer */
            src[pk] = host[start[k]] + hdr;
            goto queued;
        }
        if (nseg[k] == 1)
            vh_copy(dst, host[start[k]] + hdr, plen);
        else
            vh_copy_out(c, k, hdr, dst);
        if (fwd == VH_FWD_MACSWAP && plen >= 12)
            vh_macswap(dst);
        src[pk] = dst;
    queued:
        pkt_len[pk] = plen;
        bytes += plen;
        moved++;
        if (keep)
            pk++;
    complete:
        if (per_buffer) {
            vq_dev_push_used(q, &ids[k], &lens[k], 1);
            if (!tracked)   /* tracked: completed once delivered (vh_run_slice) */
                vhi_flush(q, 0);
        }
    }
    n->st.tx_packets += moved;
    n->st.tx_runt += runt;
    n->st.tx_oversize += oversize;
    if (fwd == VH_FWD_RXONLY)
        n->st.fwd_dropped += moved;
    if (!n->per_buffer)
        vq_dev_push_used(q, n->ids, n->lens, (uint32_t)got);
    n->tx_unflushed = 1;
    n->npkts = pk;
    n->st.tx_bytes += bytes;
    n->st.tx_bursts++;
    return got;
}

/* Publish the Tx completions of the last burst: one used-idx store (split) / one head flags store
 * (packed), then at most one call. The loop does this right after the dequeue when the frames were copied
 * out (as DPDK's vhost does): a driver that gets its packets back must find their Tx descriptors free, or
 * with as many packets in flight as the Tx ring holds it drops (testpmd does not retry). Without the
 * staging copy (direct) it comes inside the flush, once the enqueue has read the Tx buffers and before it
 * publishes the Rx side (vh_txq_flush). */
static inline void vh_tx_complete(struct vh_net *n)
{
    if (!n->tx_unflushed)
        return;
    n->tx_unflushed = 0;
    if (!n->txq)
        return;
    vhi_flush(n->txq, n->tx_inf);
    vh_notify(n->txq, n->tx_callfd, &n->st.tx_calls);
}

/* One dequeue burst, its Tx chains completed at once when its frames were copied out (not direct) and no successor
 * may have to take them again (no inflight tracking); otherwise after the enqueue. */
static inline int vh_dequeue(struct vh_net *n)
{
    int got = vh_dequeue_burst(n);
    if (!n->direct && !n->tx_inf)
        vh_tx_complete(n);
    return got;
}

/* ------------------------------------------------------------------------------------------- */
/* Enqueue: the driver's Rx queue                                                              */
/* ------------------------------------------------------------------------------------------- */

/* Drop the consumed Rx chains from the carry (moving the rest to the front). */
static inline void vh_rx_compact(struct vh_net *n)
{
    struct vq_chains *c = n->rxc;
    uint32_t k = n->rx_next;
    if (k == 0)
        return;
    n->rx_next = 0;
    if (k >= c->n) {
        c->n = 0;
        c->nsegs = 0;
        return;
    }
    uint32_t m = c->n - k, s0 = c->seg_start[k], ns = c->nsegs - s0;
    memmove(c->id, c->id + k, m * sizeof *c->id);
    memmove(c->ndesc, c->ndesc + k, m * sizeof *c->ndesc);
    memmove(c->nseg, c->nseg + k, m * sizeof *c->nseg);
    memmove(c->rlen, c->rlen + k, m * sizeof *c->rlen);
    memmove(c->wlen, c->wlen + k, m * sizeof *c->wlen);
    for (uint32_t i = 0; i < m; i++)
        c->seg_start[i] = c->seg_start[i + k] - s0;
    memmove(c->seg_addr, c->seg_addr + s0, ns * sizeof *c->seg_addr);
    memmove(c->seg_len, c->seg_len + s0, ns * sizeof *c->seg_len);
    memmove(c->seg_write, c->seg_write + s0, ns * sizeof *c->seg_write);
    memmove(c->seg_host, c->seg_host + s0, ns * sizeof *c->seg_host);
    c->n = m;
    c->nsegs = ns;
}

/* Make up to `want` more Rx chains available after the unconsumed ones. Returns 0, or -1 (broken). */
static inline int vh_rx_refill(struct vh_net *n, uint32_t want)
{
    struct vq_device *q = n->rxq;
    struct vq_chains *c = n->rxc;
    vh_rx_compact(n);
    uint32_t max = c->n + want;
    if (max > c->cap_chains)
        max = c->cap_chains;
    int r = vhi_poll(q, c, max, n->rx_inf);   /* appends after c->n / c->nsegs */
    if (r < 0) {
        n->broken |= VH_BROKEN_RX;
        n->rxq = 0;
        return -1;
    }
    return 0;
}

/* Write len bytes at byte offset off of chain k's writable part. */
static inline void vh_copy_in(const struct vq_chains *c, uint32_t k, uint32_t off, const uint8_t *src,
                              uint32_t len)
{
    uint32_t s = c->seg_start[k], e = s + c->nseg[k];
    for (; s < e && len; s++) {
        uint32_t sl = c->seg_len[s];
        if (!c->seg_write[s])
            continue;   /* a readable segment in an Rx chain: never written */
        if (off >= sl) {
            off -= sl;
            continue;
        }
        uint32_t take = sl - off < len ? sl - off : len;
        memcpy(c->seg_host[s] + off, src, take);
        src += take;
        len -= take;
        off = 0;
    }
}

/* The virtio-net header (NET-01): flags/gso/csum zero (nothing offloaded, NET-33/34), num_buffers
 * (NET-28: 1 without MRG_RXBUF; NET-29: buffers used with it) in the 12-byte header. */
static inline void vh_hdr_fill(uint8_t *h, uint32_t hdr_len, uint16_t nbuf)
{
    uint64_t lo = 0;
    __builtin_memcpy(h, &lo, 8);
    if (hdr_len >= 12) {
        uint32_t hi = (uint32_t)nbuf << 16;   /* csum_offset 0, num_buffers (little-endian) */
        __builtin_memcpy(h + 8, &hi, 4);
    } else {
        uint16_t hi = 0;
        __builtin_memcpy(h + 8, &hi, 2);
    }
}

/* vh_hdr_fill into guest memory, skipped when the buffer holds that header already: a driver that reuses its
 * buffers (DPDK's mbufs) finds last round's header there and only reads it, so the line stays shared with its
 * core instead of crossing to ours and back. The bytes are the same either way. The comparison restates
 * vh_hdr_fill's bytes as two words: through a buffer and memcmp it costs 18 instructions a packet more. */
static inline void vh_hdr_put(uint8_t *h, uint32_t hdr_len, uint16_t nbuf)
{
    uint64_t lo;
    __builtin_memcpy(&lo, h, 8);
    if (hdr_len >= 12) {
        uint32_t hi;
        __builtin_memcpy(&hi, h + 8, 4);
        if (lo == 0 && hi == (uint32_t)nbuf << 16)
            return;
    } else {
        uint16_t hi;
        __builtin_memcpy(&hi, h + 8, 2);
        if (lo == 0 && hi == 0)
            return;
    }
    vh_hdr_fill(h, hdr_len, nbuf);
}

static inline void vh_put_hdr(const struct vh_net *n, const struct vq_chains *c, uint32_t k, uint16_t nbuf)
{
    uint32_t s = c->seg_start[k];
    if (c->seg_write[s] && c->seg_len[s] >= n->hdr_len) {
        vh_hdr_put(c->seg_host[s], n->hdr_len, nbuf);
    } else {
        uint8_t h[12];
        vh_hdr_fill(h, n->hdr_len, nbuf);
        vh_copy_in(c, k, 0, h, n->hdr_len);
    }
}

/* Copy one packet into chain k right after the header (fast path: one writable segment). */
static inline void vh_put_data(const struct vq_chains *c, uint32_t k, uint32_t off, const uint8_t *p,
                               uint32_t len)
{
    uint32_t s = c->seg_start[k];
    if (c->seg_write[s] && c->seg_len[s] >= off + len)
        memcpy(c->seg_host[s] + off, p, len);
    else
        vh_copy_in(c, k, off, p, len);
}

/* The common enqueue, packets [first, first+count) while each fits the next carried Rx chain alone: one
 * writable segment holding header + frame (num_buffers 1, with or without MRG_RXBUF). State in locals (the
 * copies into guest memory may alias anything). Stops at the first packet for the general path or when the
 * carry runs out; appends to ids/lens from *m. Returns the packets delivered. */
static inline uint32_t vh_enqueue_simple(struct vh_net *n, uint32_t first, uint32_t count, uint32_t *m_io,
                                         uint64_t *bytes_io)
{
    const struct vq_chains *c = n->rxc;
    const uint16_t *cid = c->id, *nseg = c->nseg;
    const uint32_t *wlen = c->wlen, *start = c->seg_start, *pkt_len = n->pkt_len;
    uint8_t *const *host = c->seg_host;
    const uint8_t *const *src = n->pkt_src;
    const uint8_t *data = n->pkt_data;
    uint32_t *ids = n->ids, *lens = n->lens;
    uint32_t k = n->rx_next, cn = c->n, hdr = n->hdr_len, size = n->pkt_size, m = *m_io, done = 0;
    uint32_t swap = n->direct && n->fwd == VH_FWD_MACSWAP;
    uint64_t bytes = 0;
    while (done < count && k < cn) {
        uint32_t i = first + done, plen = pkt_len[i], total = plen + hdr;
        if (nseg[k] != 1 || wlen[k] < total)   /* wlen > 0: the one segment is writable */
            break;
        if (k + VH_PREFETCH < cn)
            vh_prefetch2(host[start[k + VH_PREFETCH]], 1);
        uint8_t *dst = host[start[k]];
        const uint8_t *p = src[i];
        vh_hdr_put(dst, hdr, 1);
        vh_copy(dst + hdr, p, plen);
        if (swap && plen >= 12 && plen <= size && p != data + (uint64_t)i * size)   /* direct: the driver's frame */
            vh_macswap(dst + hdr);
        ids[m] = cid[k];
        lens[m] = total;
        m++;
        k++;
        done++;
        bytes += plen;
    }
    n->rx_next = k;
    *m_io = m;
    *bytes_io += bytes;
    return done;
}

/* Frame i of the intermediate queue in its pkt_data slot, copied there (and its MACs swapped) first if it is still
 * the driver's Tx buffer (direct): the general enqueue path may write it over several Rx buffers or retry it. */
static inline const uint8_t *vh_staged(struct vh_net *n, uint32_t i)
{
    uint8_t *slot = n->pkt_data + (uint64_t)i * n->pkt_size;
    const uint8_t *p = n->pkt_src[i];
    if (n->pkt_len[i] > n->pkt_size || p == slot)   /* a longer frame was staged at its dequeue */
        return p;
    vh_copy(slot, p, n->pkt_len[i]);
    if (n->fwd == VH_FWD_MACSWAP && n->pkt_len[i] >= 12)
        vh_macswap(slot);
    n->pkt_src[i] = slot;
    return slot;
}

/* One enqueue attempt of packets [first, first+count) of the intermediate queue.
 * Returns the packets consumed (delivered or dropped as too big); *delivered counts the first kind.
 * Stops at the first packet for which no Rx buffer is left. -1: the Rx queue broke. The used entries are pushed;
 * the caller publishes them (per buffer: each packet's here, NET-31). */
static inline int vh_enqueue_attempt(struct vh_net *n, uint32_t first, uint32_t count, uint32_t *delivered)
{
    struct vq_device *q = n->rxq;
    struct vq_chains *c = n->rxc;
    uint32_t hdr = n->hdr_len, done = 0, m = 0, dl = 0;
    uint64_t bytes = 0;
    *delivered = 0;
    if (c->n - n->rx_next < count && vh_rx_refill(n, count - (c->n - n->rx_next)) < 0)
        return -1;
    for (uint32_t k = n->rx_next; k < n->rx_next + VH_PREFETCH && k < c->n; k++)
        vh_prefetch2(c->seg_host[c->seg_start[k]], 1);
    for (; done < count; done++) {
        if (!n->per_buffer) {
            uint32_t f = vh_enqueue_simple(n, first + done, count - done, &m, &bytes);
            done += f;
            dl += f;
            if (done == count)
                break;
        }
        uint32_t i = first + done, plen = n->pkt_len[i], total = plen + hdr;
        const uint8_t *p = vh_staged(n, i);
        if (n->rx_next == c->n) {   /* the carry is empty: one more poll for the rest */
            if (vh_rx_refill(n, count - done) < 0)
                return -1;
            if (c->n == 0)
                break;
        }
        uint32_t k = n->rx_next;
        if (k + VH_PREFETCH < c->n)
            vh_prefetch2(c->seg_host[c->seg_start[k + VH_PREFETCH]], 1);
        if (!n->mrg_rxbuf) {
            if (c->wlen[k] < total) {   /* NET-27: one buffer per packet; this one is too small */
                n->st.rx_too_big++;
                n->pkt_len[i] = 0;       /* consumed, not delivered (--pcap does not write it as received) */
                continue;                /* the buffer stays for the next packet */
            }
            vh_put_hdr(n, c, k, 1);
            vh_put_data(c, k, hdr, p, plen);
            n->ids[m] = c->id[k];
            n->lens[m] = total;
            m++;
            n->rx_next++;
        } else {
            if (c->wlen[k] < hdr) {      /* NET-25 broken by the driver: give it back empty */
                n->ids[m] = c->id[k];
                n->lens[m] = 0;
                m++;
                n->rx_next++;
                n->st.rx_runt_bufs++;
                done--;                  /* same packet again */
                continue;
            }
            /* reserve enough buffers first (NET-29..31), polling more when the carry runs out */
            uint32_t j = k;
            uint64_t acc = 0;   /* wlen is up to 2^32-1 per buffer: a 32-bit sum wraps */
            int enough = 1;
            while (acc < total) {
                if (j == c->n) {
                    uint32_t off = n->rx_next;
                    if (vh_rx_refill(n, count - done + 1) < 0)
                        return -1;
                    j -= off;   /* compact moved the carry to the front */
                    k -= off;
                    if (j == c->n) {
                        enough = 0;
                        break;
                    }
                }
                acc += c->wlen[j];
                j++;
            }
            if (!enough)
                break;   /* the reserved buffers stay in the carry */
            uint32_t nbuf = j - k, left = plen, off = hdr;
            vh_put_hdr(n, c, k, (uint16_t)nbuf);
            for (uint32_t b = k; b < j; b++) {
                uint32_t room = c->wlen[b] - off, take = left < room ? left : room;
                if (take)
                    vh_put_data(c, b, off, p + (plen - left), take);
                n->ids[m] = c->id[b];
                n->lens[m] = off + take;   /* NET-30: all but the last are full */
                m++;
                left -= take;
                off = 0;
            }
            n->rx_next = j;
        }
        dl++;
        bytes += plen;
        if (n->per_buffer) {   /* all buffers of one packet are published together (NET-31) */
            vq_dev_push_used(q, n->ids, n->lens, m);
            vhi_flush(q, n->rx_inf);
            n->st.rx_buffers += m;
            m = 0;
        }
    }
    if (m) {
        vq_dev_push_used(q, n->ids, n->lens, m);
        n->st.rx_buffers += m;
    }
    n->st.rx_packets += dl;
    n->st.rx_bytes += bytes;
    *delivered = dl;
    return (int)done;
}

/* Send the whole intermediate queue to the Rx queue: retries only while the previous attempt
 * delivered something, at most n->retries of them; what is left is dropped and counted. */
static inline int vh_txq_flush(struct vh_net *n)
{
    uint32_t first = 0, left = n->npkts, attempt = 0, delivered;
    int rc = 0;
    if (left == 0)
        return 0;
    n->npkts = 0;
    n->long_fill = 0;   /* every frame below is delivered or dropped before the next dequeue reuses the area */
    if (n->fwd == VH_FWD_RXONLY)   /* queued only for --pcap: counted (fwd_dropped) at the dequeue */
        return 0;
    if (!n->rxq) {
        n->st.rx_dropped += left;
        return 0;
    }
    for (;;) {
        int r = vh_enqueue_attempt(n, first, left, &delivered);
        n->st.rx_attempts++;
        if (r < 0) {
            rc = -1;
            break;
        }
        first += (uint32_t)r;
        left -= (uint32_t)r;
        int last = left == 0 || delivered == 0 || attempt >= n->retries;
        /* direct, untracked: the Tx buffers are read now; completed before the Rx publish, as a staged burst is
         * completed before its enqueue, so that a driver that gets a frame back finds its Tx descriptors free
         * (with as many frames in flight as the Tx ring holds, a preempted backend made it drop them). Tracked:
         * after, or a kill -9 between the two would lose the frames the successor must take again. */
        if (last && n->direct && !n->tx_inf)
            vh_tx_complete(n);
        vhi_flush(n->rxq, n->rx_inf);
        if (n->hook)
            n->hook(n->hook_ctx, attempt, delivered, left);
        if (n->crash_after && delivered && --n->crash_after == 0)
            _exit(9);   /* --crash-after: dies as a kill -9 would, Rx published (tracked: Tx not completed) */
        if (last)
            break;
        attempt++;
        n->st.rx_retries++;
    }
    n->st.rx_dropped += left;
    if (n->rxq)
        vh_notify(n->rxq, n->rx_callfd, &n->st.rx_calls);
    return rc;
}

/* ------------------------------------------------------------------------------------------- */
/* The loop                                                                                    */
/* ------------------------------------------------------------------------------------------- */

/* --idle sleep, after each poll iteration: busy -> kicks off; idle_polls empty polls -> kicks on, then one more
 * poll (the re-check after enabling, EVT-09/MEM-09: a buffer made available before the driver saw the change
 * is found by it); still empty -> returns 1, n->sleep set, and the caller blocks on the kick eventfd. */
static inline int vh_idle(struct vh_net *n, int got)
{
    if (!n->txq)
        return 0;
    if (got > 0 || n->npkts) {
        n->empty = 0;
        if (n->kicks_on) {
            vq_dev_enable_kicks(n->txq, 0);
            n->kicks_on = 0;
        }
        return 0;
    }
    if (++n->empty < n->idle_polls)
        return 0;
    if (!n->kicks_on) {
        vq_dev_enable_kicks(n->txq, 1);   /* with a full fence before the next poll reads the ring */
        n->kicks_on = 1;
        n->empty = n->idle_polls - 1;     /* one more poll, then sleep */
        return 0;
    }
    n->sleep = 1;
    n->st.sleeps++;
    return 1;
}

/* With inflight tracking (Tx completed only once the intermediate queue is empty): every descriptor of the Tx ring
 * is in a chain we took and have not completed, so the driver cannot send the frames a timer flush would wait for.
 * Those chains are all in the shadow (the dequeue pushes each one it takes); packed: the slots in flight. */
static inline int vh_tx_held_all(const struct vh_net *n)
{
    const struct vq_device *q = n->txq;
    if (!q)
        return 0;
    if (q->packed)
        return q->inflight_slots >= q->size;
    uint32_t held = 0;
    for (uint32_t k = 0; k < q->shadow_count; k++)
        held += q->id_ndesc[q->shadow_id[k]];
    return held >= q->size;
}

/* The poll loop of vh_run (apart from it: the function that calls sigsetjmp is compiled conservatively). */
static __attribute__((noinline)) int vh_run_slice(struct vh_net *n, uint32_t max_iters, uint64_t budget_ns)
{
    uint64_t start = vh_now_ns();
    n->sleep = 0;
    for (uint32_t it = 0; it < max_iters; it++) {
        uint64_t t0 = n->timing ? vh_now_ns() : 0;
        int got = vh_dequeue(n);   /* with inflight tracking, Tx completed once the frames are delivered: a
                                      successor resubmits what we took, never what we completed */
        if (n->direct && n->npkts) {   /* no intermediate queue: every burst goes on at once */
            n->st.flush_rx_batch++;
            vh_txq_flush(n);
        } else if (n->npkts >= n->threshold) {
            n->st.flush_threshold++;
            vh_txq_flush(n);
        } else if (n->npkts) {
            if (n->flush_mode == VH_FLUSH_RX_BATCH) {
                n->st.flush_rx_batch++;
                vh_txq_flush(n);
            } else if (n->flush_mode == VH_FLUSH_TIMER) {
                if (vh_now_ns() - n->first_ns >= n->timer_ns) {
                    n->st.flush_timer++;
                    vh_txq_flush(n);
                } else if (n->tx_inf && got <= 0 && vh_tx_held_all(n)) {   /* tracked: no more can come */
                    n->st.flush_idle++;
                    vh_txq_flush(n);
                }
            } else if (got <= 0) {   /* threshold mode: drain when the Tx queue runs dry */
                n->st.flush_idle++;
                vh_txq_flush(n);
            }
        }
        if (!n->tx_inf || !n->npkts)   /* tracked: not while frames wait (timer, threshold), or a kill -9 loses */
            vh_tx_complete(n);         /* them: completed, a successor would not take them again */
        n->st.iterations++;
        if (n->timing && got > 0) {
            n->st.busy_iterations++;
            n->st.busy_ns += vh_now_ns() - t0;
        }
        if (!n->txq && !n->npkts)
            break;   /* nothing left to do */
        if (n->idle_polls && vh_idle(n, got))
            break;   /* sleep: the caller blocks on the kick eventfd */
        if ((it & 63) == 63 && vh_now_ns() - start >= budget_ns)
            break;
    }
    return n->broken;
}

/* The entry points Python calls, guarded against guest-memory faults (guest_fault.h): on SIGBUS they set
 * n->guest_fault and return GF_FAULT, and the caller drops the connection without touching its queues again. */
#define VH_GUARDED(call)                    \
    sigjmp_buf env;                         \
    if (sigsetjmp(env, 0)) {                \
        n->guest_fault = 1;                 \
        return gf_caught();                 \
    }                                       \
    gf_arm(&env);                           \
    int r = (call);                         \
    gf_disarm();                            \
    return r

/* Run up to max_iters poll iterations or about budget_ns. Returns n->broken (0: all well), or GF_FAULT. Not
 * inlined: one call per time slice, and a symbol profilers can count from (benchmarks/loop_profile.py). */
static __attribute__((noinline)) int vh_run(struct vh_net *n, uint32_t max_iters, uint64_t budget_ns)
{
    VH_GUARDED(vh_run_slice(n, max_iters, budget_ns));
}

/* --pcap: one dequeue burst (every frame copied out: never direct), Python reads its frames, then one flush and
 * the Tx completions still due (inflight tracking), as in vh_run_slice */
static int vh_dequeue_guarded(struct vh_net *n)
{
    VH_GUARDED(vh_dequeue(n));
}

static inline int vh_flush_complete(struct vh_net *n)
{
    int r = vh_txq_flush(n);
    vh_tx_complete(n);
    return r;
}

static int vh_txq_flush_guarded(struct vh_net *n)
{
    VH_GUARDED(vh_flush_complete(n));
}

/* Python's own accesses to the frontend's memory, outside the data path, guarded the same way: the copy of a
 * ring area (used->idx at a queue start, a --ctl dump) and the event suppression written at a queue start. 0,
 * or GF_FAULT: the frontend truncated the region under our mapping (the caller drops it, as vh_run's do). */
static int vh_copy_guarded(void *dst, const void *src, size_t len)
{
    sigjmp_buf env;
    if (sigsetjmp(env, 0))
        return gf_caught();
    gf_arm(&env);
    memcpy(dst, src, len);
    gf_disarm();
    return 0;
}

static int vh_enable_kicks_guarded(struct vq_device *q, int on)
{
    sigjmp_buf env;
    if (sigsetjmp(env, 0))
        return gf_caught();
    gf_arm(&env);
    vq_dev_enable_kicks(q, on);
    gf_disarm();
    return 0;
}

/* Drop whatever waits in the intermediate queue (when the device stops). */
static inline uint32_t vh_discard(struct vh_net *n)
{
    uint32_t k = n->npkts;
    n->st.rx_dropped += k;
    n->npkts = 0;
    n->long_fill = 0;
    return k;
}

#endif

/* virtio-net driver hot paths: buffer pool, Tx burst (header prepend / chain / indirect), Tx cleanup,
 * Rx burst (header strip, mergeable reassembly), Rx refill, MAC swap, packet generation and checks.
 * Built on the ring primitives of rings/csrc/virtq.h; one C call per burst, C once per packet/descriptor.
 * Spec IDs: shared/spec/virtio-checklist.md (NET-xx). */
#ifndef VNET_H
#define VNET_H

#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "virtq.h"
#include "vnet_types.h"

#define VN_NONE 0xffffffffu
#define VN_HDR_SLOT 16
#define VN_TX_RETRIES 1024   /* macfwd: reclaim-and-retry rounds for a full Tx ring before dropping */

/* ----------------------------------------------------------------------------------- pool */

static inline uint8_t *vn_buf(const struct vn_pool *p, uint32_t b) { return p->host + (uint64_t)b * p->stride; }
static inline uint64_t vn_gpa(const struct vn_pool *p, uint32_t b) { return p->gpa + (uint64_t)b * p->stride; }

/* Take up to n buffers off the free stack (data_off = headroom, one segment). State in locals: the uint8_t
 * stores into owned[] may alias anything. */
static inline uint32_t vn_pool_alloc(struct vn_pool *p, uint32_t *out, uint32_t n)
{
    uint32_t top = p->top, *stack = p->stack, *data_len = p->data_len, *next = p->next;
    uint16_t *data_off = p->data_off, hr = (uint16_t)p->headroom;
    uint8_t *owned = p->owned;
    if (n > top)
        n = top;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t b = stack[--top];
        owned[b] = 1;
        data_off[b] = hr;
        data_len[b] = 0;
        next[b] = VN_NONE;
        out[i] = b;
    }
    p->top = top;
    return n;
}

/* Give packets (their whole segment chains) back: idx32[i] or idx64[i] (one of them NULL). Bad or double frees
 * are counted, not followed. */
static inline __attribute__((always_inline)) void
vn_pool_free_v(struct vn_pool *p, const uint32_t *idx32, const uint64_t *idx64, uint32_t n)
{
    uint32_t top = p->top, nbufs = p->nbufs, *stack = p->stack, *next = p->next;
    uint8_t *owned = p->owned;
    uint64_t bad = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t b = idx32 ? idx32[i] : idx64[i];
        uint32_t hops = 0;
        while (b != VN_NONE) {
            if (b >= nbufs || !owned[b] || ++hops > nbufs) {
                bad++;
                break;
            }
            uint32_t nx = next[b];
            owned[b] = 0;
            next[b] = VN_NONE;
            stack[top++] = (uint32_t)b;
            b = nx;
        }
    }
    p->top = top;
    p->bad_frees += bad;
}

static inline void vn_pool_free(struct vn_pool *p, const uint32_t *idx, uint32_t n)
{
    vn_pool_free_v(p, idx, 0, n);
}

static inline void vn_pool_free1(struct vn_pool *p, uint32_t b)
{
    vn_pool_free_v(p, &b, 0, 1);
}

/* ----------------------------------------------------------------------------------- notifications */

/* Polling with EVENT_IDX (split): keep used_event half a lap ahead so the device never finds a reason to call.
 * A plain store, no fence: a late view of it costs at most one spurious call. (Without EVENT_IDX the
 * NO_INTERRUPT flag / packed DISABLE set at start stays.) */
static inline void vn_quiet(struct vq_driver *q)
{
    if (!q->packed && q->event_idx)
        VQ_SET(*vq_used_event(q->avail, q->size), (uint16_t)(q->last_used + 0x7fff));
}

/* ----------------------------------------------------------------------------------- Tx */

/* Notify the device (write the kick eventfd); counted. */
static inline void vn_notify(int32_t fd, uint64_t *kicks)
{
    uint64_t one = 1;
    (*kicks)++;
    if (fd >= 0 && write(fd, &one, sizeof(one)) < 0) {
        /* EAGAIN: the counter is saturated, the device has a wakeup pending anyway */
    }
}

/* The buffer id the next add will take (so the slow path can pick its header slot). */
static inline uint16_t vn_next_id(const struct vq_driver *q)
{
    if (q->packed)
        return q->in_order ? q->next_avail : q->free_head;
    return q->in_order ? q->next_desc : q->free_head;
}

/* Reclaim what the device completed until at least `need` descriptors are free (or nothing more is used).
 * Not capped at a burst size: one call may free the whole ring. Buffers go back to the pool. */
static inline int vn_tx_cleanup(struct vn_txq *t, uint32_t need)
{
    struct vq_driver *q = t->q;
    int total = 0;
    t->cleanups++;
    do {
        uint16_t before = q->num_free;
        int r = vq_drv_reclaim(q, t->tok, t->lens, q->size);
        if (r < 0) {
            t->errors++;
            return -1;
        }
        if (r == 0)
            break;
        vn_pool_free_v(t->pool, 0, t->tok, (uint32_t)r);
        vn_quiet(q);
        t->reclaimed_bufs += (uint32_t)r;
        t->reclaimed_descs += (uint16_t)(q->num_free - before);
        total += r;
    } while (q->num_free < need);
    return total;
}

/* The header into a buffer's headroom or a header slot: the burst's template (fixed-size moves; hs is 10 or 12,
 * NET-03), or, in the per-packet variant, cleared in place for each packet. */
static inline void vn_hdr_put(uint8_t *d, const uint8_t *tmpl, uint32_t hs, int per_packet)
{
    uint64_t h0, t0;
    uint16_t h1, t1, h2 = 0, t2 = 0;
    if (per_packet) {
        memset(d, 0, hs);
        return;
    }
    /* stored only where it differs (net_vhost stores its Rx header fields so too): a header line nobody changes
     * stays shared between the two cores. With --headroom 128 and no MRG_RXBUF in front of net_vhost, which then
     * leaves num_buffers alone, nobody does. */
    __builtin_memcpy(&h0, d, 8);
    __builtin_memcpy(&t0, tmpl, 8);
    __builtin_memcpy(&h1, d + 8, 2);
    __builtin_memcpy(&t1, tmpl + 8, 2);
    if (hs >= 12) {   /* num_buffers */
        __builtin_memcpy(&h2, d + 10, 2);
        __builtin_memcpy(&t2, tmpl + 10, 2);
    }
    if (h0 != t0 || h1 != t1 || h2 != t2) {
        __builtin_memcpy(d, tmpl, 8);
        __builtin_memcpy(d + 8, tmpl + 8, 2);
        if (hs >= 12)
            __builtin_memcpy(d + 10, tmpl + 10, 2);
    }
}

/* Segments of a chained / headroom-less packet: header slot, then each pool segment. */
static inline uint32_t vn_tx_segs(struct vn_txq *t, uint32_t b, uint32_t len)
{
    struct vn_pool *p = t->pool;
    uint16_t id = vn_next_id(t->q);
    t->seg_addr[0] = t->hdr_gpa + (uint64_t)id * VN_HDR_SLOT;
    t->seg_len[0] = t->hdr_size;
    uint32_t n = 1, left = len;
    while (b != VN_NONE && n < t->max_segs) {
        if (b >= p->nbufs || !p->owned[b])
            return 0;
        uint32_t l = p->next[b] == VN_NONE ? left : p->data_len[b];
        if (l > left)
            l = left;
        t->seg_addr[n] = vn_gpa(p, b) + p->data_off[b];
        t->seg_len[n] = l;
        left -= l;
        n++;
        b = p->next[b];
    }
    return b == VN_NONE ? n : 0;
}

/* Descriptors the packets idx[0..n) need (1 on the fast path; the slow path's chain or indirect table). */
static inline uint32_t vn_tx_need(const struct vn_txq *t, const uint32_t *idx, uint32_t n)
{
    const struct vn_pool *p = t->pool;
    uint32_t need = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t b = idx[i];
        if (b >= p->nbufs)
            need += 1;
        else if (!t->force_slow && p->next[b] == VN_NONE && p->data_off[b] >= t->hdr_size)
            need += 1;
        else {
            uint32_t k = 1, c = b;
            while (c < p->nbufs && k <= t->max_segs) { k++; c = p->next[c]; }
            need += vq_drv_needed(t->q, k);
        }
    }
    return need;
}

#define VN_RUN 64   /* fast-path packets handed to the ring in one vq_drv_add_simple call */

/* Fast path: packets of one segment with headroom get the header written into it and go as ONE descriptor each,
 * a run at a time. State in locals (the header stores may alias anything). With ind (--tx-hdr indirect), packets of
 * one segment, headroom or not, go as one ring descriptor each, a two-entry table of the header slot of their id
 * and the frame; the slot is stored only when it differs from the template, so after an id's first use never, and
 * the device reads it from its own cache. Stops at the first packet that is not ours, needs the slow path, or does
 * not fit. Returns the packets queued (not yet published). */
static inline __attribute__((always_inline)) uint32_t
vn_tx_fast_v(struct vn_txq *t, const uint32_t *idx, const uint32_t *len, uint32_t n, int per_packet, int ind)
{
    const struct vn_pool *p = t->pool;
    const uint8_t *owned = p->owned;
    const uint16_t *data_off = p->data_off;
    const uint32_t *next = p->next;
    uint8_t *host = p->host;
    uint64_t gpa = p->gpa, bs = p->stride, bytes = 0;
    uint32_t nbufs = p->nbufs, hs = t->hdr_size, done = 0;
    uint8_t tmpl[12];
    uint64_t a[VN_RUN], tok[VN_RUN];
    uint32_t l[VN_RUN];
    uint16_t ids[VN_RUN];
    struct vq_hdr_table ht = {t->hdr_gpa, VN_HDR_SLOT, hs, ids};
    __builtin_memcpy(tmpl, t->hdr_tmpl, sizeof tmpl);
    while (done < n) {
        uint32_t k = 0, m = n - done < VN_RUN ? n - done : VN_RUN;
        for (; k < m; k++) {
            uint32_t b = idx[done + k];
            if (b >= nbufs || !owned[b] || next[b] != VN_NONE || (!ind && data_off[b] < hs))
                break;
            uint64_t off = (uint64_t)b * bs + data_off[b];
            if (ind) {
                a[k] = gpa + off;
                l[k] = len[done + k];
            } else {
                vn_hdr_put(host + off - hs, tmpl, hs, per_packet);
                a[k] = gpa + off - hs;
                l[k] = len[done + k] + hs;
            }
            tok[k] = b;
        }
        uint32_t added = k == 0 ? 0 : ind ? vq_drv_add_hdr_table(t->q, &ht, a, l, tok, k)
                                          : vq_drv_add_simple(t->q, a, l, 0, tok, k);
        for (uint32_t j = 0; j < added; j++) {
            if (ind)   /* the slot of an id just taken: no longer in flight (nothing is published yet) */
                vn_hdr_put(t->hdr_host + (uint32_t)ids[j] * VN_HDR_SLOT, tmpl, hs, per_packet);
            bytes += len[done + j];
        }
        done += added;
        if (added < m)
            break;
    }
    t->bytes += bytes;
    t->fast += done;
    return done;
}

static inline uint32_t vn_tx_fast(struct vn_txq *t, const uint32_t *idx, const uint32_t *len, uint32_t n)
{
    if (t->hdr_indirect)
        return t->hdr_per_packet ? vn_tx_fast_v(t, idx, len, n, 1, 1) : vn_tx_fast_v(t, idx, len, n, 0, 1);
    return t->hdr_per_packet ? vn_tx_fast_v(t, idx, len, n, 1, 0) : vn_tx_fast_v(t, idx, len, n, 0, 0);
}

/* One packet by the general path: header slot + segments as a chain, or one indirect descriptor (also the fast
 * path's packet when the ring was full). 0 queued, 1 no room, -1 refused (counted). */
static inline int vn_tx_one(struct vn_txq *t, uint32_t b, uint32_t l)
{
    struct vq_driver *q = t->q;
    struct vn_pool *p = t->pool;
    uint32_t hs = t->hdr_size;
    int full;
    if (!t->force_slow && p->next[b] == VN_NONE && p->data_off[b] >= hs) {
        uint8_t *d = vn_buf(p, b) + p->data_off[b] - hs;
        uint64_t a = vn_gpa(p, b) + p->data_off[b] - hs;
        uint32_t dl = l + hs;
        vn_hdr_put(d, t->hdr_tmpl, hs, t->hdr_per_packet);
        full = q->packed ? vq_drv_add1_packed(q, &a, &dl, 1, 1, b) : vq_drv_add1_split(q, &a, &dl, 1, 1, b);
        t->fast += !full;
    } else {
        uint32_t k = vn_tx_segs(t, b, l);
        if (k == 0 || k > q->size) {
            t->errors++;
            return -1;
        }
        /* the header slot of the id this add takes (NET-06/07/08), written only once the ring has room: with
         * the ring full, that id still belongs to a buffer in flight */
        full = vq_drv_needed(q, k) > q->num_free;
        if (!full) {
            vn_hdr_put(t->hdr_host + (uint32_t)vn_next_id(q) * VN_HDR_SLOT, t->hdr_tmpl, hs, t->hdr_per_packet);
            full = q->packed ? vq_drv_add1_packed(q, t->seg_addr, t->seg_len, k, k, b)
                             : vq_drv_add1_split(q, t->seg_addr, t->seg_len, k, k, b);
        }
        t->slow += !full;
    }
    if (!full)
        t->bytes += l;
    return full;
}

/* Publish what was queued; one kick at most, only when the device asks and the caller has no `more`. */
static inline void vn_tx_publish(struct vn_txq *t, uint32_t queued, int more)
{
    t->publishes += vq_drv_publish(t->q);   /* what the fast path has not published yet, if anything */
    t->pending_kick |= queued != 0;
    if (!more && t->pending_kick) {
        t->pending_kick = 0;
        if (vq_drv_kick_prepare(t->q)) {
            t->kick = 1;
            vn_notify(t->kickfd, &t->kicks);
        }
    }
}

/* Queue up to n packets (fast path first, the general path for the others), reclaiming at least what the rest
 * needs when the ring runs short (DPDK: cleanup of at least `need`). Returns the packets queued; -1 in *err when
 * the ring broke. */
static inline uint32_t vn_tx_queue(struct vn_txq *t, const uint32_t *idx, const uint32_t *len, uint32_t n, int *err)
{
    struct vq_driver *q = t->q;
    struct vn_pool *p = t->pool;
    uint32_t i = 0;
    int reclaimed = 0;
    if (q->num_free < n) {
        uint32_t need = vn_tx_need(t, idx, n);
        reclaimed = 1;
        if (need > q->num_free && vn_tx_cleanup(t, need) < 0) {
            *err = -1;
            return 0;
        }
    }
    while (i < n) {
        if (t->hdr_indirect || !t->force_slow)
            i += vn_tx_fast(t, idx + i, len + i, n - i);
        if (i == n)
            break;
        uint32_t b = idx[i];
        if (b >= p->nbufs || !p->owned[b]) {   /* not ours: refuse (counted), stop here */
            t->errors++;
            break;
        }
        int r = vn_tx_one(t, b, len[i]);
        if (r == 1 && !reclaimed) {   /* the rest did not fit: reclaim for it once, then try again */
            uint32_t need = vn_tx_need(t, idx + i, n - i);
            reclaimed = 1;
            if (need > q->num_free && vn_tx_cleanup(t, need) < 0) {
                *err = -1;
                return i;
            }
            continue;
        }
        if (r) {
            if (r == 1)
                t->full += n - i;
            break;
        }
        i++;
    }
    return i;
}

/* Queue up to n packets. Fast path: one segment with headroom -> header written into the headroom, ONE
 * descriptor. Slow path: header from the header area + segments, as a chain or one indirect descriptor.
 * more != 0 defers the kick (xmit_more). Sets t->kick when the device asked to be notified. The
 * doorbell-per-packet variant publishes and may kick after every packet instead (no xmit_more). */
static inline uint32_t vn_tx_burst(struct vn_txq *t, const uint32_t *idx, const uint32_t *len, uint32_t n,
                                   int more)
{
    uint32_t i = 0;
    int err = 0;
    memset(t->hdr_tmpl, 0, sizeof(t->hdr_tmpl));   /* once per burst: flags 0, GSO_NONE, num_buffers 0 */
    t->kick = 0;
    if (t->doorbell_per_packet) {
        for (; i < n; i++) {
            uint32_t k = vn_tx_queue(t, idx + i, len + i, 1, &err);
            if (err < 0)
                break;
            vn_tx_publish(t, k, 0);
            if (k == 0)
                break;
        }
    } else {
        i = vn_tx_queue(t, idx, len, n, &err);
        if (err == 0)
            vn_tx_publish(t, i, more);
    }
    t->packets += i;
    return i;
}

/* Kick now for what `more` bursts left pending (if the device wants it). */
static inline int vn_tx_flush(struct vn_txq *t)
{
    t->kick = 0;
    if (t->pending_kick) {
        t->pending_kick = 0;
        if (vq_drv_kick_prepare(t->q)) {
            t->kick = 1;
            vn_notify(t->kickfd, &t->kicks);
        }
    }
    return t->kick;
}

/* ----------------------------------------------------------------------------------- Rx */

/* Ask for a line with intent to write (x86 PREFETCHW): one transfer in the exclusive state, where a read and a
 * later store would cost a shared copy and then an upgrade, each a round trip to the core that wrote it last. */
static inline void vn_prefetchw(const void *p)
{
#if defined(__x86_64__)
    __asm__ volatile("prefetchw %0" : : "m"(*(const char *)p));
#else
    __builtin_prefetch(p, 1, 3);
#endif
}

/* Post writable buffers until the ring is full or the pool is empty; only when at least `thresh` fit. */
static inline uint32_t vn_rx_refill(struct vn_rxq *r, uint32_t thresh)
{
    struct vq_driver *q = r->q;
    struct vn_pool *p = r->pool;
    uint32_t room = q->num_free;
    if (room == 0 || room < thresh)
        return 0;
    uint32_t k = vn_pool_alloc(p, r->ref_idx, room);
    const uint32_t *ref_idx = r->ref_idx;
    uint64_t *ref_addr = r->ref_addr, *ref_tok = r->ref_tok;
    uint32_t *ref_len = r->ref_len, post_len = r->post_len;
    uint64_t base = p->gpa + p->headroom - r->hdr_size, bs = p->stride;   /* header lands in the headroom */
    for (uint32_t i = 0; i < k; i++) {
        uint32_t b = ref_idx[i];
        ref_addr[i] = base + b * bs;
        ref_len[i] = post_len;
        ref_tok[i] = b;
    }
    uint32_t added = vq_drv_add_simple(q, r->ref_addr, r->ref_len, 1, r->ref_tok, k);
    if (added < k)
        vn_pool_free(p, r->ref_idx + added, k - added);
    if (added) {
        if (!r->calls_on)
            vn_quiet(q);
        vq_drv_publish(q);
        r->refills++;
        r->posted += added;
        if (vq_drv_kick_prepare(q)) {
            r->kick = 1;
            vn_notify(r->kickfd, &r->kicks);
        }
    }
    if (k < room)
        r->nombuf++;
    return added;
}

/* Attach one used buffer to the packet being assembled; emits it when complete. Returns 1 if emitted. */
static inline int vn_rx_take(struct vn_rxq *r, uint32_t b, uint32_t len, uint32_t *out_idx, uint32_t *out_len,
                             uint32_t *nout)
{
    struct vn_pool *p = r->pool;
    uint32_t hs = r->hdr_size;
    if ((uint64_t)b >= p->nbufs || !p->owned[b]) {   /* a token we never posted: the ring engine checks ids */
        r->errors++;
        return 0;
    }
    r->bufs++;
    if (r->part_left == 0) {   /* first buffer of a packet: starts with the header (NET-32) */
        uint8_t *h = vn_buf(p, b) + p->headroom - hs;
        uint32_t nb = 1;
        if (len < hs) {
            r->errors++;
            vn_pool_free1(p, b);
            return 0;
        }
        if (r->mrg) {
            nb = (uint32_t)h[10] | ((uint32_t)h[11] << 8);   /* NET-29 */
            if (nb == 0 || nb > r->q->size) {
                r->errors++;
                vn_pool_free1(p, b);
                return 0;
            }
        }
        p->data_off[b] = (uint16_t)p->headroom;
        p->data_len[b] = len - hs;
        p->next[b] = VN_NONE;
        r->part_head = r->part_tail = b;
        r->part_len = len - hs;
        r->part_left = nb - 1;
        r->part_nseg = 1;
    } else {                   /* continuation: no header, data from the buffer's start */
        p->data_off[b] = (uint16_t)(p->headroom - hs);
        p->data_len[b] = len;
        p->next[b] = VN_NONE;
        p->next[r->part_tail] = b;
        r->part_tail = b;
        r->part_len += len;
        r->part_left--;
        r->part_nseg++;
    }
    if (r->part_left)
        return 0;
    out_idx[*nout] = r->part_head;
    out_len[*nout] = r->part_len;
    (*nout)++;
    r->packets++;
    r->bytes += r->part_len;
    if (r->part_nseg > 1)
        r->merged++;
    return 1;
}

/* vn_rx_take for the reclaimed buffers tok[0..got): a packet of one buffer (no MRG_RXBUF, or num_buffers 1)
 * with the state in locals; anything else (a merged packet, a bad token or header) by vn_rx_take. */
static inline void vn_rx_take_all(struct vn_rxq *r, uint32_t got, uint32_t *out_idx, uint32_t *out_len,
                                  uint32_t *nout_io)
{
    struct vn_pool *p = r->pool;
    const uint64_t *tok = r->tok;
    const uint32_t *lens = r->lens;
    const uint8_t *owned = p->owned, *host = p->host;
    uint16_t *data_off = p->data_off, hr = (uint16_t)p->headroom;
    uint32_t *data_len = p->data_len, *next = p->next;
    uint32_t nbufs = p->nbufs, hs = r->hdr_size, mrg = r->mrg, nout = *nout_io;
    uint64_t bs = p->stride, pkts = 0, bytes = 0;
    if (r->own_frame) {   /* the line the caller will write (macfwd): all asked for at once, before any read */
        for (uint32_t i = 0; i < got; i++)
            if (tok[i] < nbufs)
                vn_prefetchw(host + tok[i] * bs + hr);
    }
    for (uint32_t i = 0; i < got; i++) {
        uint64_t b = tok[i];
        uint32_t len = lens[i];
        if (r->part_left == 0 && b < nbufs && owned[b] && len >= hs) {
            const uint8_t *h = host + b * bs + hr - hs;
            if (!mrg || (h[10] | (h[11] << 8)) == 1) {   /* NET-29: num_buffers */
                data_off[b] = hr;
                data_len[b] = len - hs;
                next[b] = VN_NONE;
                out_idx[nout] = (uint32_t)b;
                out_len[nout] = len - hs;
                nout++;
                pkts++;
                bytes += len - hs;
                continue;
            }
        }
        r->packets += pkts;
        r->bytes += bytes;
        r->bufs += pkts;
        pkts = bytes = 0;
        vn_rx_take(r, (uint32_t)b, len, out_idx, out_len, &nout);
    }
    r->packets += pkts;
    r->bytes += bytes;
    r->bufs += pkts;
    *nout_io = nout;
}

/* Receive up to max packets (indices of first buffers, lengths with the header stripped); no refill. */
static inline int vn_rx_recv(struct vn_rxq *r, uint32_t *out_idx, uint32_t *out_len, uint32_t max)
{
    struct vq_driver *q = r->q;
    uint32_t nout = 0;
    while (nout < max) {
        /* never take more buffers than packets still wanted, unless a packet is half assembled */
        uint32_t want = r->part_left ? r->part_left : max - nout;
        int got = vq_drv_reclaim(q, r->tok, r->lens, want);
        if (got < 0) {
            r->errors++;
            return -1;
        }
        if (got == 0)
            break;
        vn_rx_take_all(r, (uint32_t)got, out_idx, out_len, &nout);
    }
    return (int)nout;
}

/* After a receive of n packets: refill in one go when at least refill_thresh slots are free, or, when nothing came,
 * whatever fits. The buffers still posted may be too few for the next packet (mergeable: several buffers each), and
 * with fewer than refill_thresh free nothing would ever come to refill the ring again (NET-26). */
static inline void vn_rx_refill_after(struct vn_rxq *r, int n)
{
    vn_rx_refill(r, n ? r->refill_thresh : 1);
}

/* Receive, then refill (vn_rx_refill_after). */
static inline int vn_rx_burst(struct vn_rxq *r, uint32_t *out_idx, uint32_t *out_len, uint32_t max)
{
    r->kick = 0;
    int n = vn_rx_recv(r, out_idx, out_len, max);
    if (n >= 0)
        vn_rx_refill_after(r, n);
    return n;
}

/* Is there a used Rx buffer waiting? (for eventfd waiting: check after enabling calls) */
static inline int vn_rx_pending(const struct vn_rxq *r)
{
    const struct vq_driver *q = r->q;
    if (q->packed) {
        uint16_t f = VQ_ACQUIRE(q->pdesc[q->last_used].flags);
        return q->inflight && !!(f & VIRTQ_DESC_F_AVAIL) == q->used_wrap && !!(f & VIRTQ_DESC_F_USED) == q->used_wrap;
    }
    return VQ_ACQUIRE(q->used->idx) != q->last_used;
}

/* ----------------------------------------------------------------------------------- packets */

static inline void vn_macswap(struct vn_pool *p, const uint32_t *idx, uint32_t n)
{
    uint32_t nbufs = p->nbufs;   /* in a local: the byte stores below may alias *p */
    for (uint32_t i = 0; i < n; i++) {
        if (idx[i] >= nbufs)   /* not a pool buffer: bounded here, whoever passed it (Python too) */
            continue;
        uint8_t *e = vn_buf(p, idx[i]) + p->data_off[idx[i]], tmp[6];
        memcpy(tmp, e, 6);
        memcpy(e, e + 6, 6);
        memcpy(e + 6, tmp, 6);
    }
}

static inline uint64_t vn_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint32_t vn_lat_bucket(uint64_t ns)
{
    if (ns < 2)
        return 0;
    uint32_t lg = 63 - (uint32_t)__builtin_clzll(ns);                       /* floor(log2) */
    uint32_t frac = lg >= 2 ? (uint32_t)((ns >> (lg - 2)) & 3) : (uint32_t)((ns << (2 - lg)) & 3);
    uint32_t b = 4 * lg + frac;
    return b > 255 ? 255 : b;
}

/* For each received frame: latency = now - the timestamp it carries; then, when `restamp`, stamp it with now (it
 * goes back out right away: macfwd). One clock read per burst; the counters in locals (the stamp's store through a
 * byte pointer may alias anything, so fields read through l would be reloaded after each packet). */
static inline void vn_lat_measure(struct vn_lat *l, struct vn_pool *p, const uint32_t *idx, uint32_t n, int restamp)
{
    uint64_t now = vn_now_ns();
    const uint16_t *data_off = p->data_off;
    const uint32_t *data_len = p->data_len;
    uint8_t *host = p->host;
    uint64_t *hist = l->hist, bs = p->stride;
    uint64_t count = l->count, sum = l->sum, min = l->min, max = l->max, bad = l->bad;
    uint32_t ts_off = l->ts_off, nbufs = p->nbufs;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t b = idx[i];
        if (b >= nbufs || data_len[b] < ts_off + 8) {
            bad++;
            continue;
        }
        uint8_t *d = host + b * bs + data_off[b] + ts_off;
        uint64_t ts;
        memcpy(&ts, d, 8);
        if (restamp)
            memcpy(d, &now, 8);
        if (ts == 0 || ts > now) {
            bad++;
            continue;
        }
        uint64_t ns = now - ts;
        if (ns < min || count == 0)
            min = ns;
        if (ns > max)
            max = ns;
        count++;
        sum += ns;
        hist[vn_lat_bucket(ns)]++;
    }
    l->count = count; l->sum = sum; l->min = min; l->max = max; l->bad = bad;
}

static inline void vn_lat_update(struct vn_lat *l, struct vn_pool *p, const uint32_t *idx, uint32_t n)
{
    vn_lat_measure(l, p, idx, n, 1);
}

/* Start the histogram over (after the warm-up). */
static inline void vn_lat_reset(struct vn_lat *l)
{
    uint32_t off = l->ts_off;
    memset(l, 0, sizeof *l);
    l->ts_off = off;
}

/* Allocate and build n packets of len bytes from the template into out[]: one buffer when the frame fits
 * the data room, else a chain of buffers (each filled to its end). Returns how many were built. */
static inline uint32_t vn_gen(struct vn_pool *p, uint32_t *out, uint32_t n, const uint8_t *tmpl, uint32_t len,
                              uint64_t seq, uint32_t seq_off, int stamp, uint32_t ts_off)
{
    uint32_t room = p->buf_size - p->headroom, nseg = (len + room - 1) / room, i;
    uint64_t now = stamp ? vn_now_ns() : 0;
    uint8_t fields[16];
    if (nseg == 0)
        nseg = 1;
    for (i = 0; i < n; i++) {
        uint64_t s = seq + i;
        uint32_t first = VN_NONE, prev = VN_NONE, pos = 0;
        if (p->top < nseg)
            break;
        memcpy(fields, &s, 8);
        memcpy(fields + 8, &now, 8);
        for (uint32_t k = 0; k < nseg; k++) {
            uint32_t b = 0;
            if (!vn_pool_alloc(p, &b, 1))   /* cannot happen: top >= nseg was checked */
                return i;
            uint32_t l = len - pos < room ? len - pos : room;
            uint8_t *d = vn_buf(p, b) + p->data_off[b];
            memcpy(d, tmpl + pos, l);
            for (uint32_t j = 0; j < l; j++) {   /* seq / timestamp bytes that fall in this segment */
                uint32_t at = pos + j;
                if (at >= seq_off && at < seq_off + 8)
                    d[j] = fields[at - seq_off];
                else if (stamp && at >= ts_off && at < ts_off + 8)
                    d[j] = fields[8 + at - ts_off];
                else if (at >= seq_off + 8 && (!stamp || at >= ts_off + 8))
                    break;
            }
            p->data_len[b] = l;
            if (prev == VN_NONE)
                first = b;
            else
                p->next[prev] = b;
            prev = b;
            pos += l;
        }
        out[i] = first;
    }
    return i;
}

#define VN_SEQ_BAD UINT64_MAX   /* a bad packet's entry in vn_check's seqs: its sequence field says nothing */

/* Check received packets against the template: length, MACs (swapped when `swapped`), every payload byte
 * after the Ethernet header except the sequence and timestamp fields. Returns the number of bad packets;
 * the sequence numbers go to seqs, VN_SEQ_BAD for a bad packet. Follows segment chains (mergeable packets). */
static inline uint32_t vn_check(const struct vn_pool *p, const uint32_t *idx, const uint32_t *len, uint32_t n,
                                const uint8_t *tmpl, uint32_t tlen, int swapped, uint32_t seq_off, uint32_t ts_off,
                                uint64_t *seqs)
{
    uint32_t bad = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t b = idx[i], pos = 0, ok = len[i] == tlen;
        uint64_t s = 0;
        uint8_t *sb = (uint8_t *)&s;
        while (ok && b != VN_NONE && pos < tlen) {
            if (b >= p->nbufs) {   /* not a pool buffer (an index passed in, or a corrupt next link) */
                ok = 0;
                break;
            }
            const uint8_t *d = vn_buf(p, b) + p->data_off[b];
            uint32_t l = p->data_len[b];
            for (uint32_t j = 0; j < l && pos < tlen; j++, pos++) {
                uint8_t want;
                if (pos < 6)
                    want = tmpl[swapped ? pos + 6 : pos];
                else if (pos < 12)
                    want = tmpl[swapped ? pos - 6 : pos];
                else
                    want = tmpl[pos];
                if (pos >= seq_off && pos < seq_off + 8) {
                    sb[pos - seq_off] = d[j];
                    continue;
                }
                if (pos >= ts_off && pos < ts_off + 8)
                    continue;
                if (d[j] != want) {
                    ok = 0;
                    break;
                }
            }
            b = p->next[b];
        }
        if (pos != tlen)
            ok = 0;
        seqs[i] = ok ? s : VN_SEQ_BAD;
        bad += !ok;
    }
    return bad;
}

#define VN_CLOCK_POLLS 64   /* empty polls between two looks at the clock while spinning */

/* Poll an empty Rx ring up to `spin` times (a pause between polls), looking at the clock every VN_CLOCK_POLLS polls
 * to give up at `until` (CLOCK_MONOTONIC ns): whatever the spin, the caller gets control back in time to see a
 * stop. Returns the polls done: fewer than `spin` when a used buffer showed up or the time was up. */
static inline uint32_t vn_rx_spin(const struct vn_rxq *r, uint32_t spin, uint64_t until)
{
    uint32_t k = 0;
    while (k < spin && !vn_rx_pending(r)) {
        __builtin_ia32_pause();
        if (!(++k % VN_CLOCK_POLLS) && vn_now_ns() >= until)
            break;
    }
    return k;
}

/* How many packets one macfwd step takes. No more than a burst out (sent, not yet received): the loop is bound by
 * latency, and a whole burst keeps the device idle while the driver works on it, then the driver idle while the
 * device does (a device polling all the time takes the whole burst in one go). Pieces of publish_every instead:
 * the device starts on the first while the driver receives the next, and the loop settles into pieces moving on
 * both sides at once (one burst in flight, packed, in front of DPDK's net_vhost: +11-14%; benchmarks/
 * interleaved.py). More out: the device has work queued, whole bursts, each one poll for it. Received more than
 * sent (a device that also sends frames of its own: the difference wraps past any burst), or a burst's worth more
 * sent than came back (one that drops or keeps frames): the counts say nothing, whole bursts. Never more than max:
 * the caller's arrays hold that many. */
static inline uint32_t vn_fwd_take(const struct vn_rxq *r, const struct vn_txq *t, uint32_t max)
{
    uint32_t every = t->publish_every;
    return every && every < max && t->packets - r->packets <= max ? every : max;
}

/* One macfwd step: receive (vn_fwd_take), swap MACs, refill the Rx ring, send back; what still does not fit in Tx
 * after VN_TX_RETRIES reclaim rounds is dropped (counted). Tx cleanup comes after the send, off the round trip.
 * Returns the packet count, or -1 when a ring broke. Not inlined: a symbol profilers can count from
 * (benchmarks/loop_profile.py). */
static __attribute__((noinline)) int vn_fwd_burst(struct vn_rxq *r, struct vn_txq *t, uint32_t *idx, uint32_t *len,
                                                  uint32_t max)
{
    r->kick = 0;
    int n = vn_rx_recv(r, idx, len, vn_fwd_take(r, t, max));
    if (n < 0)
        return n;
    if (n > 0) {
        if (r->lat)
            vn_lat_update(r->lat, r->pool, idx, (uint32_t)n);
        vn_macswap(r->pool, idx, (uint32_t)n);
        /* repost what was received before it goes back out: with as many packets in flight as the Rx ring holds
         * (bench: 256 into 256) they would otherwise reach a ring with no buffer left and be dropped. Always: what
         * the driver can see (posted Rx buffers, Tx not reclaimed) does not say how many the backend can still
         * fill (used Rx entries not yet received, packets staged after their Tx completion was reclaimed) */
        vn_rx_refill(r, 1);
        uint32_t sent = vn_tx_burst(t, idx, len, (uint32_t)n, 0);
        /* Tx full: the backend may have these very packets' Tx completions about to land (it publishes them
         * after their Rx copies); reclaim and retry a bounded number of times before dropping (testpmd: retry) */
        for (uint32_t tries = 0; sent < (uint32_t)n && tries < VN_TX_RETRIES && !t->q->error; tries++) {
            __builtin_ia32_pause();
            if (vn_tx_cleanup(t, (uint32_t)n - sent) < 0)
                return -1;
            sent += vn_tx_burst(t, idx + sent, len + sent, (uint32_t)n - sent, 0);
        }
        if (t->q->error)
            return -1;
        if (sent < (uint32_t)n) {
            vn_pool_free(t->pool, idx + sent, (uint32_t)n - sent);
            t->dropped += (uint32_t)n - sent;
        }
        if (t->q->num_free < t->cleanup_thresh && vn_tx_cleanup(t, t->cleanup_thresh) < 0)
            return -1;
    }
    vn_rx_refill_after(r, n);
    return n;
}

/* Up to `bursts` macfwd steps in one call (Python then looks at the clock and its stop flag); a step that finds
 * nothing spins up to `spin` more polls. The spinning of one call lasts `slice_ns` at most: the call then returns,
 * and the spin goes on where it was at the next call (r->spun), so that a stop is seen within about a slice,
 * whatever --spin. With `idle` (--wait), the call also ends once a whole spin found nothing and sets *idle: the
 * caller then enables calls and sleeps. Python is paid per call, not per burst; the clock is read only while
 * spinning. Returns the packets forwarded, or -1 when a ring broke. */
static inline int64_t vn_fwd_loop(struct vn_rxq *r, struct vn_txq *t, uint32_t *idx, uint32_t *len, uint32_t max,
                                  uint32_t spin, uint32_t bursts, int32_t *idle, uint64_t slice_ns)
{
    int64_t total = 0;
    uint64_t until = 0;
    if (idle)
        *idle = 0;
    for (uint32_t k = 0; k < bursts; k++) {
        int n = vn_fwd_burst(r, t, idx, len, max);
        if (n < 0)
            return -1;
        if (n > 0) {
            total += n;
            r->spun = 0;
            continue;
        }
        uint32_t left = spin > r->spun ? spin - r->spun : 0, done = 0;
        if (left) {
            if (!until)
                until = vn_now_ns() + slice_ns;
            done = vn_rx_spin(r, left, until);
            r->spun += done;
        }
        if (done == left) {   /* a whole spin found nothing */
            r->spun = 0;
            if (idle) {
                *idle = 1;
                break;
            }
        } else if (!vn_rx_pending(r)) {   /* the slice is over */
            break;
        }
    }
    return total;
}

/* txonly: build n frames from the template and send them (what does not fit is freed and counted as dropped).
 * Returns the number sent. */
static inline uint32_t vn_gen_tx(struct vn_txq *t, uint32_t *idx, uint32_t n, const uint8_t *tmpl, uint32_t len,
                                 uint64_t seq, uint32_t seq_off, int stamp, uint32_t ts_off, uint32_t *lens)
{
    uint32_t k = vn_gen(t->pool, idx, n, tmpl, len, seq, seq_off, stamp, ts_off);
    for (uint32_t i = 0; i < k; i++)
        lens[i] = len;
    uint32_t sent = vn_tx_burst(t, idx, lens, k, 0);
    if (sent < k) {
        vn_pool_free(t->pool, idx + sent, k - sent);
        t->dropped += k - sent;
    }
    return sent;
}

/* Open-loop Tx at a fixed rate (vring bench --rate): the packets due by now go out (at most `max` per step), each
 * stamped with the time it was due, so that a late sender shows up as latency; received frames (at most `rx_max`
 * per step: a receiver slower than the sender when smaller) are measured against that stamp and freed. What does not fit in Tx is dropped (counted in t->dropped). Up to `steps` steps;
 * with `spin`, returns early after that many idle steps in a row (nothing due, nothing received) and sets
 * pc->idle: the caller may block until pc->next_ns. Returns the packets received, or -1 when a ring broke. */
static inline int64_t vn_pace_loop(struct vn_rxq *r, struct vn_txq *t, struct vn_pace *pc, uint32_t *tx_idx,
                                   uint32_t *tx_len, uint32_t *rx_idx, uint32_t *rx_len, const uint8_t *tmpl,
                                   uint32_t plen, uint32_t seq_off, uint32_t ts_off, uint32_t max, uint32_t rx_max,
                                   uint32_t spin, uint32_t steps)
{
    struct vn_pool *p = r->pool;
    int64_t total = 0;
    uint32_t idle = 0;
    pc->idle = 0;
    for (uint32_t s = 0; s < steps; s++) {
        uint64_t now = vn_now_ns();
        uint64_t due = now < pc->t0 ? 0 : (uint64_t)((double)(now - pc->t0) / pc->ns_per_pkt) + 1;
        uint32_t k = 0;
        due = due > pc->offered ? due - pc->offered : 0;
        if (due) {
            k = vn_gen(p, tx_idx, due < max ? (uint32_t)due : max, tmpl, plen, pc->offered, seq_off, 0, ts_off);
            for (uint32_t i = 0; i < k; i++) {
                uint64_t at = pc->t0 + (uint64_t)((double)(pc->offered + i) * pc->ns_per_pkt);
                uint32_t b = tx_idx[i];
                if (p->data_len[b] >= ts_off + 8)
                    memcpy(vn_buf(p, b) + p->data_off[b] + ts_off, &at, 8);
                tx_len[i] = plen;
            }
            uint32_t sent = vn_tx_burst(t, tx_idx, tx_len, k, 0);
            if (t->q->error)
                return -1;
            if (sent < k) {
                vn_pool_free(p, tx_idx + sent, k - sent);
                t->dropped += k - sent;
            }
            pc->offered += k;
            if (k < due && p->top == 0)
                pc->nobuf += 1;   /* the pool ran dry: the receiver holds everything */
        }
        int n = vn_rx_recv(r, rx_idx, rx_len, rx_max);
        if (n < 0)
            return -1;
        if (n > 0) {
            if (r->lat)
                vn_lat_measure(r->lat, p, rx_idx, (uint32_t)n, 0);
            vn_pool_free(p, rx_idx, (uint32_t)n);
            total += n;
        }
        vn_rx_refill_after(r, n);
        if (t->q->num_free < t->cleanup_thresh && vn_tx_cleanup(t, t->cleanup_thresh) < 0)
            return -1;
        if (k == 0 && n == 0) {
            if (spin && ++idle >= spin) {
                pc->idle = 1;
                break;
            }
        } else {
            idle = 0;
        }
    }
    pc->next_ns = pc->t0 + (uint64_t)((double)pc->offered * pc->ns_per_pkt);
    return total;
}

/* rxonly: receive and free; on an empty ring spin up to `spin` polls, `slice_ns` at most (vn_rx_spin), then receive
 * once more. Returns packets received, or -1. */
static inline int vn_rx_drop(struct vn_rxq *r, uint32_t *idx, uint32_t *len, uint32_t max, uint32_t spin,
                             uint64_t slice_ns)
{
    int n = vn_rx_burst(r, idx, len, max);
    if (n == 0 && spin) {
        vn_rx_spin(r, spin, vn_now_ns() + slice_ns);
        n = vn_rx_burst(r, idx, len, max);
    }
    if (n > 0)
        vn_pool_free(r->pool, idx, (uint32_t)n);
    return n;
}

#endif

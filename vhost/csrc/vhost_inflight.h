/* Inflight I/O tracking on the backend's data path (VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD).
 *
 * The backend writes, per chain, what it has taken from a queue and what it has completed into the
 * frontend-kept inflight area, in the layout of the vhost-user spec ("Inflight I/O tracking"; DPDK's
 * rte_vhost_inflight_info_split/packed), so that the backend that follows a killed one takes again every
 * chain that was taken and not completed, in the order it was first taken (vhost/inflight.py reads the area
 * and fills the resubmit list; vhi_poll replays it before anything new).
 *
 * Write order, so that a crash at any instruction leaves an area the successor can read:
 *   taken:     the entry's body (packed: descriptor copies, num, last; both: counter), then inflight = 1
 *              (release);
 *   completed: split: the batch list (desc[].next, last_batch_head), used->idx (vq_dev_flush), inflight = 0,
 *              then used_idx; packed: the free list and used_idx/wrap, the used descriptors (vq_dev_flush),
 *              inflight = 0, then the old_* copies (the commit point).
 * Everything the engine needs to decide (free list, chain lengths, positions) is a private copy: the area is
 * written, never read, here. Cost with tracking off: one test of a NULL pointer per poll and per flush. */
#ifndef VHOST_INFLIGHT_H
#define VHOST_INFLIGHT_H

#include <stdint.h>
#include <unistd.h>

#include "virtq.h"   /* and vhost_net_types.h before this file (it has no include guard: cffi reads it) */

#define VHI_STORE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_RELEASE)
#define VHI_HOOK static inline __attribute__((always_inline))   /* at the call sites: one NULL test when off */
#define VHI_TRACKED static __attribute__((noinline))             /* out of line: leaves the loops as they were */
/* A store point: a test sets f->die_at = k and the process dies as a kill -9 would at the k-th point, so that
 * a crash after every store of the write order above can be tried (tests/test_inflight_crash_points.py). The
 * functions with points take a constant `pts` and are built twice (their wrappers call them with die_at != 0):
 * with die_at 0 the points are not there at all, and the data path pays one test per call. */
#define VHI_POINT(f) do { if (pts && --(f)->die_at == 0) _exit(9); } while (0)
#define VHI_DYING(f) __builtin_expect((f)->die_at != 0, 0)
#define VHI_BODY static inline __attribute__((always_inline))

/* Chains k0..c->n-1 of c were just taken (split: their heads index the area). */
VHI_BODY void vhi_taken_split_(struct vh_inflight *f, const struct vq_chains *c, uint32_t k0, const int pts)
{
    struct vhi_region_split *r = (struct vhi_region_split *)f->region;
    for (uint32_t k = k0; k < c->n; k++) {
        struct vhi_desc_split *d = &r->desc[c->id[k]];   /* id < size: checked by the poll */
        VQ_SET(d->counter, f->counter++);
        VHI_POINT(f);
        VHI_STORE(d->inflight, 1);
        VHI_POINT(f);
    }
    f->taken += c->n - k0;
}

/* Packed: chains k0..c->n-1, laid out in the ring from `slot` on, were just taken. Each gets a chain of free
 * entries holding copies of its descriptors (the ring slots may be overwritten by out-of-order used
 * descriptors while it is in flight). */
VHI_BODY void vhi_taken_packed_(struct vh_inflight *f, const struct vq_device *q, const struct vq_chains *c,
                                uint32_t k0, uint16_t slot, const int pts)
{
    struct vhi_region_packed *r = (struct vhi_region_packed *)f->region;
    uint16_t size = f->size;
    for (uint32_t k = k0; k < c->n; k++) {
        uint16_t head = f->free_head, e = head, last = head, nd = c->ndesc[k];
        if (f->stopped)
            return;
        if (head >= size) {   /* more descriptors in flight than the ring holds: a hostile driver */
            f->stopped = 1;   /* tracking stops here (reported); the queue itself goes on */
            return;
        }
        for (uint16_t j = 0; j < nd; j++) {
            const struct vring_packed_desc *s = &q->pdesc[slot];
            struct vhi_desc_packed *d = &r->desc[e];
            if (e >= size) {
                f->stopped = 1;
                return;
            }
            VQ_SET(d->addr, VQ_ONCE(s->addr));
            VQ_SET(d->len, VQ_ONCE(s->len));
            VQ_SET(d->id, VQ_ONCE(s->id));
            VQ_SET(d->flags, VQ_ONCE(s->flags));
            last = e;
            e = f->e_next[e];
            if (++slot == size)
                slot = 0;
        }
        struct vhi_desc_packed *h = &r->desc[head];
        VHI_POINT(f);
        VQ_SET(h->num, nd);
        VQ_SET(h->last, last);
        VQ_SET(h->counter, f->counter++);
        f->e_num[head] = nd;
        f->e_last[head] = last;
        f->entry_of_id[c->id[k]] = head;
        VHI_POINT(f);
        VHI_STORE(h->inflight, 1);
        VHI_POINT(f);
        f->free_head = e;
        VQ_SET(r->free_head, e);
        VHI_POINT(f);
        VHI_STORE(r->old_free_head, e);
        VHI_POINT(f);
    }
    f->taken += c->n - k0;
}

static inline void vhi_taken_split(struct vh_inflight *f, const struct vq_chains *c, uint32_t k0)
{
    if (VHI_DYING(f))
        vhi_taken_split_(f, c, k0, 1);
    else
        vhi_taken_split_(f, c, k0, 0);
}

static inline void vhi_taken_packed(struct vh_inflight *f, const struct vq_device *q, const struct vq_chains *c,
                                    uint32_t k0, uint16_t slot)
{
    if (VHI_DYING(f))
        vhi_taken_packed_(f, q, c, k0, slot, 1);
    else
        vhi_taken_packed_(f, q, c, k0, slot, 0);
}

/* Take the chains of the resubmit list again, in the order they were first taken. 0, or -1 (broken). */
static inline int vhi_replay(struct vh_inflight *f, struct vq_device *q, struct vq_chains *c, uint32_t max)
{
    while (f->resubmit_pos < f->nresubmit && c->n < max && c->n < c->cap_chains) {
        uint16_t h = f->resubmit[f->resubmit_pos];
        int r;
        if (h >= q->size)
            return vq_dev_fail(q, VQ_ERR_HEAD_OUT_OF_RANGE, h, f->resubmit_pos);
        if (f->packed) {   /* the chain's copies, parsed by the ring's own checks as a ring of their own */
            const struct vhi_region_packed *reg = (const struct vhi_region_packed *)f->region;
            uint16_t e = h, num = f->e_num[h], nd = 0;
            if (num == 0 || num > q->size)
                return vq_dev_fail(q, VQ_ERR_CHAIN_TOO_LONG, h, num);
            for (uint16_t j = 0; j < num; j++) {
                if (e >= q->size)
                    return vq_dev_fail(q, VQ_ERR_NEXT_OUT_OF_RANGE, h, e);
                f->scratch[j].addr = VQ_ONCE(reg->desc[e].addr);
                f->scratch[j].len = VQ_ONCE(reg->desc[e].len);
                f->scratch[j].id = VQ_ONCE(reg->desc[e].id);
                f->scratch[j].flags = VQ_ONCE(reg->desc[e].flags);
                e = f->e_next[e];
            }
            if (num < q->size)
                f->scratch[num].flags = 0;   /* a NEXT on the last copy ends here, not in stale entries */
            struct vring_packed_desc *ring = q->pdesc;
            uint16_t la = q->last_avail;
            q->pdesc = f->scratch;
            q->last_avail = 0;
            r = vq_dev_chain_packed(q, c, &nd);
            q->pdesc = ring;
            q->last_avail = la;
            if (r == 0 && nd != num)
                return vq_dev_fail(q, VQ_ERR_CHAIN_TOO_LONG, h, nd);
            if (r == 0)
                f->entry_of_id[c->id[c->n - 1]] = h;
        } else {
            if (q->id_inflight[h])
                return vq_dev_fail(q, VQ_ERR_ID_IN_USE, h, f->resubmit_pos);
            r = vq_dev_chain_split(q, c, h);
        }
        if (r < 0)
            return -1;
        if (r > 0)
            break;   /* no room in c: the rest next time */
        f->resubmit_pos++;
        f->resubmitted++;
    }
    return 0;
}

/* The region and its private arrays are laid out for f's format and size; the ring may be another (a frontend
 * that changed features after SET_INFLIGHT_FD): never read one through the other. */
static inline int vhi_matches(struct vq_device *q, const struct vh_inflight *f)
{
    if (f->packed == q->packed && f->size == q->size)
        return 1;
    vq_dev_fail(q, VQ_ERR_INFLIGHT_MISMATCH, f->packed, f->size);
    return 0;
}

VHI_TRACKED int vhi_poll_tracked(struct vq_device *q, struct vq_chains *c, uint32_t max, struct vh_inflight *f)
{
    if (!vhi_matches(q, f))
        return -1;
    if (f->resubmit_pos < f->nresubmit) {
        if (vhi_replay(f, q, c, max) < 0)
            return -1;
        if (f->resubmit_pos < f->nresubmit)
            return (int)c->n;   /* nothing new before the old ones (IN_ORDER) */
    }
    uint32_t k0 = c->n;
    uint16_t slot = q->last_avail;
    int r = q->packed ? vq_dev_poll_packed(q, c, max) : vq_dev_poll_split(q, c, max);
    if (r < 0)
        return -1;
    if (f->packed)
        vhi_taken_packed(f, q, c, k0, slot);
    else
        vhi_taken_split(f, c, k0);
    return r;
}

/* Poll up to max chains, appending to c; with tracking, the resubmit list goes first and what is taken is
 * recorded. Returns c->n, or -1 (broken). */
VHI_HOOK int vhi_poll(struct vq_device *q, struct vq_chains *c, uint32_t max, struct vh_inflight *f)
{
    if (!f)
        return q->packed ? vq_dev_poll_packed(q, c, max) : vq_dev_poll_split(q, c, max);
    return vhi_poll_tracked(q, c, max, f);
}

VHI_BODY void vhi_flush_tracked_(struct vq_device *q, struct vh_inflight *f, const int pts)
{
    uint32_t n = q->shadow_count;
    if (n == 0 || !vhi_matches(q, f))
        return;
    if (f->packed) {
        struct vhi_region_packed *r = (struct vhi_region_packed *)f->region;
        uint16_t size = f->size;
        if (f->stopped) {
            vq_dev_flush(q);
            return;
        }
        for (uint32_t k = 0; k < n; k++) {   /* the batch's entries back on the free list */
            uint16_t e = f->entry_of_id[q->shadow_id[k]], last = f->e_last[e];
            VQ_SET(r->desc[last].next, f->free_head);
            f->e_next[last] = f->free_head;
            f->free_head = e;
            f->used_idx += f->e_num[e];
            if (f->used_idx >= size) {
                f->used_idx -= size;
                f->used_wrap ^= 1;
            }
            VHI_POINT(f);
        }
        VQ_SET(r->free_head, f->free_head);
        VHI_POINT(f);
        VQ_SET(r->used_idx, f->used_idx);
        VHI_POINT(f);
        VHI_STORE(r->used_wrap_counter, (uint8_t)f->used_wrap);
        VHI_POINT(f);
        vq_dev_flush(q);
        VHI_POINT(f);
        for (uint32_t k = 0; k < n; k++) {
            VQ_SET(r->desc[f->entry_of_id[q->shadow_id[k]]].inflight, 0);
            VHI_POINT(f);
        }
        VHI_STORE(r->old_free_head, f->free_head);
        VHI_POINT(f);
        VHI_STORE(r->old_used_idx, f->used_idx);
        VHI_POINT(f);
        VHI_STORE(r->old_used_wrap_counter, (uint8_t)f->used_wrap);
    } else {
        struct vhi_region_split *r = (struct vhi_region_split *)f->region;
        uint16_t h = f->last_batch_head;
        for (uint32_t k = 0; k < n; k++) {   /* the batch list, newest first */
            uint16_t id = (uint16_t)q->shadow_id[k];
            VQ_SET(r->desc[id].next, h);
            h = id;
            VHI_POINT(f);
        }
        f->last_batch_head = h;
        VHI_STORE(r->last_batch_head, h);
        VHI_POINT(f);
        vq_dev_flush(q);   /* used->idx (release) */
        VHI_POINT(f);
        for (uint32_t k = 0; k < n; k++) {
            VQ_SET(r->desc[q->shadow_id[k]].inflight, 0);
            VHI_POINT(f);
        }
        VHI_STORE(r->used_idx, q->used_idx);
    }
    f->completed += n;
}

VHI_TRACKED void vhi_flush_tracked(struct vq_device *q, struct vh_inflight *f)
{
    if (VHI_DYING(f))
        vhi_flush_tracked_(q, f, 1);
    else
        vhi_flush_tracked_(q, f, 0);
}

/* Publish the shadow used entries (vq_dev_flush), recording the completions around it. */
VHI_HOOK void vhi_flush(struct vq_device *q, struct vh_inflight *f)
{
    if (!f)
        vq_dev_flush(q);
    else
        vhi_flush_tracked(q, f);
}

#endif

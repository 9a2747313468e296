/* The ring primitives: split and packed, driver and device halves, normal and in-order variants.
 * All static inline so that every package's cffi module can include them (as DPDK keeps virtqueue.h).
 * Semantics: rings/README.md. Spec IDs: shared/spec/virtio-checklist.md.
 *
 * Memory ordering: the peer's memory is read with relaxed atomic loads (a copy is taken, then checked),
 * publication points are release stores, consumption points acquire loads, and a full fence separates
 * a publication from the read of the peer's suppression fields (MEM-03, EVT-25, MEM-10). */
#ifndef VIRTQ_H
#define VIRTQ_H

#include <stdint.h>
#include <string.h>

#include "virtq_types.h"

#define VIRTQ_DESC_F_NEXT 1
#define VIRTQ_DESC_F_WRITE 2
#define VIRTQ_DESC_F_INDIRECT 4
#define VIRTQ_DESC_F_AVAIL (1 << 7)
#define VIRTQ_DESC_F_USED (1 << 15)
#define VIRTQ_AVAIL_F_NO_INTERRUPT 1
#define VIRTQ_USED_F_NO_NOTIFY 1
#define RING_EVENT_FLAGS_ENABLE 0
#define RING_EVENT_FLAGS_DISABLE 1
#define RING_EVENT_FLAGS_DESC 2

/* Error codes, shared with rings/errors.py */
enum {
    VQ_OK = 0,
    VQ_ERR_HEAD_OUT_OF_RANGE = 1,
    VQ_ERR_NEXT_OUT_OF_RANGE = 2,
    VQ_ERR_CHAIN_TOO_LONG = 3,
    VQ_ERR_AVAIL_IDX_JUMP = 4,
    VQ_ERR_INDIRECT_EMPTY = 5,
    VQ_ERR_INDIRECT_LENGTH = 6,
    VQ_ERR_NESTED_INDIRECT = 7,
    VQ_ERR_INDIRECT_WITH_NEXT = 8,
    VQ_ERR_WRITABLE_BEFORE_READABLE = 9,
    VQ_ERR_PACKED_ID_OUT_OF_RANGE = 10,
    VQ_ERR_ID_IN_USE = 11,
    VQ_ERR_ADDRESS_OUT_OF_BOUNDS = 12,
    VQ_ERR_USED_ID_NOT_IN_FLIGHT = 13,
    VQ_ERR_USED_LEN_TOO_LARGE = 14,
    VQ_ERR_USED_IDX_JUMP = 15,
    VQ_ERR_SLOT_IN_FLIGHT = 16,
    VQ_ERR_BASE_OUT_OF_RANGE = 17,
    VQ_ERR_INFLIGHT_MISMATCH = 18,   /* vhost inflight tracking made for another ring format or size */
    VQ_USAGE_NOT_IN_FLIGHT = 100, /* local API misuse, not a ring error */
    VQ_USAGE_OUT_OF_ORDER = 101,
    VQ_USAGE_SHADOW_FULL = 102,
    VQ_USAGE_NOT_IDLE = 103,
    VQ_USAGE_BAD_SIZE = 104,
};

/* Every access to ring memory (rings, descriptor and indirect tables, event fields) goes through one of
 * these: VQ_STORE a plain store, VQ_SET a relaxed and VQ_RELEASE a release store, VQ_ONCE a relaxed and
 * VQ_ACQUIRE an acquire load, VQ_FENCE a full fence. The test build (-DVQ_RECORD, csrc/virtq_record.h)
 * logs each one in program order; the normal build is unchanged by it. */
#ifdef VQ_RECORD
#include "virtq_record.h"
#else
#define VQ_STORE(x, v) ((x) = (v))
#define VQ_ONCE(x) __atomic_load_n(&(x), __ATOMIC_RELAXED)
#define VQ_ACQUIRE(x) __atomic_load_n(&(x), __ATOMIC_ACQUIRE)
#define VQ_RELEASE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_RELEASE)
#define VQ_SET(x, v) __atomic_store_n(&(x), (v), __ATOMIC_RELAXED)
#define VQ_FENCE() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#endif

static inline int vq_need_event(uint16_t event_idx, uint16_t new_idx, uint16_t old_idx)
{   /* EVT-18 */
    return (uint16_t)(new_idx - event_idx - 1) < (uint16_t)(new_idx - old_idx);
}

static inline int vq_packed_need_event(uint16_t off_wrap, uint16_t new_pos, uint16_t old_pos,
                                       uint16_t wrap_at_new, uint16_t size)
{   /* EVT-23: an offset tagged with the other wrap lies in the previous lap */
    uint16_t off = off_wrap & 0x7fff;
    if ((off_wrap >> 15) != wrap_at_new)
        off -= size;
    return vq_need_event(off, new_pos, old_pos);
}

/* Bounds-checked translation: [gpa, gpa+len) must lie inside one region; no overflow possible. */
static inline uint8_t *vq_translate(const struct vq_mem *m, uint64_t gpa, uint64_t len)
{
    const struct vq_region *r0 = &m->r[0];   /* the usual case, one region, without the loop */
    if (m->nregions && gpa >= r0->gpa && gpa - r0->gpa <= r0->size && len <= r0->size - (gpa - r0->gpa))
        return r0->host + (gpa - r0->gpa);
    for (uint32_t i = 1; i < m->nregions; i++) {
        const struct vq_region *r = &m->r[i];
        if (gpa >= r->gpa && gpa - r->gpa <= r->size && len <= r->size - (gpa - r->gpa))
            return r->host + (gpa - r->gpa);
    }
    return 0;
}

static inline uint16_t *vq_used_event(struct vring_avail *avail, uint16_t size) { return &avail->ring[size]; }
static inline uint16_t *vq_avail_event(struct vring_used *used, uint16_t size) { return (uint16_t *)&used->ring[size]; }

static inline uint16_t vq_avail_bits(uint16_t wrap)
{   /* PACKED-D-03: AVAIL = wrap, USED = !wrap */
    return wrap ? VIRTQ_DESC_F_AVAIL : VIRTQ_DESC_F_USED;
}

static inline uint16_t vq_used_bits(uint16_t wrap)
{   /* PACKED-V-02: AVAIL = USED = wrap */
    return wrap ? (VIRTQ_DESC_F_AVAIL | VIRTQ_DESC_F_USED) : 0;
}

static inline int vq_drv_fail(struct vq_driver *q, int code, uint64_t a, uint64_t b)
{
    q->error = code; q->err_a = a; q->err_b = b;
    return -1;
}

static inline int vq_dev_fail(struct vq_device *q, int code, uint64_t a, uint64_t b)
{
    q->error = code; q->err_a = a; q->err_b = b;
    return -1;
}

/* ======================================================================================= */
/* Driver half                                                                             */
/* ======================================================================================= */

/* Descriptors a buffer of nseg segments needs in the ring (1 when it goes indirect). */
static inline uint16_t vq_drv_needed(const struct vq_driver *q, uint32_t nseg)
{
    return (q->use_indirect && nseg > 1 && nseg <= q->indirect_max) ? 1 : (uint16_t)nseg;
}

/* Fill an indirect table for buffer id; returns the ring descriptor's addr. */
static inline uint64_t vq_drv_fill_indirect(struct vq_driver *q, uint16_t id, const uint64_t *addrs,
                                            const uint32_t *lens, uint32_t nread, uint32_t nseg)
{
    uint64_t off = (uint64_t)id * q->indirect_max * 16;
    if (q->packed) {
        struct vring_packed_desc *t = (struct vring_packed_desc *)(q->indirect_host + off);
        for (uint32_t j = 0; j < nseg; j++) {
            VQ_STORE(t[j].addr, addrs[j]); VQ_STORE(t[j].len, lens[j]); VQ_STORE(t[j].id, 0);
            VQ_STORE(t[j].flags, j >= nread ? VIRTQ_DESC_F_WRITE : 0);
        }
    } else {
        struct vring_desc *t = (struct vring_desc *)(q->indirect_host + off);
        for (uint32_t j = 0; j < nseg; j++) {
            uint16_t last = j + 1 == nseg;
            VQ_STORE(t[j].addr, addrs[j]); VQ_STORE(t[j].len, lens[j]);
            VQ_STORE(t[j].flags, (last ? 0 : VIRTQ_DESC_F_NEXT) | (j >= nread ? VIRTQ_DESC_F_WRITE : 0));
            VQ_STORE(t[j].next, last ? 0 : (uint16_t)(j + 1));   /* INORDER-05 holds for every table */
        }
    }
    return q->indirect_gpa + off;
}

static inline uint32_t vq_wlen(const uint32_t *lens, uint32_t nread, uint32_t nseg)
{
    uint64_t w = 0;
    for (uint32_t j = nread; j < nseg; j++)
        w += lens[j];
    return w > 0xffffffffu ? 0xffffffffu : (uint32_t)w;
}

/* An avail ring entry, stored only when it changes: in order (head == slot), and in any steady recycling, the
 * same heads come back to the same slots lap after lap; a line left unwritten stays shared with the device's
 * core, and the device's read of it hits. The bytes are the same either way. */
static inline void vq_avail_put(uint16_t *e, uint16_t head)
{
    if (VQ_ONCE(*e) != head)
        VQ_STORE(*e, head);
}

/* Split: one buffer. Returns 0, or 1 when it does not fit. */
static inline int vq_drv_add1_split(struct vq_driver *q, const uint64_t *addrs, const uint32_t *lens,
                                    uint32_t nread, uint32_t nseg, uint64_t token)
{
    uint16_t needed = vq_drv_needed(q, nseg), size = q->size;
    if (needed > q->num_free)
        return 1;
    uint16_t head = q->in_order ? q->next_desc : q->free_head;
    if (needed == 1 && nseg > 1) {
        struct vring_desc *d = &q->desc[head];
        VQ_STORE(d->addr, vq_drv_fill_indirect(q, head, addrs, lens, nread, nseg));
        VQ_STORE(d->len, nseg * 16); VQ_STORE(d->flags, VIRTQ_DESC_F_INDIRECT); VQ_STORE(d->next, 0);
        if (q->in_order)
            q->next_desc = (uint16_t)((head + 1) & (size - 1));
        else
            q->free_head = q->free_next[head];
    } else {
        uint16_t i = head;
        for (uint32_t j = 0; j < nseg; j++) {
            struct vring_desc *d = &q->desc[i];
            uint16_t last = j + 1 == nseg;
            uint16_t nxt = q->in_order ? (uint16_t)((i + 1) & (size - 1)) : q->free_next[i];
            VQ_STORE(d->addr, addrs[j]); VQ_STORE(d->len, lens[j]);
            VQ_STORE(d->flags, (last ? 0 : VIRTQ_DESC_F_NEXT) | (j >= nread ? VIRTQ_DESC_F_WRITE : 0));
            VQ_STORE(d->next, last ? 0 : nxt);   /* INORDER-04: x+1, wrapping to 0 */
            i = nxt;
        }
        if (q->in_order)
            q->next_desc = i;
        else
            q->free_head = i;
    }
    q->id_ndesc[head] = needed;
    q->id_wlen[head] = vq_wlen(lens, nread, nseg);
    q->id_token[head] = token;
    q->id_inflight[head] = 1;
    q->num_free -= needed;
    q->inflight++;
    vq_avail_put(&q->avail->ring[q->next_avail & (size - 1)], head);
    q->next_avail++;
    q->kick_added++;
    q->pending++;
    return 0;
}

/* Packed: one buffer. Each list's head flags are stored after the rest of the list, and those of the
 * batch's first list are kept aside for publish (PACKED-D-12, MEM-06). */
static inline int vq_drv_add1_packed(struct vq_driver *q, const uint64_t *addrs, const uint32_t *lens,
                                     uint32_t nread, uint32_t nseg, uint64_t token)
{
    uint16_t needed = vq_drv_needed(q, nseg), size = q->size;
    if (needed > q->num_free)
        return 1;
    uint16_t id = q->in_order ? q->next_avail : q->free_head, head = q->next_avail, head_flags = 0;
    if (!q->in_order)
        q->free_head = q->free_next[id];
    for (uint32_t j = 0; j < needed; j++) {
        struct vring_packed_desc *d = &q->pdesc[q->next_avail];
        uint16_t flags = vq_avail_bits(q->avail_wrap);
        if (needed == 1 && nseg > 1) {
            VQ_STORE(d->addr, vq_drv_fill_indirect(q, id, addrs, lens, nread, nseg));
            VQ_STORE(d->len, nseg * 16);
            flags |= VIRTQ_DESC_F_INDIRECT;
        } else {
            VQ_STORE(d->addr, addrs[j]); VQ_STORE(d->len, lens[j]);
            flags |= (j + 1 < needed ? VIRTQ_DESC_F_NEXT : 0) | (j >= nread ? VIRTQ_DESC_F_WRITE : 0);
        }
        VQ_STORE(d->id, id);
        if (j == 0)
            head_flags = flags;
        else
            VQ_SET(d->flags, flags);
        if (++q->next_avail == size) {
            q->next_avail = 0;
            q->avail_wrap ^= 1;
        }
    }
    if (q->pending == 0) {   /* the batch's first head is exposed by publish (MEM-06) */
        q->pending_head = head;
        q->pending_flags = head_flags;
    } else {                 /* PACKED-D-12: a list's head after the rest of the list */
        VQ_SET(q->pdesc[head].flags, head_flags);
    }
    q->pending++;
    q->id_ndesc[id] = needed;
    q->id_wlen[id] = vq_wlen(lens, nread, nseg);
    q->id_token[id] = token;
    q->id_inflight[id] = 1;
    q->num_free -= needed;
    q->inflight++;
    q->kick_added += needed;
    return 0;
}

/* Add up to n buffers; segments are flat, nread[i]+nwrite[i] of them per buffer. Returns how many fit. */
static inline uint32_t vq_drv_add(struct vq_driver *q, const uint64_t *addrs, const uint32_t *lens,
                                  const uint16_t *nread, const uint16_t *nwrite, const uint64_t *tokens,
                                  uint32_t n)
{
    uint32_t i, s = 0;
    for (i = 0; i < n; i++) {
        uint32_t nseg = (uint32_t)nread[i] + nwrite[i];
        int full = q->packed ? vq_drv_add1_packed(q, addrs + s, lens + s, nread[i], nseg, tokens[i])
                             : vq_drv_add1_split(q, addrs + s, lens + s, nread[i], nseg, tokens[i]);
        if (full)
            break;
        s += nseg;
    }
    return i;
}

/* The bookkeeping of one added one-descriptor buffer (the arrays from the caller's locals). */
static inline void vq_drv_track1(uint16_t *id_ndesc, uint32_t *id_wlen, uint64_t *id_token, uint8_t *id_inflight,
                                 uint16_t id, uint32_t wlen, uint64_t token)
{
    id_ndesc[id] = 1;
    id_wlen[id] = wlen;
    id_token[id] = token;
    id_inflight[id] = 1;
}

static inline void vq_drv_added(struct vq_driver *q, uint16_t n)
{
    q->num_free -= n;
    q->inflight += n;
    q->kick_added += n;
}

/* One-descriptor buffers whose descriptor is an indirect table of two device-readable entries (vq_drv_add_simple_*
 * with one of these): a header at hdr_gpa + id * hdr_stride, hdr_len bytes, then the buffer; the id each buffer took
 * goes into ids. The caller checked use_indirect and indirect_max >= 2. */
struct vq_hdr_table {
    uint64_t hdr_gpa;
    uint32_t hdr_stride, hdr_len;
    uint16_t *ids;
};

/* One-descriptor buffers, split: the state in locals (stores through id_inflight, a uint8_t array, may alias
 * anything: fields read through q would be reloaded after each one). What vq_drv_add1_split does for nseg 1.
 * With ht (a constant where inlined): each as a two-entry table. The table of an id lives at a fixed place, so its
 * ring descriptor never changes: that one is stored only when it differs, and its line stays in the device's
 * cache instead of coming back from the driver's for each use. */
static inline __attribute__((always_inline)) uint32_t
vq_drv_add_simple_split_v(struct vq_driver *q, const uint64_t *addrs, const uint32_t *lens, int writable,
                          const uint64_t *tokens, uint32_t n, const struct vq_hdr_table *ht)
{
    struct vring_desc *desc = q->desc;
    uint16_t *ring = q->avail->ring, *free_next = q->free_next, *id_ndesc = q->id_ndesc;
    uint32_t *id_wlen = q->id_wlen;
    uint64_t *id_token = q->id_token, tstride = (uint64_t)q->indirect_max * 16;
    uint8_t *id_inflight = q->id_inflight;
    uint16_t mask = q->size - 1, next_avail = q->next_avail, head = q->in_order ? q->next_desc : q->free_head;
    uint16_t flags = writable ? VIRTQ_DESC_F_WRITE : 0;
    int in_order = q->in_order;
    uint32_t i;
    if (n > q->num_free)
        n = q->num_free;
    for (i = 0; i < n; i++) {
        uint16_t id = head;
        struct vring_desc *d = &desc[id];
        head = in_order ? (uint16_t)((id + 1) & mask) : free_next[id];
        if (ht) {
            struct vring_desc *t = (struct vring_desc *)(q->indirect_host + id * tstride);
            uint64_t ta = q->indirect_gpa + id * tstride;
            VQ_STORE(t[0].addr, ht->hdr_gpa + (uint64_t)id * ht->hdr_stride); VQ_STORE(t[0].len, ht->hdr_len);
            VQ_STORE(t[0].flags, VIRTQ_DESC_F_NEXT); VQ_STORE(t[0].next, 1);
            VQ_STORE(t[1].addr, addrs[i]); VQ_STORE(t[1].len, lens[i]); VQ_STORE(t[1].flags, 0); VQ_STORE(t[1].next, 0);
            if (VQ_ONCE(d->addr) != ta || VQ_ONCE(d->len) != 32 || VQ_ONCE(d->flags) != VIRTQ_DESC_F_INDIRECT
                    || VQ_ONCE(d->next) != 0) {
                VQ_STORE(d->addr, ta); VQ_STORE(d->len, 32); VQ_STORE(d->flags, VIRTQ_DESC_F_INDIRECT);
                VQ_STORE(d->next, 0);
            }
            ht->ids[i] = id;
        } else {
            VQ_STORE(d->addr, addrs[i]); VQ_STORE(d->len, lens[i]); VQ_STORE(d->flags, flags); VQ_STORE(d->next, 0);
        }
        vq_drv_track1(id_ndesc, id_wlen, id_token, id_inflight, id, writable ? lens[i] : 0, tokens[i]);
        vq_avail_put(&ring[next_avail++ & mask], id);
    }
    if (in_order)
        q->next_desc = head;
    else
        q->free_head = head;
    q->next_avail = next_avail;
    q->pending += (uint16_t)i;
    vq_drv_added(q, (uint16_t)i);
    return i;
}

/* One-descriptor buffers, packed (see vq_drv_add_simple_split_v); the first flags of a publish batch are kept
 * aside (PACKED-D-12), as vq_drv_add1_packed does. With ht, the ring slot is stored anyway: its flags carry the
 * wrap, so it changes with every use. */
static inline __attribute__((always_inline)) uint32_t
vq_drv_add_simple_packed_v(struct vq_driver *q, const uint64_t *addrs, const uint32_t *lens, int writable,
                           const uint64_t *tokens, uint32_t n, const struct vq_hdr_table *ht)
{
    struct vring_packed_desc *ring = q->pdesc;
    uint16_t *free_next = q->free_next, *id_ndesc = q->id_ndesc;
    uint32_t *id_wlen = q->id_wlen;
    uint64_t *id_token = q->id_token, tstride = (uint64_t)q->indirect_max * 16;
    uint8_t *id_inflight = q->id_inflight;
    uint16_t size = q->size, slot = q->next_avail, wrap = q->avail_wrap, head = q->free_head, pending = q->pending;
    uint16_t wflag = ht ? VIRTQ_DESC_F_INDIRECT : writable ? VIRTQ_DESC_F_WRITE : 0;
    int in_order = q->in_order;
    uint32_t i;
    if (n > q->num_free)
        n = q->num_free;
    for (i = 0; i < n; i++) {
        uint16_t id = in_order ? slot : head;
        struct vring_packed_desc *d = &ring[slot];
        uint16_t flags = vq_avail_bits(wrap) | wflag;
        if (!in_order)
            head = free_next[id];
        if (ht) {
            struct vring_packed_desc *t = (struct vring_packed_desc *)(q->indirect_host + id * tstride);
            VQ_STORE(t[0].addr, ht->hdr_gpa + (uint64_t)id * ht->hdr_stride); VQ_STORE(t[0].len, ht->hdr_len);
            VQ_STORE(t[0].id, 0); VQ_STORE(t[0].flags, 0);
            VQ_STORE(t[1].addr, addrs[i]); VQ_STORE(t[1].len, lens[i]); VQ_STORE(t[1].id, 0); VQ_STORE(t[1].flags, 0);
            VQ_STORE(d->addr, q->indirect_gpa + id * tstride); VQ_STORE(d->len, 32);
            ht->ids[i] = id;
        } else {
            VQ_STORE(d->addr, addrs[i]); VQ_STORE(d->len, lens[i]);
        }
        VQ_STORE(d->id, id);
        if (pending++ == 0) {
            q->pending_head = slot;
            q->pending_flags = flags;
        } else {
            VQ_SET(d->flags, flags);
        }
        vq_drv_track1(id_ndesc, id_wlen, id_token, id_inflight, id, writable ? lens[i] : 0, tokens[i]);
        if (++slot == size) {
            slot = 0;
            wrap ^= 1;
        }
    }
    q->next_avail = slot;
    q->avail_wrap = wrap;
    q->free_head = head;
    q->pending = pending;
    vq_drv_added(q, (uint16_t)i);
    return i;
}

/* Fast path for one-segment buffers of one direction (Tx with header prepended, Rx refill). */
static inline uint32_t vq_drv_add_simple(struct vq_driver *q, const uint64_t *addrs, const uint32_t *lens,
                                         int writable, const uint64_t *tokens, uint32_t n)
{
    return q->packed ? vq_drv_add_simple_packed_v(q, addrs, lens, writable, tokens, n, 0)
                     : vq_drv_add_simple_split_v(q, addrs, lens, writable, tokens, n, 0);
}

/* Device-readable buffers, each behind a two-entry table with its header (struct vq_hdr_table). */
static inline uint32_t vq_drv_add_hdr_table(struct vq_driver *q, const struct vq_hdr_table *ht, const uint64_t *addrs,
                                            const uint32_t *lens, const uint64_t *tokens, uint32_t n)
{
    return q->packed ? vq_drv_add_simple_packed_v(q, addrs, lens, 0, tokens, n, ht)
                     : vq_drv_add_simple_split_v(q, addrs, lens, 0, tokens, n, ht);
}

/* One release store makes the whole batch visible (MEM-01/02, PACKED-D-22); none when nothing was added since the
 * last publish. Returns the stores made (0 or 1). */
static inline int vq_drv_publish(struct vq_driver *q)
{
    if (!q->pending)
        return 0;
    if (q->packed)
        VQ_RELEASE(q->pdesc[q->pending_head].flags, q->pending_flags);
    else
        VQ_RELEASE(q->avail->idx, q->next_avail);
    q->pending = 0;
    return 1;
}

static inline int vq_drv_kick_prepare(struct vq_driver *q)
{
    int need;
    VQ_FENCE();   /* MEM-03 / EVT-25: publish before reading the device's suppression fields */
    if (q->packed) {
        /* EVT-19: the peer writes off_wrap, then flags; flags first, with acquire, then off_wrap */
        uint16_t flags = VQ_ACQUIRE(q->device_event->flags);
        if (flags == RING_EVENT_FLAGS_DISABLE)
            need = 0;
        else if (flags == RING_EVENT_FLAGS_DESC && q->event_idx)
            need = vq_packed_need_event(VQ_ONCE(q->device_event->off_wrap), q->next_avail,
                                        (uint16_t)(q->next_avail - q->kick_added), q->avail_wrap, q->size);
        else
            need = 1;
    } else if (q->event_idx) {   /* EVT-13/14 */
        need = vq_need_event(VQ_ONCE(*vq_avail_event(q->used, q->size)), q->next_avail,
                             (uint16_t)(q->next_avail - q->kick_added));
    } else {                     /* EVT-12 */
        need = !(VQ_ONCE(q->used->flags) & VIRTQ_USED_F_NO_NOTIFY);
    }
    q->kick_added = 0;
    return need;
}

/* The free list is a FIFO: freed descriptors (split) or ids (packed) join at the tail and are taken from the head,
 * so that in steady state they are reused in ring order, as IN_ORDER would use them: the driver then writes
 * descriptors the device read long ago, not the ones it is reading now (a LIFO list hands back the lines the
 * device just finished with). Split chains stay linked through free_next. Called before the buffer is counted
 * free. */
static inline void vq_drv_free_append(struct vq_driver *q, uint16_t head, uint16_t tail)
{
    /* empty: split counts free descriptors; packed lists ids, one per buffer in flight */
    if (q->packed ? q->inflight == q->size : q->num_free == 0)
        q->free_head = head;
    else
        q->free_next[q->free_tail] = head;
    q->free_tail = tail;
}

/* Give back a reclaimed buffer's descriptors (normal variants: to the free list). */
static inline void vq_drv_free_split(struct vq_driver *q, uint16_t head)
{
    uint16_t n = q->id_ndesc[head];
    if (!q->in_order) {
        uint16_t tail = head;
        for (uint16_t k = 1; k < n; k++)
            tail = q->free_next[tail];
        vq_drv_free_append(q, head, tail);
    }
    q->id_inflight[head] = 0;
    q->num_free += n;
    q->inflight--;
}

static inline int vq_drv_check_len(struct vq_driver *q, uint16_t id, uint32_t len)
{
    if (len > q->id_wlen[id])
        return vq_drv_fail(q, VQ_ERR_USED_LEN_TOO_LARGE, id, len);
    return 0;
}

/* The fast paths of the reclaims: runs of used entries that are each one valid one-descriptor buffer (in-order:
 * exactly the oldest, no batch), with the state in locals (see vq_drv_add_simple_split_v). Anything else, valid
 * or not, stops the run and is left to the general walk below, which checks and reports it. Return the buffers
 * reclaimed. */
static inline uint32_t vq_drv_reclaim_simple_split(struct vq_driver *q, uint64_t *tokens, uint32_t *lens,
                                                   uint32_t max)
{
    const struct vring_used_elem *ring = q->used->ring;
    const uint16_t *id_ndesc = q->id_ndesc;
    const uint32_t *id_wlen = q->id_wlen;
    const uint64_t *id_token = q->id_token;
    uint16_t *free_next = q->free_next;
    uint8_t *id_inflight = q->id_inflight;
    uint16_t size = q->size, mask = size - 1, last = q->last_used, used_idx = VQ_ACQUIRE(q->used->idx);
    uint16_t free_head = q->free_head, free_tail = q->free_tail, oldest = q->oldest, nfree = q->num_free;
    int in_order = q->in_order;
    uint32_t n = 0;
    if ((uint16_t)(used_idx - last) > size)
        return 0;
    for (; last != used_idx && n < max; last++, n++) {
        const struct vring_used_elem *e = &ring[last & mask];
        uint32_t id = VQ_ONCE(e->id), len = VQ_ONCE(e->len);
        if (id >= size || !id_inflight[id] || id_ndesc[id] != 1 || len > id_wlen[id] || (in_order && id != oldest))
            break;
        tokens[n] = id_token[id];
        lens[n] = len;
        if (in_order) {
            oldest = (uint16_t)((id + 1) & mask);
        } else {   /* FIFO (vq_drv_free_append) */
            if (nfree++ == 0)
                free_head = (uint16_t)id;
            else
                free_next[free_tail] = (uint16_t)id;
            free_tail = (uint16_t)id;
        }
        id_inflight[id] = 0;
    }
    q->last_used = last;
    q->free_head = free_head;
    q->free_tail = free_tail;
    q->oldest = oldest;
    q->num_free += (uint16_t)n;
    q->inflight -= (uint16_t)n;
    return n;
}

static inline uint32_t vq_drv_reclaim_simple_packed(struct vq_driver *q, uint64_t *tokens, uint32_t *lens,
                                                    uint32_t max)
{
    const struct vring_packed_desc *ring = q->pdesc;
    const uint16_t *id_ndesc = q->id_ndesc;
    const uint32_t *id_wlen = q->id_wlen;
    const uint64_t *id_token = q->id_token;
    uint16_t *free_next = q->free_next;
    uint8_t *id_inflight = q->id_inflight;
    uint16_t size = q->size, slot = q->last_used, w = q->used_wrap, free_head = q->free_head;
    uint16_t free_tail = q->free_tail, inflight = q->inflight;
    int in_order = q->in_order;
    uint32_t n = 0;
    for (; n < max && n < inflight; n++) {
        const struct vring_packed_desc *d = &ring[slot];
        uint16_t flags = VQ_ACQUIRE(d->flags);
        /* PACKED-D-24: used iff AVAIL == USED == used wrap counter */
        if ((flags & (VIRTQ_DESC_F_AVAIL | VIRTQ_DESC_F_USED)) != vq_used_bits(w))
            break;
        uint16_t id = VQ_ONCE(d->id);
        uint32_t len = VQ_ONCE(d->len);
        if (id >= size || !id_inflight[id] || id_ndesc[id] != 1 || (in_order && id != slot))
            break;
        if (!(flags & VIRTQ_DESC_F_WRITE) && id_wlen[id] == 0)   /* PACKED-D-17, as below */
            len = 0;
        if (len > id_wlen[id])
            break;
        tokens[n] = id_token[id];
        lens[n] = len;
        if (!in_order) {   /* FIFO (vq_drv_free_append): empty while every id is in flight */
            if ((uint16_t)(inflight - n) == size)
                free_head = id;
            else
                free_next[free_tail] = id;
            free_tail = id;
        }
        id_inflight[id] = 0;
        if (++slot == size) {
            slot = 0;
            w ^= 1;
        }
    }
    q->last_used = slot;
    q->used_wrap = w;
    q->free_head = free_head;
    q->free_tail = free_tail;
    q->num_free += (uint16_t)n;
    q->inflight -= (uint16_t)n;
    return n;
}

/* Split reclaim; returns the number of buffers, or -1 when the ring is broken. */
static inline int vq_drv_reclaim_split(struct vq_driver *q, uint64_t *tokens, uint32_t *lens, uint32_t max)
{
    uint32_t n = vq_drv_reclaim_simple_split(q, tokens, lens, max);
    uint16_t size = q->size, used_idx = VQ_ACQUIRE(q->used->idx);
    if ((uint16_t)(used_idx - q->last_used) > size)
        return vq_drv_fail(q, VQ_ERR_USED_IDX_JUMP, q->last_used, used_idx);
    while (q->last_used != used_idx && n < max) {
        struct vring_used_elem *e = &q->used->ring[q->last_used & (size - 1)];
        uint32_t id = VQ_ONCE(e->id), len = VQ_ONCE(e->len);
        if (id >= size || !q->id_inflight[id])
            return vq_drv_fail(q, VQ_ERR_USED_ID_NOT_IN_FLIGHT, id, q->last_used);
        if (vq_drv_check_len(q, id, len))
            return -1;
        if (!q->in_order) {
            tokens[n] = q->id_token[id]; lens[n] = len; n++;
            vq_drv_free_split(q, id);
            q->last_used++;
            continue;
        }
        /* INORDER-06/09: one entry may stand for every buffer from the oldest up to id */
        uint16_t h = q->oldest, cnt = 1;
        while (h != id) {
            if (!q->id_inflight[h] || cnt > q->inflight)
                return vq_drv_fail(q, VQ_ERR_USED_ID_NOT_IN_FLIGHT, id, q->last_used);
            h = (uint16_t)((h + q->id_ndesc[h]) & (size - 1));
            cnt++;
        }
        if (cnt > (uint16_t)(used_idx - q->last_used))
            return vq_drv_fail(q, VQ_ERR_USED_IDX_JUMP, q->last_used, used_idx);
        for (uint16_t k = 0; k < cnt; k++) {
            h = q->oldest;
            tokens[n] = q->id_token[h];
            lens[n] = h == id ? len : q->id_wlen[h];   /* INORDER-10 */
            n++;
            q->oldest = (uint16_t)((h + q->id_ndesc[h]) & (size - 1));
            vq_drv_free_split(q, h);
        }
        q->last_used += cnt;
    }
    return (int)n;
}

static inline void vq_drv_advance_used_packed(struct vq_driver *q, uint16_t ndesc)
{
    q->last_used += ndesc;
    if (q->last_used >= q->size) {
        q->last_used -= q->size;
        q->used_wrap ^= 1;
    }
}

static inline int vq_drv_reclaim_packed(struct vq_driver *q, uint64_t *tokens, uint32_t *lens, uint32_t max)
{
    uint16_t size = q->size;
    uint32_t n = vq_drv_reclaim_simple_packed(q, tokens, lens, max);
    while (n < max && q->inflight) {
        struct vring_packed_desc *d = &q->pdesc[q->last_used];
        uint16_t flags = VQ_ACQUIRE(d->flags);
        uint16_t w = q->used_wrap;
        /* PACKED-D-24: used iff AVAIL == USED == used wrap counter */
        if (!!(flags & VIRTQ_DESC_F_AVAIL) != w || !!(flags & VIRTQ_DESC_F_USED) != w)
            break;
        uint16_t id = VQ_ONCE(d->id);
        uint32_t len = VQ_ONCE(d->len);
        if (id >= size)
            return vq_drv_fail(q, VQ_ERR_PACKED_ID_OUT_OF_RANGE, id, q->last_used);
        if (!q->id_inflight[id])
            return vq_drv_fail(q, VQ_ERR_USED_ID_NOT_IN_FLIGHT, id, q->last_used);
        /* PACKED-D-17: len is meaningful with WRITE; accepted without it for a writable buffer (QEMU) */
        if (!(flags & VIRTQ_DESC_F_WRITE) && q->id_wlen[id] == 0)
            len = 0;
        if (vq_drv_check_len(q, id, len))
            return -1;
        if (!q->in_order) {
            tokens[n] = q->id_token[id]; lens[n] = len; n++;
            vq_drv_free_append(q, id, id);
            q->id_inflight[id] = 0;
            q->num_free += q->id_ndesc[id];
            q->inflight--;
            vq_drv_advance_used_packed(q, q->id_ndesc[id]);
            continue;
        }
        /* INORDER-11..14: walk buffers from this slot up to id, skipping by their lengths */
        uint16_t h = q->last_used, cnt = 1;
        while (h != id) {
            if (!q->id_inflight[h] || cnt > q->inflight)
                return vq_drv_fail(q, VQ_ERR_USED_ID_NOT_IN_FLIGHT, id, q->last_used);
            h += q->id_ndesc[h];
            if (h >= size)
                h -= size;
            cnt++;
        }
        for (uint16_t k = 0; k < cnt; k++) {
            h = q->last_used;
            tokens[n] = q->id_token[h];
            lens[n] = h == id ? len : q->id_wlen[h];   /* INORDER-10 */
            n++;
            q->id_inflight[h] = 0;
            q->num_free += q->id_ndesc[h];
            q->inflight--;
            vq_drv_advance_used_packed(q, q->id_ndesc[h]);
        }
    }
    return (int)n;
}

static inline int vq_drv_reclaim(struct vq_driver *q, uint64_t *tokens, uint32_t *lens, uint32_t max)
{
    return q->packed ? vq_drv_reclaim_packed(q, tokens, lens, max) : vq_drv_reclaim_split(q, tokens, lens, max);
}

static inline void vq_drv_enable_calls(struct vq_driver *q, int on)
{
    if (q->packed) {
        VQ_SET(q->driver_event->flags, on ? RING_EVENT_FLAGS_ENABLE : RING_EVENT_FLAGS_DISABLE);
    } else if (q->event_idx) {   /* EVT-02: flags stay 0 */
        VQ_SET(q->avail->flags, 0);
        VQ_SET(*vq_used_event(q->avail, q->size), (uint16_t)(on ? q->last_used : q->last_used + 0x7fff));
    } else {
        VQ_SET(q->avail->flags, on ? 0 : VIRTQ_AVAIL_F_NO_INTERRUPT);
    }
    VQ_FENCE();   /* EVT-09/MEM-09: callers re-check the ring after enabling */
}

/* ======================================================================================= */
/* Device half                                                                             */
/* ======================================================================================= */

/* Queue start: the positions from a vhost-user vring base (split: the free-running avail index; packed:
 * slot | wrap << 15, DPDK's encoding), checked here whatever the caller checked, so that no base from a
 * message ever becomes a slot index outside the ring. ``taken``: buffers (split) / descriptors (packed) past
 * the used position that a predecessor had taken and that are replayed from elsewhere (inflight tracking):
 * the avail position starts that far ahead. Only on an idle queue. 0, or an error code. */
static inline int vq_dev_set_base(struct vq_device *q, uint32_t base, uint32_t taken)
{
    uint16_t size = q->size;
    if (size == 0 || size > 32768 || (!q->packed && (size & (size - 1))))
        return VQ_USAGE_BAD_SIZE;
    if (q->inflight || q->shadow_count || q->fifo_count)
        return VQ_USAGE_NOT_IDLE;
    if (base > 0xffff || (q->packed && (base & 0x7fff) >= size))
        return vq_dev_fail(q, VQ_ERR_BASE_OUT_OF_RANGE, base, size);
    if (taken > size)
        return vq_dev_fail(q, VQ_ERR_BASE_OUT_OF_RANGE, taken, size);
    if (q->packed) {
        uint32_t avail = (base & 0x7fff) + taken;   /* < 2 * size: one lap at most */
        q->used_idx = (uint16_t)(base & 0x7fff);
        q->used_wrap = (uint16_t)(base >> 15);
        q->last_avail = (uint16_t)(avail >= size ? avail - size : avail);
        q->avail_wrap = (uint16_t)(q->used_wrap ^ (avail >= size));
    } else {
        q->used_idx = (uint16_t)base;
        q->last_avail = (uint16_t)(base + taken);
    }
    q->inflight_slots = 0;
    return 0;
}

/* Emit one segment into the chains arrays; checks readable-before-writable, then translation (the reference
 * model's order, so that a segment breaking both rules gives the same error). */
static inline int vq_dev_emit(struct vq_device *q, struct vq_chains *c, uint32_t *s, uint64_t addr,
                              uint32_t len, int writable, int *seen_w, uint64_t *rlen, uint64_t *wlen)
{
    if (!writable && *seen_w)
        return vq_dev_fail(q, VQ_ERR_WRITABLE_BEFORE_READABLE, addr, len);
    uint8_t *host = vq_translate(q->mem, addr, len);
    if (!host)
        return vq_dev_fail(q, VQ_ERR_ADDRESS_OUT_OF_BOUNDS, addr, len);
    if (writable) {
        *seen_w = 1;
        *wlen += len;
    } else {
        *rlen += len;
    }
    if (*s < c->cap_segs) {   /* past it, only counted: vq_dev_finish_chain leaves the chain, checked */
        c->seg_addr[*s] = addr;
        c->seg_len[*s] = len;
        c->seg_write[*s] = (uint8_t)writable;
        if (c->seg_host)
            c->seg_host[*s] = host;
    }
    (*s)++;
    return 0;
}

/* Entry j of an indirect table, copied out: the driver may place a table at any address (no alignment is
 * required of it), and it does not change while available, so a plain byte copy is the right read. */
static inline void vq_copy_indirect(void *entry, const uint8_t *table, uint32_t j)
{
    memcpy(entry, table + (size_t)j * 16, 16);
}

/* Validate an indirect descriptor and return its table (SPLIT-V-14, SPLIT-D-09). */
static inline const uint8_t *vq_dev_indirect(struct vq_device *q, uint64_t addr, uint32_t len, uint32_t *count)
{
    if (len == 0) {
        vq_dev_fail(q, VQ_ERR_INDIRECT_EMPTY, addr, len);
        return 0;
    }
    if (len % 16) {
        vq_dev_fail(q, VQ_ERR_INDIRECT_LENGTH, addr, len);
        return 0;
    }
    if (len / 16 > q->size) {
        vq_dev_fail(q, VQ_ERR_CHAIN_TOO_LONG, len / 16, q->size);
        return 0;
    }
    const uint8_t *t = vq_translate(q->mem, addr, len);
    if (!t)
        vq_dev_fail(q, VQ_ERR_ADDRESS_OUT_OF_BOUNDS, addr, len);
    *count = len / 16;
    return t;
}

static inline int vq_dev_finish_chain(struct vq_device *q, struct vq_chains *c, uint32_t s0, uint32_t s,
                                      uint16_t id, uint16_t ndesc, uint64_t rlen, uint64_t wlen)
{
    if (rlen > 0xffffffffu || wlen > 0xffffffffu)   /* SPLIT-D-04 */
        return vq_dev_fail(q, VQ_ERR_CHAIN_TOO_LONG, rlen, wlen);
    if (s > c->cap_segs)
        return 1;   /* no room: leave the chain, every rule checked, for the next poll */
    uint32_t k = c->n++;
    c->id[k] = id; c->ndesc[k] = ndesc; c->seg_start[k] = s0; c->nseg[k] = (uint16_t)(s - s0);
    c->rlen[k] = (uint32_t)rlen; c->wlen[k] = (uint32_t)wlen;
    c->nsegs = s;
    q->id_ndesc[id] = ndesc;
    q->id_wlen[id] = (uint32_t)wlen;
    q->id_inflight[id] = 1;
    q->inflight++;
    if (q->packed)
        q->inflight_slots += ndesc;   /* checked against the ring size while walking */
    if (q->in_order) {
        uint32_t tail = (uint32_t)q->fifo_head + q->fifo_count;   /* no divide: both are < size */
        q->fifo[tail >= q->size ? tail - q->size : tail] = id;
        q->fifo_count++;
    }
    return 0;
}

/* The fast paths of the device poll: runs of one-descriptor chains (neither NEXT nor INDIRECT, what a
 * virtio-net driver posts almost always), and runs of two-descriptor direct chains (a header and a frame, what a
 * driver posts when the header is not in the frame's headroom), with the checks of the general walk in its order.
 * Two passes over at most VQ_RUN chains: the first reads and checks descriptors into local arrays
 * (marking each id in flight at once, so that an id repeated within the run is ID_IN_USE), the second writes what
 * vq_dev_emit + vq_dev_finish_chain would have, column by column. Every field sits in a local: a store through a
 * uint8_t array (seg_write, id_inflight) may alias anything, so fields read through q or c would be reloaded
 * after each one, and one loop writing all the columns would keep more pointers live than there are registers. */
#define VQ_RUN 32

/* vq_translate with region 0 held in locals (struct vq_reg0): the one region of a usual memory table. */
struct vq_reg0 {
    uint64_t gpa, size;
    uint8_t *host;
};

static inline void vq_reg0_load(struct vq_reg0 *r, const struct vq_mem *m)
{
    r->gpa = m->nregions ? m->r[0].gpa : 0;
    r->size = m->nregions ? m->r[0].size : 0;
    r->host = m->nregions ? m->r[0].host : 0;
}

static inline uint8_t *vq_translate0(const struct vq_reg0 *r, const struct vq_mem *m, uint64_t gpa, uint64_t len)
{
    uint64_t off = gpa - r->gpa;
    if (r->host && gpa >= r->gpa && off <= r->size && len <= r->size - off)
        return r->host + off;
    return vq_translate(m, gpa, len);
}

struct vq_run {
    uint32_t n;
    uint16_t id[VQ_RUN];
    uint32_t len[VQ_RUN];
    uint64_t addr[VQ_RUN];
    uint8_t *host[VQ_RUN];
    uint8_t write[VQ_RUN];
};

/* The end of a run's second pass, its chain columns and segment lengths and addresses written: the segments'
 * flags and host pointers into c, then its n chains (nseg segments, one ring slot each) counted in flight, in the
 * in-order fifo too. */
static inline void vq_run_commit(struct vq_device *q, struct vq_chains *c, const uint16_t *ids, uint32_t n,
                                 const uint8_t *write, uint8_t *const *host, uint32_t nseg)
{
    memcpy(c->seg_write + c->nsegs, write, nseg);
    if (c->seg_host)
        memcpy(c->seg_host + c->nsegs, host, nseg * sizeof *host);
    if (q->in_order) {
        uint32_t tail = (uint32_t)q->fifo_head + q->fifo_count, j;   /* no divide: both are < size */
        uint16_t *fifo = q->fifo, size = q->size;
        if (tail >= size)
            tail -= size;
        for (j = 0; j < n; j++) {
            fifo[tail] = ids[j];
            if (++tail == size)
                tail = 0;
        }
        q->fifo_count += (uint16_t)n;
    }
    c->n += n;
    c->nsegs += nseg;
    q->inflight += (uint16_t)n;
    if (q->packed)
        q->inflight_slots += nseg;   /* checked against the ring size while taken */
}

static inline void vq_run_record(struct vq_device *q, struct vq_chains *c, const struct vq_run *r)
{
    uint32_t n = r->n, k0 = c->n, s0 = c->nsegs, j;
    uint16_t *cid = c->id + k0, *cndesc = c->ndesc + k0, *cnseg = c->nseg + k0;
    uint32_t *cstart = c->seg_start + k0;
    for (j = 0; j < n; j++) {
        cid[j] = r->id[j]; cndesc[j] = 1; cnseg[j] = 1; cstart[j] = s0 + j;
    }
    uint32_t *crlen = c->rlen + k0, *cwlen = c->wlen + k0, *slen = c->seg_len + s0;
    uint64_t *saddr = c->seg_addr + s0;
    for (j = 0; j < n; j++) {
        uint32_t l = r->len[j], w = r->write[j];
        crlen[j] = w ? 0 : l; cwlen[j] = w ? l : 0; slen[j] = l; saddr[j] = r->addr[j];
    }
    uint16_t *id_ndesc = q->id_ndesc;
    uint32_t *id_wlen = q->id_wlen;
    for (j = 0; j < n; j++) {
        id_ndesc[r->id[j]] = 1;
        id_wlen[r->id[j]] = r->write[j] ? r->len[j] : 0;
    }
    vq_run_commit(q, c, r->id, n, r->write, r->host, n);
}

/* A run of two-descriptor chains: chain j is segments 2j and 2j + 1. */
struct vq_pairs {
    uint32_t n;
    uint16_t id[VQ_RUN];
    uint16_t ndesc[VQ_RUN];   /* ring descriptors of chain j: 2 direct, 1 through a two-entry indirect table */
    uint32_t len[2 * VQ_RUN];
    uint64_t addr[2 * VQ_RUN];
    uint8_t *host[2 * VQ_RUN];
    uint8_t write[2 * VQ_RUN];
};

static inline void vq_pairs_record(struct vq_device *q, struct vq_chains *c, const struct vq_pairs *r)
{
    uint32_t n = r->n, k0 = c->n, s0 = c->nsegs, j;
    uint16_t *cid = c->id + k0, *cndesc = c->ndesc + k0, *cnseg = c->nseg + k0, *id_ndesc = q->id_ndesc;
    uint32_t *cstart = c->seg_start + k0, *crlen = c->rlen + k0, *cwlen = c->wlen + k0, *id_wlen = q->id_wlen;
    for (j = 0; j < n; j++) {
        cid[j] = r->id[j]; cndesc[j] = r->ndesc[j]; cnseg[j] = 2; cstart[j] = s0 + 2 * j;
    }
    for (j = 0; j < n; j++) {   /* no overflow: vq_pair_take checked the sums */
        uint32_t l0 = r->len[2 * j], l1 = r->len[2 * j + 1], w0 = r->write[2 * j], w1 = r->write[2 * j + 1];
        uint32_t wl = (w0 ? l0 : 0) + (w1 ? l1 : 0);
        crlen[j] = l0 + l1 - wl; cwlen[j] = wl;
        id_ndesc[r->id[j]] = r->ndesc[j];
        id_wlen[r->id[j]] = wl;
    }
    memcpy(c->seg_len + s0, r->len, 2 * n * sizeof *r->len);
    memcpy(c->seg_addr + s0, r->addr, 2 * n * sizeof *r->addr);
    vq_run_commit(q, c, r->id, n, r->write, r->host, 2 * n);
}

/* The two descriptors of a direct chain, read: take them into the run as its chain r->n if the general walk
 * would accept them (the first NEXT and not INDIRECT, the second neither; readable before writable; the sums
 * within 32 bits, SPLIT-D-04; both inside guest memory). 1 taken, 0 left to the general walk. */
static inline int vq_pair_take(struct vq_pairs *r, const struct vq_reg0 *r0, const struct vq_mem *mem,
                               uint16_t f0, uint64_t a0, uint32_t l0, uint16_t f1, uint64_t a1, uint32_t l1)
{
    int w0 = !!(f0 & VIRTQ_DESC_F_WRITE), w1 = !!(f1 & VIRTQ_DESC_F_WRITE);
    if ((f0 & (VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_INDIRECT)) != VIRTQ_DESC_F_NEXT
            || (f1 & (VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_INDIRECT)) || (w0 && !w1)
            || (w0 == w1 && (uint64_t)l0 + l1 > 0xffffffffu))
        return 0;
    uint8_t *h0 = vq_translate0(r0, mem, a0, l0), *h1 = vq_translate0(r0, mem, a1, l1);
    if (!h0 || !h1)
        return 0;
    uint32_t s = 2 * r->n;
    r->addr[s] = a0; r->len[s] = l0; r->host[s] = h0; r->write[s] = (uint8_t)w0;
    r->addr[s + 1] = a1; r->len[s + 1] = l1; r->host[s + 1] = h1; r->write[s + 1] = (uint8_t)w1;
    return 1;
}

/* Split: one-descriptor chains from last_avail up to avail_idx (already checked against the jump rule).
 * Stops at a chain of more than one descriptor, or when c is full. 0, or -1 broken. */
static inline int vq_dev_simple_split(struct vq_device *q, struct vq_chains *c, uint32_t lim, uint16_t avail_idx)
{
    const struct vring_desc *desc = q->desc;
    const uint16_t *ring = q->avail->ring;
    const struct vq_mem *mem = q->mem;
    struct vq_reg0 r0;
    uint8_t *id_inflight = q->id_inflight;
    uint16_t last = q->last_avail, mask = q->size - 1, size = q->size;
    int rc = 0, more = 1;
    vq_reg0_load(&r0, mem);
    while (more && rc == 0 && last != avail_idx && c->n < lim) {
        struct vq_run r;
        uint32_t m = lim - c->n, room = c->cap_segs - c->nsegs;
        if (m > VQ_RUN)
            m = VQ_RUN;
        for (r.n = 0; r.n < m && last != avail_idx; r.n++, last++) {
            uint16_t head = VQ_ONCE(ring[last & mask]);
            if (head >= size) {
                rc = vq_dev_fail(q, VQ_ERR_HEAD_OUT_OF_RANGE, head, last);
                break;
            }
            if (id_inflight[head]) {
                rc = vq_dev_fail(q, VQ_ERR_ID_IN_USE, head, last);
                break;
            }
            uint16_t flags = VQ_ONCE(desc[head].flags);
            if (flags & (VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_INDIRECT)) {
                more = 0;
                break;
            }
            uint64_t addr = VQ_ONCE(desc[head].addr);
            uint32_t len = VQ_ONCE(desc[head].len);
            uint8_t *host = vq_translate0(&r0, mem, addr, len);
            if (!host) {
                rc = vq_dev_fail(q, VQ_ERR_ADDRESS_OUT_OF_BOUNDS, addr, len);
                break;
            }
            if (r.n >= room) {
                more = 0;
                break;
            }
            id_inflight[head] = 1;
            r.id[r.n] = head; r.addr[r.n] = addr; r.len[r.n] = len; r.host[r.n] = host;
            r.write[r.n] = !!(flags & VIRTQ_DESC_F_WRITE);
        }
        vq_run_record(q, c, &r);
    }
    q->last_avail = last;
    return rc;
}

/* Packed: one-descriptor chains from slot last_avail while available (PACKED-V-18). Stops at a chain of
 * more than one descriptor, or when c is full. 0, or -1 broken. */
static inline int vq_dev_simple_packed(struct vq_device *q, struct vq_chains *c, uint32_t lim)
{
    const struct vring_packed_desc *ring = q->pdesc;
    const struct vq_mem *mem = q->mem;
    struct vq_reg0 r0;
    uint8_t *id_inflight = q->id_inflight;
    uint16_t slot = q->last_avail, w = q->avail_wrap, size = q->size;
    int rc = 0, more = 1;
    vq_reg0_load(&r0, mem);
    while (more && rc == 0 && c->n < lim) {
        struct vq_run r;
        uint32_t m = lim - c->n, room = c->cap_segs - c->nsegs;
        if (m > VQ_RUN)
            m = VQ_RUN;
        for (r.n = 0; r.n < m; r.n++) {
            const struct vring_packed_desc *d = &ring[slot];
            uint16_t flags = VQ_ACQUIRE(d->flags);
            /* PACKED-V-18: available iff AVAIL == wrap and USED != wrap; and neither NEXT nor INDIRECT */
            if ((flags & (VIRTQ_DESC_F_AVAIL | VIRTQ_DESC_F_USED | VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_INDIRECT))
                    != vq_avail_bits(w)) {
                more = 0;
                break;
            }
            uint64_t addr = VQ_ONCE(d->addr);
            uint32_t len = VQ_ONCE(d->len);
            uint16_t id = VQ_ONCE(d->id);
            if (q->inflight_slots + r.n + 1 > size) {   /* as vq_dev_chain_packed: PACKED-D-11/05 */
                rc = vq_dev_fail(q, VQ_ERR_SLOT_IN_FLIGHT, slot, q->inflight_slots + r.n);
                break;
            }
            uint8_t *host = vq_translate0(&r0, mem, addr, len);
            if (!host) {
                rc = vq_dev_fail(q, VQ_ERR_ADDRESS_OUT_OF_BOUNDS, addr, len);
                break;
            }
            if (id >= size) {   /* PACKED-V-10 */
                rc = vq_dev_fail(q, VQ_ERR_PACKED_ID_OUT_OF_RANGE, id, slot);
                break;
            }
            if (id_inflight[id]) {
                rc = vq_dev_fail(q, VQ_ERR_ID_IN_USE, id, slot);
                break;
            }
            if (r.n >= room) {   /* after every check, as in the general walk */
                more = 0;
                break;
            }
            id_inflight[id] = 1;
            r.id[r.n] = id; r.addr[r.n] = addr; r.len[r.n] = len; r.host[r.n] = host;
            r.write[r.n] = !!(flags & VIRTQ_DESC_F_WRITE);
            if (++slot == size) {
                slot = 0;
                w ^= 1;
            }
        }
        vq_run_record(q, c, &r);
    }
    q->last_avail = slot;
    q->avail_wrap = w;
    return rc;
}

/* Split: two-descriptor chains from last_avail up to avail_idx, direct, or one ring descriptor of an indirect
 * table of exactly two entries (a header and a frame: a driver's Tx without headroom). A chain of another shape,
 * or one a check of the general walk would refuse (SPLIT-V-13 head, ID_IN_USE, next out of range, the table's
 * place, vq_pair_take), ends the run: it is left to the general walk, which reports what fails. Stops when c is
 * full too. Returns the chains taken. */
static inline uint32_t vq_dev_pairs_split(struct vq_device *q, struct vq_chains *c, uint32_t lim, uint16_t avail_idx)
{
    const struct vring_desc *desc = q->desc;
    const uint16_t *ring = q->avail->ring;
    const struct vq_mem *mem = q->mem;
    struct vq_reg0 r0;
    uint8_t *id_inflight = q->id_inflight;
    uint16_t last = q->last_avail, mask = q->size - 1, size = q->size;
    uint32_t taken = 0;
    int more = 1;
    vq_reg0_load(&r0, mem);
    while (more && last != avail_idx && c->n < lim) {
        struct vq_pairs r;
        uint32_t m = lim - c->n, room = (c->cap_segs - c->nsegs) / 2;
        if (m > room)
            m = room;
        if (m > VQ_RUN)
            m = VQ_RUN;
        if (m == 0)
            break;
        for (r.n = 0; r.n < m && last != avail_idx; r.n++, last++) {
            uint16_t head = VQ_ONCE(ring[last & mask]);
            if (head >= size || id_inflight[head]) {
                more = 0;
                break;
            }
            uint16_t f0 = VQ_ONCE(desc[head].flags), nx = VQ_ONCE(desc[head].next), f1, nd = 2;
            uint64_t a0, a1;
            uint32_t l0, l1;
            if ((f0 & (VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_INDIRECT)) == VIRTQ_DESC_F_INDIRECT) {
                uint64_t ta = VQ_ONCE(desc[head].addr);
                const uint8_t *t = VQ_ONCE(desc[head].len) == 32 && size >= 2 ? vq_translate0(&r0, mem, ta, 32) : 0;
                struct vring_desc e0, e1;
                if (!t) {
                    more = 0;
                    break;
                }
                vq_copy_indirect(&e0, t, 0);
                vq_copy_indirect(&e1, t, 1);
                if (e0.next != 1) {   /* in a table of two, the only next in range that ends the chain */
                    more = 0;
                    break;
                }
                a0 = e0.addr; l0 = e0.len; f0 = e0.flags; a1 = e1.addr; l1 = e1.len; f1 = e1.flags;
                nd = 1;
            } else {
                if (nx >= size) {
                    more = 0;
                    break;
                }
                a0 = VQ_ONCE(desc[head].addr); a1 = VQ_ONCE(desc[nx].addr);
                l0 = VQ_ONCE(desc[head].len); l1 = VQ_ONCE(desc[nx].len);
                f1 = VQ_ONCE(desc[nx].flags);
            }
            if (!vq_pair_take(&r, &r0, mem, f0, a0, l0, f1, a1, l1)) {
                more = 0;
                break;
            }
            id_inflight[head] = 1;
            r.id[r.n] = head;
            r.ndesc[r.n] = nd;
        }
        vq_pairs_record(q, c, &r);
        taken += r.n;
    }
    q->last_avail = last;
    return taken;
}

/* Packed: two-descriptor chains from slot last_avail while available (PACKED-V-18); the id is the second's
 * (PACKED-V-10). As vq_dev_pairs_split, a chain the general walk would refuse ends the run. Returns the chains
 * taken. */
static inline uint32_t vq_dev_pairs_packed(struct vq_device *q, struct vq_chains *c, uint32_t lim)
{
    const struct vring_packed_desc *ring = q->pdesc;
    const struct vq_mem *mem = q->mem;
    struct vq_reg0 r0;
    uint8_t *id_inflight = q->id_inflight;
    uint16_t slot = q->last_avail, w = q->avail_wrap, size = q->size;
    uint32_t taken = 0;
    int more = 1;
    vq_reg0_load(&r0, mem);
    while (more && c->n < lim) {
        struct vq_pairs r;
        uint32_t m = lim - c->n, room = (c->cap_segs - c->nsegs) / 2;
        if (m > room)
            m = room;
        if (m > VQ_RUN)
            m = VQ_RUN;
        if (m == 0)
            break;
        for (r.n = 0; r.n < m; r.n++) {
            const struct vring_packed_desc *d0 = &ring[slot];
            uint16_t f0 = VQ_ACQUIRE(d0->flags);
            /* PACKED-V-18: available iff AVAIL == wrap and USED != wrap; NEXT and not INDIRECT; and PACKED-D-11/05 */
            if ((f0 & (VIRTQ_DESC_F_AVAIL | VIRTQ_DESC_F_USED | VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_INDIRECT))
                    != (vq_avail_bits(w) | VIRTQ_DESC_F_NEXT) || q->inflight_slots + 2 * r.n + 2 > size) {
                more = 0;
                break;
            }
            uint16_t slot1 = slot + 1 == size ? 0 : slot + 1;
            const struct vring_packed_desc *d1 = &ring[slot1];
            uint64_t a0 = VQ_ONCE(d0->addr), a1 = VQ_ONCE(d1->addr);
            uint32_t l0 = VQ_ONCE(d0->len), l1 = VQ_ONCE(d1->len);
            uint16_t id = VQ_ONCE(d1->id), f1 = VQ_ONCE(d1->flags);
            if (id >= size || id_inflight[id] || !vq_pair_take(&r, &r0, mem, f0, a0, l0, f1, a1, l1)) {
                more = 0;
                break;
            }
            id_inflight[id] = 1;
            r.id[r.n] = id;
            r.ndesc[r.n] = 2;
            for (int t = 0; t < 2; t++) {
                if (++slot == size) {
                    slot = 0;
                    w ^= 1;
                }
            }
        }
        vq_pairs_record(q, c, &r);
        taken += r.n;
    }
    q->last_avail = slot;
    q->avail_wrap = w;
    return taken;
}

/* Split: parse the chain at head into c. 0 ok, 1 no room, -1 broken. */
static inline int vq_dev_chain_split(struct vq_device *q, struct vq_chains *c, uint16_t head)
{
    uint16_t size = q->size;
    const uint8_t *table = 0;   /* the indirect table, once in one */
    uint32_t limit = size, hops = 0, i = head, s = c->nsegs, ring_descs = 0;
    int in_indirect = 0, seen_w = 0, r;
    uint64_t rlen = 0, wlen = 0;
    for (;;) {
        struct vring_desc d;
        if (in_indirect) {
            vq_copy_indirect(&d, table, i);
        } else {
            d.addr = VQ_ONCE(q->desc[i].addr);
            d.len = VQ_ONCE(q->desc[i].len);
            d.flags = VQ_ONCE(q->desc[i].flags);
            d.next = VQ_ONCE(q->desc[i].next);
        }
        if (++hops > limit)
            return vq_dev_fail(q, VQ_ERR_CHAIN_TOO_LONG, head, hops);
        ring_descs += !in_indirect;
        if (d.flags & VIRTQ_DESC_F_INDIRECT) {
            if (in_indirect)
                return vq_dev_fail(q, VQ_ERR_NESTED_INDIRECT, head, i);
            if (d.flags & VIRTQ_DESC_F_NEXT)
                return vq_dev_fail(q, VQ_ERR_INDIRECT_WITH_NEXT, head, i);
            table = vq_dev_indirect(q, d.addr, d.len, &limit);
            if (!table)
                return -1;
            in_indirect = 1;
            hops = 0;
            i = 0;
            continue;
        }
        r = vq_dev_emit(q, c, &s, d.addr, d.len, !!(d.flags & VIRTQ_DESC_F_WRITE), &seen_w, &rlen, &wlen);
        if (r)
            return r;
        if (!(d.flags & VIRTQ_DESC_F_NEXT))
            break;
        if (d.next >= limit)
            return vq_dev_fail(q, VQ_ERR_NEXT_OUT_OF_RANGE, i, d.next);
        i = d.next;
    }
    return vq_dev_finish_chain(q, c, c->nsegs, s, head, (uint16_t)ring_descs, rlen, wlen);
}

static inline int vq_dev_poll_split(struct vq_device *q, struct vq_chains *c, uint32_t max)
{
    uint16_t size = q->size, avail_idx = VQ_ACQUIRE(q->avail->idx);
    uint32_t lim = max < c->cap_chains ? max : c->cap_chains;
    if ((uint16_t)(avail_idx - q->last_avail) > size)   /* SPLIT-V-13 */
        return vq_dev_fail(q, VQ_ERR_AVAIL_IDX_JUMP, q->last_avail, avail_idx);
    while (q->last_avail != avail_idx && c->n < lim) {
        if (vq_dev_simple_split(q, c, lim, avail_idx) < 0)
            return -1;
        if (q->last_avail == avail_idx || c->n >= lim)
            break;
        uint16_t head = VQ_ONCE(q->avail->ring[q->last_avail & (size - 1)]);
        if (head >= size)
            return vq_dev_fail(q, VQ_ERR_HEAD_OUT_OF_RANGE, head, q->last_avail);
        if (q->id_inflight[head])
            return vq_dev_fail(q, VQ_ERR_ID_IN_USE, head, q->last_avail);
        if (!(VQ_ONCE(q->desc[head].flags) & (VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_INDIRECT)))
            break;   /* a simple chain the fast path left: no room for its segment */
        if (vq_dev_pairs_split(q, c, lim, avail_idx))
            continue;
        int r = vq_dev_chain_split(q, c, head);
        if (r < 0)
            return -1;
        if (r > 0)
            break;
        q->last_avail++;
    }
    return (int)c->n;
}

/* Packed: parse the list starting at slot last_avail. 0 ok, 1 no room, -1 broken. */
static inline int vq_dev_chain_packed(struct vq_device *q, struct vq_chains *c, uint16_t *ndesc_out)
{
    uint16_t size = q->size, slot = q->last_avail, ndesc = 0, id = 0;
    uint32_t s = c->nsegs;
    int seen_w = 0, r;
    uint64_t rlen = 0, wlen = 0;
    for (;;) {
        struct vring_packed_desc d;
        d.addr = VQ_ONCE(q->pdesc[slot].addr);
        d.len = VQ_ONCE(q->pdesc[slot].len);
        d.id = VQ_ONCE(q->pdesc[slot].id);
        d.flags = VQ_ONCE(q->pdesc[slot].flags);
        if (++ndesc > size)
            return vq_dev_fail(q, VQ_ERR_CHAIN_TOO_LONG, q->last_avail, ndesc);
        /* PACKED-D-11/05: a slot of a chain still in flight (the used position has not passed it) offered
         * again; taking it would let the available position lap the used one */
        if ((uint32_t)ndesc + q->inflight_slots > size)
            return vq_dev_fail(q, VQ_ERR_SLOT_IN_FLIGHT, slot, q->inflight_slots);
        id = d.id;
        if (d.flags & VIRTQ_DESC_F_INDIRECT) {
            uint32_t count;
            if ((d.flags & VIRTQ_DESC_F_NEXT) || ndesc > 1)   /* PACKED-D-20 */
                return vq_dev_fail(q, VQ_ERR_INDIRECT_WITH_NEXT, q->last_avail, slot);
            const uint8_t *t = vq_dev_indirect(q, d.addr, d.len, &count);
            if (!t)
                return -1;
            for (uint32_t j = 0; j < count; j++) {   /* PACKED-V-13: sequential, only WRITE counts */
                struct vring_packed_desc e;
                vq_copy_indirect(&e, t, j);
                if (e.flags & VIRTQ_DESC_F_INDIRECT)
                    return vq_dev_fail(q, VQ_ERR_NESTED_INDIRECT, q->last_avail, j);
                r = vq_dev_emit(q, c, &s, e.addr, e.len, !!(e.flags & VIRTQ_DESC_F_WRITE), &seen_w, &rlen, &wlen);
                if (r)
                    return r;
            }
            break;
        }
        r = vq_dev_emit(q, c, &s, d.addr, d.len, !!(d.flags & VIRTQ_DESC_F_WRITE), &seen_w, &rlen, &wlen);
        if (r)
            return r;
        if (!(d.flags & VIRTQ_DESC_F_NEXT))
            break;
        if (++slot == size)
            slot = 0;
    }
    if (id >= size)   /* PACKED-V-10: the id is the last descriptor's */
        return vq_dev_fail(q, VQ_ERR_PACKED_ID_OUT_OF_RANGE, id, q->last_avail);
    if (q->id_inflight[id])
        return vq_dev_fail(q, VQ_ERR_ID_IN_USE, id, q->last_avail);
    *ndesc_out = ndesc;
    return vq_dev_finish_chain(q, c, c->nsegs, s, id, ndesc, rlen, wlen);
}

static inline int vq_dev_poll_packed(struct vq_device *q, struct vq_chains *c, uint32_t max)
{
    uint32_t lim = max < c->cap_chains ? max : c->cap_chains;
    while (c->n < lim) {
        if (vq_dev_simple_packed(q, c, lim) < 0)
            return -1;
        if (c->n >= lim)
            break;
        uint16_t flags = VQ_ACQUIRE(q->pdesc[q->last_avail].flags);
        uint16_t w = q->avail_wrap, ndesc = 0;
        /* PACKED-V-18: available iff AVAIL == wrap and USED != wrap */
        if (!!(flags & VIRTQ_DESC_F_AVAIL) != w || !!(flags & VIRTQ_DESC_F_USED) == w)
            break;
        if (!(flags & (VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_INDIRECT)))
            break;   /* a simple chain the fast path left: no room for its segment */
        if (vq_dev_pairs_packed(q, c, lim))
            continue;
        int r = vq_dev_chain_packed(q, c, &ndesc);
        if (r < 0)
            return -1;
        if (r > 0)
            break;
        q->last_avail += ndesc;
        if (q->last_avail >= q->size) {
            q->last_avail -= q->size;
            q->avail_wrap ^= 1;
        }
    }
    return (int)c->n;
}

/* Poll up to max chains into c (which is reset first). Returns the count, or -1 when broken. */
static inline int vq_dev_poll(struct vq_device *q, struct vq_chains *c, uint32_t max)
{
    c->n = 0;
    c->nsegs = 0;
    return q->packed ? vq_dev_poll_packed(q, c, max) : vq_dev_poll_split(q, c, max);
}

/* Append completions to the shadow used array. Returns 0 or a VQ_USAGE_* code. */
static inline int vq_dev_push_used(struct vq_device *q, const uint32_t *ids, const uint32_t *lens, uint32_t n)
{
    /* locals: the uint8_t stores into id_inflight may alias any field read through q */
    uint8_t *id_inflight = q->id_inflight;
    uint32_t *shadow_id = q->shadow_id, *shadow_len = q->shadow_len, count = q->shadow_count;
    const uint16_t *fifo = q->fifo;
    uint16_t size = q->size, fifo_head = q->fifo_head, fifo_count = q->fifo_count;
    int in_order = q->in_order, rc = 0;
    for (uint32_t k = 0; k < n; k++) {
        uint32_t id = ids[k];
        if (id >= size || id_inflight[id] != 1) {   /* 1: polled, 2: already in the shadow */
            rc = VQ_USAGE_NOT_IN_FLIGHT;
            break;
        }
        if (in_order) {   /* INORDER-02 */
            if (fifo_count == 0 || fifo[fifo_head] != id) {
                rc = VQ_USAGE_OUT_OF_ORDER;
                break;
            }
            if (++fifo_head == size)
                fifo_head = 0;
            fifo_count--;
        }
        if (count >= size) {
            rc = VQ_USAGE_SHADOW_FULL;
            break;
        }
        id_inflight[id] = 2;   /* completed, waiting in the shadow */
        shadow_id[count] = id;
        shadow_len[count] = lens[k];
        count++;
    }
    q->shadow_count = count;
    q->fifo_head = fifo_head;
    q->fifo_count = fifo_count;
    return rc;
}

/* The shadow used array and what its flush moves, in locals (as struct vq_rec, for the same reason). */
struct vq_shadow {
    const uint32_t *id, *len, *id_wlen;
    const uint16_t *id_ndesc;
    uint8_t *id_inflight;
    uint32_t count, inflight_slots;
    uint16_t size, used_idx, used_wrap, inflight, call_added;
    uint8_t batch;
};

static inline void vq_shadow_load(struct vq_shadow *v, const struct vq_device *q)
{
    v->id = q->shadow_id; v->len = q->shadow_len; v->id_wlen = q->id_wlen; v->id_ndesc = q->id_ndesc;
    v->id_inflight = q->id_inflight; v->count = q->shadow_count; v->size = q->size;
    v->used_idx = q->used_idx; v->used_wrap = q->used_wrap; v->inflight = q->inflight;
    v->call_added = q->call_added; v->batch = q->in_order && q->batch; v->inflight_slots = q->inflight_slots;
}

static inline void vq_shadow_store(const struct vq_shadow *v, struct vq_device *q)
{
    q->used_idx = v->used_idx; q->used_wrap = v->used_wrap; q->inflight = v->inflight;
    q->call_added = v->call_added; q->inflight_slots = v->inflight_slots;
}

/* End of the batch starting at shadow entry i (INORDER-10: only fully written buffers are skipped). */
static inline uint32_t vq_dev_batch_end(const struct vq_shadow *v, uint32_t i)
{
    if (!v->batch)
        return i;
    while (i + 1 < v->count && v->len[i] == v->id_wlen[v->id[i]])
        i++;
    return i;
}

static inline void vq_dev_retire(struct vq_shadow *v, uint32_t id)
{
    v->id_inflight[id] = 0;
    v->inflight--;
}

static inline void vq_dev_flush_split(struct vq_device *q)
{
    struct vq_shadow v;
    struct vring_used_elem *ring = q->used->ring;
    vq_shadow_load(&v, q);
    for (uint32_t i = 0; i < v.count;) {
        uint32_t j = vq_dev_batch_end(&v, i);
        struct vring_used_elem *e = &ring[v.used_idx & (v.size - 1)];   /* INORDER-08 */
        VQ_STORE(e->id, v.id[j]);
        VQ_STORE(e->len, v.len[j]);
        for (uint32_t k = i; k <= j; k++)
            vq_dev_retire(&v, v.id[k]);
        v.used_idx += (uint16_t)(j - i + 1);   /* INORDER-07 */
        v.call_added += (uint16_t)(j - i + 1);
        i = j + 1;
    }
    vq_shadow_store(&v, q);
    VQ_RELEASE(q->used->idx, q->used_idx);   /* SPLIT-V-08: entries before idx */
}

static inline void vq_dev_flush_packed(struct vq_device *q)
{
    struct vq_shadow v;
    struct vring_packed_desc *ring = q->pdesc;
    vq_shadow_load(&v, q);
    uint16_t first = v.used_idx, first_flags = 0;
    if (!v.batch) {   /* one used element per buffer: the loop below without its batch walk */
        uint16_t used = v.used_idx, wrap = v.used_wrap, added = 0;
        for (uint32_t i = 0; i < v.count; i++) {
            uint32_t id = v.id[i], len = v.len[i];
            uint16_t adv = v.id_ndesc[id];   /* <= size: used + adv < 2 * size <= 65536 */
            struct vring_packed_desc *d = &ring[used];
            uint16_t flags = vq_used_bits(wrap) | (len ? VIRTQ_DESC_F_WRITE : 0);
            VQ_STORE(d->id, (uint16_t)id);
            VQ_STORE(d->len, len);
            v.id_inflight[id] = 0;
            if (i == 0)
                first_flags = flags;
            else
                VQ_SET(d->flags, flags);   /* after its body, before the first's */
            used += adv;
            if (used >= v.size) {
                used -= v.size;
                wrap ^= 1;
            }
            added += adv;
        }
        v.used_idx = used;
        v.used_wrap = wrap;
        v.inflight -= (uint16_t)v.count;
        v.inflight_slots -= added;
        v.call_added += added;
        vq_shadow_store(&v, q);
        VQ_RELEASE(ring[first].flags, first_flags);   /* PACKED-V-16: the first one last */
        return;
    }
    for (uint32_t i = 0; i < v.count;) {
        uint32_t j = vq_dev_batch_end(&v, i), adv = 0;
        struct vring_packed_desc *d = &ring[v.used_idx];
        uint16_t flags = vq_used_bits(v.used_wrap) | (v.len[j] ? VIRTQ_DESC_F_WRITE : 0);
        VQ_STORE(d->id, (uint16_t)v.id[j]);   /* INORDER-11/13: last id, at the batch's first slot */
        VQ_STORE(d->len, v.len[j]);
        for (uint32_t k = i; k <= j; k++) {
            adv += v.id_ndesc[v.id[k]];
            vq_dev_retire(&v, v.id[k]);
        }
        if (i == 0)
            first_flags = flags;
        else
            VQ_SET(d->flags, flags);   /* after its body, before the first's */
        /* adv <= inflight_slots <= size (poll refuses slots in flight): one lap at most */
        uint32_t pos = (uint32_t)v.used_idx + adv;
        while (pos >= v.size) {
            pos -= v.size;
            v.used_wrap ^= 1;
        }
        v.used_idx = (uint16_t)pos;
        v.inflight_slots -= adv;
        v.call_added += (uint16_t)adv;
        i = j + 1;
    }
    vq_shadow_store(&v, q);
    VQ_RELEASE(ring[first].flags, first_flags);   /* PACKED-V-16: the first one last */
}

static inline void vq_dev_flush(struct vq_device *q)
{
    if (q->shadow_count == 0)
        return;
    if (q->packed)
        vq_dev_flush_packed(q);
    else
        vq_dev_flush_split(q);
    q->shadow_count = 0;
}

static inline int vq_dev_call_prepare(struct vq_device *q)
{
    int need;
    VQ_FENCE();   /* MEM-10: publish used before reading the driver's suppression fields */
    if (q->packed) {
        /* EVT-19: the peer writes off_wrap, then flags; flags first, with acquire, then off_wrap */
        uint16_t flags = VQ_ACQUIRE(q->driver_event->flags);
        if (flags == RING_EVENT_FLAGS_DISABLE)
            need = 0;
        else if (flags == RING_EVENT_FLAGS_DESC && q->event_idx)
            need = vq_packed_need_event(VQ_ONCE(q->driver_event->off_wrap), q->used_idx,
                                        (uint16_t)(q->used_idx - q->call_added), q->used_wrap, q->size);
        else
            need = 1;
    } else if (q->event_idx) {   /* EVT-06/07 */
        need = vq_need_event(VQ_ONCE(*vq_used_event(q->avail, q->size)), q->used_idx,
                             (uint16_t)(q->used_idx - q->call_added));
    } else {                     /* EVT-05 */
        need = !(VQ_ONCE(q->avail->flags) & VIRTQ_AVAIL_F_NO_INTERRUPT);
    }
    q->call_added = 0;
    return need;
}

static inline void vq_dev_enable_kicks(struct vq_device *q, int on)
{
    if (q->packed) {
        VQ_SET(q->device_event->flags, on ? RING_EVENT_FLAGS_ENABLE : RING_EVENT_FLAGS_DISABLE);
    } else if (q->event_idx) {   /* EVT-16: flags stay 0 */
        VQ_SET(q->used->flags, 0);
        VQ_SET(*vq_avail_event(q->used, q->size), (uint16_t)(on ? q->last_avail : q->last_avail + 0x7fff));
    } else {
        VQ_SET(q->used->flags, on ? 0 : VIRTQ_USED_F_NO_NOTIFY);
    }
    VQ_FENCE();   /* MEM-10: callers re-check the ring after enabling */
}

#endif

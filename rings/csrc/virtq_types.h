/* Ring layouts (virtio 1.2-1.4, little-endian hosts only) and queue state.
 * This file is also fed to cffi's cdef, so it holds declarations only: no macros, no includes. */

struct vring_desc {             /* SPLIT-L-03 */
    uint64_t addr;
    uint32_t len;
    uint16_t flags;
    uint16_t next;
};

struct vring_avail {            /* SPLIT-L-04: used_event follows ring[size] */
    uint16_t flags;
    uint16_t idx;
    uint16_t ring[];
};

struct vring_used_elem {
    uint32_t id;
    uint32_t len;
};

struct vring_used {             /* SPLIT-L-05: avail_event follows ring[size] */
    uint16_t flags;
    uint16_t idx;
    struct vring_used_elem ring[];
};

struct vring_packed_desc {      /* PACKED-L-01 */
    uint64_t addr;
    uint32_t len;
    uint16_t id;
    uint16_t flags;
};

struct vring_packed_event {     /* EVT-19 */
    uint16_t off_wrap;
    uint16_t flags;
};

struct vq_region {
    uint64_t gpa;
    uint64_t size;
    uint8_t *host;
};

struct vq_mem {
    uint32_t nregions;
    struct vq_region r[8];
};

/* The driver half. Everything here is private to the driver process. */
struct vq_driver {
    uint16_t size;
    uint8_t packed, in_order, event_idx, use_indirect;
    uint16_t indirect_max;          /* entries per indirect table */
    uint64_t indirect_gpa;          /* table of buffer id i at indirect_gpa + i*indirect_max*16 */
    uint8_t *indirect_host;
    struct vring_desc *desc;
    struct vring_avail *avail;
    struct vring_used *used;
    struct vring_packed_desc *pdesc;
    struct vring_packed_event *driver_event, *device_event;

    uint16_t next_avail, avail_wrap;
    uint16_t last_used, used_wrap;
    uint16_t num_free, free_head;
    uint16_t free_tail;             /* normal variants: freed descriptors/ids join here (FIFO, as a ring) */
    uint16_t next_desc;             /* split in-order: next descriptor in ring order */
    uint16_t oldest;                /* split in-order: head of the oldest buffer in flight */
    uint16_t inflight;              /* buffers */
    uint16_t kick_added;
    uint16_t pending;               /* buffers added since the last publish */
    /* packed: the first flags of those, kept aside (PACKED-D-12) */
    uint16_t pending_head, pending_flags;

    uint16_t *free_next;            /* free list (split: descriptors, packed: ids) */
    uint16_t *id_ndesc;
    uint32_t *id_wlen;
    uint64_t *id_token;
    uint8_t *id_inflight;

    int32_t error;
    uint64_t err_a, err_b;
};

/* The device half. */
struct vq_device {
    uint16_t size;
    uint8_t packed, in_order, event_idx, batch;
    struct vring_desc *desc;
    struct vring_avail *avail;
    struct vring_used *used;
    struct vring_packed_desc *pdesc;
    struct vring_packed_event *driver_event, *device_event;
    const struct vq_mem *mem;

    uint16_t last_avail, avail_wrap;
    uint16_t used_idx, used_wrap;
    uint16_t call_added;
    uint16_t inflight;
    uint32_t inflight_slots;        /* packed: ring slots of the chains in flight, from used_idx to last_avail */

    uint16_t *id_ndesc;
    uint32_t *id_wlen;
    uint8_t *id_inflight;
    uint16_t *fifo;                 /* in-order: ids in the order they were polled */
    uint16_t fifo_head, fifo_count;
    uint32_t *shadow_id, *shadow_len;
    uint32_t shadow_count;

    int32_t error;
    uint64_t err_a, err_b;
};

/* One poll's worth of chains. Arrays owned by Python; cap_* are their lengths. */
struct vq_chains {
    uint32_t cap_chains, cap_segs;
    uint32_t n, nsegs;
    uint16_t *id, *ndesc, *nseg;
    uint32_t *seg_start, *rlen, *wlen;
    uint64_t *seg_addr;
    uint32_t *seg_len;
    uint8_t *seg_write;
    uint8_t **seg_host;
};

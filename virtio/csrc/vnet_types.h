/* virtio-net driver state shared between Python (numpy arrays) and C. Also fed to cffi's cdef: declarations
 * only, no macros, no includes. Needs rings/csrc/virtq_types.h first. */

/* The buffer pool: nbufs fixed-size buffers in guest memory, like DPDK mbufs. A packet is the index of its
 * first buffer; data starts at data_off, segments chain through next (0xffffffff = end). */
struct vn_pool {
    uint8_t *host;          /* buffer 0 in this process */
    uint64_t gpa;           /* buffer 0 as a guest address */
    uint32_t buf_size, headroom, nbufs;
    uint32_t stride;        /* bytes from one buffer to the next: buf_size, or 64 more (virtio/pool.py pool_stride) */
    uint32_t top;           /* free stack: stack[0..top) */
    uint32_t *stack;
    uint8_t *owned;         /* 1 while allocated */
    uint16_t *data_off;
    uint32_t *data_len;     /* bytes in this segment */
    uint32_t *next;
    uint64_t bad_frees;
};

struct vn_txq {
    struct vq_driver *q;
    struct vn_pool *pool;
    uint32_t hdr_size;      /* 12 with VERSION_1 or MRG_RXBUF, else 10 (NET-03) */
    uint32_t max_segs;      /* scratch capacity for the slow path (header + segments) */
    uint32_t cleanup_thresh; /* vn_fwd_burst: reclaim after sending when fewer descriptors are free */
    uint8_t *hdr_host;      /* header area: one slot per buffer id */
    uint64_t hdr_gpa;
    uint8_t hdr_tmpl[16];   /* set once per burst */
    uint8_t force_slow, kick, pending_kick;   /* kick: this burst notified the device */
    uint8_t hdr_indirect;   /* --tx-hdr indirect by its fast path: a one-segment packet as a two-entry table */
    /* variants, fixed when the queue is built (vring bench --study): the header cleared once per packet instead
     * of once per burst; one publish + doorbell per packet instead of one per burst (no xmit_more) */
    uint8_t hdr_per_packet, doorbell_per_packet;
    /* macfwd with no more than a burst out: packets taken, sent and published publish_every at a time (0: whole
     * bursts; vn_fwd_take) */
    uint16_t publish_every, pad3, pad4;
    int32_t kickfd;         /* eventfd, or -1 (count only) */
    uint64_t *tok;          /* reclaim scratch, size entries */
    uint32_t *lens;
    uint64_t *seg_addr;     /* slow-path scratch, max_segs entries */
    uint32_t *seg_len;
    uint64_t packets, bytes, fast, slow, full, dropped, cleanups, reclaimed_bufs, reclaimed_descs, errors, kicks;
    uint64_t publishes;     /* release stores that made descriptors visible */
};

struct vn_rxq {
    struct vq_driver *q;
    struct vn_lat *lat;     /* macfwd: measure and re-stamp every frame when set */
    struct vn_pool *pool;
    uint32_t hdr_size, mrg, post_len, refill_thresh;
    uint8_t kick, calls_on;   /* calls_on: RxQueue.wait() has enabled calls */
    uint8_t own_frame;        /* macfwd: the caller writes each received frame's first line (and the Tx header,
                                 which pool.HEADROOM puts in that line) */
    uint8_t pad;
    int32_t kickfd;
    uint64_t *tok;          /* reclaim scratch, size entries */
    uint32_t *lens;
    uint32_t *ref_idx;      /* refill scratch, size entries */
    uint64_t *ref_addr;
    uint32_t *ref_len;
    uint64_t *ref_tok;
    uint32_t part_head, part_tail, part_len, part_left, part_nseg;
    uint32_t spun;          /* vn_fwd_loop: empty polls of the spin under way (it goes on across calls) */
    uint64_t packets, bytes, bufs, merged, refills, posted, nombuf, errors, kicks;
};

/* Round-trip latency of stamped frames: count, sum, min, max and a histogram of quarter-octave buckets
 * (bucket = floor(4 * log2(ns))). */
struct vn_lat {
    uint32_t ts_off;
    uint32_t pad;
    uint64_t count, sum, min, max, bad;
    uint64_t hist[256];
};

/* Open-loop pacing (vn_pace_loop): packet k is due at t0 + k * ns_per_pkt. */
struct vn_pace {
    double ns_per_pkt;
    uint64_t t0;            /* CLOCK_MONOTONIC ns of packet 0 */
    uint64_t offered;       /* packets due so far that were generated (sent or dropped at Tx) */
    uint64_t next_ns;       /* when the next one is due */
    uint64_t nobuf;         /* steps that found the pool empty */
    uint32_t idle, pad;     /* idle: the last call stopped after `spin` idle steps */
};

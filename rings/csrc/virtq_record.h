/* Test build only (compiled with -DVQ_RECORD, included by virtq.h): the ring-access macros log every
 * access to ring memory in program order, so tests can check write order (MEM-*, PACKED-D-12, SPLIT-V-08...),
 * which x86 hides at run time. One global log per module (the tests run one thread).
 *
 * An entry is (host address, size, value, kind): kind 'S' plain store, 'W' relaxed store, 'R' release store,
 * 'L' relaxed load, 'A' acquire load, 'F' full fence. A store is logged right after it is made, so the hook
 * (if set) sees memory as a peer would just after that store. Entries past the capacity are counted, not kept. */
#ifndef VIRTQ_RECORD_H
#define VIRTQ_RECORD_H

#include <stdint.h>

struct vq_rec_entry {
    uint64_t addr;
    uint64_t value;
    uint32_t size;
    uint32_t kind;
};

static struct vq_rec_entry *vq_rec_buf;
static uint32_t vq_rec_cap, vq_rec_n, vq_rec_lost;
static void (*vq_rec_hook)(const struct vq_rec_entry *);

static inline void vq_rec(const volatile void *p, uint32_t size, uint32_t kind, uint64_t value)
{
    if (!vq_rec_buf)
        return;
    if (vq_rec_n >= vq_rec_cap) {
        vq_rec_lost++;
        return;
    }
    struct vq_rec_entry *e = &vq_rec_buf[vq_rec_n++];
    e->addr = (uint64_t)(uintptr_t)p;
    e->size = size;
    e->kind = kind;
    e->value = value;
    if (vq_rec_hook)
        vq_rec_hook(e);
}

/* Start logging into buf[cap] (hook may be 0); stop returns how many entries were kept. */
static inline void vq_rec_start(struct vq_rec_entry *buf, uint32_t cap, void (*hook)(const struct vq_rec_entry *))
{
    vq_rec_buf = buf; vq_rec_cap = cap; vq_rec_n = 0; vq_rec_lost = 0; vq_rec_hook = hook;
}

static inline uint32_t vq_rec_stop(uint32_t *lost)
{
    uint32_t n = vq_rec_n;
    *lost = vq_rec_lost;
    vq_rec_buf = 0; vq_rec_cap = 0; vq_rec_n = 0; vq_rec_hook = 0;
    return n;
}

#define VQ_REC_STORE_(x, v, kind, ...) ({ __typeof__(&(x)) p_ = &(x); __typeof__(x) v_ = (v); \
    __VA_ARGS__; vq_rec(p_, sizeof(*p_), kind, (uint64_t)v_); })
#define VQ_REC_LOAD_(x, order, kind) ({ __typeof__(x) v_ = __atomic_load_n(&(x), order); \
    vq_rec(&(x), sizeof(x), kind, (uint64_t)v_); v_; })

#define VQ_STORE(x, v) VQ_REC_STORE_(x, v, 'S', *p_ = v_)
#define VQ_SET(x, v) VQ_REC_STORE_(x, v, 'W', __atomic_store_n(p_, v_, __ATOMIC_RELAXED))
#define VQ_RELEASE(x, v) VQ_REC_STORE_(x, v, 'R', __atomic_store_n(p_, v_, __ATOMIC_RELEASE))
#define VQ_ONCE(x) VQ_REC_LOAD_(x, __ATOMIC_RELAXED, 'L')
#define VQ_ACQUIRE(x) VQ_REC_LOAD_(x, __ATOMIC_ACQUIRE, 'A')
#define VQ_FENCE() ({ __atomic_thread_fence(__ATOMIC_SEQ_CST); vq_rec(0, 0, 'F', 0); })

#endif

/* Guest-memory faults caught, not fatal. A peer that shrinks the file behind a region we mapped (ftruncate after
 * SET_MEM_TABLE, on a file it did not let us seal) turns our next access to the vanished pages into SIGBUS.
 * A C entry point that walks peer memory arms a jump buffer with sigsetjmp(env, 0) (no signal mask saved: a
 * few instructions per call, i.e. per burst or time slice) and disarms it on return; the handler jumps back
 * there, and the entry point reports the fault instead of the process dying. A fault anywhere else (unarmed)
 * gets the disposition that was there before ours (default: the crash it always was).
 *
 * Usage (one entry point):
 *     sigjmp_buf env;
 *     if (sigsetjmp(env, 0))
 *         return gf_caught();          // the peer's memory vanished under the call: drop that peer
 *     gf_arm(&env);
 *     int r = the_loop(...);
 *     gf_disarm();
 *     return r;
 * What the interrupted call was doing is left half done: the caller must never touch those queues again.
 *
 * Zero-fill watches, for memory read where no jump buffer can be armed (the conformance harness's numpy views of
 * the rings, the tap's captures, C ring code those call): gf_watch_add registers a mapping; an unarmed fault
 * inside it maps anonymous zero pages over the vanished pages (as Wayland compositors do for client buffers), counts
 * it and returns, so the access is retried and reads zeros. The owner of the views asks gf_watch_faults before it
 * believes what it read since. Anything else gets the disposition that was there before ours: a handler is called
 * (another module's copy of this one, faulthandler), the default is restored and the fault happens again. */
#ifndef GUEST_FAULT_H
#define GUEST_FAULT_H

#include <errno.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#define GF_FAULT (-1)

/* initial-exec: a plain thread-pointer access, in the hot path and in the handler (no __tls_get_addr there).
 * volatile: the handler reads it asynchronously, so the compiler must not drop the arming store when the
 * guarded code is one it can see through (a memcpy between gf_arm and gf_disarm made them a dead store). */
static __thread sigjmp_buf *volatile gf_env __attribute__((tls_model("initial-exec")));
static struct sigaction gf_previous;
static int gf_installed;

/* One watched mapping: [lo, hi) (hi 0: a free slot, 1: being filled in), in pages of ``align`` bytes. */
#define GF_WATCH_MAX 64
struct gf_watch {
    volatile uintptr_t lo, hi, align;
    volatile unsigned long faults;       /* faults met in it so far */
    volatile uintptr_t lowest;           /* the lowest page replaced by zeros (from there to hi: all of them) */
};
static struct gf_watch gf_watches[GF_WATCH_MAX];
static volatile unsigned long gf_watch_fills;   /* faults met in any watch: the readers' cheap first test */

/* In the handler: a page of a watched mapping that holds ``a`` vanished. A truncation takes a file's end away, so
 * every page from this one to the end of the mapping has gone too: they are all replaced by zeros in one mapping
 * (one per page would split the file mapping until the kernel's map count ran out, and the next fault would be
 * fatal). 1 if done. */
static int gf_fill(uintptr_t a)
{
    for (int i = 0; i < GF_WATCH_MAX; i++) {
        struct gf_watch *w = &gf_watches[i];
        uintptr_t hi = __atomic_load_n(&w->hi, __ATOMIC_ACQUIRE);
        if (hi <= 1 || a < w->lo || a >= hi)
            continue;
        /* the mapping's page size; a hugetlbfs mapping refuses a smaller piece (EINVAL): then 2 MiB, then 1 GiB,
         * never below the mapping's start nor past the page that holds its end. NORESERVE: a peer's region may be
         * larger than our memory and swap (a sparse file costs it nothing); where even that is refused (strict
         * overcommit, RLIMIT_DATA), the faulting page alone */
        const uintptr_t sizes[3] = {w->align, (uintptr_t)1 << 21, (uintptr_t)1 << 30};
        const int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE;
        int saved = errno, done = 0;
        uintptr_t page = 0;
        for (int k = 0; k < 3 && !done; k++) {
            page = a & ~(sizes[k] - 1);
            uintptr_t end = (hi + sizes[k] - 1) & ~(sizes[k] - 1);
            if (sizes[k] < w->align || page < w->lo)
                continue;
            done = mmap((void *)page, end - page, PROT_READ | PROT_WRITE, flags, -1, 0) != MAP_FAILED;
            if (!done && errno != EINVAL)
                done = mmap((void *)page, sizes[k], PROT_READ | PROT_WRITE, flags, -1, 0) != MAP_FAILED;
            if (!done && errno != EINVAL)
                break;
        }
        errno = saved;   /* the interrupted code may be about to read it */
        if (!done)
            return 0;
        uintptr_t low = __atomic_load_n(&w->lowest, __ATOMIC_RELAXED);   /* threads may fault at once */
        while ((!low || page < low)
               && !__atomic_compare_exchange_n(&w->lowest, &low, page, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            ;
        __atomic_fetch_add(&w->faults, 1, __ATOMIC_RELEASE);   /* after lowest: a reader that sees it sees that */
        __atomic_fetch_add(&gf_watch_fills, 1, __ATOMIC_RELEASE);
        return 1;
    }
    return 0;
}

static void gf_handler(int sig, siginfo_t *si, void *uc)
{
    sigjmp_buf *env = gf_env;
    int kernel = si && si->si_code > 0;   /* raised by the kernel for an access of this thread */
    if (env && kernel) {                  /* ... while armed */
        gf_env = NULL;
        siglongjmp(*env, 1);
    }
    /* BUS_ADRERR: an access past the end of the file (a truncation); not a hardware memory error */
    if (kernel && si->si_code == BUS_ADRERR && gf_fill((uintptr_t)si->si_addr))
        return;
    /* not ours: what was there before (another module's gf_handler may be armed or watching) */
    if (gf_previous.sa_flags & SA_SIGINFO) {
        if (gf_previous.sa_sigaction) {
            gf_previous.sa_sigaction(sig, si, uc);
            return;
        }
    } else if (gf_previous.sa_handler != SIG_DFL && gf_previous.sa_handler != SIG_IGN) {
        gf_previous.sa_handler(sig);
        return;
    }
    sigaction(SIGBUS, &gf_previous, NULL);   /* the default: the fault happens again and is fatal */
    if (!kernel)
        raise(sig);
}

/* Install the SIGBUS handler (once per process and module; later calls do nothing). 0, or -1 with errno. */
static int gf_install(void)
{
    if (gf_installed)
        return 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = gf_handler;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;   /* we leave by siglongjmp: SIGBUS must not stay blocked */
    sigemptyset(&sa.sa_mask);
    /* what was there is kept before ours goes in (the handler may run at once), and never ours itself (two threads
     * installing at once would make it call itself for every fault that is not its own) */
    struct sigaction old;
    if (sigaction(SIGBUS, NULL, &old) != 0)
        return -1;
    if (!((old.sa_flags & SA_SIGINFO) && old.sa_sigaction == gf_handler))
        gf_previous = old;
    if (sigaction(SIGBUS, &sa, NULL) != 0)
        return -1;
    gf_installed = 1;
    return 0;
}

static inline void gf_arm(sigjmp_buf *env)
{
    gf_env = env;
}

static inline void gf_disarm(void)
{
    gf_env = NULL;
}

static inline int gf_caught(void)
{
    gf_env = NULL;
    return GF_FAULT;
}

/* Watch [lo, lo + len) (lo aligned to align, a power of two): the slot, or -1 (bad arguments, no free slot, or the
 * handler could not be installed). cffi calls run without the GIL: a slot is claimed by compare-and-swap (hi 1
 * while it is being filled in covers no address a SIGBUS can have). */
static inline int gf_watch_add(uintptr_t lo, size_t len, size_t align)
{
    if (!len || !align || (align & (align - 1)) || (lo & (align - 1)) || lo + len < lo || gf_install() != 0)
        return -1;
    for (int i = 0; i < GF_WATCH_MAX; i++) {
        struct gf_watch *w = &gf_watches[i];
        uintptr_t free_slot = 0;
        if (!__atomic_compare_exchange_n(&w->hi, &free_slot, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
            continue;
        w->lo = lo;
        w->align = align;
        w->faults = 0;
        w->lowest = 0;
        __atomic_store_n(&w->hi, lo + len, __ATOMIC_RELEASE);   /* live only once complete */
        return i;
    }
    return -1;
}

/* Stop watching (before the mapping goes: its addresses may be reused by a mapping that is not ours to fill). */
static inline void gf_watch_remove(int slot)
{
    if (slot >= 0 && slot < GF_WATCH_MAX)
        __atomic_store_n(&gf_watches[slot].hi, 0, __ATOMIC_RELEASE);
}

/* Faults met in all watches so far (one load: readers test it per frame). */
static inline unsigned long gf_watch_total(void)
{
    return __atomic_load_n(&gf_watch_fills, __ATOMIC_ACQUIRE);
}

/* Faults met in a watched mapping so far; *lowest: the lowest page replaced by zeros (all above it are too). */
static inline unsigned long gf_watch_faults(int slot, uintptr_t *lowest)
{
    if (slot < 0 || slot >= GF_WATCH_MAX)
        return 0;
    unsigned long n = __atomic_load_n(&gf_watches[slot].faults, __ATOMIC_ACQUIRE);
    if (lowest)
        *lowest = gf_watches[slot].lowest;
    return n;
}

#endif

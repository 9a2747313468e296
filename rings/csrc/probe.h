/* What one cache line costs to move between two CPUs: the machine fact a two-process ring benchmark rests on
 * (every publication and every completion is such a move). On a shared VM the host places the two vCPUs on
 * cores that share a cache or on cores that do not, and moves them every few seconds; a line then takes
 * ~50 ns or ~200 ns, and pairs that move more lines per packet lose more in the far placement. */
#ifndef VQ_PROBE_H
#define VQ_PROBE_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#define PROBE_SAMPLES 5
#define PROBE_BATCH 256   /* round trips between two clock reads */

struct probe_line {
    volatile uint64_t flag __attribute__((aligned(64)));   /* the line that moves */
    char pad[56];
    volatile int stop __attribute__((aligned(64)));        /* another line: the partner's exit */
    volatile int ready;                                     /* the partner runs (on cpu_b: born there) */
    int owners;                                             /* the caller and the partner: the last out frees */
    uint64_t deadline_ns;
};

static void probe_release(struct probe_line *p)
{
    if (__atomic_sub_fetch(&p->owners, 1, __ATOMIC_ACQ_REL) == 0)
        free(p);
}

static inline uint64_t probe_now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static inline int probe_pin(pthread_t th, int cpu)
{
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    return pthread_setaffinity_np(th, sizeof s, &s);
}

/* The partner: answers each odd value with the next even one, until stop (or the deadline: a caller that
 * vanished must not leave it spinning). */
static void *probe_partner(void *arg)
{
    struct probe_line *p = arg;
    p->ready = 1;
    uint64_t want = 1;
    uint32_t k = 0;
    while (!p->stop) {
        if (p->flag == want) {
            p->flag = want + 1;
            want += 2;
        } else if (!(++k % 4096) && probe_now_ns() > p->deadline_ns) {
            break;
        }
    }
    probe_release(p);   /* after this, p may be gone: a caller that gave up on joining left it to us */
    return NULL;
}

static int probe_cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The median over PROBE_SAMPLES samples of budget_ns/PROBE_SAMPLES each of one line's one-way trip from cpu_a
 * (the calling thread, pinned there for the time of the probe and then given its CPU set back) to cpu_b (a
 * thread of its own), in ns. Negative: -1 a thread could not be made or pinned, -2 the partner never answered
 * (its CPU taken by something that does not let go). */
static inline double probe_line_transfer_ns(int cpu_a, int cpu_b, uint64_t budget_ns)
{
    cpu_set_t saved, on_b;
    pthread_t self = pthread_self(), th;
    pthread_attr_t attr;
    struct sched_param prio = {0};
    struct timespec until;
    struct probe_line *p;
    double r[PROBE_SAMPLES];
    int rc = 0, policy;
    if (cpu_a < 0 || cpu_b < 0 || cpu_a >= CPU_SETSIZE || cpu_b >= CPU_SETSIZE || cpu_a == cpu_b || budget_ns == 0)
        return -1;
    if (posix_memalign((void **)&p, 64, sizeof *p))
        return -1;
    p->flag = 0;
    p->stop = 0;
    p->ready = 0;
    p->owners = 2;
    p->deadline_ns = probe_now_ns() + budget_ns + 1000000000u;
    CPU_ZERO(&on_b);
    CPU_SET(cpu_b, &on_b);
    /* The partner is born on cpu_b (it used to start on cpu_a, where the caller spins: 3-5 ms lost in the first
     * sample, and never with a SCHED_FIFO caller), and as an ordinary thread whatever the caller's policy (a
     * real-time partner could be kept from ever seeing `stop` by a real-time task on cpu_b). */
    if (pthread_attr_init(&attr)) {
        free(p);
        return -1;
    }
    if (pthread_attr_setaffinity_np(&attr, sizeof on_b, &on_b)
        || (pthread_getschedparam(self, &policy, &prio) == 0 && (policy == SCHED_FIFO || policy == SCHED_RR)
            && (prio.sched_priority = 0, pthread_attr_setinheritsched(&attr, PTHREAD_EXPLICIT_SCHED)
                || pthread_attr_setschedpolicy(&attr, SCHED_OTHER) || pthread_attr_setschedparam(&attr, &prio)))
        || pthread_getaffinity_np(self, sizeof saved, &saved) || probe_pin(self, cpu_a)) {
        pthread_attr_destroy(&attr);
        free(p);
        return -1;
    }
    if (pthread_create(&th, &attr, probe_partner, p)) {   /* EINVAL: cpu_b not ours */
        pthread_attr_destroy(&attr);
        pthread_setaffinity_np(self, sizeof saved, &saved);
        free(p);
        return -1;
    }
    pthread_attr_destroy(&attr);
    /* the clock starts once the partner runs */
    for (uint32_t k = 0; !p->ready; )
        if (!(++k % 4096) && probe_now_ns() > p->deadline_ns) {
            rc = -2;
            break;
        }
    uint64_t v = 0, slice = budget_ns / PROBE_SAMPLES;
    for (int s = 0; s < PROBE_SAMPLES && rc == 0; s++) {
        uint64_t t0 = probe_now_ns(), t = t0, trips = 0;
        while (t - t0 < slice || trips == 0) {
            for (int i = 0; i < PROBE_BATCH; i++) {
                p->flag = v + 1;
                uint32_t k = 0;
                while (p->flag != v + 2) {
                    if (!(++k % 4096) && probe_now_ns() > p->deadline_ns) {
                        rc = -2;
                        break;
                    }
                }
                if (rc)
                    break;
                v += 2;
            }
            if (rc)
                break;
            trips += PROBE_BATCH;
            t = probe_now_ns();
        }
        r[s] = trips ? (double)(t - t0) / (double)trips / 2 : 0;
    }
    p->stop = 1;
    /* a partner that cannot get cpu_b (a real-time task there) cannot end: wait for it 1 s, then leave it p */
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 1;
    if (pthread_timedjoin_np(th, NULL, &until)) {
        pthread_detach(th);
        if (rc == 0)
            rc = -2;
    }
    pthread_setaffinity_np(self, sizeof saved, &saved);
    probe_release(p);
    if (rc)
        return rc;
    qsort(r, PROBE_SAMPLES, sizeof r[0], probe_cmp);
    return r[PROBE_SAMPLES / 2];
}

#endif

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
    int cpu, pinned;
    int released;           /* set (atomically) by the first of caller and partner to let go: the second frees */
    uint64_t deadline_ns;
};

/* The caller and the partner each let go of p once; whichever comes second frees it. A partner that never got its
 * CPU (a real-time task holding it) is left behind, detached, and frees p itself when it finally runs. */
static inline void probe_release(struct probe_line *p)
{
    if (__atomic_exchange_n(&p->released, 1, __ATOMIC_ACQ_REL))
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
    p->pinned = probe_pin(pthread_self(), p->cpu) == 0 ? 1 : -1;
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
    probe_release(p);
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
    cpu_set_t saved;
    pthread_t self = pthread_self(), th;
    struct probe_line *p;
    double r[PROBE_SAMPLES];
    int rc = 0;
    if (cpu_a < 0 || cpu_b < 0 || cpu_a >= CPU_SETSIZE || cpu_b >= CPU_SETSIZE || budget_ns == 0)
        return -1;
    if (posix_memalign((void **)&p, 64, sizeof *p))
        return -1;
    p->flag = 0;
    p->stop = 0;
    p->cpu = cpu_b;
    p->pinned = 0;
    p->released = 0;
    p->deadline_ns = probe_now_ns() + budget_ns + 1000000000u;
    if (pthread_getaffinity_np(self, sizeof saved, &saved) || probe_pin(self, cpu_a)) {
        free(p);
        return -1;
    }
    if (pthread_create(&th, NULL, probe_partner, p)) {
        pthread_setaffinity_np(self, sizeof saved, &saved);
        free(p);
        return -1;
    }
    uint64_t v = 0, slice = budget_ns / PROBE_SAMPLES;
    for (int s = 0; s < PROBE_SAMPLES && rc == 0; s++) {
        uint64_t t0 = probe_now_ns(), t = t0, trips = 0;
        while (t - t0 < slice || trips == 0) {
            for (int i = 0; i < PROBE_BATCH; i++) {
                p->flag = v + 1;
                uint32_t k = 0;
                while (p->flag != v + 2) {
                    if (!(++k % 4096) && (p->pinned < 0 || probe_now_ns() > p->deadline_ns)) {
                        rc = p->pinned < 0 ? -1 : -2;
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
    if (rc == 0 && p->pinned < 0)
        rc = -1;
    /* a bounded wait for the partner: one that never ran is detached, not waited for forever */
    struct timespec until;
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

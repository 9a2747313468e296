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
 * What the interrupted call was doing is left half done: the caller must never touch those queues again. */
#ifndef GUEST_FAULT_H
#define GUEST_FAULT_H

#include <setjmp.h>
#include <signal.h>
#include <string.h>

#define GF_FAULT (-1)

/* initial-exec: a plain thread-pointer access, in the hot path and in the handler (no __tls_get_addr there).
 * volatile: the handler reads it asynchronously, so the compiler must not drop the arming store when the
 * guarded code is one it can see through (a memcpy between gf_arm and gf_disarm made them a dead store). */
static __thread sigjmp_buf *volatile gf_env __attribute__((tls_model("initial-exec")));
static struct sigaction gf_previous;
static int gf_installed;

static void gf_handler(int sig, siginfo_t *si, void *uc)
{
    (void)uc;
    sigjmp_buf *env = gf_env;
    if (env && si && si->si_code > 0) {   /* raised by the kernel for an access of this thread, while armed */
        gf_env = NULL;
        siglongjmp(*env, 1);
    }
    /* not ours: back to what was there before, and let the fault happen again (or the signal be delivered) */
    sigaction(SIGBUS, &gf_previous, NULL);
    if (!si || si->si_code <= 0)
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
    if (sigaction(SIGBUS, &sa, &gf_previous) != 0)
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

#endif

/* A native backtrace for a crash, for GPU runs with no debugger on the machine (no gdb, perf or strace).
 *
 *   gcc -O1 -fPIC -shared bench/segv_trace.c -o /tmp/segv_trace.so -ldl
 *   LD_PRELOAD=/tmp/segv_trace.so python3 -X faulthandler bench/thread_stress.py ...
 *
 * Its constructor installs a SIGSEGV / SIGBUS / SIGILL / SIGFPE handler that writes to stderr the
 * signal, the faulting address, the program counter with the library (and symbol, where exported) that
 * holds it, then glibc's backtrace() of the thread, and re-raises with the default action. Python's
 * faulthandler, enabled later (pytest's, or -X faulthandler), dumps the Python stacks first and then
 * calls the handler it found: this one. Written to a copy of the stderr the process started with, since
 * pytest's output capture replaces file descriptor 2 during a test. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <ucontext.h>
#include <unistd.h>

static int out_fd = 2; /* a copy of stderr as the process started: pytest's capture later swaps fd 2 for a file */

static void say(const char *s) { (void)!write(out_fd, s, strlen(s)); }

static void where(const char *what, void *pc)
{
    char line[768];
    Dl_info info;
    if (dladdr(pc, &info) && info.dli_fname) {
        snprintf(line, sizeof line, "segv_trace: %s %p in %s+%#lx (%s+%#lx)\n", what, pc, info.dli_fname,
                 (unsigned long)((char *)pc - (char *)info.dli_fbase), info.dli_sname ? info.dli_sname : "?",
                 info.dli_saddr ? (unsigned long)((char *)pc - (char *)info.dli_saddr) : 0UL);
    } else {
        snprintf(line, sizeof line, "segv_trace: %s %p (no library)\n", what, pc);
    }
    say(line);
}

static void handler(int sig, siginfo_t *si, void *uc_)
{
    char line[256];
    void *frames[64];
    int n, i;
    ucontext_t *uc = uc_;
    snprintf(line, sizeof line, "\nsegv_trace: signal %d, fault address %p, thread %ld\n", sig, si->si_addr,
             (long)gettid());
    say(line);
#if defined(__x86_64__)
    where("pc", (void *)uc->uc_mcontext.gregs[REG_RIP]);
#endif
    n = backtrace(frames, 64);
    for (i = 0; i < n; i++)
        where("frame", frames[i]);
    signal(sig, SIG_DFL);
    raise(sig);
}

__attribute__((constructor)) static void install(void)
{
    struct sigaction sa;
    void *warm[2];
    int fd = dup(2);
    if (fd >= 0)
        out_fd = fd;
    backtrace(warm, 2); /* loads libgcc_s now, not inside the handler */
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = handler;
    sa.sa_flags = SA_SIGINFO | SA_RESETHAND;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, NULL);
    sigaction(SIGBUS, &sa, NULL);
    sigaction(SIGILL, &sa, NULL);
    sigaction(SIGFPE, &sa, NULL);
}

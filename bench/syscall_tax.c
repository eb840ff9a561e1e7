/* The host-wide tax of the agent: what a process that is NOT traced pays per syscall while
 * the agent's tracepoints are attached (every read/write/send/recv on the host enters them
 * and leaves at the PID filter).
 *
 *   syscall_tax pipe ITERATIONS     1-byte write + read on a pipe
 *   syscall_tax socket ITERATIONS   1-byte send + recv on an AF_UNIX stream socketpair
 *   syscall_tax getppid ITERATIONS  two getppid calls: a syscall no program is attached to,
 *                                   which still pays for the syscall-tracepoint entry path
 *
 * Prints the mean nanoseconds per syscall (two syscalls per iteration). */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int die(const char *what) {
    perror(what);
    return 1;
}

int main(int argc, char **argv) {
    const char *mode = argc == 3 ? argv[1] : "";
    int use_socket = strcmp(mode, "socket") == 0, use_getppid = strcmp(mode, "getppid") == 0;
    if (!use_socket && !use_getppid && strcmp(mode, "pipe") != 0) {
        fprintf(stderr, "usage: %s pipe|socket|getppid ITERATIONS\n", argv[0]);
        return 2;
    }
    long iterations = atol(argv[2]);
    int fds[2];
    if (use_socket ? socketpair(AF_UNIX, SOCK_STREAM, 0, fds) : pipe(fds))
        return die(use_socket ? "socketpair" : "pipe");
    char byte = 'x';
    double start = now_ns();
    for (long i = 0; i < iterations; i++) {
        if (use_getppid) {
            /* syscall(2), not getppid(3): nothing may cache the answer. */
            syscall(SYS_getppid);
            syscall(SYS_getppid);
        } else if (use_socket) {
            if (send(fds[0], &byte, 1, 0) != 1) return die("send");
            if (recv(fds[1], &byte, 1, 0) != 1) return die("recv");
        } else {
            if (write(fds[1], &byte, 1) != 1) return die("write");
            if (read(fds[0], &byte, 1) != 1) return die("read");
        }
    }
    double elapsed = now_ns() - start;
    printf("%.1f\n", elapsed / (2.0 * (double)iterations));
    return 0;
}

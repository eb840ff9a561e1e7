/* The host-wide tax of the agent: what a process that is NOT traced pays per syscall while
 * the agent's tracepoints are attached (every read/write/send/recv on the host enters them
 * and leaves at the PID filter).
 *
 *   syscall_tax pipe ITERATIONS     1-byte write + read on a pipe
 *   syscall_tax socket ITERATIONS   1-byte send + recv on an AF_UNIX stream socketpair
 *   syscall_tax getppid ITERATIONS  two getppid calls: a syscall no program is attached to,
 *                                   which still pays for the syscall-tracepoint entry path
 *   syscall_tax http ITERATIONS     a small HTTP/1.1 exchange on a loopback TCP connection of
 *                                   its own: the client writes a request, the server reads it
 *                                   and writes a response, the client reads it (four syscalls,
 *                                   each a message the agent captures when it traces this
 *                                   process). Waits for a line on stdin before it connects, so
 *                                   that an agent attached in between sees the connection open.
 *
 * Prints the mean nanoseconds per syscall (two, or four for http, per iteration). */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
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

static const char REQUEST[] = "POST /verify HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                               "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}";
static const char RESPONSE[] = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                "content-length: 2\r\n\r\n{}";

/* Moves exactly `length` bytes (loopback delivers a small write whole, but be exact). */
static int read_exact(int fd, char *buffer, size_t length) {
    size_t done = 0;
    while (done < length) {
        ssize_t got = read(fd, buffer + done, length - done);
        if (got <= 0) return -1;
        done += (size_t)got;
    }
    return 0;
}

static int http_exchanges(long iterations) {
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return die("waiting for the go line on stdin");
    int listener = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t length = sizeof address;
    if (listener < 0 || bind(listener, (struct sockaddr *)&address, sizeof address) ||
        listen(listener, 1) || getsockname(listener, (struct sockaddr *)&address, &length))
        return die("listener");
    int client = socket(AF_INET, SOCK_STREAM, 0);
    if (client < 0 || connect(client, (struct sockaddr *)&address, sizeof address)) return die("connect");
    int server = accept(listener, NULL, NULL);
    if (server < 0) return die("accept");
    setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(server, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    char buffer[sizeof REQUEST + sizeof RESPONSE];
    double start = now_ns();
    for (long i = 0; i < iterations; i++) {
        if (write(client, REQUEST, sizeof REQUEST - 1) != sizeof REQUEST - 1) return die("write request");
        if (read_exact(server, buffer, sizeof REQUEST - 1)) return die("read request");
        if (write(server, RESPONSE, sizeof RESPONSE - 1) != sizeof RESPONSE - 1) return die("write response");
        if (read_exact(client, buffer, sizeof RESPONSE - 1)) return die("read response");
    }
    double elapsed = now_ns() - start;
    printf("%.1f\n", elapsed / (4.0 * (double)iterations));
    return 0;
}

int main(int argc, char **argv) {
    const char *mode = argc == 3 ? argv[1] : "";
    if (strcmp(mode, "http") == 0) return http_exchanges(atol(argv[2]));
    int use_socket = strcmp(mode, "socket") == 0, use_getppid = strcmp(mode, "getppid") == 0;
    if (!use_socket && !use_getppid && strcmp(mode, "pipe") != 0) {
        fprintf(stderr, "usage: %s pipe|socket|getppid|http ITERATIONS\n", argv[0]);
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

/* The lab line's delay: a packet-level hop on a TUN device (pdd/lab/netns/delay.py builds it).
 *
 *   pdd-delay DEVICE DELAY_US JITTER_US LOSS_PPM SEED
 *
 * The line namespace routes every packet it forwards into TUN device DEVICE; each comes
 * back out of DEVICE (and on to its site) DELAY_US later, plus a uniform draw in
 * [0, JITTER_US], never before the packet ahead of it (the order is kept: a real line
 * does not reorder), unless it is dropped (LOSS_PPM in a million, seeded). The kernel's
 * TCP at both ends sees the round trip: congestion control, windows and slow start are
 * the kernel's. This kernel has no netem, so the delay is ours; in C because a hop in
 * Python caps the rate far below the lines PDD is built for.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#define RING (1u << 18) /* packets held at once: 2.4 GB at 9000 bytes, beyond any lab line's BDP */
#define MAX_PACKET 65536

struct held {
    uint64_t due_ns;
    uint32_t len;
    unsigned char *data;
};

static volatile sig_atomic_t stopping;
static void stop(int sig) { (void)sig; stopping = 1; }

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static uint64_t rng_state;
static uint64_t next_random(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s DEVICE DELAY_US JITTER_US LOSS_PPM SEED\n", argv[0]);
        return 2;
    }
    uint64_t delay_ns = strtoull(argv[2], NULL, 10) * 1000u;
    uint64_t jitter_ns = strtoull(argv[3], NULL, 10) * 1000u;
    uint64_t loss_ppm = strtoull(argv[4], NULL, 10);
    rng_state = strtoull(argv[5], NULL, 10);

    int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK);
    if (fd < 0) { perror("open /dev/net/tun"); return 1; }
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
    strncpy(ifr.ifr_name, argv[1], IFNAMSIZ - 1);
    if (ioctl(fd, TUNSETIFF, &ifr) < 0) { perror("TUNSETIFF"); return 1; }
    signal(SIGTERM, stop);
    signal(SIGINT, stop);
    prctl(PR_SET_TIMERSLACK, 1000); /* wake within a microsecond of a packet's time, not 50 */

    struct held *ring = calloc(RING, sizeof *ring);
    unsigned char *buf = malloc(MAX_PACKET);
    if (!ring || !buf) { perror("malloc"); return 1; }
    uint32_t head = 0, count = 0;
    uint64_t last_due = 0, dropped = 0, overflow = 0, forwarded = 0;
    struct pollfd pfd = {.fd = fd, .events = POLLIN};

    while (!stopping) {
        uint64_t now = now_ns();
        while (count && ring[head].due_ns <= now) {
            struct held *h = &ring[head];
            if (write(fd, h->data, h->len) < 0 && errno == EAGAIN) break; /* the kernel's queue is full: retry */
            free(h->data);
            head = (head + 1) & (RING - 1);
            count--;
            forwarded++;
        }
        struct timespec wait, *timeout = NULL;
        if (count) {
            uint64_t left = ring[head].due_ns > now ? ring[head].due_ns - now : 0;
            wait.tv_sec = (time_t)(left / 1000000000u);
            wait.tv_nsec = (long)(left % 1000000000u);
            timeout = &wait;
        }
        if (ppoll(&pfd, 1, timeout, NULL) < 0 && errno != EINTR) { perror("ppoll"); return 1; }
        if (!(pfd.revents & POLLIN)) continue;
        now = now_ns();
        for (;;) {
            ssize_t n = read(fd, buf, MAX_PACKET);
            if (n <= 0) break;
            if (loss_ppm && next_random() % 1000000u < loss_ppm) { dropped++; continue; }
            if (count == RING) { overflow++; continue; }
            uint64_t due = now + delay_ns + (jitter_ns ? next_random() % (jitter_ns + 1) : 0);
            if (due < last_due) due = last_due;
            last_due = due;
            struct held *h = &ring[(head + count) & (RING - 1)];
            h->data = malloc((size_t)n);
            if (!h->data) { overflow++; continue; }
            memcpy(h->data, buf, (size_t)n);
            h->len = (uint32_t)n;
            h->due_ns = due;
            count++;
        }
    }
    fprintf(stderr, "pdd-delay: %llu forwarded, %llu dropped, %llu over its ring\n",
            (unsigned long long)forwarded, (unsigned long long)dropped, (unsigned long long)overflow);
    return 0;
}

// Memory latency on this machine as a dependent load sees it: a pointer chase over a random
// cycle of 64-byte lines spanning SIZE KiB, in huge pages when HUGE is set (transparent huge
// pages in madvise mode). What the random-victim bench's 100 k case pays per miss on its chain
// (docs/performance.md, "What the 100 k case pays").
//
//   cc -O2 -o /tmp/pointer_chase scripts/pointer_chase.c
//   for kb in 2048 4096 8192 16384; do HUGE=1 taskset -c 1 /tmp/pointer_chase $kb; done
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

int main(int argc, char **argv) {
    const size_t huge = 2u << 20;
    if (argc != 2 || strtoull(argv[1], 0, 10) < 1 || strtoull(argv[1], 0, 10) > (64u << 20)) {
        fprintf(stderr, "usage: pointer_chase SIZE_KIB (1 to 67108864)\n");
        return 2;
    }
    size_t bytes = (size_t)strtoull(argv[1], 0, 10) << 10, n = bytes / 64;
    if (n < 2) n = 2;
    size_t span = (n * 64 + huge - 1) / huge * huge;
    uint64_t *a = aligned_alloc(huge, span);
    size_t *order = malloc(n * sizeof(size_t));
    if (!a || !order) return 1;
    if (getenv("HUGE")) madvise(a, span, MADV_HUGEPAGE);
    for (size_t i = 0; i < n; i++) order[i] = i;
    uint64_t x = 0x9E3779B97F4A7C15u;
    for (size_t i = n - 1; i > 0; i--) {  // Fisher-Yates with xorshift
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        size_t j = x % (i + 1), t = order[i];
        order[i] = order[j], order[j] = t;
    }
    for (size_t i = 0; i < n; i++) a[order[i] * 8] = order[(i + 1) % n] * 8;
    size_t p = 0, steps = 20000000;
    for (size_t i = 0; i < n; i++) p = a[p];  // warm up: one lap
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (size_t i = 0; i < steps; i++) p = a[p];
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double ns = (t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec);
    printf("%zu KiB: %.1f ns per dependent load (%zu)\n", bytes >> 10, ns / steps, p & 1);
    return 0;
}

/* What the C tests share: a fixed xorshift generator and a CHECK that counts failures. */
#ifndef EDGESPEC_TEST_UTIL_H
#define EDGESPEC_TEST_UTIL_H

#include <stdint.h>
#include <stdio.h>

static uint64_t rng = 88172645463325252ull;
static uint32_t rnd(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (uint32_t)(rng >> 32);
}
static float frnd(void) { return (rnd() >> 8) * (1.f / 16777216.f) * 2.f - 1.f; }

static int failures = 0;
#define CHECK(c, ...) do { if (!(c)) { failures++; if (failures < 20) { printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); } } } while (0)

#endif

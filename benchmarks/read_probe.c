/* A probe, not part of the runtime: one read of `n` bytes from `a` at the rate this core can read memory, for the
   bandwidth ceiling in benchmarks/decode_floor.py and benchmarks/peers.py (a thread per core calls it on a part
   each). 64-byte loads into independent sums and nothing else, so the adds hide under the loads. Two forms, since
   neither is the faster everywhere: one linear stream, the faster on a Zen 4 host in minutes when it read 52-53
   GB/s on two threads (numba's loop read 42-45), and four equal parts read side by side, a stream each, the faster
   in that host's slow minutes (21.6-25.9 GB/s against 17.5-22.4), when more streams keep more lines in flight
   (docs/performance.md#the-share-of-the-ceiling-beside-each-token). */
#include <stddef.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));

/* the floats of [a + i, a + n): the part after the last full block (tested) */
static float tail_sum(const char* a, size_t i, size_t n) {
  float total = 0.0f, value;
  for (; i + 4 <= n; i += 4) {
    memcpy(&value, a + i, 4);
    total += value;
  }
  return total;
}

static float lanes(v16 s) {
  float total = 0.0f;
  for (int lane = 0; lane < 16; lane++) total += s[lane];
  return total;
}

/* one linear stream, four sums side by side */
__attribute__((visibility("default"))) float read_one_stream(const char* a, size_t n) {
  v16 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}, x;
  size_t i = 0;
  for (; i + 256 <= n; i += 256) {
    memcpy(&x, a + i, 64); s0 += x;
    memcpy(&x, a + i + 64, 64); s1 += x;
    memcpy(&x, a + i + 128, 64); s2 += x;
    memcpy(&x, a + i + 192, 64); s3 += x;
  }
  return tail_sum(a, i, n) + lanes((s0 + s1) + (s2 + s3));
}

/* four equal parts side by side, a sum each, then what is left after them */
__attribute__((visibility("default"))) float read_four_streams(const char* a, size_t n) {
  v16 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}, x;
  const size_t part = n / 4 / 64 * 64;
  for (size_t i = 0; i < part; i += 64) {
    memcpy(&x, a + i, 64); s0 += x;
    memcpy(&x, a + part + i, 64); s1 += x;
    memcpy(&x, a + 2 * part + i, 64); s2 += x;
    memcpy(&x, a + 3 * part + i, 64); s3 += x;
  }
  return tail_sum(a, 4 * part, n) + lanes((s0 + s1) + (s2 + s3));
}

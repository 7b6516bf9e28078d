/* A probe, not part of the runtime: one read of `n` bytes from `a` at the rate this core can read memory, for the
   bandwidth ceiling in benchmarks/decode_floor.py and benchmarks/peers.py (a thread per core calls it on a part
   each). Four independent sums of 64-byte loads and nothing else: the adds hide under the loads, and the
   hardware's prefetchers follow the one linear stream. numba's loop over the same bytes read 42-45 GB/s on a
   Zen 4 host in minutes where this one read 52-53 (docs/performance.md#the-share-of-the-ceiling-beside-each-token). */
#include <stddef.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));

__attribute__((visibility("default"))) float read_bytes(const char* a, size_t n) {
  v16 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}, x;
  size_t i = 0;
  for (; i + 256 <= n; i += 256) {
    memcpy(&x, a + i, 64); s0 += x;
    memcpy(&x, a + i + 64, 64); s1 += x;
    memcpy(&x, a + i + 128, 64); s2 += x;
    memcpy(&x, a + i + 192, 64); s3 += x;
  }
  float total = 0.0f, tail;
  for (; i + 4 <= n; i += 4) { /* floats past the last 256 bytes: the sum is the floats' sum (tested) */
    memcpy(&tail, a + i, 4);
    total += tail;
  }
  const v16 s = (s0 + s1) + (s2 + s3);
  for (int lane = 0; lane < 16; lane++) total += s[lane];
  return total;
}

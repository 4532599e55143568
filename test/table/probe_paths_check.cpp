// Checks csrc/cpu/probe.h against the scalar probe of hash_primitives.h on random
// buckets (few digest values and keys, so matches and false matches are common).
// test_probe_paths.py builds it for each instruction set the probe has a path for
// (AVX-512BW, AVX2, SSE2, none): the extension itself is built for one of them.
#include <cstdio>
#include <random>
#include <vector>

#include "cpu/probe.h"

using dynamicemb::probe_bucket_scalar;
using dynamicemb::cpu::next_digest_match;
using dynamicemb::cpu::probe_bucket;

int main() {
  std::mt19937_64 rng(7);
  long checks = 0, wrong = 0;
  for (int bc : {16, 32, 48, 64, 80, 128, 256}) {
    // Three buckets; the middle one is probed, so loads past it stay in bounds.
    std::vector<uint8_t> digests(3 * bc);
    std::vector<int64_t> keys(3 * bc);
    std::vector<int16_t> tids(3 * bc);
    const int b = bc;
    for (int rep = 0; rep < 5000; ++rep) {
      for (auto& d : digests) d = static_cast<uint8_t>(rng() % 4);  // 0: empty
      for (auto& k : keys) k = static_cast<int64_t>(rng() % 8);
      for (auto& t : tids) t = static_cast<int16_t>(rng() % 2);
      const uint8_t digest = static_cast<uint8_t>(1 + rng() % 3);
      const int64_t key = static_cast<int64_t>(rng() % 8);
      const int16_t tid = static_cast<int16_t>(rng() % 2);
      const int start = 16 * static_cast<int>(rng() % (bc / 16));
      const int from = static_cast<int>(rng() % (bc + 1));

      int expected = -1;  // first match at or after an arbitrary offset
      for (int j = from; j < bc; ++j) {
        if (digests[b + j] == digest) { expected = j; break; }
      }
      wrong += next_digest_match(digests.data() + b, bc, digest, from) != expected;

      const int scalar = probe_bucket_scalar(keys.data() + b, tids.data() + b,
                                             digests.data() + b, bc, key, tid, digest, start);
      wrong += probe_bucket(keys.data() + b, tids.data() + b, digests.data() + b, bc, key,
                            tid, digest, start) != scalar;
      // As find calls it: after its first digest match from start did not hold the key.
      const int first = next_digest_match(digests.data() + b, bc, digest, start);
      if (first < 0 || keys[b + first] != key || tids[b + first] != tid) {
        wrong += probe_bucket(keys.data() + b, tids.data() + b, digests.data() + b, bc, key,
                              tid, digest, start, first) != scalar;
        ++checks;
      }
      checks += 2;
    }
  }
  std::printf("%ld checks, %ld wrong\n", checks, wrong);
  return wrong == 0 ? 0 : 1;
}

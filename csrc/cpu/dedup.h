// CPU dedup of (table id, key) pairs: an open-addressing set over one batch,
// shared by the `dedup` op (embedding.cpp) and the fused `dedup_upsert` op
// (hash_table.cpp), which hands each new pair to an inserting thread as soon as it
// is found. Both give their unique arrays n entries, as the CUDA kernels do
// (csrc/cuda/dedup.cu): the entries past the unique count are padding.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "dynamicemb/hash_primitives.h"

namespace dynamicemb {
namespace cpu {

// Where dedup writes; every array has room for n entries (U <= n). keys, tids
// and hash of a pair are final when it is published; counts and inverse only
// when the dedup returns.
struct DedupOut {
  int64_t* keys;    // (U,) unique keys, first-occurrence order
  int16_t* tids;    // (U,) their table ids
  uint64_t* hash;   // (U,) hash_key of each pair (the table's hash); may be nullptr
  int64_t* counts;  // (U,) sum of the frequencies of each pair's lookups
  int64_t* inverse;  // (n,) unique index of each lookup (-1: left out)
};

// The lookups a call takes (Python's BatchPart): those of one group of a batch
// that several groups share. groups == nullptr: every lookup.
struct BatchPart {
  const int64_t* groups = nullptr;  // (n,) the group of each lookup
  int64_t group = 0;
  bool leaves_out(int64_t i) const { return groups != nullptr && groups[i] != group; }
};

// Dedup of keys[0, n) (n < 2^31). Calls publish(u) with the number of unique
// pairs written so far, every `every` new pairs; writes of pairs [0, u) happen
// before the call. Lookups `part` leaves out get inverse -1 and count nowhere.
// Returns U. Never throws once `set` is allocated.
class DedupSet {
 public:
  explicit DedupSet(int64_t n) {
    int64_t size = 16;
    while (size < 2 * n) size <<= 1;
    mask_ = static_cast<uint64_t>(size - 1);
    set_.assign(size, Entry{0, -1});
  }

  template <class Publish>
  int64_t run(const int64_t* k, const int16_t* t, const int64_t* freq, int64_t n,
              const DedupOut& out, int64_t every, Publish&& publish,
              const BatchPart& part = BatchPart{}) {
    uint64_t ahead[kAhead];  // hashes of the next lookups, their set lines prefetched
    for (int64_t i = 0; i < std::min(n, kAhead); ++i) ahead[i] = fetch(k[i], t[i]);
    int64_t unique = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t h = ahead[i % kAhead];
      if (i + kAhead < n) ahead[i % kAhead] = fetch(k[i + kAhead], t[i + kAhead]);
      if (part.leaves_out(i)) {
        out.inverse[i] = -1;
        continue;
      }
      const int64_t c = freq ? freq[i] : 1;
      const uint32_t tag = static_cast<uint32_t>(h >> 32);
      for (uint64_t pos = h & mask_;; pos = (pos + 1) & mask_) {
        Entry& e = set_[pos];
        if (e.u < 0) {
          e = Entry{tag, static_cast<int32_t>(unique)};
          out.keys[unique] = k[i];
          out.tids[unique] = t[i];
          if (out.hash) out.hash[unique] = h;
          out.counts[unique] = c;
          out.inverse[i] = unique++;
          if (unique % every == 0) publish(unique);
          break;
        }
        // The tag rules out almost every other pair; the unique arrays decide.
        if (e.tag == tag && out.keys[e.u] == k[i] && out.tids[e.u] == t[i]) {
          out.inverse[i] = e.u;
          out.counts[e.u] += c;
          break;
        }
      }
    }
    publish(unique);
    return unique;
  }

 private:
  // 8 bytes: the top half of the pair's hash and its unique index (u < 0: empty);
  // the pair itself is read from the unique arrays when the tag matches.
  struct Entry {
    uint32_t tag;
    int32_t u;
  };
  static constexpr int64_t kAhead = 16;

  uint64_t fetch(int64_t key, int16_t tid) {
    const uint64_t h = hash_key(key, tid);
    __builtin_prefetch(&set_[h & mask_]);
    return h;
  }

  std::vector<Entry> set_;
  uint64_t mask_;
};

// Lookups grouped by unique index, a stable counting sort of `inverse`: group u
// holds ranks [starts[u], starts[u + 1]), and lookup j of group u has rank[j] in
// it, ranks ascending with j. `starts` has room for unique + 2 entries (the last
// is scratch); lookups with inverse < 0 get rank -1. One thread; never throws.
inline void group_by_unique(const int64_t* inverse, int64_t n, int64_t unique, int64_t* starts,
                            int64_t* rank) {
  std::fill(starts, starts + unique + 2, 0);
  for (int64_t j = 0; j < n; ++j) {
    if (inverse[j] >= 0) ++starts[inverse[j] + 2];
  }
  for (int64_t u = 0; u < unique; ++u) starts[u + 2] += starts[u + 1];
  // starts[u + 1] is now where group u begins; ranking moves it to where it ends,
  // which is where group u + 1 begins.
  for (int64_t j = 0; j < n; ++j) rank[j] = inverse[j] >= 0 ? starts[inverse[j] + 1]++ : -1;
}

// The unique arrays of a padded dedup past its U pairs: key 0, table 0, count 0
// (what csrc/cuda/dedup.cu writes there).
inline void pad_pairs(const DedupOut& out, int64_t unique, int64_t n) {
  std::fill(out.keys + unique, out.keys + n, 0);
  std::fill(out.tids + unique, out.tids + n, int16_t{0});
  std::fill(out.counts + unique, out.counts + n, 0);
}

// `starts` (room for n + 2 entries, [0, U + 1] written by group_by_unique) past
// U + 1, up to n: the lookup count, as the scan of zero occurrences gives on the GPU.
inline void pad_starts(int64_t* starts, int64_t unique, int64_t n) {
  std::fill(starts + unique + 1, starts + n + 1, starts[unique]);
}

// pad_pairs, and pad_starts with `starts` (nullptr: none).
inline void pad_unique(const DedupOut& out, int64_t unique, int64_t n, int64_t* starts) {
  pad_pairs(out, unique, n);
  if (starts != nullptr) pad_starts(starts, unique, n);
}

// A padded dedup's outputs for a batch the module's input check refused: no
// unique pair (all padding), every inverse -1, and with `starts` the grouping of
// no lookup: starts 0, and rank as the GPU's stable sort of n equal inverses
// leaves it (j) or, when a part is given, -1 (no lookup places a gradient).
inline void refuse_unique(const DedupOut& out, int64_t n, int64_t* starts, int64_t* rank,
                          const BatchPart& part) {
  std::fill(out.inverse, out.inverse + n, -1);
  if (starts != nullptr) {
    starts[0] = 0;
    for (int64_t j = 0; j < n; ++j) rank[j] = part.groups != nullptr ? -1 : j;
  }
  pad_unique(out, 0, n, starts);
}

}  // namespace cpu
}  // namespace dynamicemb

// CPU bulk loops of the scored hash table (OpenMP): loops over the per-key
// procedures of dynamicemb/table_view.h (find_one, upsert_one, erase_one,
// undo_one, move_one) that add the threading, the prefetch pipelines and the SIMD
// digest probe (cpu/probe.h). Python (dynamicemb/table) owns the tensors and the
// policy; these functions only walk them.
//
// `meta` is always the list [keys, scores, tids, digests, occupied, pinned]
// described in hash_primitives.h; `bc` is the bucket capacity.
#include <omp.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <memory>
#include <vector>

#include "cpu/aten.h"
#include "cpu/checks.h"
#include "cpu/dedup.h"
#include "cpu/probe.h"
#include "cpu/table.h"
#include "cpu/verbs.h"
#include "dynamicemb/hash_primitives.h"
#include "dynamicemb/table_view.h"

namespace dynamicemb {
namespace cpu {
namespace {

// Outcomes counted per call: kHit, kInserted, kEvictedAndInserted, kFailed, then
// the expired hits, at kExpiredOutcome.
constexpr int kNumCounted = kExpiredOutcome + 1;
using Counted = std::array<int64_t, kNumCounted>;

}  // namespace

at::Tensor hash_keys(const at::Tensor& keys, const at::Tensor& tids) {
  check_batch(keys, tids);
  auto out = at::empty_like(keys);
  const int64_t n = keys.numel();
  const int64_t* k = keys.data_ptr<int64_t>();
  const int16_t* t = tids.data_ptr<int16_t>();
  int64_t* o = out.data_ptr<int64_t>();
#pragma omp parallel for schedule(static) if (n >= kParallelMinKeys)
  for (int64_t i = 0; i < n; ++i) o[i] = static_cast<int64_t>(hash_key(k[i], t[i]));
  return out;
}

at::Tensor find(const std::vector<at::Tensor>& meta, int64_t bc, const at::Tensor& keys,
                const at::Tensor& tids, bool single_table) {
  check_batch(keys, tids);
  const TableView v = view_of(meta, bc);
  auto slots = at::empty_like(keys);
  const int64_t n = keys.numel();
  const int64_t* k = keys.data_ptr<int64_t>();
  const int16_t* t = tids.data_ptr<int16_t>();
  int64_t* s = slots.data_ptr<int64_t>();
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n >= kParallelMinKeys)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t lo = c * kChunk;
    find_chunk(v, k, t, [lo](int r) { return lo + r; },
               static_cast<int>(std::min(n - lo, int64_t{kChunk})), single_table, s);
  }
  return slots;
}

namespace {

// One inserting pass: its keys, table ids and given scores (n,), its options and
// where it writes.
struct UpsertArgs {
  const int64_t* keys;
  const int16_t* tids;
  const uint64_t* given;         // (n,) nullptr unless a rule needs scores per key
  const uint64_t* table_scores;  // (T,) or nullptr: the scores by table id (given_score)
  PassOptions opt;
  PassOutputs out;
};

// The keys one thread upserts, in order: position p of the feed is key
// positions(p) with hash hash(p). ready(p, most) says how many of the positions
// [p, p + most) exist (0: none past p).
struct ListFeed {  // a list known in advance
  const int64_t* position;
  const uint64_t* hashes;
  int64_t size;
  int64_t ready(int64_t p, int64_t most) const { return std::min(most, size - p); }
  int64_t at(int64_t p) const { return position[p]; }
  uint64_t hash(int64_t p) const { return hashes[p]; }
};

// How many new unique keys dedup_upsert's dedup thread finds between publications.
constexpr int64_t kPublishEvery = 32;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Unique keys published by a concurrent dedup (DedupSet::run): key p is unique
// key p. ready(p, most) waits until the dedup published p (then counts those
// published, up to most) or finished without it (0).
struct StreamFeed {
  const uint64_t* hashes;
  const std::atomic<int64_t>* published;  // count, | kDone once final
  static constexpr int64_t kDone = int64_t{1} << 62;
  int64_t ready(int64_t p, int64_t most) const {
    while (true) {
      const int64_t n = published->load(std::memory_order_acquire);
      if (p < (n & ~kDone)) return std::min(most, (n & ~kDone) - p);
      if (n & kDone) return 0;
      cpu_relax();
    }
  }
  int64_t at(int64_t p) const { return p; }
  uint64_t hash(int64_t p) const { return hashes[p]; }
};

// One thread's keys, kUpsertChunk at a time in three phases, as find_chunk: the
// digest lines (and pinned words) of the whole chunk are prefetched, then each
// key's first digest match is found and its key line prefetched, then the keys
// are settled in order with those matches as hints (checked, not trusted: an
// earlier key of the chunk may have changed the bucket). The misses of a chunk
// overlap; a pipeline that interleaved one key's prefetches with another's
// settling loads kept fewer in flight, its stalled loads filling the reorder
// buffer (19 ns a hit against find's 8). The thread owns the buckets of all its
// keys.
constexpr int kUpsertChunk = 64;

template <class Rule, class Feed>
void upsert_owned(const CpuTableView& v, const UpsertArgs& a, const Rule& rule, const Feed& feed,
                  int64_t* outcomes) {  // (kNumCounted,) +=
  KeyHome home[kUpsertChunk];
  int hints[kUpsertChunk];
  int64_t p = 0;
  for (int64_t m; (m = feed.ready(p, kUpsertChunk)) > 0; p += m) {
    for (int r = 0; r < m; ++r) {
      const KeyHome& at = home[r] = home_of(v, feed.hash(p + r));
      // every digest line of the bucket: a new key's probe reads them all (2.5 ms a
      // step against 3.7 for ~32K new keys, when only the start group's came early)
      const uint8_t* digests = v.digests + at.base;
      for (int line = 0; line < v.bc; line += 64) prefetch(digests + line);
      prefetch(digests + v.bc - 1);  // a bucket across a line boundary (bc 48, 80...)
      prefetch(v.pinned_of(at.bucket));
      prefetch(v.occupied_of(at.bucket));
    }
    for (int r = 0; r < m; ++r) {
      const KeyHome& at = home[r];
      const int j = hints[r] = next_digest_match(v.digests + at.base, v.bc, at.digest, at.start);
      // the slot the key is in, or, when no digest matches (a new key), the one an
      // insert takes: its key, score and table id are written there
      const int slot = j >= 0 ? j : first_clear_bit_from(v.occupied_of(at.bucket), v.bc, at.start);
      if (slot >= 0) {
        __builtin_prefetch(&v.keys[at.base + slot], 1);  // and its score, in the same line
        // an insert writes the table id; a hit reads it with several tables
        if (j < 0 || !a.opt.one_table) __builtin_prefetch(v.tids + at.base + slot, 1);
      }
    }
    for (int r = 0; r < m; ++r) {
      const int64_t i = feed.at(p + r);
      const uint64_t given = given_score(a.given, a.table_scores, i, a.tids[i]);
      const int8_t st = upsert_one(v, DigestProbe{}, rule, a.opt, a.out, i, a.keys[i],
                                   a.tids[i], given, home[r], hints[r]);
      ++outcomes[st == kExpiredHit ? kExpiredOutcome : st];
    }
  }
  for (int64_t q = 0; q < p; ++q) {  // the pass's pins go
    const int64_t s = a.out.slots[feed.at(q)];
    if (s < 0) continue;
    const int64_t b = v.bucket_of_slot(s);
    clear_bit(v.pinned_of(b), static_cast<int>(s - b * v.bc));
  }
}

// Each thread hashes the keys [0, n) as it partitions them: no separate pass, and
// no branch on the owner (half of them mispredicted with two threads: a quarter
// of the pass): every key is written at the thread's next place, which advances
// when the thread owns it. buckets (nullptr: none) marks keys to skip (kNoBucket:
// slot -1, kFailed, counted nowhere); its other entries are not read (each key's
// hash decides).
template <class Rule>
void upsert_all(const CpuTableView& v, const UpsertArgs& a, const Rule& rule, int64_t n,
                const int32_t* buckets, int64_t* outcomes) {  // += (kNumCounted,)
  const int threads = n >= kParallelMinKeys ? omp_get_max_threads() : 1;
  std::vector<Counted> counted(threads);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    const int nt = omp_get_num_threads();
    // this thread's keys, in input order, and their hashes: room for its share and
    // more, doubled in the rare case it owns more (a well-predicted branch)
    std::vector<int64_t> mine(n / nt + 64);
    std::vector<uint64_t> hashes(mine.size());
    int64_t count = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (buckets != nullptr && buckets[i] == kNoBucket) {
        if (t == 0) {
          a.out.slots[i] = -1;
          a.out.status[i] = kFailed;
          if (a.out.prev_scores) a.out.prev_scores[i] = kNoPrevScore;
        }
        continue;
      }
      const uint64_t h = hash_key(a.keys[i], a.tids[i]);
      if (count == static_cast<int64_t>(mine.size())) {
        mine.resize(2 * mine.size());
        hashes.resize(mine.size());
      }
      mine[count] = i;
      hashes[count] = h;
      count += v.owner_of(bucket_of(h, v.num_buckets), nt) == t;
    }
    counted[t].fill(0);
    const ListFeed feed{mine.data(), hashes.data(), count};
    upsert_owned(v, a, rule, feed, counted[t].data());
  }
  for (const auto& c : counted) {
    for (int o = 0; o < kNumCounted; ++o) outcomes[o] += c[o];
  }
}

// Calls f(score rule object) for the rule code: 0 clock (score = now), 1 count
// (LFU, adds given), 2 given (CUSTOMIZED), 3 count then clock (LRU_LFU: adds
// given, stamps now).
template <class F>
void with_rule(int64_t rule, uint64_t now, F&& f) {
  switch (rule) {
    case 0: f(ClockScore{now}); break;
    case 1: f(CountScore{}); break;
    case 2: f(GivenScore{}); break;
    case 3: f(CountThenClockScore{now}); break;
    default: TORCH_CHECK(false, "unknown score rule ", rule);
  }
}

template <class T>
T* optional_ptr(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 ? reinterpret_cast<T*>(t.data_ptr()) : nullptr;
}


// The per-key outputs of an inserting pass (each with room for n keys) and
// the pass's options; keys, table ids and given scores are set by the caller.
UpsertArgs pass_args(int64_t n, bool evicts, bool one_table, at::Tensor& slots,
                     at::Tensor& status, const c10::optional<at::Tensor>& prev_scores,
                     at::Tensor& ev_keys, at::Tensor& ev_tids, at::Tensor& ev_scores) {
  check_tensor(slots, at::kLong, "slots");
  check_tensor(status, at::kChar, "status");
  check_tensor(ev_keys, at::kLong, "ev_keys");
  check_tensor(ev_tids, at::kShort, "ev_tids");
  check_tensor(ev_scores, at::kLong, "ev_scores");
  TORCH_CHECK(slots.numel() >= n && status.numel() >= n && ev_keys.numel() >= n &&
                  ev_tids.numel() >= n && ev_scores.numel() >= n,
              "pass outputs need room for ", n, " keys");
  UpsertArgs a;
  a.keys = nullptr;
  a.tids = nullptr;
  a.given = nullptr;
  a.table_scores = nullptr;
  a.opt = PassOptions{evicts, one_table, 0};
  a.out.slots = slots.data_ptr<int64_t>();
  a.out.status = status.data_ptr<int8_t>();
  a.out.prev_scores = nullptr;
  if (prev_scores.has_value()) {
    check_tensor(*prev_scores, at::kLong, "prev_scores");
    TORCH_CHECK(prev_scores->numel() == 0 || prev_scores->numel() >= n,
                "prev_scores needs room for ", n, " keys");
    a.out.prev_scores = optional_ptr<uint64_t>(*prev_scores);
  }
  a.out.ev_keys = ev_keys.data_ptr<int64_t>();
  a.out.ev_tids = ev_tids.data_ptr<int16_t>();
  a.out.ev_scores = reinterpret_cast<uint64_t*>(ev_scores.data_ptr<int64_t>());
  return a;
}

// The table's size in memory ((1,) int64), which an inserting call advances.
int64_t* size_of(at::Tensor& size) {
  check_tensor(size, at::kLong, "size");
  TORCH_CHECK(size.numel() == 1, "size must hold one count");
  return size.data_ptr<int64_t>();
}

// A call's outcome counts in memory: (5,) hits, inserted, evicted, failed, expired.
void check_outcomes(const at::Tensor& outcomes) {
  check_tensor(outcomes, at::kLong, "outcomes");
  TORCH_CHECK(outcomes.numel() == kNumCounted,
              "outcomes must hold 5 counts (hits, inserted, evicted, failed, expired hits)");
}

// Adds what a call counted to its outcomes.
void add_outcomes(at::Tensor& outcomes, const Counted& counted) {
  int64_t* out = outcomes.data_ptr<int64_t>();
  for (int o = 0; o < kNumCounted; ++o) out[o] += counted[o];
}

// The per-table scores of a call (CUSTOMIZED, read by table id): (T,) int64.
const uint64_t* table_scores_of(const c10::optional<at::Tensor>& table_scores) {
  if (!table_scores.has_value()) return nullptr;
  check_tensor(*table_scores, at::kLong, "table_scores");
  TORCH_CHECK(table_scores->dim() == 1 && table_scores->numel() > 0,
              "table_scores holds one score per table: (T,) int64");
  return reinterpret_cast<const uint64_t*>(table_scores->data_ptr<int64_t>());
}


}  // namespace

namespace {

// A dedup of keys (n,) into `out` and an inserting pass over its unique keys (a:
// keys and tids are out's; given, when a rule reads scores, out's counts) in one
// call: one thread dedups, a second upserts the pairs (owning every bucket); while
// the second finishes, the first groups the lookups by unique index into starts
// and rank (group_by_unique; none when starts is nullptr). With the clock rule
// (no given scores) the dedup publishes each new pair as it goes, so the two
// overlap; a rule that reads the counts waits for the dedup to end. Each thread
// then pads what it wrote past U (pad_pairs and the pass's outputs; pad_starts).
// With one thread they run one after the other. Returns U; the pass adds its
// outcomes to `counted`.
template <class Rule>
int64_t dedup_and_upsert(const CpuTableView& v, const UpsertArgs& a, const Rule& rule,
                         const int64_t* keys, const int16_t* tids, const int64_t* freq,
                         int64_t n, const BatchPart& part, DedupOut out, int64_t* starts,
                         int64_t* rank, int64_t* counted) {
  // Everything that allocates happens here: nothing in the parallel region throws.
  std::unique_ptr<uint64_t[]> uhash(new uint64_t[n + 1]);  // written before it is read
  out.hash = uhash.get();
  DedupSet set(n);
  std::atomic<int64_t> published{0};
  const StreamFeed feed{uhash.get(), &published};
  const int64_t every = a.given == nullptr ? kPublishEvery : n + 1;
  int64_t unique = 0;
  const int threads = n >= kParallelMinKeys ? std::min(2, omp_get_max_threads()) : 1;
#pragma omp parallel num_threads(threads)
  {
    const bool alone = omp_get_num_threads() < 2;
    if (omp_get_thread_num() == 0) {
      unique = set.run(
          keys, tids, freq, n, out, every,
          [&](int64_t u) { published.store(u, std::memory_order_release); }, part);
      published.store(unique | StreamFeed::kDone, std::memory_order_release);
      if (starts != nullptr) {
        group_by_unique(out.inverse, n, unique, starts, rank);
        pad_starts(starts, unique, n);
      }
    }
    if (alone || omp_get_thread_num() == 1) {
      upsert_owned(v, a, rule, feed, counted);
      // the dedup has finished (the feed said so): its count is final
      const int64_t u = published.load(std::memory_order_acquire) & ~StreamFeed::kDone;
      pad_pairs(out, u, n);
      std::fill(a.out.slots + u, a.out.slots + n, -1);
      std::fill(a.out.status + u, a.out.status + n, int8_t{kFailed});
      std::fill(a.out.prev_scores + u, a.out.prev_scores + n, kNoPrevScore);
    }
  }
  return unique;
}

void check_dedup_batch(const at::Tensor& keys, const at::Tensor& tids,
                       const c10::optional<at::Tensor>& frequencies, const int64_t** freq) {
  check_batch(keys, tids);
  const int64_t n = keys.numel();
  TORCH_CHECK(n < (int64_t{1} << 31), "dedup takes fewer than 2^31 keys, got ", n);
  *freq = nullptr;
  if (frequencies.has_value()) {
    check_tensor(*frequencies, at::kLong, "frequencies");
    TORCH_CHECK(frequencies->numel() == n, "one frequency per key");
    *freq = frequencies->data_ptr<int64_t>();
  }
}

}  // namespace

// `dedup` and an inserting pass over its unique keys, overlapped
// (dedup_and_upsert), as HashTableKernels.dedup_upsert: the unique arrays and the
// pass outputs have N entries, those past the U pairs padding (key 0, table 0,
// count 0, slot -1, kFailed, counted nowhere; starts past U hold the lookup
// count). A full bucket evicts (`evicts`) or fails its key. Unless the error word refuses
// the batch (then nothing changes: no pair, inverse -1), `time` (2,) (the table's
// clock and step) advances by one and the pass runs at time[now_index] with
// `rule`: a count rule scores by the dedup's counts, the given rule by
// table_scores (T,), each table's score read by table id; with a ttl (0: none) a
// hit on a row last accessed before time[now_index] - ttl is an insert. `outcomes`
// (5,) += its outcome counts and expired hits, `size` (1,) += its inserts into
// empty slots. part_groups (N,) (None: every lookup) and part_group: the lookups
// of other groups are left out.
// Returns (unique_keys, unique_tids, inverse, counts, starts (N + 1,), rank, slots,
// status, prev_scores, ev_keys, ev_tids, ev_scores).
DedupUpserted dedup_upsert(
    const std::vector<at::Tensor>& meta, int64_t bc, const at::Tensor& keys,
    const at::Tensor& tids, const c10::optional<at::Tensor>& frequencies, int64_t rule,
    at::Tensor& time, int64_t now_index, bool evicts, bool one_table,
    const c10::optional<at::Tensor>& error, at::Tensor& outcomes, at::Tensor& size,
    const c10::optional<at::Tensor>& part_groups, int64_t part_group,
    const c10::optional<at::Tensor>& table_scores, int64_t ttl) {
  const int64_t* freq;
  check_dedup_batch(keys, tids, frequencies, &freq);
  const int64_t n = keys.numel();
  check_tensor(time, at::kLong, "time");
  TORCH_CHECK(time.numel() == 2 && (now_index == 0 || now_index == 1),
              "time holds a clock and a step; now_index picks one");
  TORCH_CHECK(0 <= rule && rule <= 3, "unknown score rule ", rule);
  TORCH_CHECK(ttl >= 0, "ttl must be >= 0 (0: none), got ", ttl);
  check_outcomes(outcomes);
  int64_t* table_size = size_of(size);
  const uint64_t* per_table = table_scores_of(table_scores);
  TORCH_CHECK(rule != 2 || per_table != nullptr,
              "the given-score rule of a deduplicating call reads each table's score: "
              "table_scores");
  const CpuTableView v = view_of(meta, bc);
  const BatchPart part = batch_part(part_groups, part_group, n);
  const bool refused = is_refused(error);
  const auto i64 = keys.options();
  auto ukeys = at::empty({n}, i64);
  auto utids = at::empty({n}, tids.options());
  auto counts = at::empty({n}, i64);
  auto inverse = at::empty({n}, i64);
  auto starts = at::empty({n + 2}, i64);
  auto rank = at::empty({n}, i64);
  auto slots = at::empty({n}, i64);
  auto status = at::empty({n}, i64.dtype(at::kChar));
  auto prev = at::empty({n}, i64);
  auto ev_keys = at::empty({n}, i64);
  auto ev_tids = at::empty({n}, tids.options());
  auto ev_scores = at::empty({n}, i64);
  UpsertArgs a = pass_args(n, evicts, one_table, slots, status, prev, ev_keys, ev_tids,
                           ev_scores);
  const DedupOut out{ukeys.data_ptr<int64_t>(), utids.data_ptr<int16_t>(), nullptr,
                     counts.data_ptr<int64_t>(), inverse.data_ptr<int64_t>()};
  int64_t unique = 0;
  if (refused) {
    refuse_unique(out, n, starts.data_ptr<int64_t>(), rank.data_ptr<int64_t>(), part);
  } else {
    int64_t* clock_and_step = time.data_ptr<int64_t>();
    ++clock_and_step[0];
    ++clock_and_step[1];
    a.keys = out.keys;
    a.tids = out.tids;
    const bool counts_rule = rule == 1 || rule == 3;
    a.given = counts_rule ? reinterpret_cast<const uint64_t*>(out.counts) : nullptr;
    a.table_scores = rule == 2 ? per_table : nullptr;
    const uint64_t now = static_cast<uint64_t>(clock_and_step[now_index]);
    a.opt.expired_before = expired_before(now, static_cast<uint64_t>(ttl));
    Counted counted{};
    with_rule(rule, now, [&](const auto& score) {
      unique = dedup_and_upsert(v, a, score, keys.data_ptr<int64_t>(), tids.data_ptr<int16_t>(),
                                freq, n, part, out, starts.data_ptr<int64_t>(),
                                rank.data_ptr<int64_t>(), counted.data());
    });
    add_outcomes(outcomes, counted);
    *table_size += counted[kInserted];
  }
  if (refused) {
    std::fill(a.out.slots, a.out.slots + n, -1);
    std::fill(a.out.status, a.out.status + n, int8_t{kFailed});
    std::fill(a.out.prev_scores, a.out.prev_scores + n, kNoPrevScore);
  }
  return {ukeys, utids, inverse, counts, starts.narrow(0, 0, n + 1), rank, slots, status, prev,
          ev_keys, ev_tids, ev_scores};
}

// One inserting pass over keys (n,), as HashTableKernels.upsert: the keys of one
// bucket in input order (a repeated key hits its first occurrence's slot). With
// buckets (n,) int32, a key of bucket kNoBucket is skipped (slot -1, kFailed,
// counted nowhere). The call's time (the clock rule's score) is time[now_index]
// (time (2,) int64, a table's clock and step), 0 without `time`; with ttl (0:
// none) a hit on a row expired at that time is an insert. outcomes (5,) += the
// outcome counts, size (1,) += the inserts into empty slots. Returns (slots,
// status, prev_scores, ev_keys, ev_tids, ev_scores), (n,) each.
PassResult upsert(const std::vector<at::Tensor>& meta, int64_t bc, const at::Tensor& keys,
                  const at::Tensor& tids, const c10::optional<at::Tensor>& scores, int64_t rule,
                  bool evicts, bool one_table, const c10::optional<at::Tensor>& buckets,
                  at::Tensor& outcomes, at::Tensor& size, const c10::optional<at::Tensor>& time,
                  int64_t now_index, int64_t ttl) {
  check_batch(keys, tids);
  TORCH_CHECK(ttl >= 0, "ttl must be >= 0 (0: none), got ", ttl);
  int64_t now = 0;
  if (time.has_value()) {
    check_tensor(*time, at::kLong, "time");
    TORCH_CHECK(time->numel() == 2 && (now_index == 0 || now_index == 1),
                "time holds a clock and a step; now_index picks one");
    now = time->data_ptr<int64_t>()[now_index];
  }
  const int64_t n = keys.numel();
  const int32_t* skip = nullptr;
  if (buckets.has_value()) {
    check_tensor(*buckets, at::kInt, "buckets");
    TORCH_CHECK(buckets->numel() == n, "buckets are given for every key of a pass: (", n,
                ",) int32");
    skip = buckets->data_ptr<int32_t>();
  }
  check_outcomes(outcomes);
  int64_t* table_size = size_of(size);
  const CpuTableView v = view_of(meta, bc);
  const auto i64 = keys.options();
  auto slots = at::empty({n}, i64);
  auto status = at::empty({n}, i64.dtype(at::kChar));
  auto prev = at::empty({n}, i64);
  auto ev_keys = at::empty({n}, i64);
  auto ev_tids = at::empty({n}, tids.options());
  auto ev_scores = at::empty({n}, i64);
  UpsertArgs a = pass_args(n, evicts, one_table, slots, status, prev, ev_keys, ev_tids,
                           ev_scores);
  a.keys = keys.data_ptr<int64_t>();
  a.tids = tids.data_ptr<int16_t>();
  if (scores.has_value()) {
    check_tensor(*scores, at::kLong, "scores");
    TORCH_CHECK(scores->numel() == n, "one score per key");
    a.given = optional_ptr<const uint64_t>(*scores);
  }
  TORCH_CHECK(rule == 0 || scores.has_value(), "the count and given-score rules need scores");
  a.opt.expired_before = expired_before(static_cast<uint64_t>(now), static_cast<uint64_t>(ttl));
  Counted counted{};
  with_rule(rule, static_cast<uint64_t>(now), [&](const auto& score) {
    upsert_all(v, a, score, n, skip, counted.data());
  });
  add_outcomes(outcomes, counted);
  *table_size += counted[kInserted];
  return {slots, status, prev, ev_keys, ev_tids, ev_scores};
}

// Reverts an inserting call whose positions were processed (ERROR mode), newest
// first: restores victims, empties fresh slots, restores hit scores.
void undo_upsert(const std::vector<at::Tensor>& meta, int64_t bc, const at::Tensor& slots,
                 const at::Tensor& status, const at::Tensor& prev_scores,
                 const at::Tensor& ev_keys, const at::Tensor& ev_tids,
                 const at::Tensor& ev_scores) {
  const TableView v = view_of(meta, bc);
  const PassRecord r{slots.data_ptr<int64_t>(),
                     status.data_ptr<int8_t>(),
                     reinterpret_cast<const uint64_t*>(prev_scores.data_ptr<int64_t>()),
                     ev_keys.data_ptr<int64_t>(),
                     ev_tids.data_ptr<int16_t>(),
                     reinterpret_cast<const uint64_t*>(ev_scores.data_ptr<int64_t>())};
  for (int64_t i = slots.numel() - 1; i >= 0; --i) undo_one<PlainBits>(v, r, i);
}

// Moves every slot of `old_meta` to the table `new_meta` with twice the buckets,
// keeping its offset in the bucket. Returns the new slot of each old slot (-1: empty).
at::Tensor grow(const std::vector<at::Tensor>& old_meta,
                const std::vector<at::Tensor>& new_meta, int64_t bc) {
  const TableView o = view_of(old_meta, bc);
  const TableView n = view_of(new_meta, bc);
  TORCH_CHECK(n.num_buckets == 2 * o.num_buckets, "grow doubles the bucket count");
  auto moved = at::full({o.num_buckets * bc}, -1, old_meta[0].options());
  int64_t* m = moved.data_ptr<int64_t>();
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < o.num_buckets; ++b) {
    // An old bucket's slots go to bucket b or b + old buckets: a thread owns both.
    for (int j = 0; j < o.bc; ++j) {
      const int64_t to = move_one<PlainBits>(o, n, b, j);
      if (to >= 0) m[b * bc + j] = to;
    }
  }
  return moved;
}

namespace {

// Erases keys[i] (i < n) where status is nullptr or status[i] == which; erased[i]
// (nullptr: not written) = whether it was there. Buckets are split across threads
// as in upsert, so a key given twice is erased by its first occurrence. Returns
// how many were there.
int64_t erase_each(const CpuTableView& v, const int64_t* k, const int16_t* t, int64_t n,
                   const int8_t* status, int64_t which, bool* erased) {
  const int threads = n >= kParallelMinKeys ? omp_get_max_threads() : 1;
  int64_t found = 0;
#pragma omp parallel num_threads(threads) reduction(+ : found)
  {
    const int me = omp_get_thread_num();
    const int nt = omp_get_num_threads();
    for (int64_t i = 0; i < n; ++i) {
      if (status != nullptr && status[i] != which) continue;
      const KeyHome home = home_of(v, hash_key(k[i], t[i]));
      if (v.owner_of(home.bucket, nt) != me) continue;
      if (erase_one<PlainBits>(v, DigestProbe{}, home, k[i], t[i])) {
        ++found;
        if (erased != nullptr) erased[i] = true;
      }
    }
  }
  return found;
}

}  // namespace

// Erases each key once; returns a bool per key (a key given twice is erased by
// its first occurrence).
at::Tensor erase(const std::vector<at::Tensor>& meta, int64_t bc, const at::Tensor& keys,
                 const at::Tensor& tids) {
  check_batch(keys, tids);
  const CpuTableView v = view_of(meta, bc);
  const int64_t n = keys.numel();
  auto erased = at::zeros({n}, keys.options().dtype(at::kBool));
  erase_each(v, keys.data_ptr<int64_t>(), tids.data_ptr<int16_t>(), n, nullptr, 0,
             erased.data_ptr<bool>());
  return erased;
}

// Erases keys[i] wherever status[i] == which (the victims of a call, by their
// status in it: each a different key), as HashTableKernels.erase_where; erased
// (1,) += and size (1,) -= the keys found.
void erase_where(const std::vector<at::Tensor>& meta, int64_t bc, const at::Tensor& keys,
                 const at::Tensor& tids, const at::Tensor& status, int64_t which,
                 at::Tensor& erased, at::Tensor& size) {
  check_batch(keys, tids);
  const int64_t n = keys.numel();
  check_tensor(status, at::kChar, "status");
  TORCH_CHECK(status.numel() >= n, "one status per key");
  check_tensor(erased, at::kLong, "erased");
  TORCH_CHECK(erased.numel() == 1, "erased must hold one count");
  int64_t* table_size = size_of(size);
  const CpuTableView v = view_of(meta, bc);
  const int64_t found = erase_each(v, keys.data_ptr<int64_t>(), tids.data_ptr<int16_t>(), n,
                                   status.data_ptr<int8_t>(), which, nullptr);
  erased.data_ptr<int64_t>()[0] += found;
  *table_size -= found;
}

// TTL sweep: empties every slot whose last access (score & time_mask) is before
// `before`; returns (capacity,) bool, the slots it emptied. A thread owns a range of
// buckets, so plain bit stores suffice; only occupied slots' scores are read (the
// set bits of each occupancy word).
at::Tensor expire(const std::vector<at::Tensor>& meta, int64_t bc, int64_t time_mask,
                  int64_t before) {
  TORCH_CHECK(before >= 0, "before must be >= 0");
  const TableView v = view_of(meta, bc);
  auto expired = at::zeros({v.num_buckets * bc}, meta[0].options().dtype(at::kBool));
  bool* e = expired.data_ptr<bool>();
  const uint64_t mask = static_cast<uint64_t>(time_mask);
  const uint64_t until = static_cast<uint64_t>(before);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < v.num_buckets; ++b) {
    for (int w = 0; w < v.words; ++w) {
      for (uint64_t bits = v.occupied_of(b)[w]; bits != 0; bits &= bits - 1) {
        const int j = w * 64 + count_trailing_zeros(bits);
        if (expire_one<PlainBits>(v, b, j, mask, until)) e[b * bc + j] = true;
      }
    }
  }
  return expired;
}

// Occupied slots in [start, end), ascending.
at::Tensor occupied_slots(const std::vector<at::Tensor>& meta, int64_t bc, int64_t start,
                          int64_t end) {
  const TableView v = view_of(meta, bc);
  std::vector<int64_t> found;
  for (int64_t s = start; s < end; ++s) {
    if (test_bit(v.occupied_of(s / v.bc), static_cast<int>(s % v.bc))) found.push_back(s);
  }
  auto out = at::empty({static_cast<int64_t>(found.size())}, meta[0].options());
  std::copy(found.begin(), found.end(), out.data_ptr<int64_t>());
  return out;
}

}  // namespace cpu
}  // namespace dynamicemb

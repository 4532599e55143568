// The scored hash table's per-key procedures, written once for every backend.
//
// TableView is one table as raw pointers (the layout of hash_primitives.h). The
// functions below are what happens to one key or one slot: find_one, upsert_one,
// erase_one, undo_one and move_one (growth). The CPU loops (csrc/cpu/hash_table.cpp)
// and the CUDA kernels (csrc/cuda/hash_table.cu) are loops over them that add only
// threading, prefetching and a faster probe. NVRTC compiles this header: it
// includes nothing but other headers of this folder.
//
// Per-key contract of an inserting pass. Every backend meets it key by key;
// upsert_one is it, written for a caller that owns the key's bucket:
//   - input order: the keys of one bucket are settled in input order. Which keys
//     go together is the loop's choice: the CPU gives each thread a contiguous
//     range of buckets and walks all keys in input order; the CUDA kernel sorts a
//     pass's keys stably by bucket and gives each bucket's run to one warp, with
//     its own warp-cooperative upsert (the GPU's bulk algorithm) that gives the
//     same result, key by key.
//   - hit (key present): kHit; score = rule.on_hit(old, given), the old score
//     recorded in prev_scores (when recorded); the slot is pinned.
//   - hit on an expired row (rule.time_of(old) below the pass's expired_before,
//     a ttl's): the key takes its own slot as a new key: kInserted, score =
//     rule.on_insert(given), the old score recorded in prev_scores; pinned. The
//     procedure returns kExpiredHit (counted apart from inserts into empty slots).
//   - insert: the first empty slot at or after the key's start offset, wrapping
//     around the bucket; kInserted; key, table id, digest written, score =
//     rule.on_insert(given), kNoPrevScore in prev_scores; occupied and pinned.
//   - full bucket, the pass evicts, some slot unpinned: the unpinned slot with the
//     minimum score, ties to the lowest offset, is the victim; its key, table id
//     and score are reported in ev_*; it is taken as an insert would be:
//     kEvictedAndInserted.
//   - otherwise kFailed, slot -1 (kNoPrevScore in prev_scores), nothing changes.
// Pinning keeps a slot returned for an earlier key of the call from being taken by
// a later one; the loop unpins at the end of the pass. A pass over a table that
// may grow does not evict: its caller grows and runs the call again. Value rows
// are not touched here.
#pragma once

#include "dynamicemb/hash_primitives.h"

namespace dynamicemb {

// One table: the `meta` tensors of the Python side, as pointers.
struct TableView {
  SlotField<int64_t> keys;     // (capacity,) stride 2: column 0 of the (capacity, 2) slots
  SlotField<uint64_t> scores;  // (capacity,) stride 2: column 1, beside its key
  int16_t* tids;               // (capacity,)
  uint8_t* digests;            // (capacity,) 0 = empty
  uint64_t* occupied;          // (num_buckets, words)
  uint64_t* pinned;            // (num_buckets, words)
  int64_t num_buckets;         // a power of two
  int bc;                      // slots per bucket
  int words;                   // words_per_bucket(bc)

  DEMB_HD uint64_t* occupied_of(int64_t b) const { return occupied + b * words; }
  DEMB_HD uint64_t* pinned_of(int64_t b) const { return pinned + b * words; }
};

// slot_words is the (capacity, 2) int64 array of keys and scores.
DEMB_HD TableView table_view(int64_t* slot_words, int16_t* tids, uint8_t* digests,
                             uint64_t* occupied, uint64_t* pinned, int64_t num_buckets, int bc) {
  TableView v;
  v.keys = SlotField<int64_t>{slot_words};
  v.scores = SlotField<uint64_t>{reinterpret_cast<uint64_t*>(slot_words) + 1};
  v.tids = tids;
  v.digests = digests;
  v.occupied = occupied;
  v.pinned = pinned;
  v.num_buckets = num_buckets;
  v.bc = bc;
  v.words = words_per_bucket(bc);
  return v;
}

// Where a key lives, from its hash: its bucket, the bucket's first slot, the
// digest it is stored under and the offset its probes and inserts start from.
struct KeyHome {
  int64_t bucket;
  int64_t base;  // bucket * bc
  int start;
  uint8_t digest;
};

DEMB_HD KeyHome home_of(const TableView& v, uint64_t h) {
  KeyHome home;
  home.bucket = bucket_of(h, v.num_buckets);
  home.base = home.bucket * v.bc;
  home.start = start_offset(h, v.bc);
  home.digest = digest_of(h);
  return home;
}

// Does slot s hold (key, tid)? With one logical table every id is 0: the key
// decides alone.
DEMB_HD bool holds_key(const TableView& v, int64_t s, int64_t key, int16_t tid,
                       bool one_table) {
  return v.keys[s] == key && (one_table || v.tids[s] == tid);
}

// Probe policies: the offset of (key, tid) in one bucket, or -1, exactly as
// probe_bucket_scalar finds it. A backend passes a faster one (the CPU's SIMD
// digest match, csrc/cpu/probe.h; the CUDA thread's 16-digest loads,
// csrc/cuda/common.cuh); the procedures' logic does not change with it.
//   probe(keys, tids, digests, bc, key, tid, digest, start, first)
// takes the bucket's arrays (indexable by offset; tids nullptr with one logical
// table) and `first`: the first digest match at or after `start` that the caller
// found on the bucket as it is now, whose slot did not hold the key (-1: none
// up to the end), or kFirstUnknown. A probe may skip what `first` rules out.
// A probe that upsert_one takes also chooses a full bucket's victim, exactly as
// choose_victim does:
//   probe.victim(scores, pinned, bc)
constexpr int kFirstUnknown = -2;

struct ScalarProbe {
  template <class Keys>
  DEMB_HD int operator()(const Keys& keys, const int16_t* tids, const uint8_t* digests, int bc,
                         int64_t key, int16_t tid, uint8_t digest, int start,
                         int /*first*/) const {
    return probe_bucket_scalar(keys, tids, digests, bc, key, tid, digest, start);
  }
  DEMB_HD int victim(const SlotField<uint64_t>& scores, const uint64_t* pinned, int bc) const {
    return choose_victim(scores, pinned, bc);
  }
};

// Bit policies: how a procedure sets and clears occupied and pinned bits. Plain
// stores where one thread owns the bucket (the default); atomics where threads
// share a bucket's words (csrc/cuda/common.cuh).
struct PlainBits {
  DEMB_HD static void set(uint64_t* bits, int j) { set_bit(bits, j); }
  DEMB_HD static void clear(uint64_t* bits, int j) { clear_bit(bits, j); }
};

// Offset of (key, tid) in its home bucket, or -1. `first` as for a probe: a
// read-only caller that scanned the digests ahead (to prefetch the key's slot)
// passes its first match, which is checked first.
template <class Probe>
DEMB_HD int find_one(const TableView& v, const Probe& probe, const KeyHome& home, int64_t key,
                     int16_t tid, bool one_table, int first = kFirstUnknown) {
  if (first >= 0 && holds_key(v, home.base + first, key, tid, one_table)) return first;
  return probe(v.keys + home.base, one_table ? nullptr : v.tids + home.base,
               v.digests + home.base, v.bc, key, tid, home.digest, home.start, first);
}

// How an inserting pass treats table ids and a full bucket.
struct PassOptions {
  bool evicts;     // a full bucket evicts (the rule evicts, the table cannot grow)
  bool one_table;  // every table id is 0: the key decides alone
  uint64_t expired_before;  // a hit on a row last accessed before this is an insert
                            // (expired_before(now, ttl); 0: nothing expires)
};

// Where an inserting pass writes, at the key's position i (each (n,)).
struct PassOutputs {
  int64_t* slots;         // slot of the key, -1: failed
  int8_t* status;         // InsertStatus
  uint64_t* prev_scores;  // score before a hit; nullptr: not recorded
  int64_t* ev_keys;       // the victim's key, table id and score (kEvictedAndInserted)
  int16_t* ev_tids;
  uint64_t* ev_scores;
};

// What a pass wrote (PassOutputs, read-only), which undo_one reads back.
struct PassRecord {
  const int64_t* slots;
  const int8_t* status;
  const uint64_t* prev_scores;
  const int64_t* ev_keys;
  const int16_t* ev_tids;
  const uint64_t* ev_scores;
};

// One key of an inserting pass (see the contract above); the caller owns the
// key's bucket. `hint` is an offset that held the key a moment ago (or -1):
// checked, never trusted, since an earlier key of the pass may have changed the
// bucket since. Returns the key's status (also written to out), or kExpiredHit.
template <class Probe, class Rule>
DEMB_HD_INLINED int8_t upsert_one(const TableView& v, const Probe& probe, const Rule& rule,
                          const PassOptions& opt, const PassOutputs& out, int64_t i,
                          int64_t key, int16_t tid, uint64_t given, const KeyHome& home,
                          int hint) {
  const int64_t base = home.base;
  int j = hint;
  if (j < 0 || v.digests[base + j] != home.digest ||
      !holds_key(v, base + j, key, tid, opt.one_table)) {
    j = find_one(v, probe, home, key, tid, opt.one_table);
  }
  uint64_t* pinned = v.pinned_of(home.bucket);
  if (j >= 0) {
    uint64_t& score = v.scores[base + j];
    const uint64_t old = score;
    if (out.prev_scores) out.prev_scores[i] = old;
    const bool expired = rule.time_of(old) < opt.expired_before;
    score = expired ? rule.on_insert(given) : rule.on_hit(old, given);
    set_bit(pinned, j);
    out.slots[i] = base + j;
    out.status[i] = expired ? kInserted : kHit;
    return expired ? kExpiredHit : kHit;
  }
  uint64_t* occupied = v.occupied_of(home.bucket);
  int8_t outcome = kInserted;
  j = first_clear_bit_from(occupied, v.bc, home.start);
  if (j < 0) {
    j = opt.evicts ? probe.victim(v.scores + base, pinned, v.bc) : -1;
    if (j < 0) {
      out.slots[i] = -1;
      out.status[i] = kFailed;
      if (out.prev_scores) out.prev_scores[i] = kNoPrevScore;
      return kFailed;
    }
    out.ev_keys[i] = v.keys[base + j];
    out.ev_tids[i] = v.tids[base + j];
    out.ev_scores[i] = v.scores[base + j];
    outcome = kEvictedAndInserted;
  }
  if (out.prev_scores) out.prev_scores[i] = kNoPrevScore;
  set_bit(occupied, j);
  set_bit(pinned, j);
  v.keys[base + j] = key;
  v.tids[base + j] = tid;
  v.digests[base + j] = home.digest;
  v.scores[base + j] = rule.on_insert(given);
  out.slots[i] = base + j;
  out.status[i] = outcome;
  return outcome;
}

// Erases (key, tid) from its home bucket; returns whether it was there. The
// slot becomes empty (occupied bit and digest cleared).
template <class Bits, class Probe>
DEMB_HD bool erase_one(const TableView& v, const Probe& probe, const KeyHome& home, int64_t key,
                       int16_t tid) {
  const int j = find_one(v, probe, home, key, tid, false);
  if (j < 0) return false;
  Bits::clear(v.occupied_of(home.bucket), j);
  v.digests[home.base + j] = kEmptyDigest;
  return true;
}

// Reverts key i of an inserting pass (ERROR mode, aborts): a hit, or a hit on an
// expired row (kInserted with a previous score recorded), gets its old score back,
// a fresh slot is emptied, an evicted victim is put back. Each of
// these rewrites every field the call changed in the slot from the record of the
// slot's state before key i, so the oldest key of a call that touched a slot
// restores it alone: a caller walks the keys newest first (the CPU), or undoes
// only the oldest key of each slot, all slots at once (the GPU, with atomic bits).
template <class Bits>
DEMB_HD void undo_one(const TableView& v, const PassRecord& r, int64_t i) {
  const int64_t s = r.slots[i];
  if (s < 0) return;
  const int64_t b = s / v.bc;
  const int j = static_cast<int>(s - b * v.bc);
  const bool expired_hit = r.status[i] == kInserted && r.prev_scores != nullptr &&
                           r.prev_scores[i] != kNoPrevScore;
  if (r.status[i] == kHit || expired_hit) {
    v.scores[s] = r.prev_scores[i];
  } else if (r.status[i] == kInserted) {
    Bits::clear(v.occupied_of(b), j);
    v.digests[s] = kEmptyDigest;
  } else if (r.status[i] == kEvictedAndInserted) {
    v.keys[s] = r.ev_keys[i];
    v.tids[s] = r.ev_tids[i];
    v.digests[s] = digest_of(hash_key(r.ev_keys[i], r.ev_tids[i]));
    v.scores[s] = r.ev_scores[i];
  }
}

// TTL sweep: empties slot j of bucket b when it holds a key whose last access,
// `score & time_mask` (the whole score for clock and step scores, the low word of
// LRU_LFU's), is before `before`. Returns whether it did; the key, table id and
// score stay readable in the slot until another key takes it.
template <class Bits>
DEMB_HD bool expire_one(const TableView& v, int64_t b, int j, uint64_t time_mask,
                        uint64_t before) {
  if (!test_bit(v.occupied_of(b), j)) return false;
  const int64_t s = b * v.bc + j;
  if ((v.scores[s] & time_mask) >= before) return false;
  Bits::clear(v.occupied_of(b), j);
  v.digests[s] = kEmptyDigest;
  return true;
}

// Growth: moves slot j of old bucket b to `to`, a table with twice the buckets,
// at the same offset of its new bucket (b or b + from.num_buckets, so no two old
// buckets meet and no bucket overflows); key, table id, digest, score and pin go
// along. Returns the new slot, or -1 when the old slot is empty.
template <class Bits>
DEMB_HD int64_t move_one(const TableView& from, const TableView& to, int64_t b, int j) {
  if (!test_bit(from.occupied_of(b), j)) return -1;
  const int64_t s = b * from.bc + j;
  const int64_t nb = bucket_of(hash_key(from.keys[s], from.tids[s]), to.num_buckets);
  const int64_t t = nb * to.bc + j;
  to.keys[t] = from.keys[s];
  to.tids[t] = from.tids[s];
  to.digests[t] = from.digests[s];
  to.scores[t] = from.scores[s];
  Bits::set(to.occupied_of(nb), j);
  if (test_bit(from.pinned_of(b), j)) Bits::set(to.pinned_of(nb), j);
  return t;
}

}  // namespace dynamicemb

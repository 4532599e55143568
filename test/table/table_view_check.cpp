// Checks the per-key procedures of csrc/dynamicemb/table_view.h on their own, without
// torch: twin tables take the same random calls, one probed by the header's default
// ScalarProbe and one by the CPU's SIMD DigestProbe (cpu/probe.h); they must stay
// byte-identical and agree with a map of what the table holds (the per-key contract:
// hit, insert, evict, fail; erase; undo; growth by move_one). Built and run by
// test_table_view.py; prints "N checks, M wrong".
#include <algorithm>
#include <cstdio>
#include <map>
#include <random>
#include <utility>
#include <vector>

#include "cpu/probe.h"
#include "dynamicemb/table_view.h"

using namespace dynamicemb;

namespace {

using Pair = std::pair<int64_t, int16_t>;  // (key, table id)

struct Table {  // owns what a TableView points at
  int64_t num_buckets;
  int bc;
  std::vector<int64_t> slot_words;  // (capacity, 2)
  std::vector<int16_t> tids;
  std::vector<uint8_t> digests;
  std::vector<uint64_t> occupied, pinned;

  Table(int64_t nb, int bc_)
      : num_buckets(nb), bc(bc_), slot_words(2 * nb * bc_), tids(nb * bc_), digests(nb * bc_),
        occupied(nb * words_per_bucket(bc_)), pinned(nb * words_per_bucket(bc_)) {}
  TableView view() {
    return table_view(slot_words.data(), tids.data(), digests.data(), occupied.data(),
                      pinned.data(), num_buckets, bc);
  }
  bool operator==(const Table& o) const {
    return slot_words == o.slot_words && tids == o.tids && digests == o.digests &&
           occupied == o.occupied && pinned == o.pinned;
  }
};

long checks = 0, wrong = 0;

void expect(bool ok, const char* what) {
  ++checks;
  if (!ok && ++wrong <= 10) std::printf("wrong: %s\n", what);
}

// Slot of (key, tid) in t per the probe, or -1.
template <class Probe>
int64_t find(Table& t, const Probe& probe, Pair p) {
  TableView v = t.view();
  const KeyHome home = home_of(v, hash_key(p.first, p.second));
  const int j = find_one(v, probe, home, p.first, p.second, false);
  return j < 0 ? -1 : home.base + j;
}

struct Pass {  // one inserting pass's outputs
  std::vector<int64_t> slots, ev_keys;
  std::vector<int8_t> status;
  std::vector<uint64_t> prev_scores, ev_scores;
  std::vector<int16_t> ev_tids;
  explicit Pass(size_t n)
      : slots(n), ev_keys(n), status(n), prev_scores(n), ev_scores(n), ev_tids(n) {}
  PassOutputs out() {
    return PassOutputs{slots.data(),  status.data(),  prev_scores.data(),
                       ev_keys.data(), ev_tids.data(), ev_scores.data()};
  }
  PassRecord record() const {
    return PassRecord{slots.data(),  status.data(),  prev_scores.data(),
                      ev_keys.data(), ev_tids.data(), ev_scores.data()};
  }
};

// One pass of upsert_one over `keys` in order; its slots stay pinned.
template <class Probe>
Pass upsert_pass(Table& t, const Probe& probe, const std::vector<Pair>& keys, uint64_t now,
                 const PassOptions& opt) {
  TableView v = t.view();
  Pass pass(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    const KeyHome home = home_of(v, hash_key(keys[i].first, keys[i].second));
    const int8_t st = upsert_one(v, probe, ClockScore{now}, opt, pass.out(),
                                 static_cast<int64_t>(i), keys[i].first, keys[i].second, 0,
                                 home, -1);
    expect(st == pass.status[i], "upsert_one returns the status it writes");
  }
  return pass;
}

void unpin_all(Table& t) { std::fill(t.pinned.begin(), t.pinned.end(), 0); }

// Twice the buckets, every slot moved by move_one.
Table grown(Table& t) {
  Table n(2 * t.num_buckets, t.bc);
  TableView from = t.view(), to = n.view();
  for (int64_t b = 0; b < t.num_buckets; ++b) {
    for (int j = 0; j < t.bc; ++j) {
      const int64_t s = move_one<PlainBits>(from, to, b, j);
      expect((s >= 0) == test_bit(from.occupied_of(b), j), "move_one moves occupied slots");
      if (s < 0) continue;
      expect(s % t.bc == j, "move_one keeps the offset");
      expect(test_bit(to.pinned_of(s / t.bc), j) == test_bit(from.pinned_of(b), j),
             "move_one keeps the pin");
    }
  }
  return n;
}

void run(int bc, std::mt19937_64& rng) {
  Table scalar(2, bc), simd(2, bc);
  std::map<Pair, uint64_t> model;  // what the table holds, with scores
  const ScalarProbe sp;
  const cpu::DigestProbe dp;
  const auto random_pair = [&] {
    return Pair{static_cast<int64_t>(rng() % (6 * bc)), static_cast<int16_t>(rng() % 2)};
  };
  for (uint64_t step = 1; step <= 3000; ++step) {
    const int op = static_cast<int>(rng() % 10);
    if (op < 6) {  // an inserting pass
      std::vector<Pair> keys(1 + rng() % 24);
      for (auto& k : keys) k = random_pair();
      const PassOptions opt{rng() % 4 != 0, false, 0};
      const Table before = scalar;
      const auto model_before = model;
      Pass a = upsert_pass(scalar, sp, keys, step, opt);
      Pass b = upsert_pass(simd, dp, keys, step, opt);
      expect(a.slots == b.slots && a.status == b.status && a.ev_keys == b.ev_keys,
             "the two probes give the same pass");
      for (size_t i = 0; i < keys.size(); ++i) {
        const int8_t st = a.status[i];
        const bool had = model.count(keys[i]) > 0;
        if (st == kHit) {
          expect(had, "a hit is a key the table held");
          model[keys[i]] = step;
        } else if (st == kInserted || st == kEvictedAndInserted) {
          expect(!had, "an insert is a key the table did not hold");
          if (st == kEvictedAndInserted) {
            const Pair victim{a.ev_keys[i], a.ev_tids[i]};
            expect(opt.evicts && model.count(victim) && model[victim] == a.ev_scores[i],
                   "the victim was held with its score");
            model.erase(victim);
          }
          model[keys[i]] = step;
        } else {
          expect(st == kFailed && !had && a.slots[i] == -1,
                 "a key that fails was not held and has no slot");
        }
        if (st != kFailed) {
          expect(find(scalar, sp, keys[i]) == a.slots[i], "find_one finds the pass's slot");
        }
      }
      if (rng() % 4 == 0) {  // undo the pass, newest first: what was held is back
        unpin_all(scalar);
        unpin_all(simd);
        const PassRecord r = a.record();
        TableView va = scalar.view(), vb = simd.view();
        for (int64_t i = static_cast<int64_t>(keys.size()) - 1; i >= 0; --i) {
          undo_one<PlainBits>(va, r, i);
          undo_one<PlainBits>(vb, r, i);
        }
        expect(scalar.occupied == before.occupied && scalar.digests == before.digests,
               "undo restores occupancy and digests");
        model = model_before;
      } else {
        if (scalar.num_buckets < 16 && rng() % 3 == 0) {  // grown, with the pass's pins
          scalar = grown(scalar);
          simd = grown(simd);
        }
        unpin_all(scalar);
        unpin_all(simd);
      }
    } else if (op < 8) {  // erase one key
      const Pair p = random_pair();
      TableView va = scalar.view(), vb = simd.view();
      const KeyHome home = home_of(va, hash_key(p.first, p.second));
      const bool ea = erase_one<PlainBits>(va, sp, home, p.first, p.second);
      const bool eb = erase_one<PlainBits>(vb, dp, home_of(vb, hash_key(p.first, p.second)),
                                           p.first, p.second);
      expect(ea == eb && ea == (model.count(p) > 0), "erase_one erases what was held");
      model.erase(p);
    } else {  // find every pair the model holds, and one random pair
      for (const auto& kv : model) {
        const int64_t s = find(scalar, sp, kv.first);
        expect(s >= 0 && scalar.view().scores[s] == kv.second, "a held key is found");
      }
      const Pair p = random_pair();
      const int64_t s = find(scalar, sp, p);
      expect((s >= 0) == (model.count(p) > 0) && s == find(simd, dp, p),
             "find_one agrees with the model and the other probe");
    }
    expect(scalar == simd, "the twin tables hold the same bytes");
  }
}

}  // namespace

int main() {
  std::mt19937_64 rng(11);
  for (int bc : {16, 32, 64, 128}) run(bc, rng);
  std::printf("%ld checks, %ld wrong\n", checks, wrong);
  return wrong == 0 ? 0 : 1;
}

"""A short tour of dynamicemb's hash table, printed as it runs (`make demo`)."""

import torch

from dynamicemb import DynamicEmbScoreStrategy, ScoredHashTable


def main() -> None:
    torch.manual_seed(0)
    print("== ScoredHashTable: raw int64 ids, rows created on first sight ==")
    table = ScoredHashTable(
        num_tables=2, capacity=256, bucket_capacity=16, max_capacity=1024, value_dim=4,
        score_strategy=DynamicEmbScoreStrategy.LRU,
    )
    print(table)
    ids = torch.tensor([3, -7, 2**62 + 1, 3, 123456789012])
    tables = torch.tensor([0, 0, 1, 1, 0])
    result = table.find_or_insert(ids, tables)
    print(f"find_or_insert ids={ids.tolist()} tables={tables.tolist()}")
    print(f"  slots={result.slots.tolist()} inserted={result.inserted.tolist()}")
    print("  (3 in table 0 and 3 in table 1 are different keys)")

    print("\n== Growth keeps every key, value and score ==")
    keys = torch.arange(600, dtype=torch.int64) * 7919
    table.insert_or_assign(keys, torch.randn(600, 4))
    print(f"inserted 600 more keys: size={table.size()} capacity={table.capacity()} "
          f"growths={table.stats.growths}")
    assert bool((table.find(keys) >= 0).all())

    print("\n== Eviction at max capacity: LRU, only inside a full bucket ==")
    lru = ScoredHashTable(capacity=32, bucket_capacity=16, value_dim=1)
    for step in range(4):
        batch = torch.arange(step * 16, step * 16 + 16, dtype=torch.int64)
        out = lru.find_or_insert(batch)
        print(f"batch {step}: size={lru.size()} evicted {out.evicted.keys.numel()} keys "
              f"(oldest scores {sorted(set(out.evicted.scores.tolist()))})")

    print("\n== An embedding step on the table's rows (SGD, lr=0.5) ==")
    emb = ScoredHashTable(capacity=1024, value_dim=8)
    batch = torch.tensor([10, 20, 10, 99], dtype=torch.int64)
    slots = emb.find_or_insert(batch).slots
    new = emb.export_batch().slots
    emb.values[new] = torch.randn(new.numel(), 8) * 0.1  # the initializer
    rows = emb.values[slots].requires_grad_()
    loss = rows.pow(2).sum()
    loss.backward()
    emb.values.index_add_(0, slots, rows.grad, alpha=-0.5)
    after = emb.values[emb.find(batch)].pow(2).sum()
    print(f"loss before {loss.item():.4f} -> after one step {after.item():.4f}")
    print(f"stats: {emb.stats}")


if __name__ == "__main__":
    main()

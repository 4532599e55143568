"""A short tour of dynamicemb's API, printed as it runs (`python examples/tour.py`).

1. The scored hash table: raw int64 ids, growth, LRU eviction.
2. BatchedDynamicEmbeddingTables training a tiny click model: user and item ids
   are raw 64-bit values, rows are created on first sight, the optimizer is fused
   into backward.
"""

import time

import torch

from dynamicemb import (
    BatchedDynamicEmbeddingTables,
    DynamicEmbInitializerArgs,
    DynamicEmbOptimType,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
    ScoredHashTable,
)


def hash_table_tour() -> None:
    print("== ScoredHashTable: raw int64 ids, rows created on first sight ==")
    table = ScoredHashTable(
        num_tables=2, capacity=256, bucket_capacity=16, max_capacity=1024, value_dim=4,
        score_strategy=DynamicEmbScoreStrategy.LRU,
    )
    ids = torch.tensor([3, -7, 2**62 + 1, 3, 123456789012])
    tables = torch.tensor([0, 0, 1, 1, 0])
    result = table.find_or_insert(ids, tables)
    print(f"find_or_insert ids={ids.tolist()} tables={tables.tolist()}")
    print(f"  slots={result.slots.tolist()} inserted={result.inserted.tolist()}")
    keys = torch.arange(600, dtype=torch.int64) * 7919
    table.insert_or_assign(keys, torch.randn(600, 4))
    print(f"600 more keys: size={table.size()} capacity={table.capacity()} "
          f"(grew {table.stats.growths}x, nothing lost: "
          f"{bool((table.find(keys) >= 0).all())})")
    lru = ScoredHashTable(capacity=32, bucket_capacity=16, value_dim=1)
    for step in range(3):
        out = lru.find_or_insert(torch.arange(step * 16, step * 16 + 16, dtype=torch.int64))
        print(f"LRU batch {step}: size={lru.size()}/32, evicted {out.evicted.keys.numel()} "
              f"keys with scores {sorted(set(out.evicted.scores.tolist()))}")


def synthetic_clicks(batch: int, gen: torch.Generator):
    """Users and items with raw 64-bit ids; a click iff their hidden tastes agree."""
    users = torch.randint(0, 2000, (batch,), generator=gen)
    items = torch.randint(0, 500, (batch,), generator=gen)
    clicks = ((users % 7) < (items % 7) + 1).float()
    # Spread ids over the whole int64 range: no pre-indexing needed.
    return users * 0x5851F42D4C957F2D, -(items + 10**15), clicks  # wraps: any int64 is fine


def training_tour() -> None:
    print("\n== BatchedDynamicEmbeddingTables: a click model with raw int64 ids ==")
    dim = 16
    init = DynamicEmbInitializerArgs(mode="normal", std_dev=0.05)
    tables = BatchedDynamicEmbeddingTables(
        [DynamicEmbTableOptions(dim=dim, max_capacity=1 << 12, initializer_args=init),
         DynamicEmbTableOptions(dim=dim, max_capacity=1 << 10, initializer_args=init)],
        table_names=["user", "item"],
        optimizer=DynamicEmbOptimType.ADAM, learning_rate=0.02,
    )
    head = torch.nn.Sequential(torch.nn.Linear(2 * dim, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    dense_opt = torch.optim.Adam(head.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    batch = 512
    offsets = torch.arange(0, 2 * batch + 1)  # 2 features x batch, one id per bag
    start = time.perf_counter()
    for step in range(1, 201):
        users, items, clicks = synthetic_clicks(batch, gen)
        pooled = tables(torch.cat([users, items]), offsets)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(head(pooled).squeeze(1), clicks)
        dense_opt.zero_grad()
        loss.backward()  # also updates the embedding rows (fused Adam)
        dense_opt.step()
        if step in (1, 50, 100, 200):
            print(f"step {step:3d}: loss {loss.item():.4f}  rows user={tables.table_size('user')} "
                  f"item={tables.table_size('item')}")
    print(f"200 steps in {time.perf_counter() - start:.2f}s")
    tables.eval()
    with torch.no_grad():
        users, items, clicks = synthetic_clicks(4096, gen)
        accuracy = ((head(tables(torch.cat([users, items]), torch.arange(0, 8193))).squeeze(1) > 0)
                    .float() == clicks).float().mean()
        unseen = tables(torch.tensor([424242, -424242]), torch.tensor([0, 1, 2]))
    print(f"eval accuracy {accuracy:.3f}; unseen ids read zeros in eval: "
          f"{bool((unseen == 0).all())}; tables unchanged by eval: rows user="
          f"{tables.table_size('user')}")


def main() -> None:
    torch.manual_seed(0)
    hash_table_tour()
    training_tour()


if __name__ == "__main__":
    main()

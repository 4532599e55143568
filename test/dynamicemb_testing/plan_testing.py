"""Plan files for the tests: HugeCTR's documented examples and small factories."""

import json
from typing import Any, Dict, List, Optional

# The 26 Criteo table sizes of HugeCTR's embedding-collection notebook.
CRITEO_SIZES = [203931, 18598, 14092, 7012, 18977, 4, 6385, 1245, 49, 186213, 71328, 67288, 11,
                2168, 7338, 61, 4, 932, 15, 204515, 141526, 199433, 60919, 9137, 71, 34]

# HugeCTR's first 2-GPU example: all five lookups data parallel (older shard keys).
EXAMPLE_ALL_DP = """
[
  [{"local_embedding_list": [0, 1, 2, 3, 4],
    "global_embedding_list": [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]],
    "num_sharding": 1, "sharding_id": 0, "table_placement_strategy": "dp"}],
  [{"local_embedding_list": [0, 1, 2, 3, 4],
    "global_embedding_list": [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]],
    "num_sharding": 1, "sharding_id": 0, "table_placement_strategy": "dp"}]
]
"""

# HugeCTR's second 2-GPU example: lookups 0, 2 on GPU 0 and 1, 3 on GPU 1; lookup 4 dp.
EXAMPLE_MIXED = """
[
  [{"local_embedding_list": [0, 2], "global_embedding_list": [[0, 2], [1, 3]],
    "table_placement_strategy": "mp"},
   {"local_embedding_list": [4], "global_embedding_list": [[4], [4]],
    "table_placement_strategy": "dp"}],
  [{"local_embedding_list": [1, 3], "global_embedding_list": [[0, 2], [1, 3]],
    "table_placement_strategy": "mp"},
   {"local_embedding_list": [4], "global_embedding_list": [[4], [4]],
    "table_placement_strategy": "dp"}]
]
"""


def example(text: str) -> List[Any]:
    """A fresh parsed copy of an example, to mutate."""
    return json.loads(text)


def make_group(lookups: List[int], strategy: str = "mp", shard_id: Optional[int] = None,
               shard_count: Optional[int] = None, spelling: str = "new") -> Dict[str, Any]:
    """One GPU's group object as HugeCTR writes it (no global list)."""
    keys = {"new": ("shard_id", "shards_count"), "old": ("sharding_id", "num_sharding")}
    id_key, count_key = keys[spelling]
    group: Dict[str, Any] = {"local_embedding_list": list(lookups), "table_placement_strategy": strategy}
    if shard_id is not None:
        group[id_key] = shard_id
    if shard_count is not None:
        group[count_key] = shard_count
    return group

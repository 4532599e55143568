"""Makes this folder's helpers (``ckpt_testing``, ``ckpt_workers``) and the spawning
helper of test/shard (``dist_utils``) importable."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "shard"))

"""The storage layer: where value rows live (device tier, host store)."""

from dynamicemb.storage.tiered import TierMetrics, TieredStorage

__all__ = ["TierMetrics", "TieredStorage"]

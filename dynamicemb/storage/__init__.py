"""The storage layer: where value rows live (device tier, host store)."""

from dynamicemb.storage.tiered import HOST_ROW_BIT, TierMetrics, TieredStorage

__all__ = ["HOST_ROW_BIT", "TierMetrics", "TieredStorage"]

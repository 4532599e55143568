"""Upstream dynamicemb's module path of its admission names (re-exported)."""

from dynamicemb.embedding.admission import Counter
from dynamicemb.options import FrequencyAdmissionStrategy, KVCounter

__all__ = ["Counter", "FrequencyAdmissionStrategy", "KVCounter"]

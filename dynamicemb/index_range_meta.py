"""Upstream dynamicemb's module path ``dynamicemb.index_range_meta``: an internal module of
upstream's, refused on import with what to use instead (``docs/MIGRATING.md``)."""

from dynamicemb._upstream import refuse_module

refuse_module(__name__)

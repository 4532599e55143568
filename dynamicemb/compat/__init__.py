"""The code behind upstream's module paths ``dynamicemb.<name>``, which re-export
``dynamicemb.compat.<name>``; nothing imported here (some submodules import TorchRec)."""

__all__ = []

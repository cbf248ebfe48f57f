"""Adapters from vmemkv to other stacks.

* :mod:`integrations.transformers_cache`: ``VmemkvCache``, a Hugging Face transformers ``Cache``
  for ``model.generate()`` backed by a :class:`vmemkv.KVCacheManager`.

Nothing is imported here, so ``import integrations`` does not pull in transformers.
"""

"""Adapters from vmemkv to other stacks.

* :mod:`vmemkv.integrations.transformers_cache`: ``VmemkvCache``, a Hugging Face transformers ``Cache``
  for ``model.generate()`` backed by a :class:`vmemkv.KVCacheManager`.

Nothing is imported here, so ``import vmemkv.integrations`` does not pull in transformers.
"""

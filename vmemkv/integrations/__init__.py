"""Adapters from vmemkv to other stacks.

* :mod:`vmemkv.integrations.transformers_cache`: ``VmemkvCache``, a Hugging Face transformers ``Cache``
  for ``model.generate()`` backed by a :class:`vmemkv.KVCacheManager` (with ``manager_for`` and
  ``cache_kwarg``); its parts live in ``transformers_layer``, ``transformers_rows``,
  ``transformers_prefix`` and ``transformers_model``.

Nothing is imported here, so ``import vmemkv.integrations`` does not pull in transformers.
"""

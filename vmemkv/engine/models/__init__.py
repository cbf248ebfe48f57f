"""Models: the built-in model zoo (``zoo``), fetching weights (``hub``) and what vmemkv reads from
a Hugging Face model (``hf_support``: KV shapes, attention windows and chunks, what is supported),
and linear layers on packed weights for the CPU (``packed_linear``, over ``panel_linear``'s native kernel).
"""

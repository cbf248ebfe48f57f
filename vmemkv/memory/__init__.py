"""Virtual memory for KV caches: the page-mapping backends (``vmm``: memfd + mmap on CPU, the CUDA
VMM driver API on GPU), the byte layout of a request's KV in its slot (``layout``) and the slots
whose virtual tensors a request's blocks are mapped into (``slots``).
"""

"""Serving: the OpenAI-compatible HTTP server (``server``), its request and response models, the
async engine that drives the step loop for it, and the KV-event publisher.
"""

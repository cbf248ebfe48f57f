"""The engine's step: configuration, requests and their sequences, the scheduler, the runner and
the model forward, sampling and postprocessing, detokenizing, metrics, and the offline ``LLM``.
"""

"""The serving engine: continuous batching of Hugging Face models with the KV cache in vmemkv."""

from vmemkv._lazy import lazy_exports

_EXPORTS = {"EngineConfig": "vmemkv.engine.core.config",
            **dict.fromkeys(("KVManager", "KVViews", "make_kv_manager"), "vmemkv.engine.core.kv_manager"),
            "LLM": "vmemkv.engine.core.llm",
            "LLMEngine": "vmemkv.engine.core.llm_engine",
            **dict.fromkeys(("CompletionOutput", "RequestOutput"), "vmemkv.engine.core.outputs"),
            "SamplingParams": "vmemkv.engine.core.sampling_params"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

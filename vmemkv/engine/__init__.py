"""The serving engine: continuous batching of Hugging Face models with the KV cache in vmemkv."""

from vmemkv.engine.core.config import EngineConfig
from vmemkv.engine.core.kv_manager import KVManager, KVViews, make_kv_manager
from vmemkv.engine.core.llm import LLM
from vmemkv.engine.core.llm_engine import LLMEngine
from vmemkv.engine.core.outputs import CompletionOutput, RequestOutput
from vmemkv.engine.core.sampling_params import SamplingParams

__all__ = ["EngineConfig", "LLM", "LLMEngine", "CompletionOutput", "RequestOutput", "SamplingParams",
           "KVManager", "KVViews", "make_kv_manager"]

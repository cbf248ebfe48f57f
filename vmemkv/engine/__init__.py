"""The serving engine: continuous batching of Hugging Face models with the KV cache in vmemkv."""

from .config import EngineConfig
from .llm import LLM
from .llm_engine import LLMEngine
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["EngineConfig", "LLM", "LLMEngine", "CompletionOutput", "RequestOutput", "SamplingParams"]

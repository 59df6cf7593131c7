"""loraplex: serve many LoRA adapters over one base LLM, mixed in one batch."""

from loraplex.client.adapter_mix import AdapterMix
from loraplex.client.output import ClassificationOutput, EmbeddingOutput, RequestOutput
from loraplex.config import EngineConfig, ModelConfig
from loraplex.engine.pooling.params import PoolingParams
from loraplex.engine.request import SamplingParams
from loraplex.engine.sampling.structured.params import StructuredOutputsParams
from loraplex.errors import (
    AdapterAlreadyLoaded,
    AdapterContentChanged,
    AdapterError,
    AdapterMemoryBudgetExceeded,
    AdapterNotFound,
    AdapterOverflow,
    AdapterPinLimit,
    AdapterRankTooLarge,
    AdapterShapeMismatch,
    ForbiddenAdapterPath,
    InvalidAdapter,
    InvalidAdapterName,
    LoraplexError,
    ModelError,
    RequestError,
    UnknownAdapter,
    UnsupportedAdapter,
)


def __getattr__(name: str):  # noqa: ANN202 - lazy: importing loraplex must not import the engine
    if name == "LLM":
        from loraplex.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = [
    "StructuredOutputsParams", "AdapterMix", "PoolingParams", "EmbeddingOutput", "ClassificationOutput",
    "LLM", "EngineConfig", "ModelConfig", "SamplingParams", "RequestOutput", "LoraplexError", "AdapterError",
    "AdapterNotFound", "InvalidAdapter", "AdapterRankTooLarge", "UnsupportedAdapter", "AdapterShapeMismatch",
    "AdapterAlreadyLoaded", "UnknownAdapter", "AdapterContentChanged", "AdapterMemoryBudgetExceeded", "ModelError",
    "RequestError", "AdapterOverflow", "ForbiddenAdapterPath", "InvalidAdapterName", "AdapterPinLimit",
]

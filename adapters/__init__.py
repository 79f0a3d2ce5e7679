"""Engine adapters, one module per wire protocol. Adding an engine is one module and one entry here."""

from __future__ import annotations

from adapters.base import EngineAdapter, HandoffCtx, HandoffMode, PrefillVerdict, ProbeInfo
from adapters.openai import OpenAIAdapter
from adapters.sglang import SGLangAdapter
from adapters.vllm import VLLMAdapter
from common.workers import Engine

ADAPTERS: dict[Engine, EngineAdapter] = {
    Engine.SGLANG: SGLangAdapter(),
    Engine.VLLM: VLLMAdapter(),
    Engine.OPENAI: OpenAIAdapter(),
}

__all__ = ["ADAPTERS", "EngineAdapter", "HandoffCtx", "HandoffMode", "PrefillVerdict", "ProbeInfo"]

"""Structured output with xgrammar (see README.md in this folder)."""
from __future__ import annotations

from aioengine.structured.bitmask import GrammarBitmask
from aioengine.structured.compiler import GrammarCompileCache, GrammarCompileError, choice_grammar
from aioengine.structured.manager import StructuredOutputManager, structured_state
from aioengine.structured.request_state import StructuredRequestState, StructuredStats

__all__ = [
    "GrammarBitmask",
    "GrammarCompileCache",
    "GrammarCompileError",
    "StructuredOutputManager",
    "StructuredRequestState",
    "StructuredStats",
    "choice_grammar",
    "structured_state",
]

"""Structured outputs with xgrammar: JSON schemas, JSON objects, regular expressions,
choices, EBNF/Lark grammars and ATEM tool calls (`grammars.py`), compiled once and applied
per sequence as a token mask in the batched sampler (`manager.py`)."""

from .manager import CompiledStructure, GrammarState, StructuredOutputManager, unpack_bitmask

__all__ = ["CompiledStructure", "GrammarState", "StructuredOutputManager", "unpack_bitmask"]

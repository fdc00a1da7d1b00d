"""Structured output: grammars (JSON schema, regex, choice, EBNF) enforced on the logits.

``params.py`` is what a caller asks for (torch- and xgrammar-free); ``grammar.py``
compiles it with xgrammar and tracks each request's matcher; ``bitmask.py`` fills the
allowed-token bitmask on the host while the device runs the forward and applies it to
the logits before sampling (docs/structured.md).
"""
from mempath.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]

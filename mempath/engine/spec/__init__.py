"""Speculative decoding: a draft (a second model, or n-gram lookup in the prompt) proposes
tokens, the target scores them in one forward, rejection sampling keeps the target's
distribution (docs/speculative.md)."""

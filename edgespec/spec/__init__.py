"""Speculation: the draft tree, one-batch verification, acceptance math, the speculative step."""

"""Decoding: sampling, the request loop, output and detokenization, events, chat templates."""

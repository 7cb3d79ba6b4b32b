"""The benchmark harness: plain decoding and each configuration side by side, same prompts."""

"""The OpenAI-compatible local server."""

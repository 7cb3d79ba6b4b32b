"""The only package that imports llama_cpp: models, contexts, the memory probe and the in-process peer."""

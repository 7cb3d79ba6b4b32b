"""Model files: the GGUF reader and validator, vocabularies, the store and its manifests."""

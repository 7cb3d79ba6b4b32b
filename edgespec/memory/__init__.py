"""Memory: footprints from GGUF metadata, the machine, the plan search, budgets, file-backed weights, RSS."""

"""Reading and writing models: sources (Hub folders, GGUF), checkpoints, shards, layer offload,
tokenizers, text data, run folders and their manifests. Knows formats, not methods."""

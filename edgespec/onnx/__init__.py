"""ONNX drafters: GGUF models converted exactly to onnxruntime graphs (blocks, graph, convert,
session). onnxruntime's execution providers put a drafter where llama.cpp does not reach."""

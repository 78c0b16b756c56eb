"""The HTTP service: FastAPI routes -> validation -> tokenization -> batcher -> ONNX Runtime
workers -> postprocessing. Needs neither torch nor transformers."""

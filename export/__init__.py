"""Export BigBird models to plain ONNX (block-sparse attention as Gather/MatMul) and run
them with ONNX Runtime. `export.runtime` and `export.manifest` need no torch."""

"""Export BigBird models to plain ONNX (block-sparse attention as Gather/MatMul) and run
them with ONNX Runtime. `longdoc.export.runtime` and `longdoc.export.manifest` need no torch."""

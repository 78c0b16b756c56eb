"""Export long-document models (BigBird, BigBird-Pegasus, BERT2BERT, Longformer, LED, ModernBERT; one record each in
`longdoc.export.registry`) to plain ONNX (block-sparse and windowed attention as Gather/MatMul) and run
them with ONNX Runtime. `longdoc.export.runtime` and `longdoc.export.manifest` need no torch."""

"""The head draft (infra/drafts/head.py) served: `draft` is its runner and propose stage, `lean`
its math over fused, optionally quantized weights."""

"""The drafts. `protocol` is the one Draft protocol the engine drives; `specs` turns a draft
spec into a model; `factory` gives a draft model its runner and Draft; `k_policy` decides how
many tokens to draft. One
sub-package or module per family: `layer` (a causal LM of its own), `head/`, `suffix/` (the
suffix index, and its hybrid with a head) and `trees/` (EAGLE-2 dynamic trees).
Imports sampling/ and model/, never engine/ or api/."""

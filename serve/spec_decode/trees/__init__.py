"""Dynamic draft trees (EAGLE-2): `dynamic` builds and verifies trees, pure over tensors;
`stages` runs one speculative step with a tree."""

"""Model execution. `runner` runs a forward over new tokens against a preallocated KV cache
(the lean Llama-family forward and the generic Hugging Face one); `factory` picks a model's
runner; `families` says what each decoder family adds to Llama; `linear` holds the weight
formats (dense, int8, int4); `batch_forward` is one forward over several sequences;
`cuda_graphs` replays fixed shapes on a GPU; `native_*` and `native/` are the CPU forward in
C++. Imports nothing else of serve/."""

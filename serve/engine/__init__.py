"""One target's speculative decoding engine. `core` holds the engine and its options;
`scheduler` batches the active requests into one target forward a step; `stages` are a
step's stages for one sequence; `sequence` is a request's state; `admission` hands out KV
slots; `capture` keeps what the target computed; `detokenize` streams text; `tenancy` says
what the platform may keep of a request; `errors` are the engine's errors (torch-free).
Imports spec_decode/, sampling/ and model/, never api/."""

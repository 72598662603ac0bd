"""The benchmarks behind `osd bench ACTION`: engine (own AR and speculation vs Hugging Face),
forward (one forward by weight format; llamacpp.py times llama.cpp beside it), load (a running
server under concurrency), stream (records through Redis), teacher, train and adapt.

Each module owns its command line, as vLLM's benchmarks do: `HELP`, `add_arguments(parser)`,
`run(cfg, args)` and `ERRORS`, the exceptions the CLI reports as the user's to fix (exit 2).
A bench imports its model libraries when it runs, not when the CLI lists its flags."""

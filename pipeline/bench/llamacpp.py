"""llama.cpp as a method of `osd bench engine --vs-llamacpp`, and as a runner of `osd bench
forward --vs-llamacpp`: the speed a CPU user gets from the very GGUF our target comes from,
timed in the same run on the same token ids.

llama-cpp-python is an optional bench dependency (the `bench` extra, which
compiles llama.cpp: minutes on 2 cores); nothing else in the project needs it. Decoding is
greedy (top-k 1), prompt evaluation included, as our methods are timed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

INSTALL_HINT = ("osd bench engine --vs-llamacpp needs llama-cpp-python, an optional bench dependency: "
                "CMAKE_ARGS=-DGGML_NATIVE=ON .venv/bin/pip install -e '.[bench]' (llama-cpp-python; it compiles llama.cpp)")


def llamacpp_method(gguf: Path, threads: int, n_ctx: int, eos: int | None, prefix_reuse: bool = False
                    ) -> Callable[[list[int], int], tuple[list[int], None, None]]:
    """A bench method over `gguf`: (prompt ids, budget) -> (output ids, None, None).
    `Llama.generate` starts from the longest prefix its context holds from the call before
    (the chat template's system turn, or a whole prompt run twice); without `prefix_reuse`
    the context is emptied first, so each call prefills its prompt, as the engine's methods do."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    llm: Any = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                     verbose=False, logits_all=False)
    stop = {eos, llm.token_eos()} - {None}

    def run(ids: list[int], max_new: int) -> tuple[list[int], None, None]:
        out: list[int] = []
        if not prefix_reuse:
            llm.reset()
        for tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if tok in stop or len(out) >= max_new:
                break
        return out, None, None

    return run


class LlamaCppCache:
    def __init__(self) -> None:
        self.length = 0

    def truncate(self, n: int) -> None:
        self.length = n


class LlamaCppRunner:
    """llama.cpp's forward of T tokens over a context, as `osd bench forward` times a runner:
    one llama_decode of the block with logits for every row (a verify's), the KV cache cut back
    to the cache's length first. One context: every cache shares it, so caches take turns."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int):
        try:
            from llama_cpp import Llama
        except ImportError:
            raise ValueError(INSTALL_HINT.replace("bench engine", "bench forward")) from None
        self.llm: Any = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                              n_batch=512, n_ubatch=512, verbose=False, logits_all=True)
        self.vocab_size = self.llm.n_vocab()

    def new_cache(self) -> LlamaCppCache:
        return LlamaCppCache()

    def forward(self, tokens: Any, cache: LlamaCppCache) -> Any:
        if self.llm.n_tokens != cache.length:
            self.llm.n_tokens = cache.length  # eval drops the KV positions past n_tokens
        ids = [int(t) for t in tokens.tolist()]
        self.llm.eval(ids)
        cache.length += len(ids)
        return self.llm.scores[cache.length - len(ids):cache.length]

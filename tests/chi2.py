"""Chi-square goodness of fit for the losslessness tests (torch only, no scipy)."""

import torch


def chi2_pvalue(observed, expected, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit; cells with expected < min_expected are pooled.

    Cells with expected 0 must have observed 0 (checked by the caller's assertion here).
    """
    obs = torch.as_tensor(observed, dtype=torch.float64).flatten()
    exp = torch.as_tensor(expected, dtype=torch.float64).flatten()
    exp = exp * obs.sum() / exp.sum()
    zero = exp <= 0
    assert obs[zero].sum() == 0, "observed a token the exact distribution gives probability 0"
    obs, exp = obs[~zero], exp[~zero]
    rare = exp < min_expected
    if rare.any():
        o = torch.cat([obs[~rare], obs[rare].sum().view(1)])
        e = torch.cat([exp[~rare], exp[rare].sum().view(1)])
        if e[-1] < min_expected and e.numel() > 2:  # still too small: fold into the smallest other cell
            j = int(torch.argmin(e[:-1]))
            o[j] += o[-1]
            e[j] += e[-1]
            o, e = o[:-1], e[:-1]
        obs, exp = o, e
    df = obs.numel() - 1
    assert df >= 1, "too few cells for a chi-square test"
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def first_two_tokens_pvalue(target, prompt: list[int], outputs: list[list[int]], vocab: int, sampling) -> float:
    """chi2_pvalue of the joint counts of outputs' first two tokens against the target's exact
    two-step distribution after `prompt` (warped by `sampling`)."""
    from serve.sampling.verify import warp_probs

    counts = torch.zeros(vocab, vocab, dtype=torch.long)
    for out in outputs:
        counts[out[0], out[1]] += 1
    with torch.no_grad():
        p1 = warp_probs(target(torch.tensor([prompt])).logits[0, -1], sampling)
        p2 = warp_probs(target(torch.tensor([prompt + [t] for t in range(vocab)])).logits[:, -1], sampling)
    return chi2_pvalue(counts, p1[:, None] * p2)


def sample_first_two(eng, prompt, sampling, n: int):
    """n sampled generations of 3 tokens from `eng` (SamplingParams like `sampling`, seeds
    0..n-1): (counts [V, V] of the first two tokens, draft tokens proposed, accepted)."""
    from serve.engine.core import GenerationParams
    from serve.sampling.verify import SamplingParams

    vocab = eng.target.vocab_size
    counts = torch.zeros(vocab, vocab, dtype=torch.long)
    drafted = accepted = 0
    for i in range(n):
        sp = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed=i)
        r = eng.generate(prompt, GenerationParams(max_new_tokens=3, sampling=sp, capture=False))
        counts[r.output_ids[0], r.output_ids[1]] += 1
        drafted += r.stats.num_draft_tokens
        accepted += r.stats.num_accepted_tokens
    return counts, drafted, accepted

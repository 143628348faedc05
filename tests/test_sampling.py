"""Sampling semantics through the real engine (tiny random Llama) and the sampler's tensor functions."""
from __future__ import annotations

import math
import random

import pytest
import torch
import transformers

from pagellm import LLM, SamplingParams
from pagellm.model_executor.layers.cpu_kernels import load_extension
from pagellm.model_executor.sampler import (Sampler, SamplingMetadata, _inverse_cdf, apply_min_p, apply_penalties,
                                             apply_top_k_top_p_min_p, top_k_top_p_probs)
from tests.conftest import pool_is_whole


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    return path, LLM(model=str(path), dtype="float32", kv_cache_memory="64MiB")


def _prompts(n, seed=3):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(rng.randrange(4, 60))]} for _ in range(n)]


def _gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def test_seeded_sampling_is_independent_of_the_batch(tiny):
    _, llm = tiny
    prompts = _prompts(6)
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = _gen(llm, prompts[:1], params)[0].outputs[0].token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = _gen(llm, prompts, [params] + [unseeded] * 5)[0].outputs[0].token_ids
    again = _gen(llm, prompts[:1], params)[0].outputs[0].token_ids
    assert alone == batch == again
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=99, max_tokens=20, ignore_eos=True)
    assert _gen(llm, prompts[:1], other_seed)[0].outputs[0].token_ids != alone


def test_top_k_one_and_tiny_temperature_are_greedy(tiny):
    _, llm = tiny
    prompts = _prompts(4)
    greedy = [o.outputs[0].token_ids for o in _gen(llm, prompts, SamplingParams(temperature=0, max_tokens=12))]
    topk1 = [o.outputs[0].token_ids for o in _gen(llm, prompts, SamplingParams(temperature=0.8, top_k=1,
                                                                                max_tokens=12))]
    assert topk1 == greedy


def test_top_k_past_the_vocabulary_keeps_every_token(tiny):
    """Any k >= the vocabulary is no top-k (one above int64's range once stopped the step loop)."""
    _, llm = tiny
    prompts = _prompts(3, seed=7)
    outs = {k: [o.outputs[0].token_ids for o in _gen(llm, prompts, SamplingParams(
        temperature=1.0, top_k=k, seed=21, max_tokens=10, ignore_eos=True))] for k in (0, 512, 10**6, 2**63)}
    assert outs[512] == outs[10**6] == outs[2**63] == outs[0]


def test_logit_bias_matches_hf_sequence_bias(tiny):
    """Greedy with logit_bias against HF's greedy generate with the same single-token sequence_bias (fp32): each
    step adds the biases to the logits; logprobs stay the model's own (vLLM's default)."""
    path, llm = tiny
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [p["prompt_token_ids"] for p in _prompts(3, seed=13)]
    plain = [o.outputs[0].token_ids for o in _gen(llm, [{"prompt_token_ids": p} for p in prompts],
                                                     SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]
    # ban each prompt's first greedy token, push a token it never picks, and nudge another by a fraction
    for p, base in zip(prompts, plain):
        bias = {base[0]: -100.0, (base[0] + 7) % 512: 3.5, (base[1] + 3) % 512: 0.25}
        with torch.inference_mode():
            ids = torch.tensor([p])
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                               eos_token_id=None, pad_token_id=0,
                               sequence_bias={(t,): b for t, b in bias.items()})[0, len(p):].tolist()
        out = _gen(llm, [{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                                   logit_bias=bias, logprobs=0))[0].outputs[0]
        assert out.token_ids == want and base[0] not in out.token_ids
        with torch.inference_mode():
            raw = hf(torch.tensor([p + want])).logits[0, len(p) - 1:-1].log_softmax(-1)
        assert [e[t].logprob for e, t in zip(out.logprobs, want)] == pytest.approx(
            raw.gather(1, torch.tensor(want)[:, None]).squeeze(1).tolist(), abs=1e-4)
    # in a batch, each request only its own bias; string keys (OpenAI's JSON) and values past +-100 clamped
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={str(plain[0][0]): -1e9}),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    assert params[0].logit_bias == {plain[0][0]: -100.0}
    assert SamplingParams(logit_bias={1: 10**400, 2: -10**400}).logit_bias == {1: 100.0, 2: -100.0}
    outs = _gen(llm, [{"prompt_token_ids": p} for p in prompts[:2]], params)
    assert plain[0][0] not in outs[0].outputs[0].token_ids and outs[1].outputs[0].token_ids == plain[1]
    forced = _gen(llm, [{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=1.0, seed=5, max_tokens=6,
                                                                         ignore_eos=True, logit_bias={42: 100}))
    assert forced[0].outputs[0].token_ids == [42] * 6  # sampled rows see the bias too
    with pytest.raises(ValueError, match=r"logit_bias: token id 512 is outside the vocabulary \[0, 512\)"):
        llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(logit_bias={512: 1.0}), use_tqdm=False)
    assert pool_is_whole(llm)


@pytest.mark.parametrize("bias,match", [({"x": 1.0}, "key 'x' is not a token id"), ({-1: 1.0}, "key -1"),
                                        ({3: float("nan")}, "bias of token 3 must be a number"),
                                        ({3: "1"}, "bias of token 3"), ([3], "must be a dict")])
def test_bad_logit_bias_names_the_field(bias, match):
    with pytest.raises(ValueError, match=f"logit_bias.*{match}"):
        SamplingParams(logit_bias=bias)


def test_sampling_follows_the_distribution(tiny):
    """First-token frequencies over many seeded draws match softmax(logits / T) from HF's own forward pass."""
    path, llm = tiny
    prompt = _prompts(1, seed=11)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt["prompt_token_ids"]])).logits[0, -1]
    probs = (logits / 2.0).softmax(-1)
    n = 400
    outs = _gen(llm, [prompt] * n, [SamplingParams(temperature=2.0, max_tokens=1, seed=s) for s in range(n)])
    counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[0] for o in outs]), minlength=probs.numel())
    top = probs.argmax()
    expected = probs[top].item() * n
    assert abs(counts[top].item() - expected) < 5 * math.sqrt(expected) + 3
    assert counts[probs < 1e-6].sum() == 0


def test_max_tokens_stop_token_ids_and_min_tokens(tiny):
    _, llm = tiny
    prompt = _prompts(1, seed=5)
    base = _gen(llm, prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 16
    stop_tok = base.token_ids[5]
    first = base.token_ids.index(stop_tok)
    out = _gen(llm, prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                           stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == base.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # min_tokens masks the stop token until enough tokens exist, so the output continues past it.
    out = _gen(llm, prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, min_tokens=first + 2,
                                           stop_token_ids=[stop_tok]))[0].outputs[0]
    assert len(out.token_ids) >= first + 2
    assert stop_tok not in out.token_ids[:first + 2]


def test_logprobs_match_hf(tiny):
    path, llm = tiny
    prompt = _prompts(1, seed=8)[0]
    out = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=4))[0].outputs[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = prompt["prompt_token_ids"] + out.token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    assert len(out.logprobs) == 3
    total = 0.0
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt["prompt_token_ids"]) - 1 + i]
        assert entry[tok].rank == 1
        assert entry[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4)
        top = row.topk(4)
        assert set(entry) == set(top.indices.tolist())
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[t].logprob == pytest.approx(v, abs=1e-4)
        total += entry[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)


def _meta(r, **kw):
    base = dict(temperature=torch.ones(r), all_greedy=False, top_k=None, top_p=None, min_p=None, generators={},
                prompt_token_ids=None, output_token_ids=None, repetition_penalty=None, presence_penalty=None,
                frequency_penalty=None, stop_mask_rows=None, stop_mask_tokens=None, max_num_logprobs=None)
    base.update(kw)
    return SamplingMetadata(**base)


def test_penalties_follow_vllm_semantics():
    torch.manual_seed(0)
    logits = torch.randn(2, 10)
    prompt = torch.tensor([[1, 2, -1], [3, -1, -1]])
    output = torch.tensor([[2, 2, 4], [5, -1, -1]])
    m = _meta(2, prompt_token_ids=prompt, output_token_ids=output, repetition_penalty=torch.tensor([1.5, 1.0]),
              presence_penalty=torch.tensor([0.0, 0.7]), frequency_penalty=torch.tensor([0.3, 0.0]))
    got = apply_penalties(logits, m)
    want = logits.clone()
    for t in (1, 2, 4):  # row 0: repetition on prompt+output tokens, frequency on output counts
        want[0, t] = want[0, t] / 1.5 if want[0, t] > 0 else want[0, t] * 1.5
    want[0, 2] -= 0.3 * 2
    want[0, 4] -= 0.3 * 1
    want[1, 5] -= 0.7  # row 1: presence on output tokens only
    assert torch.allclose(got, want)


def test_penalties_match_a_dense_reference():
    """The sparse penalties equal the plain [R, V] formulas on random ids with repeats and padding."""
    g = torch.Generator().manual_seed(5)
    r, vocab = 5, 40
    logits = torch.randn(r, vocab, generator=g) * 3
    prompt = torch.randint(0, vocab, (r, 12), generator=g)
    output = torch.randint(0, vocab, (r, 9), generator=g)
    prompt[1, 6:] = -1
    output[2, 3:] = -1
    output[3, :] = -1
    rep, freq, pres = (torch.rand(r, generator=g) * 1.5 + 0.5, torch.randn(r, generator=g), torch.randn(r, generator=g))
    m = _meta(r, prompt_token_ids=prompt, output_token_ids=output, repetition_penalty=rep, presence_penalty=pres,
              frequency_penalty=freq)
    counts = torch.zeros(r, vocab)
    seen = torch.zeros(r, vocab, dtype=torch.bool)
    for i in range(r):
        for t in prompt[i][prompt[i] >= 0].tolist():
            seen[i, t] = True
        for t in output[i][output[i] >= 0].tolist():
            seen[i, t] = True
            counts[i, t] += 1
    want = torch.where(seen, torch.where(logits > 0, logits / rep[:, None], logits * rep[:, None]), logits)
    want = want - freq[:, None] * counts - pres[:, None] * (counts > 0).float()
    torch.testing.assert_close(apply_penalties(logits, m), want)


def test_penalised_sampler_keeps_raw_logprobs():
    """The sampler penalises its own fp32 copy in place when nothing else reads it; with logprobs asked, the
    logprobs stay those of the model's raw logits (and the model's logits are never written)."""
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(3, 64, generator=g) * 4).to(torch.bfloat16)
    before = logits.clone()
    prompt = torch.tensor([[1, 2, 3], [4, 5, -1], [6, -1, -1]])
    output = torch.tensor([[7, 7], [8, -1], [-1, -1]])
    pen = dict(prompt_token_ids=prompt, output_token_ids=output, repetition_penalty=torch.full((3,), 2.0),
               presence_penalty=torch.full((3,), 0.5), frequency_penalty=torch.full((3,), 0.25))
    want = apply_penalties(logits.float(), _meta(3, **pen)).argmax(-1)
    for ops in (None, load_extension()):
        greedy = _meta(3, temperature=torch.zeros(3), all_greedy=True, **pen)
        out = Sampler(ops)(logits, greedy)
        assert torch.equal(out.sampled, want) and torch.equal(logits, before)
        out = Sampler(ops)(logits, _meta(3, temperature=torch.zeros(3), all_greedy=True, max_num_logprobs=2, **pen))
        assert torch.equal(out.sampled, want) and torch.equal(logits, before)
        raw = logits.float().log_softmax(-1)
        torch.testing.assert_close(out.logprob, raw.gather(1, want[:, None]).squeeze(1))
        torch.testing.assert_close(out.top_logprobs, raw.topk(2, dim=-1).values)


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1], [0.4, 0.3, 0.2, 0.1], [0.7, 0.2, 0.06, 0.04]]))
    m = _meta(3, top_k=torch.tensor([2, 0, 0]), top_p=torch.tensor([1.0, 0.6, 1.0]),
              min_p=torch.tensor([0.0, 0.0, 0.1]))
    kept = torch.isfinite(apply_top_k_top_p_min_p(logits, m))
    assert kept.tolist() == [[True, True, False, False], [True, True, False, False], [True, True, False, False]]


# The C++ kernel (histogram cut) and the torch path (most likely tokens, whole-row sort when they do not settle).
CUTS = {"cpp": load_extension(), "torch": None}


@pytest.mark.parametrize("path", CUTS)
def test_top_k_top_p_probs_match_the_reference(path):
    """Kept tokens and their probabilities equal the full-sort reference's, for peaked and flat rows (a flat row's
    nucleus holds thousands of tokens: past the torch path's first candidates), top-k alone, top-p alone, both,
    neither, min-p with and without them, and rows with tokens masked to -inf."""
    torch.manual_seed(0)
    vocab = 5000
    scale = torch.tensor([[3.0], [0.05], [1.0], [0.5], [2.0], [0.01], [30.0], [1.0], [8.0], [2.0]])
    logits = torch.randn(len(scale), vocab) * scale
    logits[7, 100:] = float("-inf")
    logits[8, ::2] = float("-inf")
    top_k = torch.tensor([0, 0, 40, 1000, 0, 3000, 0, 200, 300, 0])
    top_p = torch.tensor([0.9, 0.99, 0.5, 0.95, 1.0, 0.999, 0.3, 0.97, 0.8, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.0, 0.2, 0.1])  # alone in the last row
    m = _meta(len(scale), top_k=top_k, top_p=top_p, min_p=min_p)
    want = apply_top_k_top_p_min_p(logits, m).softmax(-1)
    if path == "cpp":
        got = top_k_top_p_probs(logits, top_k, top_p, CUTS[path], min_p=min_p)
    else:  # the torch path leaves min-p to its caller
        got = top_k_top_p_probs(apply_min_p(logits, m), top_k, top_p, None)
    got = got / got.sum(-1, keepdim=True)
    assert torch.equal(got > 0, want > 0), ((got > 0).sum(-1), (want > 0).sum(-1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert (want > 0).sum(-1).tolist()[:3] == [86, 4943, 17]  # the cases above are the ones meant


@pytest.mark.parametrize("path", CUTS)
def test_top_k_keeps_the_lowest_ids_among_tied_logits(path):
    """Ties at the cut keep token-id order, whatever else is in the batch (the torch path looks at more
    candidates when another row asks for a larger k)."""
    row = torch.full((600,), -5.0)
    row[[7, 3, 400, 9, 250]] = 2.0  # five tied for first
    row[100] = 4.0
    alone = top_k_top_p_probs(row[None], torch.tensor([3]), None, CUTS[path])
    with_big_k = top_k_top_p_probs(torch.stack([row, row]), torch.tensor([3, 550]), None, CUTS[path])
    for probs in (alone[0], with_big_k[0]):
        assert (probs > 0).nonzero().squeeze(1).tolist() == [3, 7, 100]
    # top-p 0.7: 4.0 holds 57% of the mass and each 2.0 another 7.7%: 4.0, then the 2.0s from id 3 up while the
    # mass before them is at most 70%
    nucleus = top_k_top_p_probs(row[None], None, torch.tensor([0.7]), CUTS[path])[0]
    assert (nucleus > 0).nonzero().squeeze(1).tolist() == [3, 7, 100]


def test_sample_rows_draws_as_the_torch_path():
    """The C++ sampler (temperature, min-p, cut and draw in one call) picks, for the same uniforms, the tokens the
    torch path's inverse CDF picks; never a removed token."""
    ops = CUTS["cpp"]
    torch.manual_seed(1)
    n_u, vocab = 2000, 3000
    base = torch.randn(4, vocab) * torch.tensor([[2.0], [0.3], [5.0], [1.0]])
    base[3, 1000:] = float("-inf")
    params = [(0.7, 0, 0.9, 0.0), (1.3, 50, 1.0, 0.0), (1.0, 20, 0.6, 0.0), (0.5, 0, 1.0, 0.0), (1.5, 0, 0.95, 0.05)]
    base = torch.cat([base, base[:1]])
    u = (torch.arange(n_u) + 0.5) / n_u
    for row, (t, k, p, mp) in zip(base, params):  # temperature, top_k, top_p, min_p
        logits = row[None].repeat(n_u, 1)
        temp, top_k, top_p, min_p = (torch.full((n_u,), v) for v in (t, k, p, mp))
        got = torch.empty(n_u, dtype=torch.int64)
        ops.sample_rows(logits, temp, top_k, top_p, min_p, u, got)
        scaled = apply_min_p(logits[:1] / t, _meta(1, min_p=min_p[:1]))
        probs = top_k_top_p_probs(scaled, top_k[:1], top_p[:1], None)
        want = _inverse_cdf(probs.repeat(n_u, 1), u)
        assert (got != want).sum().item() <= 2, (t, k, p, mp)
        assert bool((probs[0, got] > 0).all())


def test_nan_logits_are_removed_tokens_and_keep_the_maximum():
    """A NaN logit is a token the cut removes, and it does not hide the row's maximum: the kernels' vector maximum
    once let a NaN replace what its lane had seen, so a row's maximum came out below a real logit (here exp(l - max)
    was 533 at the largest token, whose bucket fell below zero: the histogram wrote before its array)."""
    ops = CUTS["cpp"]
    torch.manual_seed(4)
    r = 3
    logits = torch.randn(r, 64)
    logits[:, 5] = 9.0  # the largest, in lane 5 of the first vector of 16 (and of 8)
    logits[:, 21] = float("nan")  # lane 5 again, in a later vector
    top_k, top_p = torch.tensor([1, 0, 0]), torch.tensor([1.0, 0.5, 1.0])
    probs = torch.empty_like(logits)
    ops.top_k_top_p_probs(logits, top_k, top_p, torch.zeros(r), probs)
    assert probs[:, 5].tolist() == [1.0, 1.0, 1.0]  # exp(l - max) at the maximum
    assert (probs[:, 21] == 0).all() and bool(torch.isfinite(probs).all())
    got = torch.empty(r, dtype=torch.int64)
    ops.sample_rows(logits, torch.ones(r), top_k, top_p, torch.zeros(r), torch.tensor([0.5, 0.5, 0.999]), got)
    assert got[:2].tolist() == [5, 5] and got[2].item() != 21


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_logprobs_rows_match_torch(k):
    """The C++ logprobs (two passes per row) equal log_softmax's: the sampled token's value and rank, and the top
    k in order (ties: lower id first)."""
    torch.manual_seed(3)
    logits = torch.randn(6, 3000) * torch.tensor([[1.0], [4.0], [0.1], [2.0], [1.0], [1.0]])
    logits[3, 100:] = float("-inf")
    logits[4, [10, 20, 30]] = 9.0  # a three-way tie for first
    sampled = torch.tensor([0, int(logits[1].argmax()), 5, 7, 20, int(logits[5].argmin())])
    chosen, rank = torch.empty(6), torch.empty(6, dtype=torch.int64)
    top_ids, top_lp = torch.empty(6, k, dtype=torch.int64), torch.empty(6, k)
    CUTS["cpp"].logprobs_rows(logits, sampled, k, chosen, rank, top_ids, top_lp)
    want = logits.log_softmax(-1)
    want_chosen = want.gather(1, sampled[:, None]).squeeze(1)
    torch.testing.assert_close(chosen, want_chosen, rtol=0, atol=2e-6)
    assert rank.tolist() == ((want > want_chosen[:, None]).sum(-1) + 1).tolist()
    assert rank[1] == 1 and rank[4] == 1 and rank[5] == 3000
    if k:
        vals, _ = want.topk(k, dim=-1)
        torch.testing.assert_close(top_lp, vals, rtol=0, atol=2e-6)
        torch.testing.assert_close(want.gather(1, top_ids), top_lp, rtol=0, atol=2e-6)  # ids match values
        assert top_ids[4, :3].tolist() == [10, 20, 30][:k]


def test_inverse_cdf_draws_in_proportion():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0]]).repeat(10_000, 1) * 7.0  # unnormalised is fine
    u = (torch.arange(10_000) + 0.5) / 10_000
    counts = torch.bincount(_inverse_cdf(probs, u), minlength=5)
    assert counts.tolist() == [1000, 0, 6000, 3000, 0]
    assert _inverse_cdf(probs[:1], torch.tensor([1.0 - 2 ** -24])).item() == 3  # never the zero tail


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5), ("max_tokens", 0),
    ("min_tokens", -1), ("logprobs", 21), ("repetition_penalty", 0.0), ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0), ("n", 0), ("best_of", 0), ("stop", [""]), ("stop_token_ids", [-1]), ("seed", 2**64),
    ("seed", -2**63 - 1), ("seed", 1.5),
])
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)

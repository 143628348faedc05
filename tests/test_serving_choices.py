"""The server's choices (entrypoints/openai/serving.py) without a server: with n > 1 and prompt logprobs, only a
prompt's first choice (its lead) gets them from the engine; a follower whose outputs arrive first is held back
until the lead's do, then takes the lead's prompt fields. The order is forced here, which a live server rarely
shows (the lead is queued first)."""
from __future__ import annotations

from types import SimpleNamespace

from pagellm import SamplingParams
from pagellm.entrypoints.openai.serving import OpenAIServing
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput

PROMPT = [5, 6, 7]
PROMPT_LOGPROBS = [None, {6: Logprob(-1.0, 1, "b")}, {7: Logprob(-2.0, 1, "c")}]


def _serving() -> OpenAIServing:
    tok = SimpleNamespace(decode=lambda ids: "".join("abcdefgh"[i - 5] for i in ids))
    return OpenAIServing(SimpleNamespace(tokenizer=tok), "m")


def _out(tokens: list[int], finished: bool, lead: bool) -> RequestOutput:
    text = "".join(f"<{t}>" for t in tokens)
    return RequestOutput("r", None, PROMPT, [CompletionOutput(0, text, tokens, finish_reason="length" if finished
                                                             else None)], finished,
                         prompt_logprobs=PROMPT_LOGPROBS if lead else None)


def test_a_follower_waits_for_its_leads_prompt_logprobs():
    serving = _serving()
    params = SamplingParams(max_tokens=2, prompt_logprobs=1)
    choices = serving.choices(4, 2, params, echo=True)  # two prompts, n = 2
    assert [c.lead for c in choices] == [None, choices[0], None, choices[2]]
    # prompt 0's follower runs to the end before its lead has output anything
    for tokens, finished in (([1], False), ([1, 2], True)):
        serving.update(choices[1], _out(tokens, finished, lead=False), 0)
        assert choices[1].waiting and serving.released(choices, 1, 2) == []
    # prompt 1's lead releases its own follower (no output yet), not prompt 0's
    serving.update(choices[2], _out([3], False, lead=True), 0)
    assert serving.released(choices, 2, 2) == [choices[2], choices[3]] and choices[1].waiting
    serving.update(choices[0], _out([4], False, lead=True), 0)
    assert serving.released(choices, 0, 2) == [choices[0], choices[1]]
    follower = choices[1]
    assert not follower.waiting and follower.prompt_logprobs is PROMPT_LOGPROBS
    assert (follower.prompt_text, follower.first_token_text, follower.prompt_token_chars) == ("abc", "a", 3)
    assert follower.finish_reason == "length" and follower.token_ids == [1, 2]
    # released once: the lead's later outputs release only itself
    serving.update(choices[0], _out([4, 1], True, lead=True), 0)
    assert serving.released(choices, 0, 2) == [choices[0]]


def test_without_prompt_logprobs_no_choice_waits():
    serving = _serving()
    choices = serving.choices(3, 3, SamplingParams(max_tokens=1), echo=True)
    serving.update(choices[2], _out([1], True, lead=False), 0)
    assert all(c.lead is None for c in choices) and serving.released(choices, 2, 3) == [choices[2]]
    assert choices[2].prompt_text == "abc"


def test_prompt_only_drops_the_steps_token():
    serving = _serving()
    choices = serving.choices(1, 1, SamplingParams(max_tokens=1, prompt_logprobs=0), echo=True, prompt_only=True)
    serving.update(choices[0], _out([3], True, lead=True), 0)
    c = choices[0]
    assert (c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason) == ("", [], [], "length", None)
    assert c.prompt_text == "abc" and c.prompt_logprobs is PROMPT_LOGPROBS

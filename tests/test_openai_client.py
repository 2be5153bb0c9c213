"""The official openai client against the agent on loopback: completions and streaming."""
from __future__ import annotations

import contextlib

import httpx
import openai
import pytest

from test_serve import demo_model, start_agent


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    # a KV budget for the long concurrent streams below (3 x 3000 positions beside the seeded one)
    a = start_agent(demo_model(tmp_path_factory), tmp_path_factory.mktemp("openai"), "--cache-cap", "50%",
                    "--kv-budget", "16384")
    yield a
    a.stop()


@pytest.fixture(scope="module")
def client(agent) -> openai.OpenAI:
    return openai.OpenAI(base_url=agent.url + "/v1", api_key="unused-on-loopback", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    """The served model's id: a completion names it (another is a 404)."""
    return client.models.list().data[0].id


def test_models_and_a_completion(client, model):
    done = client.completions.create(model=model, prompt="The SSD on this box", max_tokens=5, temperature=0)
    assert done.object == "text_completion" and done.model == model
    choice = done.choices[0]
    assert choice.finish_reason in ("length", "stop") and isinstance(choice.text, str)
    assert done.usage.prompt_tokens == len(b"The SSD on this box")
    assert 1 <= done.usage.completion_tokens <= 5


def test_streaming_yields_the_same_text_as_one_response(client, model):
    whole = client.completions.create(model=model, prompt=[72, 105, 33], max_tokens=6, temperature=0)
    chunks = list(client.completions.create(model=model, prompt=[72, 105, 33], max_tokens=6, temperature=0,
                                            stream=True))
    assert len(chunks) >= 2 and all(c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text  # greedy: identical
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_a_refused_request_raises_the_clients_error_with_our_reason(client, model):
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=model, prompt=[5, 10**7], max_tokens=2)


def test_another_model_raises_the_clients_not_found_error(client, model):
    with pytest.raises(openai.NotFoundError, match=f"this agent serves '{model}'") as refused:
        client.completions.create(model="gpt-4", prompt="The SSD on this box", max_tokens=2)
    assert refused.value.code == "model_not_found"


PROMPT, LONG = "The SSD on this box", 24


@pytest.fixture(scope="module")
def whole(client, model) -> str:
    """The demo model's greedy continuation of PROMPT: ASCII, so one token per character."""
    text = client.completions.create(model=model, prompt=PROMPT, max_tokens=LONG, temperature=0).choices[0].text
    assert text.isascii() and len(text) == LONG
    return text


def _first_stop(whole: str, stops: list[str]) -> tuple[int, int]:
    """Where the stop string that is generated first starts, and how many tokens it takes to generate it."""
    start, s = min((whole.find(s), s) for s in stops if s in whole)
    return start, start + len(s)


def test_stop_ends_the_text_before_the_first_stop_string_and_no_token_is_generated_past_it(client, whole, model):
    stops = [whole[15:17], "never", whole[7:9]]
    start, generated = _first_stop(whole, stops)
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=LONG, temperature=0, stop=stops)
    assert done.choices[0].text == whole[:start] and done.choices[0].finish_reason == "stop"
    assert done.usage.completion_tokens == generated < LONG
    one = client.completions.create(model=model, prompt=PROMPT, max_tokens=LONG, temperature=0, stop=whole[10:12])
    assert one.choices[0].text == whole[:whole.find(whole[10:12])]


def test_streaming_with_stop_sends_the_same_text_and_never_part_of_a_stop_string(client, whole, model):
    stops = [whole[12:14]]
    start, generated = _first_stop(whole, stops)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=LONG, temperature=0,
                                            stop=stops, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole[:start]
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].usage.completion_tokens == generated


def test_streaming_holds_back_a_tail_that_may_begin_a_stop_string_and_sends_it_when_none_follows(client, whole, model):
    stop = whole[9:12] + "\u2603"  # its first three characters are generated, the snowman never is
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=LONG, temperature=0,
                                            stop=[stop], stream=True))
    sent = ""
    for chunk in chunks[:-1]:
        sent += chunk.choices[0].text
        assert not any(stop.startswith(sent[-n:]) for n in range(1, len(stop))), sent
    assert sent + chunks[-1].choices[0].text == whole and chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("stop", [["a", "b", "c", "d", "e"], "", ["ok", ""], ["ok", "x" * 257]])
def test_stop_takes_up_to_four_strings_of_1_to_256_characters(client, stop, model):
    with pytest.raises(openai.UnprocessableEntityError, match="stop takes a string or a list of at most 4"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, stop=stop)


def test_a_small_top_p_samples_the_greedy_text_and_top_p_takes_0_to_1(client, whole, model):
    nucleus = client.completions.create(model=model, prompt=PROMPT, max_tokens=LONG, temperature=1.5, top_p=1e-6)
    assert nucleus.choices[0].text == whole
    with pytest.raises(openai.UnprocessableEntityError, match="top_p: Input should be greater than 0"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, top_p=0)


UNSUPPORTED = {"logprobs": 2, "echo": True, "suffix": "!", "best_of": 2, "logit_bias": {"65": 5.0},
               "presence_penalty": 0.5, "frequency_penalty": -1.0}


@pytest.mark.parametrize("field", UNSUPPORTED)
def test_a_field_the_agent_does_not_implement_is_refused_by_name(client, field, model):
    with pytest.raises(openai.UnprocessableEntityError, match=f"{field}: .*{field} is not supported by this agent"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, **{field: UNSUPPORTED[field]})


def test_null_settings_are_their_defaults(client, model):
    """The openai client sends null for an explicit None; the agent refused it as no integer or number."""
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=None, temperature=None, top_p=None,
                                     n=None, stream=None, seed=1)
    assert done.usage.completion_tokens == 16 or done.choices[0].finish_reason == "stop"  # max_tokens' default
    assert done.choices[0].text == _sampled_text(client, model, 1, 16)  # temperature 1 and top_p 1, as when left out


def test_defaults_and_harmless_fields_pass(client, whole, model):
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=LONG, temperature=0, logprobs=None,
                                     echo=False, suffix=None, best_of=1, logit_bias={}, presence_penalty=0,
                                     frequency_penalty=0.0, seed=None, user="someone", top_p=1, stop=None)
    assert done.choices[0].text == whole


def _sampled(client, model: str, seed: int | None) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=LONG, temperature=2.0,
                                     seed=seed).choices[0].text


def _sampled_text(client, model: str, seed: int, max_tokens: int) -> str:
    """A seeded completion with every setting left out but max_tokens."""
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, seed=seed).choices[0].text


def test_a_seed_gives_the_same_sampled_text_alone_and_beside_other_requests(agent, client, whole, model):
    alone = _sampled(client, model, 7)
    assert alone != whole and _sampled(client, model, 7) == alone
    with contextlib.ExitStack() as others:  # sampled requests that run before, during and after the seeded one
        lines = []  # kept: a dropped line iterator closes its connection, which cancels its request
        for i in range(3):  # seeded too, so that whether one samples the end of text early is the same every run
            body = {"prompt": f"another client {i}", "max_tokens": 3000, "temperature": 1.0, "seed": 100 + i,
                    "stream": True}
            stream = others.enter_context(httpx.stream("POST", agent.url + "/v1/completions", json=body, timeout=60))
            lines.append(stream.iter_lines())
            next(lines[-1])  # its first token: it is running
        beside = _sampled(client, model, 7)
        assert httpx.get(agent.url + "/v1/status").json()["batch_size"] == 3  # they ran through all its steps
    assert beside == alone
    assert len({alone, _sampled(client, model, 8), _sampled(client, model, 2**64 - 1)}) == 3


@pytest.mark.parametrize("seed", [2**64, -2**63 - 1])
def test_a_seed_outside_64_bits_is_refused_by_name(client, seed, model):
    with pytest.raises(openai.UnprocessableEntityError, match="seed: Input should be"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, seed=seed)

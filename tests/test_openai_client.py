"""The official openai client against the agent on loopback: completions and streaming."""
from __future__ import annotations

import openai
import pytest

from test_serve import demo_model, start_agent


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    a = start_agent(demo_model(tmp_path_factory), tmp_path_factory.mktemp("openai"), "--cache-cap", "50%")
    yield a
    a.stop()


@pytest.fixture(scope="module")
def client(agent) -> openai.OpenAI:
    return openai.OpenAI(base_url=agent.url + "/v1", api_key="unused-on-loopback", max_retries=0, timeout=120)


def test_models_and_a_completion(client):
    model = client.models.list().data[0].id
    done = client.completions.create(model=model, prompt="The SSD on this box", max_tokens=5, temperature=0)
    assert done.object == "text_completion" and done.model == model
    choice = done.choices[0]
    assert choice.finish_reason in ("length", "stop") and isinstance(choice.text, str)
    assert done.usage.prompt_tokens == len(b"The SSD on this box")
    assert 1 <= done.usage.completion_tokens <= 5


def test_streaming_yields_the_same_text_as_one_response(client):
    model = client.models.list().data[0].id
    whole = client.completions.create(model=model, prompt=[72, 105, 33], max_tokens=6, temperature=0)
    chunks = list(client.completions.create(model=model, prompt=[72, 105, 33], max_tokens=6, temperature=0,
                                            stream=True))
    assert len(chunks) >= 2 and all(c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text  # greedy: identical
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_a_refused_request_raises_the_clients_error_with_our_reason(client):
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=model, prompt=[5, 10**7], max_tokens=2)

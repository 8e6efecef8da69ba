"""The official OpenAI Python client against a running Levee server.

Usage: python3 tests/openai_client.py http://127.0.0.1:PORT
"""

import sys

import openai


def main(base: str) -> None:
    client = openai.OpenAI(base_url=base + "/v1", api_key="not-needed", max_retries=0)
    model = client.models.list().data[0].id

    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
    )
    assert chat.choices[0].message.role == "assistant", chat
    assert chat.choices[0].message.content, chat
    assert chat.usage.completion_tokens > 0, chat

    completion = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert "Paris" in completion.choices[0].text, completion

    text, usage = "", None
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text, "streamed chat produced no text"
    assert usage is not None and usage.completion_tokens > 0, usage

    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True
        )
        if c.choices
    ]
    assert "".join(pieces) == completion.choices[0].text, pieces

    try:
        client.completions.create(model=model, prompt="hi", temperature=5)
    except openai.BadRequestError as error:
        assert "temperature" in str(error), error
    else:
        raise AssertionError("temperature 5 was accepted")

    try:
        client.completions.create(model="no-such-model", prompt="hi")
    except openai.NotFoundError:
        pass
    else:
        raise AssertionError("an unknown model was accepted")

    retrieved = client.models.retrieve(model)
    assert retrieved.id == model, retrieved
    try:
        client.models.retrieve("no-such-model")
    except openai.NotFoundError as error:
        assert "no-such-model" in str(error), error
    else:
        raise AssertionError("an unknown model was retrieved")

    try:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi " * 20000}], max_tokens=4
        )
    except openai.BadRequestError as error:
        assert error.code == "context_length_exceeded", error
        assert error.param == "messages", error
    else:
        raise AssertionError("a chat over the context was accepted")

    print("openai client: chat, completions, streaming, models and errors ok")


if __name__ == "__main__":
    main(sys.argv[1])

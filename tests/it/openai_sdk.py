"""Drive the official OpenAI Python SDK as a client program would, for the
Rust tests of the AI gateway (tests/it/ai_gateway_sdk.rs runs it).

    PYTHONPATH=target/openai python3 -S tests/it/openai_sdk.py '<json spec>'

scripts/test installs the pinned SDK into target/openai. The spec:

    base_url       "http://127.0.0.1:PORT/v1"
    api_key        the bearer key sent (default "sk-test")
    max_retries    the SDK's retries (default 2, the SDK's own)
    timeout        seconds (default 20)
    endpoint       "chat" | "completions" | "embeddings" (default "chat")
    model          (default "gpt-4o-mini")
    prompt         the user message, the prompt, or the embeddings' input
                   (a string, or for embeddings a list of strings)
    max_tokens     optional int; max_completion_tokens likewise (chat only)
    stream         bool (default false)
    include_usage  optional bool: stream_options={"include_usage": ...}
    headers        optional {name: value}: extra request headers
    calls          how many calls to make, one after another (default 1)
    concurrent     instead of the above: a list of specs, run at once (a
                   thread each); the results of each in the list's order

It prints one JSON line: {"results": [one per call]}, each with
ok, status, error_class, error_code, error_type, error_message, elapsed
(seconds), headers (the response's, lowercased; an error's too), text (the
answer, a stream's deltas joined, as far as it got), usage (a dict, or
null), chunks (stream chunks received), usage_chunks (those whose usage is
not null) and embeddings (the vectors). An SDK exception is reported in its
call's result, never raised.
"""

import concurrent.futures
import json
import sys
import time

import openai


def main():
    spec = json.loads(sys.argv[1])
    if "concurrent" in spec:
        # Several specs at once, a thread each: their results in order.
        specs = spec["concurrent"]
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(specs) or 1) as pool:
            answers = list(pool.map(run, specs))
        results = [result for answer in answers for result in answer]
    else:
        results = run(spec)
    print(json.dumps({"results": results}, default=str), flush=True)


def run(spec):
    """The calls of one spec, one after another."""
    client = openai.OpenAI(
        base_url=spec["base_url"],
        api_key=spec.get("api_key", "sk-test"),
        max_retries=spec.get("max_retries", 2),
        timeout=spec.get("timeout", 20),
    )
    return [call(client, spec) for _ in range(spec.get("calls", 1))]


def call(client, spec):
    """One call as the spec says, and what came of it."""
    result = {
        "ok": False,
        "status": None,
        "error_class": None,
        "error_code": None,
        "error_type": None,
        "error_message": None,
        "elapsed": 0.0,
        "headers": {},
        "text": "",
        "usage": None,
        "chunks": 0,
        "usage_chunks": 0,
        "embeddings": [],
    }
    start = time.monotonic()
    try:
        raw = create(client, spec)
        result["status"] = raw.status_code
        result["headers"] = lowercased(raw.headers)
        parsed = raw.parse()
        if spec.get("stream"):
            for chunk in parsed:
                result["chunks"] += 1
                if getattr(chunk, "usage", None) is not None:
                    result["usage_chunks"] += 1
                    result["usage"] = as_dict(chunk.usage)
                for choice in chunk.choices:
                    result["text"] += answer_text(choice) or ""
        else:
            if spec.get("endpoint") == "embeddings":
                result["embeddings"] = [list(e.embedding) for e in parsed.data]
            else:
                result["text"] = "".join(answer_text(c) or "" for c in parsed.choices)
            result["usage"] = as_dict(parsed.usage)
        result["ok"] = True
    except openai.APIStatusError as e:
        result["status"] = e.status_code
        result["headers"] = lowercased(e.response.headers)
        failed(result, e)
    except openai.OpenAIError as e:
        # APIConnectionError, APITimeoutError (before an answer or in the
        # middle of a stream), an error event in a stream.
        failed(result, e)
    except Exception as e:  # noqa: BLE001 - reported, never a crash
        failed(result, e)
    result["elapsed"] = time.monotonic() - start
    return result


def create(client, spec):
    """The SDK's call for the spec's endpoint, with its raw response."""
    endpoint = spec.get("endpoint", "chat")
    model = spec.get("model", "gpt-4o-mini")
    args = {"model": model}
    if spec.get("headers"):
        args["extra_headers"] = spec["headers"]
    if endpoint == "embeddings":
        return client.embeddings.with_raw_response.create(input=spec["prompt"], **args)
    if spec.get("stream"):
        args["stream"] = True
    if spec.get("include_usage") is not None:
        args["stream_options"] = {"include_usage": spec["include_usage"]}
    if spec.get("max_tokens") is not None:
        args["max_tokens"] = spec["max_tokens"]
    if endpoint == "chat":
        if spec.get("max_completion_tokens") is not None:
            args["max_completion_tokens"] = spec["max_completion_tokens"]
        messages = [{"role": "user", "content": spec["prompt"]}]
        return client.chat.completions.with_raw_response.create(messages=messages, **args)
    if endpoint == "completions":
        return client.completions.with_raw_response.create(prompt=spec["prompt"], **args)
    raise ValueError(f"unknown endpoint {endpoint!r}")


def answer_text(choice):
    """A choice's text: a chat message's or delta's content, or a legacy
    completion's text."""
    for part in ("delta", "message"):
        if hasattr(choice, part):
            return getattr(choice, part).content
    return choice.text


def as_dict(usage):
    """The usage as the SDK parsed it (the API's names), or None."""
    return None if usage is None else usage.to_dict(warnings=False)


def lowercased(headers):
    return {name.lower(): value for name, value in headers.items()}


def failed(result, error):
    result["error_class"] = type(error).__name__
    result["error_message"] = str(error)
    result["error_code"] = getattr(error, "code", None)
    result["error_type"] = getattr(error, "type", None)


if __name__ == "__main__":
    main()

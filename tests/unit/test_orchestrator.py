"""The router's transport-free core: what a failed worker call means for the request (retry,
migrate, fail), the deadline a request gets, cancellation of calls in flight, how each front maps
a RequestError."""

from __future__ import annotations

import json
import time

import pytest
from baton.services.router.errors import RequestError, Status
from baton.services.router.orchestrator import (
    Cancellation,
    Deadline,
    Failed,
    Migrate,
    Orchestrator,
    Retry,
    RouterSettings,
    failure_outcome,
)
from baton.services.router.workers import WorkerError

from tests.support.calls import Call


def failure(status: Status, *, sent: bool = False, left: float = 60.0, cancelled=False,
            field=None):
    cancel = Cancellation()
    if cancelled:
        cancel.cancel()
    e = WorkerError("10.0.0.1:5000", status, "what the worker said", field)
    return failure_outcome(e, Deadline.after(left), cancel, sent)


@pytest.mark.parametrize("status", [Status.UNAVAILABLE, Status.ABORTED, Status.CANCELLED])
def test_an_unavailable_worker_before_the_first_token_is_retried(status):
    out = failure(status)
    assert isinstance(out, Retry) and out.address == "10.0.0.1:5000"
    assert status.name in out.detail and "what the worker said" in out.detail


def test_a_failed_hand_off_is_retried_without_the_prefill_worker_it_failed_on():
    # the decode worker is fine: the prefill worker holding the KV is not (gone, stalled, its
    # engine dead); leaving the decode worker out would leave a one-decode-worker cluster with
    # none to try
    e = WorkerError("10.0.0.1:5000", Status.UNAVAILABLE, "PeerUnavailableError: ...",
                    culprit="10.0.0.2:6000")
    out = failure_outcome(e, Deadline.after(60), Cancellation(), False)
    assert isinstance(out, Retry) and out.address == "10.0.0.2:6000"
    out = failure_outcome(e, Deadline.after(60), Cancellation(), True)  # mid-stream
    assert isinstance(out, Migrate) and out.address == "10.0.0.1:5000"


@pytest.mark.parametrize("status", [Status.UNAVAILABLE, Status.CANCELLED])
def test_a_worker_lost_after_tokens_were_sent_is_migrated(status):
    out = failure(status, sent=True)
    assert isinstance(out, Migrate) and out.address == "10.0.0.1:5000"


def test_a_workers_own_timeout_is_retried_but_the_clients_deadline_ends_the_request():
    assert isinstance(failure(Status.DEADLINE_EXCEEDED, left=30), Retry)
    out = failure(Status.DEADLINE_EXCEEDED, left=0.2)
    assert isinstance(out, Failed) and out.error.status is Status.DEADLINE_EXCEEDED
    out = failure(Status.DEADLINE_EXCEEDED, sent=True, left=30)  # tokens sent: not retried
    assert isinstance(out, Failed) and out.error.status is Status.DEADLINE_EXCEEDED


def test_a_workers_refusal_of_the_input_ends_the_request_naming_the_field():
    out = failure(Status.INVALID_ARGUMENT, field="prompt_token_ids")
    assert isinstance(out, Failed)
    assert out.error.status is Status.INVALID_ARGUMENT
    assert out.error.field == "prompt_token_ids" and out.error.message == "what the worker said"


def test_a_cancelled_call_of_a_cancelled_request_is_the_client_going_away():
    out = failure(Status.CANCELLED, cancelled=True)
    assert isinstance(out, Failed) and out.error.status is Status.CANCELLED
    # not cancelled by the client (a stall watch, a worker's own cancel): not the client's
    assert isinstance(failure(Status.CANCELLED, sent=True), Migrate)
    assert isinstance(failure(Status.CANCELLED), Retry)


def test_a_request_without_a_client_deadline_gets_the_routers_default():
    orch = Orchestrator.__new__(Orchestrator)
    orch.settings = RouterSettings("m", 100, "fp", request_timeout_s=42.0)
    # gRPC reports a call without a deadline as ~9.2e18 seconds remaining
    for client in (None, 9.223372035059208e18, 1e6):
        left = orch.deadline(client).at - time.monotonic()
        assert 41.0 < left <= 42.0, client
    left = orch.deadline(5.0).at - time.monotonic()
    assert 4.0 < left <= 5.0
    assert Deadline.after(-3).remaining() == pytest.approx(0.001)  # a timeout stays positive


def test_cancelling_a_request_cancels_the_calls_linked_to_it_and_no_others():
    cancel, inside, after = Cancellation(), Call(), Call()
    with cancel.linked(inside):
        cancel.cancel()
        assert inside.cancelled.is_set()
    with cancel.linked(after):  # linked after the cancel: cancelled at once
        assert after.cancelled.is_set()
    done, other = Cancellation(), Call()
    with done.linked(other):
        pass
    done.cancel()
    assert not other.cancelled.is_set()  # it ended before the cancel


def test_a_consumer_that_stops_reading_cancels_the_call_in_flight():
    cancel, call = Cancellation(), Call()

    def relay():
        with cancel.linked(call):
            yield 1
            yield 2

    gen = relay()
    next(gen)
    gen.close()  # GeneratorExit at the yield
    assert call.cancelled.is_set() and not cancel.cancelled


def test_each_front_maps_a_request_error_once():
    import grpc
    from baton.services.router.openai_http import _error

    for status in Status:
        assert grpc.StatusCode[status.name].name == status.name
    r = _error(RequestError(Status.INVALID_ARGUMENT, "temperature must be >= 0",
                            "temperature", -1))
    body = json.loads(r.body)
    assert r.status_code == 400 and body["error"]["param"] == "temperature"
    assert body["error"]["type"] == "invalid_request_error"
    assert _error(RequestError(Status.RESOURCE_EXHAUSTED, "full")).status_code == 429
    assert _error(RequestError(Status.UNAVAILABLE, "no worker")).status_code == 503
    assert _error(RequestError(Status.DEADLINE_EXCEEDED, "late")).status_code == 504
    assert _error(RequestError(Status.DATA_LOSS, "bad")).status_code == 500


def test_chat_text_parts_are_joined():
    from baton.services.router.openai_http import generate_request

    req = generate_request("chat", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]}]})
    assert req.chat.messages[0].content == "Hello, world"


def test_the_openai_body_errors_name_the_field():
    from baton.services.router.openai_http import generate_request

    cases = [({"prompt": "hi", "temperature": "hot"}, "temperature"),
             ({"prompt": "hi", "n": 17}, "n"), ({"prompt": "hi", "n": 2, "stream": True}, "n"),
             ({"prompt": 5}, "prompt"),
             ({"messages": [{"role": "user"}]}, "messages[0]"), ([1, 2], "body"),
             ({"prompt": "hi", "max_tokens": 2**40}, "max_tokens"),
             ({"messages": [{"role": "user", "content": [
                 {"type": "text", "text": "hi"},
                 {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]},
              "messages[0].content[1].type")]
    for body, field in cases:
        kind = "chat" if isinstance(body, dict) and "messages" in body else "text"
        with pytest.raises(RequestError) as e:
            generate_request(kind, body)
        assert e.value.status is Status.INVALID_ARGUMENT and e.value.field == field, body


# each OpenAI field Baton does not implement: (the API it belongs to, a value that uses it,
# the value that means "not used")
UNIMPLEMENTED = [
    ("chat", "functions", [{"name": "f"}], []),
    ("chat", "function_call", "auto", "none"),
    ("chat", "modalities", ["text", "audio"], ["text"]),
    ("chat", "audio", {"voice": "alloy"}, None),
    ("chat", "prediction", {"type": "content", "content": "x"}, None),
    ("chat", "reasoning_effort", "high", None),
    ("chat", "web_search_options", {}, None),
    ("text", "echo", True, False),
    ("text", "suffix", "end", ""),
    ("text", "best_of", 3, 1),
]


@pytest.mark.parametrize("kind,field,used,unused", UNIMPLEMENTED)
def test_an_unimplemented_openai_field_is_refused_naming_it(kind, field, used, unused):
    from baton.services.router.openai_http import generate_request

    base = ({"messages": [{"role": "user", "content": "hi"}]} if kind == "chat"
            else {"prompt": "hi"})
    with pytest.raises(RequestError) as e:
        generate_request(kind, {**base, field: used})
    assert e.value.status is Status.INVALID_ARGUMENT and e.value.field == field
    assert "not implemented" in e.value.message
    generate_request(kind, {**base, field: unused})  # its default is no use of it: served
    generate_request(kind, {**base, "user": "u-1", "metadata": {"k": "v"}})  # who is asking


def test_the_sampling_fields_reach_the_workers_params_and_bad_values_are_refused():
    from baton.services.common.protocol import params_from_proto
    from baton.services.router.openai_http import generate_request

    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "presence_penalty": 0.5, "frequency_penalty": -1, "logit_bias": {"7": -100, "3": 2.5},
            "repetition_penalty": 1.3, "min_p": 0.1, "min_tokens": 4, "stop_token_ids": [9]}
    p = params_from_proto(generate_request("chat", body).params)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.0,
                                                                              pytest.approx(1.3))
    assert p.logit_bias == ((3, 2.5), (7, -100.0)) and p.min_tokens == 4
    assert p.min_p == pytest.approx(0.1) and p.stop_token_ids == (9,)
    for field, bad in (("presence_penalty", 2.5), ("frequency_penalty", -3),
                       ("repetition_penalty", 0), ("min_p", 1.5), ("min_tokens", -1),
                       ("logit_bias", {"x": 1}), ("logit_bias", {"5": 101}),
                       ("stop_token_ids", [-1]), ("min_tokens", 1.5)):
        with pytest.raises(RequestError) as e:
            generate_request("text", {"prompt": "hi", field: bad})
        assert e.value.status is Status.INVALID_ARGUMENT and e.value.field == field, (field, bad)


def test_every_openai_request_field_is_known():
    # the field list is the official client's request types: each field is served, accepted
    # as the caller's, or refused as not implemented; none is "unrecognized"
    import typing

    from baton.services.router.openai_http import known_fields
    from openai.types import completion_create_params as text
    from openai.types.chat import completion_create_params as chat

    for kind, params in (("chat", chat.CompletionCreateParamsBase),
                         ("text", text.CompletionCreateParamsBase)):
        fields = set(typing.get_type_hints(params)) | {"stream"}
        assert fields <= known_fields(kind), (kind, sorted(fields - known_fields(kind)))


def test_an_unknown_field_is_refused_unless_the_router_ignores_them():
    from baton.services.router.openai_http import generate_request

    body = {"messages": [{"role": "user", "content": "hi"}], "beam_width": 4}
    with pytest.raises(RequestError) as e:
        generate_request("chat", body)
    assert e.value.status is Status.INVALID_ARGUMENT and e.value.field == "beam_width"
    assert "Unrecognized request argument supplied: beam_width" in e.value.message
    assert generate_request("chat", body, "ignore").chat.messages[0].content == "hi"
    with pytest.raises(RequestError) as e:  # a chat field sent to completions
        generate_request("text", {"prompt": "hi", "messages": []})
    assert e.value.field == "messages"
    # what describes the caller, or asks a hosted service for something: accepted, a no-op
    generate_request("chat", {**body, "beam_width": None} | {
        "store": True, "service_tier": "auto", "prompt_cache_key": "k", "user": "u",
        "safety_identifier": "s", "metadata": {"a": "b"}, "parallel_tool_calls": True},
        "ignore")


def test_chat_template_kwargs_reach_the_template(tiny_llama):
    from baton.engine.tokenizer import BatonTokenizer
    from baton.services.router.openai_http import generate_request

    tok = BatonTokenizer.from_hf_dir(tiny_llama[0], (1,))
    tok.chat_template = ("{% if enable_thinking is defined and not enable_thinking %}/no_think "
                         "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    orch = Orchestrator.__new__(Orchestrator)
    orch.settings, orch.tokenizer = RouterSettings("m", 100, "fp"), tok
    msgs = [{"role": "user", "content": "hi there"}]
    plain = orch._prompt_ids(generate_request("chat", {"messages": msgs}))
    off = orch._prompt_ids(generate_request("chat", {
        "messages": msgs, "chat_template_kwargs": {"enable_thinking": False}}))
    assert off == tok.encode_chat(msgs, enable_thinking=False) and off != plain
    for kwargs, field in (({"messages": []}, "chat_template_kwargs.messages"),
                          ({"not a name": 1}, "chat_template_kwargs.not a name")):
        with pytest.raises(RequestError) as e:
            orch.validate(generate_request("chat", {"messages": msgs,
                                                    "chat_template_kwargs": kwargs}))
        assert e.value.field == field
    with pytest.raises(RequestError) as e:
        generate_request("chat", {"messages": msgs, "chat_template_kwargs": [1]})
    assert e.value.field == "chat_template_kwargs"


def test_a_chat_without_max_tokens_runs_to_the_context_or_the_pool(tiny_llama):
    # OpenAI and vLLM run chat to EOS or the context; completions keep their documented 16
    from baton.engine.tokenizer import BatonTokenizer
    from baton.services.router.openai_http import generate_request

    orch = Orchestrator.__new__(Orchestrator)
    orch.tokenizer = BatonTokenizer.from_hf_dir(tiny_llama[0], (1,))
    msgs = [{"role": "user", "content": "hi there"}]
    for cap, want in ((0, None), (10, 10)):
        orch.settings = RouterSettings("m", 100, "fp", max_tokens=cap)
        req = generate_request("chat", {"messages": msgs})
        ids = orch.validate(req)
        assert req.params.max_tokens == (want or 100 - len(ids)) and req.params.fit_pool
    req = generate_request("chat", {"messages": msgs, "max_tokens": 7})
    orch.validate(req)
    assert req.params.max_tokens == 7 and not req.params.fit_pool
    assert generate_request("text", {"prompt": "hi"}).params.max_tokens == 16

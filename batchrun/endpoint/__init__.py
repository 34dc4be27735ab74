"""Talking to the OpenAI-compatible endpoint:

- ``client.py``: the Model a session calls (OpenAIModel) and the worker's clients (OpenAIEndpoint);
- ``call.py``: one chat completion through the run's gate, with retries;
- ``errors.py``: what each error means (run-fatal, the prompt's, transient) and how long to wait;
- ``replies.py``: a reply's bytes read and checked;
- ``transport.py``: the client's HTTP transport, which bounds each reply's size.
"""

from batchrun.endpoint.call import call_model
from batchrun.endpoint.client import OpenAIEndpoint, OpenAIModel, make_client, preload_http_stack
from batchrun.endpoint.errors import MAX_RETRY_AFTER, classify, retry_after_seconds
from batchrun.endpoint.replies import MalformedReplyError, parse_reply
from batchrun.endpoint.transport import MAX_REPLY_BYTES

__all__ = ["MAX_REPLY_BYTES", "MAX_RETRY_AFTER", "MalformedReplyError", "OpenAIEndpoint",
           "OpenAIModel", "call_model", "classify", "make_client", "parse_reply", "preload_http_stack",
           "retry_after_seconds"]

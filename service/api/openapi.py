"""The service's OpenAPI 3.1 document, built from the same pydantic schemas that validate requests."""

from __future__ import annotations

import copy
from functools import lru_cache

from pydantic import TypeAdapter

from ..limits import RequestLimits
from .anthropic import protocol as anthropic_protocol
from .batches import protocol as batches_protocol
from .chat.protocol import ChatCompletion, ChatCompletionChunk, ChatCompletionRequest
from .conversations import protocol as conversations_protocol
from .native.protocol import FORM_FIELDS, NativeAnswer, NativeChatRequest, NativeDelta, NativeDone, NativeHead
from .ops.protocol import ModelCard, ModelList
from .responses import protocol as responses_protocol
from .search import protocol as search_protocol

_REF = "#/components/schemas/{model}"


def _schema(model, components: dict, name: str | None = None) -> dict:
    """A pydantic model (or, `name`d, any type pydantic validates) among the components, and its $ref."""
    name = name or model.__name__
    adapter = TypeAdapter(model)
    schema = adapter.json_schema(ref_template=_REF)
    components.update(schema.pop("$defs", {}))
    components[name] = schema
    return {"$ref": _REF.format(model=name)}


def _answer(schema: dict, description: str, *errors: int, media: str = "application/json") -> dict:
    """An operation's responses: 200 with `schema` as `media`, and the errors' shape."""
    return {"200": {"description": description, "content": {media: {"schema": schema}}}, **_errors(*errors)}


def _in_path(*names: str) -> list[dict]:
    return [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}} for name in names]


_ERROR = {"description": "error", "content": {"application/json": {"schema": {"$ref": _REF.format(model="Error")}}}}
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def _form_schema() -> dict:
    """multipart/form-data for /v1/chat: the JSON body's fields a form may carry (as the JSON schema
    has them, without null), `stop` repeatable, and the files."""
    properties = NativeChatRequest.model_json_schema(ref_template=_REF)["properties"]

    def not_null(schema: dict) -> dict:
        options = [o for o in schema.get("anyOf", [schema]) if o.get("type") != "null"]
        return options[0] if len(options) == 1 else {"anyOf": options}

    fields = {name: not_null(properties[name]) for name in sorted(FORM_FIELDS)}
    binary = {"type": "array", "items": {"type": "string", "format": "binary"}}
    return {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            **fields,
            "stop": {"type": "array", "items": properties["stop"]["anyOf"][0]},
            "image": binary,
            "video": binary,
        },
    }


def _errors(*codes: int) -> dict:
    return {str(c): _ERROR for c in codes}


def _anthropic_errors(*codes: int) -> dict:
    error = {"content": {"application/json": {"schema": {"$ref": _REF.format(model="AnthropicError")}}}}
    return {str(c): {"description": "error, in Anthropic's shape", **error} for c in codes}


_ANTHROPIC_ERROR_SCHEMA = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}


def _responses_paths(components: dict) -> dict:
    """OpenAI's Responses API: create (whole or its typed events), retrieve and delete a stored response,
    list its input items."""
    request = _schema(responses_protocol.ResponsesRequest, components)
    response = _schema(responses_protocol.Response, components)
    deleted = _schema(responses_protocol.DeletedResponse, components)
    item_list = _schema(responses_protocol.InputItemList, components)
    events = [_schema(e, components) for e in responses_protocol.STREAM_EVENTS]
    by_id = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    query = responses_protocol.InputItemsQuery.model_json_schema()["properties"]
    item_query = [{"name": name, "in": "query", "required": False, "schema": query[name]} for name in query]
    return {
        "/v1/responses": {
            "post": {
                "summary": "OpenAI Responses (SSE events when stream is true); stored unless store is false",
                "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
                "responses": {
                    "200": {
                        "description": (
                            "a response, or (stream: true) server-sent events, each `event: <type>` and `data: ` "
                            "with one of x-event-schemas (response.created ... response.completed)"
                        ),
                        "content": {
                            "application/json": {"schema": response},
                            "text/event-stream": {
                                "schema": {"type": "string", "description": "event: <type> / data: <event JSON>"},
                                "x-event-schemas": events,
                            },
                        },
                    },
                    **_errors(400, 401, 404, 413, 415, 422, 429, 503),
                },
            }
        },
        "/v1/responses/{response_id}": {
            "get": {
                "summary": "a stored response",
                "parameters": by_id,
                "responses": {
                    "200": {"description": "the response", "content": {"application/json": {"schema": response}}},
                    **_errors(401, 404),
                },
            },
            "delete": {
                "summary": "forget a stored response",
                "parameters": by_id,
                "responses": {
                    "200": {"description": "deleted", "content": {"application/json": {"schema": deleted}}},
                    **_errors(401, 404),
                },
            },
        },
        "/v1/responses/{response_id}/input_items": {
            "get": {
                "summary": "a page of what a stored response was made from (include[] as the official client sends it)",
                "parameters": by_id + item_query,
                "responses": {
                    "200": {"description": "the page", "content": {"application/json": {"schema": item_list}}},
                    **_errors(400, 401, 404),
                },
            }
        },
    }


def _conversations_paths(components: dict) -> dict:
    """OpenAI's Conversations API: a conversation made (with items, metadata), read, its metadata updated,
    deleted; its items listed (paged as a response's input items), added, read and deleted."""
    conversation = _schema(conversations_protocol.Conversation, components)
    item_list = _schema(responses_protocol.InputItemList, components)
    item = _schema(responses_protocol.InputItemOut, components, "ConversationItem")
    query = responses_protocol.InputItemsQuery.model_json_schema()["properties"]
    item_query = [{"name": name, "in": "query", "required": False, "schema": query[name]} for name in query]
    include = [p for p in item_query if p["name"] == "include"]

    def body(model) -> dict:
        return {"required": True, "content": {"application/json": {"schema": _schema(model, components)}}}

    by_id, by_item = _in_path("conversation_id"), _in_path("conversation_id", "item_id")
    return {
        "/v1/conversations": {
            "post": {
                "summary": "a conversation, with its first items (at most 20) and metadata",
                "requestBody": body(conversations_protocol.ConversationCreate),
                "responses": _answer(conversation, "the conversation", 400, 401, 413, 415, 503),
            }
        },
        "/v1/conversations/{conversation_id}": {
            "get": {
                "summary": "a conversation",
                "parameters": by_id,
                "responses": _answer(conversation, "the conversation", 401, 404),
            },
            "post": {
                "summary": "a conversation's metadata replaced",
                "parameters": by_id,
                "requestBody": body(conversations_protocol.ConversationUpdate),
                "responses": _answer(conversation, "the conversation", 400, 401, 404, 415, 503),
            },
            "delete": {
                "summary": "forget a conversation (503 while the shared store is down)",
                "parameters": by_id,
                "responses": _answer(
                    _schema(conversations_protocol.ConversationDeleted, components), "deleted", 401, 404, 503
                ),
            },
        },
        "/v1/conversations/{conversation_id}/items": {
            "get": {
                "summary": "a page of a conversation's items (include[] as the official client sends it)",
                "parameters": by_id + item_query,
                "responses": _answer(item_list, "the page", 400, 401, 404),
            },
            "post": {
                "summary": "items added after the conversation's own (at most 20 at once): the added items",
                "parameters": by_id + include,
                "requestBody": body(conversations_protocol.ItemsCreate),
                "responses": _answer(item_list, "the added items", 400, 401, 404, 413, 415, 503),
            },
        },
        "/v1/conversations/{conversation_id}/items/{item_id}": {
            "get": {
                "summary": "one item of a conversation",
                "parameters": by_item + include,
                "responses": _answer(item, "the item", 400, 401, 404),
            },
            "delete": {
                "summary": "an item deleted from a conversation: the conversation",
                "parameters": by_item,
                "responses": _answer(conversation, "the conversation", 401, 404, 503),
            },
        },
    }


def _batches_paths(components: dict) -> dict:
    """OpenAI's Files and Batches APIs: uploads (a batch's JSONL lines), batches of them, their results."""
    bp = batches_protocol
    file, batch = _schema(bp.FileObject, components), _schema(bp.Batch, components)
    page = [
        {
            "name": "limit",
            "in": "query",
            "required": False,
            "schema": {"type": "integer", "minimum": 1, "maximum": 100},
        },
        {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}},
    ]
    purpose = {"name": "purpose", "in": "query", "required": False, "schema": {"enum": list(bp.PURPOSES)}}
    upload = {
        "type": "object",
        "required": ["file", "purpose"],
        "properties": {
            "file": {"type": "string", "format": "binary"},
            "purpose": {"enum": list(bp.PURPOSES)},
            "expires_after[anchor]": {"const": "created_at"},
            "expires_after[seconds]": {"type": "integer", "minimum": bp.MIN_EXPIRY, "maximum": bp.MAX_EXPIRY},
        },
    }
    content = {"type": "string", "format": "binary", "description": "the file's bytes (JSONL for .jsonl files)"}
    batch_body = {"required": True, "content": {"application/json": {"schema": _schema(bp.BatchCreate, components)}}}
    return {
        "/v1/files": {
            "post": {
                "summary": "upload a file (a batch's JSONL lines: purpose batch)",
                "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": upload}}},
                "responses": _answer(file, "the file", 400, 401, 413, 429, 503),
            },
            "get": {
                "summary": "the tenant's files, newest first",
                "parameters": [purpose, *page],
                "responses": _answer(_schema(bp.FileList, components), "a page of files", 400, 401, 503),
            },
        },
        "/v1/files/{file_id}": {
            "get": {
                "summary": "a file",
                "parameters": _in_path("file_id"),
                "responses": _answer(file, "the file", 401, 404, 503),
            },
            "delete": {
                "summary": "delete a file (a batch running from it is cancelled)",
                "parameters": _in_path("file_id"),
                "responses": _answer(_schema(bp.FileDeleted, components), "deleted", 401, 404, 503),
            },
        },
        "/v1/files/{file_id}/content": {
            "get": {
                "summary": "a file's content (a batch's output and error files: its answers)",
                "parameters": _in_path("file_id"),
                "responses": {
                    "200": {
                        "description": "the bytes, named by Content-Disposition",
                        "content": {
                            "application/jsonl": {"schema": content},
                            "application/octet-stream": {"schema": content},
                        },
                    },
                    **_errors(401, 404, 503),
                },
            }
        },
        "/v1/batches": {
            "post": {
                "summary": "a batch of an uploaded file's lines, run beside the interactive requests",
                "requestBody": batch_body,
                "responses": _answer(batch, "the batch", 400, 401, 404, 415, 429, 503),
            },
            "get": {
                "summary": "the tenant's batches, newest first",
                "parameters": page,
                "responses": _answer(_schema(bp.BatchList, components), "a page of batches", 400, 401, 503),
            },
        },
        "/v1/batches/{batch_id}": {
            "get": {
                "summary": "a batch: its status and request_counts",
                "parameters": _in_path("batch_id"),
                "responses": _answer(batch, "the batch", 401, 404, 503),
            }
        },
        "/v1/batches/{batch_id}/cancel": {
            "post": {
                "summary": "cancel a batch (its lines not yet run are skipped)",
                "parameters": _in_path("batch_id"),
                "responses": _answer(batch, "the batch", 401, 404, 503),
            }
        },
    }


def _search_paths(components: dict) -> dict:
    """Embeddings, rerank (Cohere/Jina, as vLLM serves it; /v2/rerank the same) and vLLM's score."""
    errors = _errors(400, 401, 413, 415, 422, 429, 503)

    def post(summary: str, request_model, answer_model, form: dict | None = None) -> dict:
        content = {"application/json": {"schema": _schema(request_model, components)}}
        if form is not None:
            content["multipart/form-data"] = {"schema": form}
        answer = {
            "description": "the answer",
            "content": {"application/json": {"schema": _schema(answer_model, components)}},
        }
        return {
            "post": {
                "summary": summary,
                "requestBody": {"required": True, "content": content},
                "responses": {"200": answer, **errors},
            }
        }

    text, texts = {"type": "string"}, {"type": "array", "items": {"type": "string"}}
    files = {"type": "array", "items": {"type": "string", "format": "binary"}}
    embedding_form = {
        "type": "object",
        "properties": {"input": texts, "image": files, "instruction": text, "dimensions": {"type": "integer"}},
    }
    rerank_form = {
        "type": "object",
        "required": ["query"],
        "properties": {
            "query": text,
            "query_image": files,
            "documents": texts,
            "document_image": files,
            "top_n": {"type": "integer"},
            "instruction": text,
        },
    }
    rerank = post(
        "relevance of each document to the query (a reranker)",
        search_protocol.RerankRequest,
        search_protocol.RerankResponse,
        rerank_form,
    )
    return {
        "/v1/embeddings": post(
            "OpenAI embeddings (an embedding model): texts, pictures, clips, or a user message",
            search_protocol.EmbeddingsRequest,
            search_protocol.EmbeddingList,
            embedding_form,
        ),
        "/v1/rerank": rerank,
        "/v2/rerank": rerank,
        "/v1/score": post(
            "vLLM's score: a reranker's relevance, or an embedding model's cosine similarity, per pair",
            search_protocol.ScoreRequest,
            search_protocol.ScoreResponse,
        ),
    }


def _anthropic_paths(components: dict) -> dict:
    """Anthropic's Messages API: the request, the message, each stream event, the token count."""
    components["AnthropicError"] = _ANTHROPIC_ERROR_SCHEMA
    request = _schema(anthropic_protocol.MessagesRequest, components)
    count_request = _schema(anthropic_protocol.CountTokensRequest, components)
    message = _schema(anthropic_protocol.MessageOut, components)
    count = _schema(anthropic_protocol.CountTokensOut, components)
    events = [_schema(e, components) for e in anthropic_protocol.STREAM_EVENTS]
    errors = _anthropic_errors(400, 401, 413, 415, 422, 429, 503)
    return {
        "/v1/messages": {
            "post": {
                "summary": "Anthropic Messages (SSE events when stream is true); x-api-key or a bearer key",
                "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
                "responses": {
                    "200": {
                        "description": (
                            "a message, or (stream: true) server-sent events, each `event: <type>` and `data: ` "
                            "with one of x-event-schemas: message_start, content_block_start/delta/stop, "
                            "message_delta, message_stop (and ping)"
                        ),
                        "content": {
                            "application/json": {"schema": message},
                            "text/event-stream": {
                                "schema": {"type": "string", "description": "event: <type> / data: <event JSON>"},
                                "x-event-schemas": events,
                            },
                        },
                    },
                    **errors,
                },
            }
        },
        "/v1/messages/count_tokens": {
            "post": {
                "summary": "the prompt's tokens, as a Messages request with this body would have them",
                "requestBody": {"required": True, "content": {"application/json": {"schema": count_request}}},
                "responses": {
                    "200": {"description": "the count", "content": {"application/json": {"schema": count}}},
                    **errors,
                },
            }
        },
    }


def openapi_document(limits: RequestLimits) -> dict:
    """The document for this server: the request schemas, and its limits (`x-limits`; the stop
    strings a request may carry also as maxItems)."""
    document = copy.deepcopy(_document())
    document["info"]["x-limits"] = limits.published()
    for name in ("ChatCompletionRequest", "NativeChatRequest"):
        stop = document["components"]["schemas"][name]["properties"]["stop"]
        for option in stop["anyOf"]:
            if option.get("type") == "array":
                option["maxItems"] = limits.max_stop_strings
    return document


@lru_cache(maxsize=1)
def _document() -> dict:
    components: dict = {"Error": _ERROR_SCHEMA}
    openai_ref = _schema(ChatCompletionRequest, components)
    native_ref = _schema(NativeChatRequest, components)
    completion, chunk, models = (_schema(m, components) for m in (ChatCompletion, ChatCompletionChunk, ModelList))
    card = _schema(ModelCard, components)
    answer = _schema(NativeAnswer, components)
    lines = [_schema(m, components) for m in (NativeHead, NativeDelta, NativeDone)]
    chat_errors = _errors(400, 401, 413, 415, 422, 429, 503)
    anthropic_paths = _anthropic_paths(components)
    responses_paths = _responses_paths(components)
    conversations_paths = _conversations_paths(components)
    search_paths = _search_paths(components)
    batches_paths = _batches_paths(components)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Qwen3-VL CPU service",
            "version": "1.0.0",
            "description": (
                "OpenAI Chat Completions, Responses, Conversations, Embeddings, Files and Batches, Anthropic "
                "Messages, rerank and score, a curl-first JSON-lines API."
            ),
        },
        "paths": {
            "/v1/chat/completions": {
                "post": {
                    "summary": "OpenAI Chat Completions (SSE when stream is true)",
                    "requestBody": {"required": True, "content": {"application/json": {"schema": openai_ref}}},
                    "responses": {
                        "200": {
                            "description": (
                                "a chat.completion, or (stream: true) server-sent events, each `data: ` and a "
                                "chat.completion.chunk, ending with `data: [DONE]`"
                            ),
                            "content": {
                                "application/json": {"schema": completion},
                                "text/event-stream": {
                                    "schema": {"type": "string", "description": "data: <ChatCompletionChunk JSON>"},
                                    "x-event-schema": chunk,
                                },
                            },
                        },
                        **chat_errors,
                    },
                }
            },
            "/v1/chat": {
                "post": {
                    "summary": "Native endpoint: JSON lines (application/x-ndjson), stateful by conversation_id",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {"schema": native_ref},
                            "multipart/form-data": {"schema": _form_schema()},
                        },
                    },
                    "responses": {
                        "200": {
                            "description": (
                                "JSON lines: a NativeHead, a NativeDelta per piece of text, a NativeDone; or one "
                                "NativeAnswer when stream is false"
                            ),
                            "content": {
                                "application/x-ndjson": {
                                    "schema": {"type": "string", "description": "one JSON object per line"},
                                    "x-line-schemas": lines,
                                },
                                "application/json": {"schema": answer},
                            },
                        },
                        **chat_errors,
                    },
                }
            },
            **responses_paths,
            **conversations_paths,
            **anthropic_paths,
            **search_paths,
            **batches_paths,
            "/v1/models": {
                "get": {
                    "summary": "the loaded model",
                    "responses": {
                        "200": {"description": "model list", "content": {"application/json": {"schema": models}}},
                        **_errors(401, 503),
                    },
                }
            },
            "/v1/models/{model_id}": {
                "get": {
                    "summary": "the loaded model by its id (another id: 404 model_not_found)",
                    "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                    "responses": {
                        "200": {"description": "the model", "content": {"application/json": {"schema": card}}},
                        **_errors(401, 404, 503),
                    },
                }
            },
            "/health": {"get": {"summary": "liveness", "responses": {"200": {"description": "alive"}}}},
            "/ready": {
                "get": {
                    "summary": "readiness (503 while loading); needs no API key",
                    "responses": {"200": {"description": "ready"}, **_errors(503)},
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {"200": {"description": "exposition text"}, **_errors(401)},
                }
            },
        },
        "components": {
            "schemas": components,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
        "security": [{}, {"bearer": []}, {"x-api-key": []}],
    }

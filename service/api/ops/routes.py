"""Operational endpoints: models, liveness, readiness, Prometheus metrics, the OpenAPI document."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify

from ... import metrics, startup
from ...errors import ServiceError
from ...random_checkpoints.marker import RANDOM_MODEL_WARNING
from ..http_io import error_response
from ..openapi import openapi_document
from ..schemas import dump
from ..state import state
from .protocol import ModelCard, ModelList

ops_api = Blueprint("ops", __name__)


@ops_api.get("/health")
def health():
    """Alive: the worker answers, whatever the model is doing."""
    return jsonify({"status": "ok"})


@ops_api.get("/ready")
def ready():
    """Ready to serve: the model is loaded (503 while loading or after a failed load), and which
    INT8 kernels serve it; `degraded` (still 200: the rest serves) names a part that cannot be used
    now — the job store, as last seen (the Batch API then answers 503), or the shared store (each
    instance then serves conversations from its own state)."""
    app_state = state()
    try:
        engine = app_state.require_engine()
    except ServiceError as exc:  # loading, or the load failed
        return error_response(exc)
    info = engine.info
    body = {"status": "ready", "model": info.name, "random_model": info.is_random, "thinking": info.thinking}
    problems = {"job_store": app_state.batches.jobs.problem()}
    if app_state.shared is not None:  # conversations served from this instance's own state meanwhile
        problems["shared_state"] = app_state.shared.problem()
    problems = {part: problem for part, problem in problems.items() if problem is not None}
    if problems:
        body["status"], body["degraded"] = "degraded", problems
    if info.int8_kernels is not None:  # which kernel serves; what each measured is on /metrics (behind a key)
        body["int8_kernel"] = {part: info.int8_kernels[part] for part in ("decoder", "vision")}
    body["startup"] = startup.timeline()  # where the start's seconds went (service/startup.py)
    return jsonify(body)


def _card(info) -> ModelCard:
    card = ModelCard(
        id=info.name,
        object="model",
        created=0,
        owned_by="local",
        quantization=info.quantization,
        random_test_model=info.is_random,
        image_max_pixels=info.image_max_pixels,
        thinking=info.thinking,
    )
    if info.is_random:
        card.warning = RANDOM_MODEL_WARNING
    return card


@ops_api.get("/v1/models")
def models():
    card = _card(state().require_engine().info)
    return jsonify(dump(ModelList(object="list", data=[card])))


@ops_api.get("/v1/models/<path:model_id>")
def model(model_id: str):
    """The loaded model's card by its id; any other id is a 404, as OpenAI answers an unknown model."""
    info = state().require_engine().info
    if model_id != info.name:
        raise ServiceError(
            f"the model {model_id[:128]!r} does not exist here: this server serves {info.name!r}",
            param="model",
            code="model_not_found",
            status=404,
        )
    return jsonify(dump(_card(info)))


@ops_api.get("/openapi.json")
def openapi():
    return jsonify(openapi_document(state().require_engine().limits))


@ops_api.get("/metrics")
def prometheus():
    body, content_type = metrics.render()
    return Response(body, content_type=content_type)

"""Search over HTTP on real Gunicorn instances serving the tiny presets: the official `openai` client's
embeddings.create (floats and base64, dimensions, pictures as the official objects and vLLM's forms), a
plain `requests` rerank (/v1/rerank, /v2/rerank, top_n, return_documents) and score, multipart forms for
curl, /openapi.json, the Batch API's /v1/embeddings lines, and what is refused: empty or too many inputs,
an undecodable picture, a disallowed `dimensions`, a request for the other task."""

from __future__ import annotations

import base64
import json
import time

import numpy as np
import openai
import pytest
import requests

from conftest import built_preset
from imaging import data_url, encode, pattern
from servers import openai_client

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def embedding_server(serve, cache_dir, tmp_path_factory):
    path = built_preset(cache_dir, "tiny-embedding")
    store = f"sqlite:///{tmp_path_factory.mktemp('search-jobs') / 'jobs.sqlite3'}"
    env = {"MODEL_PATH": str(path), "SEARCH_MAX_ITEMS": "8", "SEARCH_MAX_PICTURES": "9", "JOB_STORE_URL": store}
    with serve(env, "embedding") as (base, _):
        yield base


@pytest.fixture(scope="module")
def reranker_server(serve, cache_dir):
    with serve({"MODEL_PATH": str(built_preset(cache_dir, "tiny-reranker"))}, "reranker") as (base, _):
        yield base


def _png(seed: int) -> str:
    return data_url(encode(pattern(80, 64, seed=seed), ".png"))


def test_the_openai_client_embeds_texts_as_floats_and_base64(embedding_server):
    client = openai_client(embedding_server)
    texts = ["a red car", "a cat on a mat", "where is the dog?"]
    default = client.embeddings.create(model="m", input=texts)  # the client asks for base64 and decodes it
    floats = client.embeddings.create(model="m", input=texts, encoding_format="float")
    assert [e.index for e in default.data] == [0, 1, 2]
    for a, b in zip(default.data, floats.data):
        assert a.embedding == b.embedding and len(a.embedding) == 64
        assert abs(np.linalg.norm(a.embedding) - 1) < 1e-5
    one = client.embeddings.create(model="m", input="a cat on a mat", encoding_format="float")
    assert one.data[0].embedding == floats.data[1].embedding  # alone or beside others: the same floats
    assert default.usage.prompt_tokens == default.usage.total_tokens > 0
    assert (
        client.embeddings.create(model="m", input=texts[:1], dimensions=64).data[0].embedding
        == floats.data[0].embedding
    )


def test_pictures_embed_as_official_objects_vllm_parts_and_messages(embedding_server):
    picture = _png(1)
    official = requests.post(
        embedding_server + "/v1/embeddings",
        json={"input": [{"image": picture, "text": "a pattern"}, {"image": picture.split(",", 1)[1]}]},
        timeout=60,
    )
    assert official.status_code == 200, official.text
    content = [{"type": "image_url", "image_url": {"url": picture}}, {"type": "text", "text": "a pattern"}]
    parts = requests.post(embedding_server + "/v1/embeddings", json={"input": [{"content": content}]}, timeout=60)
    messages = requests.post(
        embedding_server + "/v1/embeddings",
        json={"messages": [{"role": "user", "content": content}], "encoding_format": "float"},
        timeout=60,
    )
    vectors = [official.json()["data"][0]["embedding"], parts.json()["data"][0]["embedding"]]
    assert vectors[0] == vectors[1] == messages.json()["data"][0]["embedding"]  # pictures first, as official
    assert official.json()["data"][1]["embedding"] != vectors[0]
    with open_form(picture) as files:
        form = requests.post(embedding_server + "/v1/embeddings", data={"input": "a pattern"}, files=files, timeout=60)
    assert form.status_code == 200 and len(form.json()["data"]) == 2


class open_form:
    """A multipart upload of one picture (curl -F image=@file)."""

    def __init__(self, picture: str):
        self.data = base64.b64decode(picture.split(",", 1)[1])

    def __enter__(self):
        return {"image": ("page.png", self.data, "image/png")}

    def __exit__(self, *exc):
        return False


def test_a_clip_embeds_beside_pictures_and_texts(embedding_server, tmp_path):
    from clips import write_clip

    clip = base64.b64encode(write_clip(tmp_path / "clip.mp4", frames=20, fps=10.0)).decode("ascii")
    body = {"input": [{"video": clip}, {"video": clip, "text": "a moving square"}, "a moving square"]}
    response = requests.post(embedding_server + "/v1/embeddings", json=body, timeout=120)
    assert response.status_code == 200, response.text
    vectors = [d["embedding"] for d in response.json()["data"]]
    assert len(vectors) == 3 and len({tuple(v) for v in vectors}) == 3
    broken = requests.post(embedding_server + "/v1/embeddings", json={"input": [{"video": "AAAA"}]}, timeout=60)
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "input[0].video"


def test_bad_embedding_requests_get_a_400_naming_the_field(embedding_server):
    url = embedding_server + "/v1/embeddings"

    def refused(body: dict, param: str, status: int = 400):
        response = requests.post(url, json=body, timeout=60)
        assert response.status_code == status, response.text
        assert response.json()["error"]["param"] == param, response.text

    refused({"input": ""}, "input")
    refused({"input": []}, "input")
    refused({"input": ["ok", ""]}, "input[1]")
    refused({"input": ["x"] * 9}, "input")
    refused({"input": ["x"] * 8 + [{"image": "data:image/png;base64,AAAA"}]}, "input")  # counted before decoding
    refused({"input": [{"image": "data:image/png;base64,AAAA"}]}, "input[0].image")
    refused({"input": ["x"], "dimensions": 65}, "dimensions")
    refused({"input": [{"image": "https://example.com/a.png"}]}, "input[0].image")
    chat = requests.post(
        embedding_server + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60
    )
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "wrong_model_task"
    rerank = requests.post(embedding_server + "/v1/rerank", json={"query": "q", "documents": ["d"]}, timeout=60)
    assert rerank.status_code == 400 and "/v1/embeddings" in rerank.json()["error"]["message"]
    assert requests.get(embedding_server + "/health", timeout=10).status_code == 200


def test_a_request_decodes_at_most_search_max_pictures_pictures_and_clip_frames(embedding_server, tmp_path):
    """SEARCH_MAX_PICTURES (9 here) bounds what one request decodes whatever its item count: its pictures
    are counted before any is decoded (a broken one among them is never reached), a clip's frames before
    they are; past it a 400 names the field and the limit, at it the request is served."""
    from clips import write_clip

    url, picture, broken = embedding_server + "/v1/embeddings", _png(4), "data:image/png;base64,AAAA"

    def refused(body: dict, param: str, path: str = "/v1/embeddings"):
        response = requests.post(embedding_server + path, json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("too_many_pictures", param), response.text
        assert "at most 9" in error["message"] and "SEARCH_MAX_PICTURES" in error["message"]

    refused({"input": [{"image": [broken, *[picture] * 4]}, {"image": [picture] * 5}]}, "input")
    parts = [{"type": "image_url", "image_url": {"url": broken}}] * 10
    refused({"input": [{"content": parts}]}, "input")
    refused({"messages": [{"role": "user", "content": parts}]}, "messages")
    refused({"text_1": {"image": [picture] * 5}, "text_2": [{"image": [broken] * 5}]}, "text_2", "/v1/score")
    clip = base64.b64encode(write_clip(tmp_path / "clip.mp4", frames=20, fps=10.0)).decode("ascii")  # 4 frames
    refused({"input": [{"image": [picture] * 2}, {"video": clip}, {"video": clip}]}, "input[2].video")
    clip_part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + clip}}
    pictures = [{"type": "image_url", "image_url": {"url": picture}}] * 2
    refused({"messages": [{"role": "user", "content": [*pictures, clip_part, clip_part]}]}, "messages[0].content[3]")
    at_limit = requests.post(url, json={"input": [{"image": [picture] * 5}, {"image": [picture] * 4}]}, timeout=120)
    assert at_limit.status_code == 200 and len(at_limit.json()["data"]) == 2, at_limit.text
    with_clip = requests.post(url, json={"input": [{"image": picture}, {"video": clip}, {"video": clip}]}, timeout=120)
    assert with_clip.status_code == 200, with_clip.text
    limits = requests.get(embedding_server + "/openapi.json", timeout=10).json()["info"]["x-limits"]
    assert limits["max_search_pictures"] == 9


def test_a_rerank_counts_the_querys_picture_with_the_documents(reranker_server):
    """SEARCH_MAX_PICTURES at its default (32): a picture query and 32 picture documents are refused before
    any is decoded."""
    documents = [{"image": "data:image/png;base64,AAAA"}] * 32
    body = {"query": {"image": _png(5)}, "documents": documents}
    response = requests.post(reranker_server + "/v1/rerank", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("too_many_pictures", "documents") and "at most 32" in error["message"]


def test_an_embedding_models_score_names_the_field_and_takes_as_many_texts_as_embeddings(embedding_server):
    """text_1 and text_2 are embedded by a request each: a too-long text_1 is named as text_1, and one text_1
    against SEARCH_MAX_ITEMS text_2 is within the limit; the cosines are those of the endpoint's vectors."""
    url = embedding_server + "/v1/score"
    too_long = requests.post(url, json={"text_1": "word " * 20000, "text_2": ["a", "b"]}, timeout=60)
    assert too_long.status_code == 422 and too_long.json()["error"]["param"] == "text_1[0]", too_long.text
    texts = [f"a picture of {n} cats" for n in range(8)]
    scored = requests.post(url, json={"text_1": "cats", "text_2": texts}, timeout=120)
    assert scored.status_code == 200, scored.text
    vectors = openai_client(embedding_server).embeddings.create(model="m", input=["cats", *texts[:2]])
    first, *others = (np.array(d.embedding, dtype=np.float64) for d in vectors.data)
    for score, other in zip(scored.json()["data"][:2], others):
        assert abs(score["score"] - float(first @ other)) < 1e-6
    many = requests.post(url, json={"text_1": "cats", "text_2": texts + ["one more"]}, timeout=60)
    assert many.status_code == 400 and many.json()["error"]["code"] == "too_many_items"


def test_a_plain_requests_call_reranks_documents(reranker_server):
    documents = ["a cat on a red car", "stock prices fell", {"image": _png(2)}, "a cat"]
    body = {"query": "a cat", "documents": documents, "top_n": 3}
    response = requests.post(reranker_server + "/v1/rerank", json=body, timeout=60)
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert len(results) == 3 and sorted({r["index"] for r in results}) == sorted(r["index"] for r in results)
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True) and all(0 < s < 1 for s in scores)
    assert all("document" in r for r in results)
    every = requests.post(
        reranker_server + "/v2/rerank", json={**body, "top_n": None, "return_documents": False}, timeout=60
    ).json()["results"]
    assert len(every) == 4 and all("document" not in r for r in every)
    by_index = {r["index"]: r["relevance_score"] for r in every}
    assert all(by_index[r["index"]] == r["relevance_score"] for r in results)
    score = requests.post(
        reranker_server + "/v1/score", json={"text_1": "a cat", "text_2": ["a cat on a red car", "a cat"]}, timeout=60
    ).json()
    assert [d["score"] for d in score["data"]] == [by_index[0], by_index[3]]
    refused = requests.post(reranker_server + "/v1/embeddings", json={"input": "x"}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "wrong_model_task"
    empty = requests.post(reranker_server + "/v1/rerank", json={"query": "q", "documents": ["ok", ""]}, timeout=60)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "documents[1]"


def test_openapi_types_the_search_endpoints(embedding_server):
    document = requests.get(embedding_server + "/openapi.json", timeout=10).json()
    for path in ("/v1/embeddings", "/v1/rerank", "/v2/rerank", "/v1/score"):
        assert "post" in document["paths"][path]
    schemas = document["components"]["schemas"]
    assert {"EmbeddingsRequest", "EmbeddingList", "RerankRequest", "RerankResponse"} <= set(schemas)


def test_a_batch_of_embedding_lines_has_the_endpoints_vectors_and_counts(embedding_server):
    client = openai_client(embedding_server)
    inputs = [["a red car", "a cat"], "where is the dog?", [{"image": _png(3)}], ""]
    lines = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"input": x, "encoding_format": "float"},
        }
        for i, x in enumerate(inputs)
    ]
    content = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    uploaded = client.files.create(file=("embed.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (4, 3, 1)
    answers = {r["custom_id"]: r for r in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())}
    direct = client.embeddings.create(model="m", input=["a red car", "a cat"], encoding_format="float")
    assert answers["e0"]["response"]["body"]["data"][1]["embedding"] == direct.data[1].embedding
    errors = [json.loads(t) for t in client.files.content(batch.error_file_id).text.splitlines()]
    assert errors[0]["custom_id"] == "e3" and errors[0]["response"]["status_code"] == 400


def test_a_chat_server_refuses_embeddings_clearly(shared_server):
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client(shared_server).embeddings.create(model="m", input="hi")
    assert refused.value.body["code"] == "wrong_model_task" and "/v1/chat/completions" in refused.value.message


def test_search_requests_need_the_api_key_where_keys_are_set(keyed_server):
    from conftest import AUTH

    base, _ = keyed_server
    for path, body in (("/v1/embeddings", {"input": "x"}), ("/v1/rerank", {"query": "q", "documents": ["d"]})):
        assert requests.post(base + path, json=body, timeout=30).status_code == 401
        keyed = requests.post(base + path, json=body, headers=AUTH, timeout=30)
        assert keyed.status_code == 400 and keyed.json()["error"]["code"] == "wrong_model_task"


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/embeddings", {"input": 5}),
        ("/v1/embeddings", {"input": [[1, 2, 3]]}),
        ("/v1/embeddings", {"input": {"image": 5}}),
        ("/v1/embeddings", {"input": "x", "dimensions": "many"}),
        ("/v1/embeddings", {"input": "x", "encoding_format": "hex"}),
        ("/v1/embeddings", {"input": "x", "messages": [{"role": "user", "content": "y"}]}),
        ("/v1/embeddings", {"messages": [{"role": "assistant", "content": "y"}]}),
        ("/v1/embeddings", {"input": [{"content": []}]}),
        (
            "/v1/embeddings",
            {"input": [{"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}]}]},
        ),
        ("/v1/embeddings", {"input": ["\ud800"]}),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c"]}),
        ("/v1/score", {"text_1": "a", "text_2": []}),
    ],
)
def test_hostile_search_bodies_get_a_4xx_and_the_worker_keeps_serving(embedding_server, path, body):
    response = requests.post(embedding_server + path, data=json.dumps(body), timeout=60,
                             headers={"Content-Type": "application/json"})  # fmt: skip
    assert 400 <= response.status_code < 500 and response.json()["error"]["message"], response.text
    assert requests.post(embedding_server + "/v1/embeddings", json={"input": "ok"}, timeout=60).status_code == 200

"""Hostile requests for fuzzing: hypothesis strategies of bodies, images and multipart forms that a
server on the internet meets. Shared by tests/test_fuzz.py (short) and bench/bench_fuzz.py (long run)."""

from __future__ import annotations

import base64
import json
import struct

from hypothesis import strategies as st

from imaging import data_url, encode, pattern

_PNG = encode(pattern(64, 48), ".png")
_JPEG = encode(pattern(64, 48), ".jpg")
_WEBP = encode(pattern(64, 48), ".webp")


def _giant_png(width: int, height: int) -> bytes:
    data = bytearray(_PNG)
    data[16:24] = struct.pack(">II", width, height)
    return bytes(data)


def _giant_jpeg(width: int, height: int) -> bytes:
    data = bytearray(_JPEG)
    sof = data.find(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


dimensions = st.integers(min_value=0, max_value=2**31 - 1)

image_bytes = st.one_of(
    st.binary(max_size=2048),
    st.sampled_from([_PNG, _JPEG, _WEBP]).flatmap(lambda b: st.integers(0, len(b)).map(lambda n: b[:n])),
    st.tuples(dimensions, dimensions).map(lambda wh: _giant_png(*wh)),
    st.tuples(st.integers(0, 65535), st.integers(0, 65535)).map(lambda wh: _giant_jpeg(*wh)),
    st.sampled_from([_PNG, _JPEG, _WEBP]).flatmap(
        lambda b: st.tuples(st.integers(0, len(b) - 1), st.integers(0, 255)).map(
            lambda ib: b[: ib[0]] + bytes([ib[1]]) + b[ib[0] + 1 :]
        )
    ),  # one corrupted byte
)

unicode_text = st.one_of(
    st.text(max_size=200),
    st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=50),
    st.sampled_from(["\u0000", "\ud800", "\udfff", "\u202e", "\ufeff", "🦙" * 50, "a\u0301" * 30, "\r\n" * 40]),
)

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), unicode_text)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(unicode_text, inner, max_size=4)),
    max_leaves=20,
)


image_urls = st.one_of(
    image_bytes.map(data_url),
    st.text(max_size=100).map(lambda t: "data:image/png;base64," + t),  # base64 that is not base64
    st.sampled_from(
        [
            "http://127.0.0.1:1/x.png",
            "https://example.com/a.jpg",
            "file:///etc/passwd",
            "data:text/plain;base64,aGVsbG8=",
            "data:image/png,rawbytes",
            "ftp://x/y",
            "",
            "data:",
        ]
    ),
)

content_parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": unicode_text}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": image_urls})}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": image_urls}),
    st.dictionaries(st.sampled_from(["type", "text", "image_url", "input_audio"]), json_values, max_size=3),
)

messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.one_of(st.sampled_from(["user", "assistant", "system", "developer"]), unicode_text),
            "content": st.one_of(unicode_text, st.lists(content_parts, max_size=3), json_values),
        }
    ),
    max_size=4,
)

sampling = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.one_of(st.integers(-5, 6), json_values),
        "temperature": st.one_of(st.floats(-1, 3), json_values),
        "top_p": st.floats(-1, 2),
        "top_k": st.integers(-3, 100),
        "seed": st.integers(-5, 2**64),
        "stop": st.one_of(unicode_text, st.lists(unicode_text, max_size=6)),
        "stream": json_values,
        "n": st.integers(-1, 3),
        "stream_options": json_values,
        "user": json_values,
    },
)


@st.composite
def openai_bodies(draw) -> bytes:
    body = {"messages": draw(st.one_of(messages, json_values)), **draw(sampling)}
    body["max_tokens"] = body.get("max_tokens", 4)
    return json.dumps(body).encode()


@st.composite
def native_bodies(draw) -> bytes:
    body = draw(
        st.one_of(
            st.fixed_dictionaries(
                {"prompt": unicode_text},
                optional={
                    "images": st.lists(
                        st.one_of(image_urls, image_bytes.map(lambda b: base64.b64encode(b).decode())), max_size=2
                    )
                },
            ),
            st.fixed_dictionaries({"messages": st.one_of(messages, json_values)}),
            st.dictionaries(unicode_text, json_values, max_size=4),
        )
    )
    if isinstance(body, dict):
        body.update(draw(sampling))
        body.setdefault("max_tokens", 3)
    return json.dumps(body).encode()


raw_bodies = st.one_of(
    st.binary(max_size=512),
    st.integers(1, 5000).map(lambda depth: b"[" * depth + b"]" * depth),  # deeply nested JSON
    st.integers(1, 5000).map(lambda depth: b'{"a":' * depth + b"1" + b"}" * depth),
    st.text(max_size=300).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.just(b'{"messages": [{"role": "user", "content": "' + b"x" * 200_000 + b'"}], "max_tokens": 2}'),
)


@st.composite
def multipart_forms(draw) -> tuple[list, dict]:
    """(files, data) for requests: missing, duplicate and unknown parts, hostile images."""
    files = [
        ("image", ("f.bin", draw(image_bytes), draw(st.sampled_from(["image/png", "application/x-foo"]))))
        for _ in range(draw(st.integers(0, 3)))
    ]
    names = st.sampled_from(["prompt", "conversation_id", "max_tokens", "temperature", "stop", "stream", "junk"])
    fields = draw(st.lists(st.tuples(names, unicode_text), max_size=5))
    if draw(st.booleans()):
        fields.append(("prompt", draw(unicode_text)))
    if draw(st.booleans()):
        files.append(("other", ("x", b"abc", "text/plain")))
    files += [(k, (None, v.encode("utf-8", "surrogatepass"))) for k, v in fields]
    return files, {}

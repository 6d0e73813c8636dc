"""service/model/processor.py against transformers' Qwen3VLProcessor + Qwen2VLImageProcessorPil, built
as service/model/loading.py built them before it switched to the service's own: same prompts, same
token ids, bit-identical pixel values; and importing / loading it keeps transformers' modeling code out."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers.image_utils import SizeDict

from service.model.processor import ImageProcessor, Processor, chat_template_of

ROOT = Path(__file__).resolve().parent.parent


def reference_processor(path: Path):
    """transformers' processor, as service/model/loading.py's load_processor built it."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLProcessor

    class VideoLessQwen3VLProcessor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = AutoImageProcessor.from_pretrained(path)
    chat_template = chat_template_of(tokenizer, path)
    return VideoLessQwen3VLProcessor(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=chat_template
    )


@pytest.fixture(params=["tiny", "tiny-thinking"])
def pair(request, tiny_dir, tiny_thinking_dir):
    path = tiny_dir if request.param == "tiny" else tiny_thinking_dir
    theirs = reference_processor(path)
    assert type(theirs.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    return Processor.load(path), theirs


def pictures(*sizes: tuple[int, int], seed: int = 0) -> list[np.ndarray]:
    """Random H x W x 3 uint8 pictures (every byte value in every channel, for the bit checks)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8) for h, w in sizes]


def fit(processor, shortest: int, longest: int) -> None:
    """The processor's size rule: pictures resized into [shortest, longest] pixels."""
    processor.image_processor.size = SizeDict(shortest_edge=shortest, longest_edge=longest)


def assert_same_batch(ours: dict, theirs) -> None:
    assert set(ours) == set(theirs.keys())
    for key in theirs.keys():
        a, b = ours[key], theirs[key]
        assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, key
        assert torch.equal(a, b), key


def test_attributes(pair):
    ours, theirs = pair
    for name in (
        "image_token",
        "video_token",
        "vision_start_token",
        "vision_end_token",
        "image_token_id",
        "video_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
        "chat_template",
        "image_token_ids",
        "video_token_ids",
    ):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.video_processor is None and theirs.video_processor is None
    assert ours.tokenizer.init_kwargs == theirs.tokenizer.init_kwargs
    ip, ref = ours.image_processor, theirs.image_processor
    for name in ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std", "rescale_factor"):
        assert getattr(ip, name) == getattr(ref, name), name
        assert type(getattr(ip, name)) is type(getattr(ref, name)), name
    for name in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        assert getattr(ip, name) == getattr(ref, name), name
    assert int(ip.resample) == int(ref.resample)
    assert dict(ip.size) == dict(ref.size)
    assert (ip.size.shortest_edge, ip.size.longest_edge) == (ref.size.shortest_edge, ref.size.longest_edge)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    }
]

CONVERSATIONS = {
    "text": [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}],
    "string content": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "pictures": [
        {"role": "system", "content": [{"type": "text", "text": "You look at pictures."}]},
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "and"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "text", "text": "what differs?"},
            ],
        },
    ],
    "history": [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
            "reasoning_content": "The user wants the weather.",
        },
        {"role": "tool", "content": [{"type": "text", "text": '{"temp": 21}'}]},
        {
            "role": "assistant",
            "content": "It is 21 degrees.",
            "tool_calls": [],
            "reasoning_content": None,
        },
        {"role": "user", "content": [{"type": "text", "text": "And <|image_pad|> as text?"}]},
    ],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template(pair, name, tools, add_generation_prompt):
    ours, theirs = pair
    conversation = CONVERSATIONS[name]
    for kwargs in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
        args = dict(tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
        expected = theirs.apply_chat_template(conversation, **args)
        assert isinstance(expected, str)
        assert ours.apply_chat_template(conversation, **args) == expected, kwargs


SWITCHED = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content if m.content is string else m.content | length }}"
    "<|im_end|>\n{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}{{ eos_token }}{{ custom | default('') }}"
)


def test_chat_template_variables(pair):
    """A template that reads enable_thinking, the tokenizer's special tokens and a variable of its own."""
    ours, theirs = pair
    conversation = CONVERSATIONS["pictures"]
    for kwargs in ({}, {"enable_thinking": True}, {"enable_thinking": False, "custom": "X"}):
        args = dict(chat_template=SWITCHED, tools=TOOLS, tokenize=False, add_generation_prompt=True, **kwargs)
        assert ours.apply_chat_template(conversation, **args) == theirs.apply_chat_template(conversation, **args)
    off = ours.apply_chat_template(
        conversation, chat_template=SWITCHED, add_generation_prompt=True, enable_thinking=False
    )
    assert "<think>" in off


def test_chat_template_batch_and_continue(pair):
    ours, theirs = pair
    batch = [CONVERSATIONS["text"], CONVERSATIONS["pictures"]]
    assert ours.apply_chat_template(batch, tokenize=False) == theirs.apply_chat_template(batch, tokenize=False)
    answer = [*CONVERSATIONS["text"], {"role": "assistant", "content": "Partial ans"}]
    args = dict(tokenize=False, continue_final_message=True)
    assert ours.apply_chat_template(answer, **args) == theirs.apply_chat_template(answer, **args)
    with pytest.raises(ValueError, match="tokenize=False"):
        ours.apply_chat_template(answer, tokenize=True)


def prompt(processor, n_pictures: int) -> str:
    content = [{"type": "image"} for _ in range(n_pictures)] + [{"type": "text", "text": "Describe, please."}]
    return processor.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize(
    "sizes",
    [(), ((224, 160),), ((224, 160), (96, 128))],
    ids=["text-only", "one-picture", "two-pictures"],
)
def test_call_fitted(pair, sizes):
    """The service's case: pictures pre-sized to multiples of patch_size * merge_size, the processor
    told not to resize them (fit_processor)."""
    ours, theirs = pair
    factor = ours.image_processor.patch_size * ours.image_processor.merge_size
    assert all(h % factor == 0 and w % factor == 0 for h, w in sizes)
    for p in (ours, theirs):
        p.image_processor.do_resize = False
    images = pictures(*sizes)
    text = prompt(theirs, len(sizes))
    kwargs = {"images": images} if images else {}
    expected = theirs(text=[text], return_tensors="pt", **kwargs)
    got = ours(text=[text], return_tensors="pt", **kwargs)
    assert_same_batch(got, expected)
    pads = sum(h * w for h, w in sizes) // (factor * factor)
    assert int((got["input_ids"] == ours.image_token_id).sum()) == pads
    assert int(got["mm_token_type_ids"].sum()) == pads


def test_call_with_the_checkpoints_own_sizes(pair):
    """The checkpoint's min/max pixels (65536 here): small pictures are scaled up, odd ones resized,
    by transformers' smart_resize and Pillow, the same bits."""
    ours, theirs = pair
    images = pictures((224, 160), (97, 131), (300, 41), seed=1)
    text = prompt(theirs, len(images))
    assert_same_batch(
        ours(text=text, images=images, return_tensors="pt"), theirs(text=text, images=images, return_tensors="pt")
    )


@pytest.mark.parametrize(
    "size",
    [(32 * 32, 1 << 20), (64 * 64, 96 * 96), (256 * 256, 1 << 24)],
    ids=["fitted", "max-pixels", "min-pixels"],
)
def test_image_processor(pair, size):
    ours, theirs = pair
    fit(ours, *size)
    fit(theirs, *size)
    theirs_ip = theirs.image_processor
    images = pictures((224, 160), (96, 128), (250, 333), (64, 64), seed=2)
    images.append(np.ascontiguousarray(images[0][::-1, ::2]))  # a strided view's copy
    expected = theirs_ip(images=images, return_tensors="pt")
    got = ours.image_processor(images=images, return_tensors="pt")
    assert_same_batch(got, expected)
    assert got["pixel_values"].dtype == torch.float32 and got["image_grid_thw"].dtype == torch.int64
    one = ours.image_processor(images=[images[1]], return_tensors="pt")
    assert torch.equal(one["pixel_values"], theirs_ip(images=[images[1]], return_tensors="pt")["pixel_values"])


def test_image_processor_channels(pair):
    """Grey, RGBA and channels-first arrays: converted as transformers converts them."""
    ours, theirs = pair
    fit(ours, 32 * 32, 1 << 20)
    fit(theirs, 32 * 32, 1 << 20)
    theirs_ip = theirs.image_processor
    rng = np.random.default_rng(3)
    images = [
        rng.integers(0, 256, size=(64, 96, 1), dtype=np.uint8),
        rng.integers(0, 256, size=(64, 96, 4), dtype=np.uint8),
        rng.integers(0, 256, size=(3, 64, 96), dtype=np.uint8),
    ]
    assert_same_batch(ours.image_processor(images=images), theirs_ip(images=images, return_tensors="pt"))


def test_replacements_and_mm_token_types(pair):
    ours, theirs = pair
    fit(ours, 32 * 32, 1 << 20)
    theirs.image_processor.size = ours.image_processor.size
    images = pictures((64, 96), (128, 32))
    inputs = ours.image_processor(images=images, return_tensors="pt")
    ref_inputs = theirs.image_processor(images=images, return_tensors="pt")
    for i in range(len(images)):
        assert ours.replace_image_token(inputs, image_idx=i) == theirs.replace_image_token(ref_inputs, image_idx=i)
    t = ours
    texts = [
        f"a {t.image_token} b {t.video_token} c {t.image_token}",
        f"{t.video_token}{t.image_token} tail",
        "no placeholders",
    ]
    image_texts = ["<I0>", "<I1>", "<I2>"]
    video_texts = ["<V0>", "<V1>"]
    for args in ((image_texts, video_texts), (image_texts, []), ([], video_texts), ([], [])):
        assert ours.get_text_with_replacements(list(texts), *args) == theirs.get_text_with_replacements(
            list(texts), *args
        )
    ids = ours.tokenizer(texts[:2], return_token_type_ids=False)["input_ids"]
    assert ours.create_mm_token_type_ids(ids) == theirs.create_mm_token_type_ids(ids)
    row = torch.tensor([ids[0]])
    assert ours.create_mm_token_type_ids(row) == theirs.create_mm_token_type_ids(row)
    assert {1, 2} <= set(ours.create_mm_token_type_ids(row)[0])


def test_call_errors_like_transformers(pair):
    ours, theirs = pair
    images = pictures((64, 64))
    for kwargs in (
        {"text": [prompt(theirs, 2)], "images": images},
        {"text": [prompt(theirs, 1)]},
        {"text": [f"x {ours.video_token}"]},
    ):
        with pytest.raises(ValueError):
            theirs(return_tensors="pt", **kwargs)
        with pytest.raises(ValueError):
            ours(return_tensors="pt", **kwargs)


def test_load_without_a_chat_template(tiny_dir, tmp_path):
    for name in ("tokenizer.json", "preprocessor_config.json", "config.json"):
        shutil.copy(tiny_dir / name, tmp_path / name)
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template"):
        Processor.load(tmp_path)
    with pytest.raises(ValueError, match="preprocessor_config"):
        ImageProcessor.from_pretrained(tmp_path / "missing")


def test_no_modeling_code_imported(tiny_dir):
    script = (
        "import sys, json\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import numpy as np\n"
        "import service.model.processor as m\n"
        f"p = m.Processor.load({str(tiny_dir)!r})\n"
        "content = [{'type': 'image'}, {'type': 'text', 'text': 'hi'}]\n"
        "text = p.apply_chat_template([{'role': 'user', 'content': content}], tokenize=False,"
        " add_generation_prompt=True)\n"
        "p(text=[text], images=[np.zeros((64, 64, 3), np.uint8)], return_tensors='pt')\n"
        "heavy = ['transformers.modeling_utils', 'transformers.processing_utils',"
        " 'transformers.image_processing_utils', 'torch._dynamo']\n"
        "print(json.dumps([name for name in heavy if name in sys.modules]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []

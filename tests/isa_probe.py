"""What tests/test_every_cpu.py compares between instruction sets: run in a fresh Python (the forced
AVX2 settings are read once per process), it loads each checkpoint it is given and prints, as JSON, a
digest of every tensor an answer depends on — the vision features of a picture and of a clip, every
prompt row's logits, a few decode steps' logits, every layer's keys and values (a hybrid model's
recurrent states too), and a sampled answer's token ids, logprobs and `answer_digest`.

    python tests/isa_probe.py CACHE_DIR NAME=PATH:QUANTIZATION ...

(or the NAME=PATH:QUANTIZATION lines in the environment's PROBE_SPECS).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS.parent))
sys.path.insert(0, str(TESTS))

DECODE_STEPS = 4


def bits(tensor: torch.Tensor) -> str:
    """The tensor's bytes, digested (its dtype and shape named, so no two layouts collide)."""
    tensor = tensor.detach().contiguous()
    head = f"{tensor.dtype}{list(tensor.shape)}".encode()
    raw = tensor.view(torch.uint8) if tensor.numel() else tensor
    return hashlib.blake2b(head + raw.numpy().tobytes(), digest_size=8).hexdigest()


def features(prefix: str, found) -> dict[str, str]:
    deepstack = {f"{prefix}.deepstack{i}": bits(layer) for i, layer in enumerate(found.deepstack)}
    return {f"{prefix}.pooler": bits(found.pooler), **deepstack}


def the_cache(cache) -> dict[str, str]:
    """Every layer's keys and values, or a recurrent layer's state and convolution inputs."""
    out = {}
    for i, layer in enumerate(cache.layers):
        if hasattr(layer, "state"):
            out[f"kv{i}.state"], out[f"kv{i}.conv"] = bits(layer.state), bits(layer.conv)
        else:
            out[f"kv{i}.keys"], out[f"kv{i}.values"] = bits(layer.keys), bits(layer.values)
    return out


def probe(cache_dir: Path, path: Path, quantization: str) -> dict[str, str]:
    from service.engine.engine import Engine, GenerationRequest, SamplingParams
    from service.engine.prefill import PromptRows
    from service.media.images import decode_image
    from service.media.video import decode_video
    from service.model.attention import ExactAttention
    from service.model.forward import Rows, TextForward
    from service.model.loading import load_model
    from service.model.prompts import ChatMessage, ImagePart, TextPart, VideoPart, prepare_prompt
    from service.settings import load_settings
    from service.vision.features import VisionFeatures
    from service.vision.steps import image_steps, run_to_end, video_steps

    from clips import write_clip
    from imaging import encode, pattern

    settings = load_settings(
        cache_dir=cache_dir, model_path=path, quantization=quantization, threads=2, kv_disk_mb=0, speculative="off"
    )
    engine = Engine(load_model(settings), settings)
    picture = decode_image(encode(pattern(224, 160, seed=5), ".png"), engine.limits.image)
    clip = decode_video(write_clip(Path(cache_dir) / "isa-probe-clip.mp4", frames=20, fps=10.0), engine.limits.video)
    message = ChatMessage("user", [ImagePart(picture), VideoPart(clip), TextPart("What happens here, in detail?")])
    prompt = prepare_prompt(engine.processor, [message], engine.limits.prompt)
    out = {}
    with torch.inference_mode():
        found = {
            "image": run_to_end(image_steps(engine.vision_encoder, prompt.pixel_values[0], prompt.image_grid_thw)),
            "video": run_to_end(
                video_steps(engine.vision_encoder, prompt.pixel_values_videos[0], prompt.video_grid_thw)
            ),
        }
        out |= features("picture", found["image"]) | features("clip", found["video"])
        rows = PromptRows(engine.model, prompt, {m: VisionFeatures.cat([f]) for m, f in found.items()}, 0)
        forward = TextForward(engine.model, ExactAttention.load())
        cache = forward.new_cache(torch.float32)
        logits = forward(*rows.piece(cache, 0, len(rows.ids)))
        out["prompt.logits"] = bits(logits)
        token, steps = int(logits[-1].argmax()), []
        for _ in range(DECODE_STEPS):
            position = torch.tensor([cache.get_seq_length() + rows.rope_delta])
            step = forward(torch.tensor([token]), position, [Rows(cache, 1)])
            steps.append(step)
            token = int(step[-1].argmax())
        out["decode.logits"] = bits(torch.cat(steps))
        out |= the_cache(cache)
    sampling = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=0, seed=7, logprobs=2)
    done = list(engine.generate(GenerationRequest([message], sampling)))[-1]
    out["answer.ids"] = json.dumps(list(done.token_ids))
    out["answer.logprobs"] = json.dumps([entry.logprob for entry in done.logprobs])
    out["answer.digest"] = done.answer_digest
    return out


def paths() -> dict[str, str]:
    """What this process runs on — the instruction sets its kernels were built for and torch dispatches
    to — and, as a control, two of torch's own float ops (which follow them) on fixed inputs."""
    import torch.nn.functional as F

    from service import native

    x = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    return {
        "march": native.target_march(),
        "torch": torch.backends.cpu.get_cpu_capability(),
        "torch.gelu": bits(F.gelu(x)),
        "torch.softmax": bits(x.softmax(-1)),
    }


def main() -> None:
    from service import native
    from service.threads import compute_on

    cache_dir = Path(sys.argv[1])
    native.configure(cache_dir)
    compute_on(2)
    report = {"paths": paths()}
    for spec in sys.argv[2:] or os.environ["PROBE_SPECS"].splitlines():
        name, _, rest = spec.partition("=")
        path, _, quantization = rest.rpartition(":")
        report[name] = probe(cache_dir, Path(path), quantization)
    print(json.dumps(report), flush=True)
    os._exit(0)  # the engines' scheduler threads are left running: no interpreter teardown to wait on them


if __name__ == "__main__":
    main()
